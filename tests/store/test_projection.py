"""Logged rows equal P_out · G_i · P_inᵀ with G_i from torch.func per-sample gradients."""

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.store.projection import build_projections, module_shape, random_projection


def per_sample_grads(model, loss_of_output, *inputs):
    """{param name: [N, *shape]} of each sample's own loss, by torch.func."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, *xs):
        xs = tuple(x.unsqueeze(0) for x in xs)
        return loss_of_output(functional_call(model, p, xs[:1]), *xs[1:])

    return vmap(grad(loss), in_dims=(None, *([0] * len(inputs))))(params, *inputs)


def matrix_form(g, prefix, kind="linear"):
    """[N, d_out, d_in(+1)] from weight/bias per-sample gradients (bias = last column)."""
    w = g[f"{prefix}weight"]
    w = w.flatten(2) if kind == "conv" else w
    b = g.get(f"{prefix}bias")
    return torch.cat([w, b.unsqueeze(-1)], dim=-1) if b is not None else w


def log_rows(tmp_path, model, batches, rank=3, seed=0, name="p"):
    run = nnstat.init(project=name, root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    nnstat.add_projection(rank=rank, seed=seed)
    for ids, fn in batches:
        with run(data_id=ids):
            fn().backward()
    nnstat.finalize()
    nnstat.unwatch()
    store = nnstat.GradientStore(run.path)
    return store, store.rows(0, len(store)), load_file(str(run.path / "projections.safetensors"))


def expected(g_mat, proj, name, d_in, d_out):
    p_in = proj.get(f"{name}/p_in", torch.eye(d_in))
    p_out = proj.get(f"{name}/p_out", torch.eye(d_out))
    return torch.einsum("ro,nod,sd->nrs", p_out, g_mat, p_in).flatten(1)


def test_linear_with_bias_matches_torch_func(tmp_path, rows_formed_in):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 4))
    x, y = torch.randn(7, 6), torch.randint(0, 4, (7,))

    def loss_fn(out, t):
        return nn.functional.cross_entropy(out, t, reduction="sum")

    store, rows, proj = log_rows(
        tmp_path, model, [(list(range(7)), lambda: loss_fn(model(x), y))], rank=3
    )
    g = per_sample_grads(model, loss_fn, x, y)
    assert [m["r_in"] for m in store.modules] == [3, 3] and [m["r_out"] for m in store.modules] == [
        3,
        3,
    ]
    assert set(proj) == {"0/p_in", "0/p_out", "2/p_in", "2/p_out"}
    for m, prefix, d_in, d_out in [(store.modules[0], "0.", 7, 5), (store.modules[1], "2.", 6, 4)]:
        want = expected(matrix_form(g, prefix), proj, m["name"], d_in, d_out)
        got = rows[:, m["offset"] : m["offset"] + m["width"]]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(store.module_view(rows, m["name"]), want.reshape(7, 3, 3))


def test_sequences_sum_positions(tmp_path):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    x = torch.randn(5, 8, 4)  # [N, T, d]
    w = torch.randn(5, 8, 3)

    def loss_fn(out, t):
        return (out * t).sum()

    _, rows, proj = log_rows(
        tmp_path, model, [(["a", "b", "c", "d", "e"], lambda: loss_fn(model(x), w))]
    )
    g = per_sample_grads(model, loss_fn, x, w)
    want = torch.cat(
        [
            expected(matrix_form(g, "0."), proj, "0", 5, 6),
            expected(matrix_form(g, "2."), proj, "2", 7, 3),
        ],
        dim=1,
    )
    torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-5)


def test_conv2d_matches_torch_func(tmp_path):
    torch.manual_seed(2)
    model = nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, stride=2), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 3 * 3, 2)
    )
    x, y = torch.randn(4, 2, 6, 6), torch.randint(0, 2, (4,))

    def loss_fn(out, t):
        return nn.functional.cross_entropy(out, t, reduction="sum")

    store, rows, proj = log_rows(
        tmp_path, model, [([0, 1, 2, 3], lambda: loss_fn(model(x), y))], rank=5
    )
    g = per_sample_grads(model, loss_fn, x, y)
    conv = store.modules[0]
    assert (conv["d_in"], conv["d_out"], conv["r_in"], conv["r_out"]) == (19, 4, 5, 4)
    want = expected(matrix_form(g, "0.", kind="conv"), proj, "0", 19, 4)
    torch.testing.assert_close(rows[:, : conv["width"]], want, rtol=1e-4, atol=1e-5)


def test_full_gradients_without_projection(tmp_path):
    torch.manual_seed(3)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    run = nnstat.init(project="full", root_dir=tmp_path)
    nnstat.watch(model)  # no add_projection: rank=None stores G_i itself
    with run(data_id=[5, 6, 7, 8]):
        model(x).pow(2).sum().backward()
    nnstat.finalize()
    store = nnstat.GradientStore(run.path)
    g = per_sample_grads(model, lambda o: o.pow(2).sum(), x)
    torch.testing.assert_close(
        store.rows(0, 4), matrix_form(g, "").flatten(1), rtol=1e-5, atol=1e-6
    )
    assert store.meta["projection"]["rank"] is None and store.projections() == {}


def test_rank_capped_and_identity_sides_recorded():
    spec = module_shape("fc", nn.Linear(10, 4))
    p = random_projection(spec, rank=64, seed=0)
    assert (p.r_in, p.r_out, p.p_in, p.p_out) == (11, 4, None, None)
    p = random_projection(spec, rank=2, seed=0)
    assert p.p_in.shape == (2, 11) and p.p_out.shape == (2, 4)
    again = random_projection(spec, rank=2, seed=0)
    assert torch.equal(p.p_in, again.p_in)  # reproducible from the recorded seed
    assert not torch.equal(p.p_in, random_projection(spec, rank=2, seed=1).p_in)


def test_random_projection_preserves_norms_in_expectation():
    torch.manual_seed(4)
    spec = module_shape("fc", nn.Linear(49, 30))
    g = torch.randn(30, 50)
    ratios = []
    for seed in range(300):
        p = random_projection(spec, rank=8, seed=seed)
        ratios.append(float((p.p_out @ g @ p.p_in.T).pow(2).sum() / g.pow(2).sum()))
    mean = sum(ratios) / len(ratios)
    assert abs(mean - 1.0) < 0.05, mean


def test_pca_uses_top_eigenvectors_of_kfac_factors(tmp_path):
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(32, 6) * torch.linspace(0.2, 3, 6), torch.randint(0, 3, (32,))
    run = nnstat.init(project="pca", root_dir=tmp_path)
    nnstat.setup({"statistic": "kfac", "save": []})
    nnstat.watch(model)
    with pytest.raises(ValueError, match="statistics pass"):
        nnstat.add_projection(rank=2, init="pca")  # no statistics yet: never a silent fallback
    with run(data_id=list(range(32))):
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    nnstat.finalize()
    layout = nnstat.add_projection(rank=2, init="pca")
    assert layout == {"0": (2, 2), "2": (2, 2)}
    p_in = run._projections["0"].p_in
    # independent reference: A = mean over samples of [x, 1][x, 1]ᵀ, top-2 eigenvectors
    a = torch.cat([x, torch.ones(32, 1)], 1).double()
    vals, vecs = torch.linalg.eigh(a.T @ a / 32)
    top = vecs[:, -2:].flip(-1).T.float()
    torch.testing.assert_close(p_in.abs(), top.abs(), rtol=1e-4, atol=1e-5)
    assert torch.allclose((p_in * top).sum(1).abs(), torch.ones(2), atol=1e-5)


def test_pca_without_statistics_is_refused():
    specs = [module_shape("fc", nn.Linear(4, 3))]
    with pytest.raises(ValueError, match="statistics pass"):
        build_projections(specs, 2, "pca", statistics={})
    with pytest.raises(ValueError, match="missing"):
        build_projections(specs, 2, "pca", statistics={"other/forward/covariance": torch.eye(2)})
    with pytest.raises(ValueError, match="valid"):
        build_projections(specs, 2, "svd")


def test_masked_sequence_positions_are_excluded(tmp_path, rows_formed_in):
    torch.manual_seed(6)
    model = nn.Linear(4, 3)
    x, w = torch.randn(3, 5, 4), torch.randn(3, 5, 3)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    run = nnstat.init(project="mask", root_dir=tmp_path)
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    with run(data_id=[0, 1, 2], mask=mask):
        (model(x) * w * mask.unsqueeze(-1)).sum().backward()
    nnstat.finalize()
    store = nnstat.GradientStore(run.path)
    proj = store.projections()

    def loss_fn(out, t, m):
        return (out * t * m.unsqueeze(-1)).sum()

    g = per_sample_grads(model, loss_fn, x, w, mask.float())
    want = expected(matrix_form(g, ""), proj, "model", 5, 3)
    torch.testing.assert_close(store.rows(0, 3), want, rtol=1e-4, atol=1e-5)


def test_embedding_and_layernorm_rows(tmp_path, rows_formed_in):
    torch.manual_seed(7)
    model = nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 2))
    idx, t = torch.randint(0, 11, (4, 5)), torch.randn(4, 5, 2)

    def loss_fn(out, target):
        return (out * target).sum()

    store, rows, proj = log_rows(
        tmp_path, model, [([0, 1, 2, 3], lambda: loss_fn(model(idx), t))], rank=3
    )
    g = per_sample_grads(model, loss_fn, idx, t)
    emb, ln = store.modules[0], store.modules[1]
    assert emb["kind"] == "embedding" and ln["kind"] == "layernorm" and ln["r_out"] is None
    # embedding: G_i = [D, V] (weight gradient transposed), projected on both sides
    want = expected(g["0.weight"].transpose(1, 2), proj, "0", 11, 6)
    torch.testing.assert_close(rows[:, : emb["width"]], want, rtol=1e-4, atol=1e-5)
    # layernorm: flat [weight, bias] gradient times p_in [r, 12]
    flat = torch.cat([g["1.weight"], g["1.bias"]], dim=1)
    want = flat @ proj["1/p_in"].T
    torch.testing.assert_close(
        rows[:, ln["offset"] : ln["offset"] + ln["width"]], want, rtol=1e-4, atol=1e-5
    )


def test_reused_row_buffers_zero_missing_modules_and_add_two_backwards(tmp_path, rows_formed_in):
    # the logging pass assembles rows in a few reused buffers: a module without gradient in a
    # later batch must be stored as zeros (not an older batch's values), two backward passes in
    # one block add up, and rows queued while the next batch is assembled stay intact
    torch.manual_seed(0)

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 5), nn.Linear(4, 5)

        def forward(self, x, use_b=True):
            return self.a(x) + (self.b(x) if use_b else 0)

    model = Two()
    x, y = torch.randn(20, 4), torch.randint(0, 5, (20,))

    def loss_fn(out, t):
        return nn.functional.cross_entropy(out, t, reduction="sum")

    run = nnstat.init(project="reuse", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "queue_size": 1, "shard_rows": 3})
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    plan = [(0, 6, True), (6, 10, False), (10, 13, True), (13, 20, True)]
    for lo, hi, use_b in plan:
        with run(data_id=list(range(lo, hi))):
            loss_fn(model(x[lo:hi], use_b), y[lo:hi]).backward()
            if hi == 20:  # a second backward in the same block
                (model(x[lo:hi]) ** 2).sum().backward()
    nnstat.finalize()
    store = nnstat.GradientStore(run.path)
    rows = store.rows(0, len(store))
    proj = load_file(str(run.path / "projections.safetensors"))
    assert store.ids == list(range(20))
    for lo, hi, use_b in plan:

        def total(out, t, use_b=use_b, hi=hi):
            extra = (out**2).sum() if hi == 20 else 0
            return loss_fn(out, t) + extra

        def fwd(m, xs, use_b=use_b):
            return m(xs, use_b)

        params = {k: v.detach() for k, v in model.named_parameters()}

        def loss(p, xi, yi, use_b=use_b, total=total):
            out = functional_call(model, p, (xi.unsqueeze(0), use_b))
            return total(out, yi.unsqueeze(0))

        g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x[lo:hi], y[lo:hi])
        for m in store.modules:
            want = expected(matrix_form(g, m["name"] + "."), proj, m["name"], 5, 5)
            got = rows[lo:hi, m["offset"] : m["offset"] + m["width"]]
            if m["name"] == "b" and not use_b:
                assert torch.count_nonzero(got) == 0
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def _func_rows(model, loss_fn, x, y, proj, store):
    """Expected rows of every module from torch.func per-sample gradients."""
    g = per_sample_grads(model, loss_fn, x, y)
    cols = []
    for m in store.modules:
        prefix = "" if m["name"] == "model" else m["name"] + "."
        cols.append(expected(matrix_form(g, prefix), proj, m["name"], m["d_in"], m["d_out"]))
    return torch.cat(cols, dim=1)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_rows_match_torch_func_with_identity_side(tmp_path, reduction):
    # the head has d_out = 2 <= rank: its output side is the identity
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2, bias=False))
    x, y = torch.randn(9, 6), torch.randint(0, 2, (9,))
    run = nnstat.init(project="f", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "loss_reduction": reduction})
    nnstat.watch(model)
    nnstat.add_projection(rank=3)
    with run(data_id=list(range(9))):
        nn.functional.cross_entropy(model(x), y, reduction=reduction).backward()
    nnstat.finalize()
    store = nnstat.GradientStore(run.path)
    proj = load_file(str(run.path / "projections.safetensors"))
    assert "2/p_out" not in proj and store.modules[1]["projected_out"] is False

    def own_loss(out, t):  # each sample's own loss term
        return nn.functional.cross_entropy(out, t, reduction="sum")

    want = _func_rows(model, own_loss, x, y, proj, store)
    torch.testing.assert_close(store.rows(0, 9), want, rtol=1e-4, atol=1e-5)


def test_module_called_twice_falls_back_to_the_summed_capture(tmp_path):
    torch.manual_seed(2)
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.Tanh(), lin)  # weight sharing: two calls per batch
    x, y = torch.randn(5, 4), torch.randn(5, 4)

    def loss_fn(out, t):
        return ((out - t) ** 2).sum()

    store, rows, proj = log_rows(
        tmp_path, model, [(list(range(5)), lambda: loss_fn(model(x), y))], rank=2
    )
    g = per_sample_grads(model, loss_fn, x, y)
    want = expected(matrix_form(g, "0."), proj, store.modules[0]["name"], 5, 4)
    torch.testing.assert_close(rows, want, rtol=1e-4, atol=1e-5)


def test_overflowing_rows_follow_the_nonfinite_policy(tmp_path, rows_formed_in):
    # inputs and output gradients are finite, their outer products are not
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4))
    x = torch.randn(4, 3)
    x[1] *= 1e25
    scale = torch.tensor([1.0, 1e25, 1.0, 1.0]).unsqueeze(1)
    run = nnstat.init(project="o", root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    # on the accelerator branch the writer's thread checks the flags once the rows' copy has
    # landed: the refusal comes at the next call, here finalize()
    deferred = rows_formed_in == "device staging"
    with pytest.raises(ValueError, match=r"ids \[1\] contain NaN/Inf"):
        with run(data_id=[0, 1, 2, 3]):
            (model(x) * scale).sum().backward()
        if deferred:
            nnstat.finalize()
    if not deferred:
        nnstat.finalize()
    run = nnstat.init(project="o2", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "nonfinite": "skip"})
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    with run(data_id=[0, 1, 2, 3]):
        (model(x) * scale).sum().backward()
    nnstat.finalize()
    store = nnstat.GradientStore(run.path)
    assert store.ids == [0, 2, 3] and store.meta["skipped_rows"] == 1


@pytest.mark.parametrize("sequence", [False, True])
def test_rows_beyond_float16_range_follow_the_nonfinite_policy(tmp_path, rows_formed_in, sequence):
    # finite in float32, infinite once stored as float16: the policy sees what would be stored
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 4))
    x = torch.randn(4, 2, 3) if sequence else torch.randn(4, 3)
    x[2] *= 1e3
    scale = torch.tensor([1.0, 1.0, 1e3, 1.0]).reshape(4, *([1] * (x.dim() - 1)))

    def log(project, policy):
        run = nnstat.init(project=project, root_dir=tmp_path)
        nnstat.setup({"statistic": "none", "dtype": "float16", "nonfinite": policy})
        nnstat.watch(model)
        nnstat.add_projection(rank=2)
        with run(data_id=[0, 1, 2, 3]):
            (model(x) * scale).sum().backward()
        nnstat.finalize()
        nnstat.unwatch()
        return nnstat.GradientStore(run.path), run

    with pytest.raises(ValueError, match=r"ids \[2\] contain NaN/Inf or values float16 stores"):
        log("err", "error")
    nnstat.finalize()
    nnstat.unwatch()
    store, run = log("skip", "skip")
    assert store.ids == [0, 1, 3] and store.meta["skipped_rows"] == 1
    rows = store.rows(0, 3)
    assert torch.isfinite(rows).all() and rows.abs().max() > 0
    store, _ = log("keep", "keep")
    kept = store.rows(0, 4)
    assert torch.isinf(kept[2]).any() and torch.isfinite(kept[[0, 1, 3]]).all()


def test_recorded_seed_rule_regenerates_every_module_matrix(tmp_path):
    """The per-module seeds: two modules of identical shape get different matrices;
    the matrices follow the rule written to meta.json (regenerated here from its text, with
    zlib.crc32 of the module name); the same name and seed reproduce them in a new run."""
    import json
    import zlib

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 5))
    x = torch.randn(4, 6)
    batches = [(list(range(4)), lambda: model(x).pow(2).sum())]
    _, _, proj = log_rows(tmp_path / "a", model, batches, rank=3, seed=5)
    meta = json.loads((next((tmp_path / "a").glob("*/meta.json"))).read_text())
    rule = meta["projection"]
    assert rule["seed"] == 5 and "seed * 1000003 + crc32(name)" in rule["seed_rule"]
    assert "p_in then p_out, N(0, 1/r)" in rule["seed_rule"]
    for m in meta["modules"]:
        gen = torch.Generator().manual_seed(rule["seed"] * 1000003 + zlib.crc32(m["name"].encode()))
        p_in = torch.randn(m["r_in"], m["d_in"], generator=gen) / m["r_in"] ** 0.5
        p_out = torch.randn(m["r_out"], m["d_out"], generator=gen) / m["r_out"] ** 0.5
        assert torch.equal(proj[f"{m['name']}/p_in"], p_in), m["name"]
        assert torch.equal(proj[f"{m['name']}/p_out"], p_out), m["name"]
    # the two 5x5 layers: same shapes, different names, different matrices
    assert not torch.allclose(proj["1/p_in"], proj["2/p_in"])
    assert not torch.allclose(proj["1/p_out"], proj["2/p_out"])
    # another run (fresh modules, global RNG elsewhere) with the same names and seed: identical
    torch.manual_seed(123)
    other = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 5), nn.Linear(5, 5))
    _, _, again = log_rows(tmp_path / "b", other, [(list(range(4)), lambda: other(x).sum())], 3, 5)
    assert again.keys() == proj.keys()
    assert all(torch.equal(again[k], proj[k]) for k in proj)
    # a different seed moves every matrix
    spec = module_shape("1", model[1])
    assert not torch.allclose(random_projection(spec, 3, seed=6).p_in, proj["1/p_in"])
