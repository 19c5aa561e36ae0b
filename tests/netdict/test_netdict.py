"""NetDict, the model getters and compute_stats."""

import warnings

import numpy as np
import pytest
import scipy.stats
import torch
from torch import nn

import nnstat
from nnstat import NetDict
from nnstat.describe import STAT_NAMES
from nnstat.netdict import SameParams


class Block(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.mlp = nn.Linear(d, d)

    def forward(self, x):
        h = self.ln_1(x)
        return self.mlp(x + self.attn(h, h, h, need_weights=False)[0])


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def train_step(model, opt):
    opt.zero_grad()
    model(torch.randn(2, 3, 8)).pow(2).mean().backward()
    opt.step()


def test_keys_are_named_parameters_in_order_with_bare_in_proj_weight():
    model = make_model()
    W = nnstat.get_weight(model)
    assert list(W) == [n for n, _ in model.named_parameters()]
    assert "0.attn.in_proj_weight" in W
    for n, p in model.named_parameters():
        assert torch.equal(W[n], p) and W[n].data_ptr() != p.data_ptr()  # a copy by default
    alias = nnstat.get_weight(model, copy=False)
    assert alias["0.mlp.weight"].data_ptr() == model[0].mlp.weight.data_ptr()


def test_include_exclude_match_anywhere():
    W = nnstat.get_weight(make_model())
    assert list(W.filter(include="ln")) == [
        "0.ln_1.weight",
        "0.ln_1.bias",
        "1.ln_1.weight",
        "1.ln_1.bias",
    ]
    assert all("bias" not in k for k in W.filter(exclude="bias"))
    assert list(nnstat.get_weight(make_model(), include=r"^1\.mlp")) == [
        "1.mlp.weight",
        "1.mlp.bias",
    ]
    with pytest.raises(ValueError, match="no parameter matches"):
        nnstat.get_weight(make_model(), include="nothing_like_this")


def test_arithmetic_against_plain_tensors():
    torch.manual_seed(0)
    a = NetDict({"x": torch.randn(3), "y": torch.randn(2, 2)})
    b = NetDict({"x": torch.rand(3) + 1, "y": torch.rand(2, 2) + 1})
    for got, fn in [
        (a + b, torch.add),
        (a - b, torch.sub),
        (a * b, torch.mul),
        (a / b, torch.div),
    ]:
        for k in a:
            torch.testing.assert_close(got[k], fn(a[k], b[k]))
    torch.testing.assert_close((2 - a)["x"], 2 - a["x"])
    torch.testing.assert_close((1 / b)["y"], 1 / b["y"])
    torch.testing.assert_close((a * 3 + 1)["y"], a["y"] * 3 + 1)
    torch.testing.assert_close(abs(a)["x"], a["x"].abs())
    torch.testing.assert_close((-a)["x"], -a["x"])
    torch.testing.assert_close(b.sqrt()["x"], b["x"].sqrt())
    torch.testing.assert_close((b**2)["y"], b["y"] ** 2)
    torch.testing.assert_close(b.pow(a)["x"], b["x"].pow(a["x"]))
    torch.testing.assert_close(a.apply(torch.tanh)["y"], a["y"].tanh())
    c = a.clone()
    c["x"].add_(1)
    assert not torch.equal(c["x"], a["x"])
    assert a.to(torch.float64)["x"].dtype == torch.float64
    assert a.numel() == 7


def test_norms_over_the_whole_network():
    torch.manual_seed(0)
    a = NetDict({"x": torch.randn(5), "y": torch.randn(3, 4)})
    flat = torch.cat([a["x"], a["y"].reshape(-1)]).double().numpy()
    for p in (1, 2, 3, np.inf):
        assert a.norm(p) == pytest.approx(np.linalg.norm(flat, ord=p), rel=1e-6)
    norms = a.layer_norms(2)
    assert norms["y"] == pytest.approx(np.linalg.norm(a["y"].numpy()), rel=1e-6)
    with pytest.raises(ValueError, match="empty"):
        NetDict().norm()


def test_mismatched_netdicts_name_the_difference():
    a = NetDict({"x": torch.ones(2), "y": torch.ones(2)})
    with pytest.raises(ValueError, match=r"only in left: \['y'\]"):
        a + NetDict({"x": torch.ones(2), "z": torch.ones(2)})
    with pytest.raises(ValueError, match="layer 'y' has shapes"):
        a - NetDict({"x": torch.ones(2), "y": torch.ones(3)})
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        NetDict({"x": [1.0, 2.0]})
    with pytest.raises(TypeError):
        a + "text"


def test_describe_whole_network_is_over_all_elements():
    torch.manual_seed(0)
    a = NetDict({"x": torch.randn(100) * 3 + 1, "y": torch.rand(7, 3)})
    flat = torch.cat([a["x"], a["y"].reshape(-1)]).double().numpy()
    d = a.describe()
    assert list(d) == list(STAT_NAMES)
    assert d["mean"] == pytest.approx(flat.mean(), rel=1e-5)
    assert d["var"] == pytest.approx(flat.var(), rel=1e-5)
    assert d["skew"] == pytest.approx(scipy.stats.skew(flat, bias=True), rel=1e-4)
    assert d["kurtosis"] == pytest.approx(scipy.stats.kurtosis(flat, bias=True), rel=1e-4)
    assert d["numel"] == 121
    # not a mean of layer means
    assert d["mean"] != pytest.approx((a["x"].mean() + a["y"].mean()).item() / 2, rel=1e-3)


def test_describe_layerwise_keys_belong_to_their_layer():
    # the seed returned wrong keys for layerwise dicts (shadowed loop variable)
    a = NetDict({"first": torch.tensor([1.0, 1.0]), "second": torch.tensor([5.0, 7.0])})
    d = a.describe(layerwise=True, stats=["mean", "max"])
    assert dict(d) == {"first": {"mean": 1.0, "max": 1.0}, "second": {"mean": 6.0, "max": 7.0}}
    frame = d.to_frame()
    assert frame.loc["second", "max"] == 7.0
    flat = a.describe_layers(stats=["mean"], prefix="w/")
    assert flat == {"w/first/mean": 1.0, "w/second/mean": 6.0}
    assert a.describe_layers(stats=["max"], layerwise=False) == {"max": 7.0}


def test_describe_does_not_mutate_defaults_and_display_prints(capsys):
    a = NetDict({"x": torch.arange(4.0)})
    first = a.describe_layers()
    stats = ["l2"]
    a.describe_layers(stats=stats)
    assert stats == ["l2"]
    assert a.describe_layers() == first  # defaults unchanged by earlier calls
    a.describe(layerwise=True, display=True)
    out = capsys.readouterr().out
    assert "layer" in out and "kurtosis" in out
    a.describe_layers(display=False)
    assert capsys.readouterr().out == ""


def test_describe_bad_input():
    a = NetDict({"x": torch.ones(2)})
    with pytest.raises(ValueError, match="valid names"):
        a.describe(stats=["l3"])
    with pytest.raises(ValueError, match="no layer matches"):
        a.describe(include="zzz")
    with pytest.raises(ValueError, match="empty NetDict"):
        NetDict().describe()


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_save_load_roundtrip(tmp_path, suffix):
    W = nnstat.get_weight(make_model())
    path = tmp_path / f"w{suffix}"
    W.save(path)
    back = NetDict.load(path)
    assert list(back) == list(W)
    for k in W:
        assert torch.equal(back[k], W[k])


def test_get_grad_optimizer_state_and_update():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    W0 = nnstat.get_weight(model)
    train_step(model, opt)
    W1 = nnstat.get_weight(model)
    G = nnstat.get_grad(model)
    for n, p in model.named_parameters():
        assert torch.equal(G[n], p.grad)
        assert torch.equal(
            nnstat.get_optimizer_state(model, opt, "exp_avg")[n], opt.state[p]["exp_avg"]
        )
    upd = nnstat.get_update(W0, W1)
    for n, p in model.named_parameters():
        torch.testing.assert_close(upd[n], p.detach() - W0[n])
    torch.testing.assert_close(
        nnstat.get_update(W0, W1, lr=1e-2)["1.mlp.bias"], upd["1.mlp.bias"] / 1e-2
    )
    sgd_model = nn.Linear(3, 2)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.1, momentum=0.9)
    sgd_model(torch.ones(1, 3)).sum().backward()
    sgd.step()
    mom = nnstat.get_optimizer_state(sgd_model, sgd, "momentum_buffer")
    torch.testing.assert_close(mom["bias"], sgd_model.bias.grad)


def test_unknown_state_key_names_the_existing_ones():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(nnstat.UnknownStateKeyError, match="empty"):
        nnstat.get_optimizer_state(model, opt, "exp_avg")
    train_step(model, opt)
    with pytest.raises(KeyError) as err:
        nnstat.get_optimizer_state(model, opt, "exp_avg_sg")
    msg = str(err.value)
    assert "exp_avg_sq" in msg and "did you mean 'exp_avg_sq'" in msg
    assert isinstance(err.value, nnstat.UnknownStateKeyError)


def test_a_state_the_optimizer_never_keeps_is_not_blamed_on_a_missing_step():
    # SGD without momentum keeps no state even after its steps: "call step() first" misled
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train_step(model, opt)
    assert not any(opt.state.values())
    with pytest.raises(nnstat.UnknownStateKeyError, match=r"empty.*SGD without momentum"):
        nnstat.get_optimizer_state(model, opt, "momentum_buffer")


def test_get_grad_missing_gradients():
    model = make_model()
    with pytest.raises(ValueError, match="no parameter has a gradient yet"):
        nnstat.get_grad(model)
    model[0].mlp(torch.randn(2, 8)).sum().backward()
    with pytest.warns(UserWarning, match="no gradient"):
        G = nnstat.get_grad(model)
    assert list(G) == ["0.mlp.weight", "0.mlp.bias"]
    with pytest.raises(ValueError, match="no gradient"):
        nnstat.get_grad(model, missing="raise")
    model[1].ln_1.requires_grad_(False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert "1.ln_1.weight" not in nnstat.get_grad(model)
    with pytest.raises(ValueError, match="no parameters"):
        nnstat.get_weight(nn.ReLU())


def test_compute_stats_groups_and_validation():
    model = make_model()
    opt = torch.optim.Adam(model.parameters())
    train_step(model, opt)
    stats = nnstat.compute_stats(model, opt, ["exp_avg", "exp_avg_sq"], stats=["l2", "mean"])
    n = len(list(model.parameters()))
    for group in ("weight", "grad", "exp_avg", "exp_avg_sq"):
        assert sum(k.startswith(f"{group}/") for k in stats) == 2 * n
    p = model[1].mlp.weight
    assert stats["exp_avg_sq/1.mlp.weight/mean"] == pytest.approx(
        opt.state[p]["exp_avg_sq"].double().mean().item(), rel=1e-5
    )
    assert stats["grad/1.mlp.weight/l2"] == pytest.approx(p.grad.norm().item(), rel=1e-5)
    # state keys are validated before anything is computed
    with pytest.raises(nnstat.UnknownStateKeyError, match="exp_avg_sq"):
        nnstat.compute_stats(model, opt, ["exp_avg", "exp_avg_sg"])
    opt.zero_grad()
    with pytest.warns(UserWarning, match="left out of grad/") as rec:
        after = nnstat.compute_stats(model, opt, ["exp_avg"], stats=["l2"])
    assert len(rec) == 1
    assert not any(k.startswith("grad/") for k in after) and "weight/0.mlp.bias/l2" in after


def test_seed_readme_usage_with_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (nnstat[wandb])")

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    W0 = nnstat.get_weight(model)
    train_step(model, opt)
    update = nnstat.get_weight(model) - W0
    run = wandb.init(project="nnstat-tests", dir=str(tmp_path))
    try:
        logged = W0.describe_layers(layerwise=True, include="ln")
        wandb.log(logged, step=0)
        wandb.log(update.describe_layers(), step=1, commit=True)
        summary = dict(run.summary)
        key = "0.attn.in_proj_weight/l2"
        assert summary[key] == pytest.approx(update[key.split("/")[0]].norm().item(), rel=1e-5)
    finally:
        run.finish()
    assert all("ln" in k for k in logged)


def test_copies_of_mixed_dtypes_are_independent_snapshots_of_their_own_storage(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    model[1].to(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model[1](model[0](torch.randn(5, 3)).double()).sum().backward()
    opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    W = nnstat.get_weight(model)
    M = nnstat.get_optimizer_state(model, opt, "exp_avg")
    G = nnstat.get_grad(model)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    moments = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    opt.step()  # in place: the parameters, their moments and (after zero_grad) their gradients
    opt.zero_grad(set_to_none=False)
    storages = set()
    for n, p in model.named_parameters():
        assert W[n].dtype == p.dtype and not torch.equal(W[n], p)
        assert torch.equal(W[n], before[n]) and torch.equal(G[n], grads[n])
        assert torch.equal(M[n], moments[n])
        storages |= {t.untyped_storage().data_ptr() for t in (W[n], G[n], M[n])}
    assert len(storages) == 3 * 4  # saving one entry saves only that entry
    W.save(tmp_path / "w.safetensors")
    assert list(nnstat.NetDict.load(tmp_path / "w.safetensors")) == list(W)


def test_sparse_gradients_and_their_optimizer_states_are_described_dense():
    """nn.Embedding(sparse=True) gives a sparse .grad (and SGD a sparse momentum buffer):
    get_grad, get_optimizer_state and the Tracker describe the whole tensor, zeros included."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps = []
    tracker = nnstat.Tracker(model, opt, stats=None, sinks=[lambda m, s: steps.append(m)])
    for _ in range(2):
        opt.zero_grad()
        model(torch.randint(0, 10, (3, 3))).pow(2).sum().backward()
        opt.step()
        tracker.step()
    tracker.close()
    grad, buf = model[0].weight.grad, opt.state[model[0].weight]["momentum_buffer"]
    assert grad.is_sparse and buf.is_sparse
    for group, got, ref in (
        ("grad", nnstat.get_grad(model).describe_layers(), grad.to_dense()),
        ("momentum_buffer", nnstat.get_optimizer_state(model, opt, "momentum_buffer"), None),
    ):
        ref = buf.to_dense() if ref is None else ref
        if not isinstance(got, dict):
            got = got.describe_layers()
        x = ref.double().numpy().ravel()
        expect = {"l2": np.linalg.norm(x), "mean": x.mean(), "sparsity": (x == 0).mean()}
        for stat, value in expect.items():
            assert got[f"0.weight/{stat}"] == pytest.approx(value, rel=1e-6, abs=1e-9)
            assert steps[-1][f"{group}/0.weight/{stat}"] == pytest.approx(value, rel=1e-6, abs=1e-9)


def test_same_params_passes_in_place_changes_and_moved_containers_and_names_replacements():
    inner = nn.Linear(3, 2)
    model = nn.Sequential(nn.Sequential(inner), nn.Linear(2, 2))
    names = [n for n, _ in model.named_parameters()]
    same = SameParams(model, names, list(model.parameters()), "Owner", "the fix")
    model.double()  # in place: the same tensors
    same.check()
    model[0] = nn.Sequential(inner)  # a new container around the same layer
    same.check()
    model[1] = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"^Owner: 2 .*\['1\.weight', '1\.bias'\].*the fix$"):
        same.check()


def test_complex_layer_norm_is_the_modulus_norm_and_describe_refuses_complex():
    z = torch.tensor([1 + 1j, 2 - 1j, -3j])
    nd = NetDict({"z": z, "r": torch.tensor([2.0])})
    want = np.linalg.norm(np.concatenate([z.numpy(), [2.0]]))
    assert nd.norm(2) == pytest.approx(want, rel=1e-6)
    assert nd.layer_norms(1)["z"] == pytest.approx(np.abs(z.numpy()).sum(), rel=1e-6)
    for call in (nd.describe, nd.describe_layers):
        with pytest.raises(TypeError, match=r"complex64.*nd\.abs\(\)"):
            call()


def test_load_of_a_damaged_safetensors_file_names_the_file(tmp_path):
    path = tmp_path / "w.safetensors"
    NetDict({"a.b": torch.arange(3.0)}).save(path)
    assert torch.equal(NetDict.load(path)["a.b"], torch.arange(3.0))
    path.write_bytes(path.read_bytes()[:20])  # cut short
    with pytest.raises(ValueError, match=r"w\.safetensors: not a readable safetensors file"):
        NetDict.load(path)
