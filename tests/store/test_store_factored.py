"""Factored rows (``factors=c``): the factors against numpy's SVD, stores of factored rows scored
against the dense rows of the same projection and a float64 computation from the stored factors,
the format (meta layout, revision, captured energy, an older store), and the config's checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _ledger import device_branch_staging
from torch import nn

import nnstat
from nnstat.influence import compute_influence_all, compute_self_influence
from nnstat.store import GradientStore
from nnstat.store.factored import factor_rows, split, unfactor
from nnstat.store.files import atomic_write_json, read_json
from nnstat.store.meta import FORMAT_REVISION

N, BATCH, T, D_IN = 24, 8, 3, 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    # no nonlinearity: with inputs x_t = α_t x each layer's G has rank <= 3 (see _data)
    return nn.Sequential(nn.Linear(D_IN, 16), nn.Linear(16, 10))


def _data(n: int, t: int, low_rank: bool = False, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if low_rank:  # every position a multiple of one vector: G = Σ_t b_t (α_t P x + P 1)ᵀ
        return torch.randn(n, 1, D_IN, generator=g) * torch.randn(n, t, 1, generator=g)
    return torch.randn(n, t, D_IN, generator=g)


def _loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().sum()


def _log(tmp_path, project, x, xq, factors, rank=8):
    model = _model()
    run = nnstat.init(project=project, root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac", "rank": rank,
                  "factors": factors})  # fmt: skip
    nnstat.watch(model)
    for s in range(0, len(x), BATCH):
        with run(data_id=list(range(s, s + BATCH))):
            _loss(model, x[s : s + BATCH]).backward()
        model.zero_grad()
    nnstat.finalize()
    nnstat.eval()
    with run(data_id=[f"q{i}" for i in range(len(xq))]):
        _loss(model, xq).backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return tmp_path / project, log


def _dense64(rows: torch.Tensor, modules: list) -> torch.Tensor:
    """float64 dense rows from stored (factored) rows, by an einsum of U and V per module."""
    parts = []
    for m in modules:
        cols = rows[:, m["offset"] : m["offset"] + m["width"]].double()
        if m.get("factors"):
            c, r_out, r_in = m["factors"], m["r_out"], m["r_in"]
            u = cols[:, : c * r_out].reshape(-1, c, r_out)
            v = cols[:, c * r_out :].reshape(-1, c, r_in)
            cols = torch.einsum("nco,nci->noi", u, v).reshape(len(rows), -1)
        parts.append(cols)
    return torch.cat(parts, 1)


# ------------------------------------------------------------------ the factors themselves
@pytest.mark.parametrize("t,c", [(9, 3), (20, 5), (4, 6)])
def test_factors_are_the_truncated_svd_of_numpy(t, c):
    g = torch.Generator().manual_seed(t)
    bp, ap = torch.randn(5, t, 7, generator=g), torch.randn(5, t, 6, generator=g)
    rows, energy = factor_rows(bp, ap, c)
    assert rows.shape == (5, c * (7 + 6))
    for i in range(5):
        G = bp[i].double().numpy().T @ ap[i].double().numpy()
        left, s, vh = np.linalg.svd(G)
        k = min(c, len(s))
        want = (left[:, :k] * s[:k]) @ vh[:k]
        np.testing.assert_allclose(unfactor(rows[i : i + 1], c, 7, 6)[0].reshape(7, 6).numpy(),
                                   want, atol=1e-4 * s[0])  # fmt: skip
        want_energy = (s[:k] ** 2).sum() / (s**2).sum()
        assert energy[i].item() == pytest.approx(want_energy, rel=1e-5)
        if t <= c:  # exact: the projected δ_t, x_t themselves, zero-padded
            u, v = split(rows[i : i + 1], c, 7, 6)
            assert torch.equal(u[0, :t], bp[i]) and torch.equal(v[0, :t], ap[i])
            assert not u[0, t:].any() and not v[0, t:].any()
        else:  # the singular values are in U: its rows are orthogonal with norms σ
            u, v = split(rows[i : i + 1], c, 7, 6)
            np.testing.assert_allclose(u[0].norm(dim=1).numpy(), s[:k], rtol=1e-4)
            np.testing.assert_allclose((v[0] @ v[0].T).numpy(), np.eye(k), atol=1e-5)


def test_factors_of_a_low_rank_gradient_are_exact():
    g = torch.Generator().manual_seed(0)
    # rank(G) = 2 < c = 3 < T = 8
    bp = torch.randn(4, 8, 2, generator=g) @ torch.randn(2, 6, generator=g)
    ap = torch.randn(4, 8, 5, generator=g)
    rows, energy = factor_rows(bp, ap, 3)
    dense = torch.bmm(bp.transpose(1, 2), ap).reshape(4, -1)
    torch.testing.assert_close(unfactor(rows, 3, 6, 5), dense, rtol=1e-4, atol=1e-4)
    assert torch.allclose(energy, torch.ones(4))


# ------------------------------------------------------------------------ stores and scores
def test_exact_factored_store_scores_as_its_factors_and_as_the_dense_store(tmp_path):
    x, xq = _data(N, T), _data(4, T, seed=2)
    fpath, flog = _log(tmp_path, "f", x, xq, factors=T)  # T <= c: exact factors
    dpath, dlog = _log(tmp_path, "d", x, xq, factors=None)
    fstore, dstore = GradientStore(fpath), GradientStore(dpath)
    mods = fstore.meta["modules"]
    assert [m.get("factors") for m in mods] == [T, T]
    assert fstore.row_width == sum(T * (m["r_out"] + m["r_in"]) for m in mods) < dstore.row_width
    stored = fstore.rows(0, len(fstore))
    train64 = _dense64(stored, mods)
    # queries are logged exact, as dense rows, and named so in their meta
    assert all("factors" not in m for m in flog.meta["modules"])
    assert flog.rows.shape[1] == flog.meta["row_width"] == dstore.row_width
    torch.testing.assert_close(flog.rows, dlog.rows)
    query64 = flog.rows.double()
    # the dense store's rows (the engine's projected product, no factors) are the same rows
    torch.testing.assert_close(train64, dstore.rows(0, len(dstore)).double(), rtol=1e-5,
                               atol=1e-5)  # fmt: skip
    plain = compute_influence_all(flog, fpath, preconditioner="identity")
    torch.testing.assert_close(plain.scores.double(), query64 @ train64.T, rtol=1e-5, atol=1e-3)
    for pre in ("raw", "kfac"):
        for mode in ("dot", "relatif"):
            f = compute_influence_all(flog, fpath, preconditioner=pre, mode=mode, damping=1e-3)
            d = compute_influence_all(dlog, dpath, preconditioner=pre, mode=mode, damping=1e-3)
            torch.testing.assert_close(f.scores, d.scores, rtol=1e-4, atol=1e-4)
    top = compute_influence_all(flog, fpath, preconditioner="identity", top_k=3)
    assert [list(r) for r in top.helpful_ids] == [
        [plain.train_ids[j] for j in row.argsort(descending=True)[:3].tolist()]
        for row in plain.scores
    ]
    own = compute_self_influence(fpath, preconditioner="identity")
    torch.testing.assert_close(own.scores.double(), train64.square().sum(1), rtol=1e-5, atol=1e-4)
    assert fstore.verify() == len(fstore.shards) >= 1  # every shard checked, none refused


def test_truncation_at_the_gradient_rank_scores_as_dense(tmp_path):
    # T = 6 > c = 3 >= rank(G): the SVD path, exact
    x, xq = _data(N, 6, low_rank=True), _data(4, 6, low_rank=True, seed=2)
    fpath, flog = _log(tmp_path, "f", x, xq, factors=3)
    dpath, dlog = _log(tmp_path, "d", x, xq, factors=None)
    # the default damping: rows of rank <= 2 make "raw"'s covariance singular, and a tiny
    # damping would amplify float32 rounding of either side alike
    for pre in ("identity", "raw", "kfac"):
        f = compute_influence_all(flog, fpath, preconditioner=pre)
        d = compute_influence_all(dlog, dpath, preconditioner=pre)
        scale = d.scores.abs().max()
        torch.testing.assert_close(f.scores / scale, d.scores / scale, rtol=0, atol=1e-4)
    energy = read_json(fpath / "meta.json")["factor_energy"]
    assert set(energy) == {"0", "1"}
    for e in energy.values():
        assert e["rows"] == N and e["min"] == pytest.approx(1.0, abs=1e-5)


def test_truncated_store_records_the_energy_it_kept(tmp_path):
    x, xq = _data(N, 10), _data(2, 10, seed=2)
    fpath, _ = _log(tmp_path, "f", x, xq, factors=2)
    meta = read_json(fpath / "meta.json")
    store = GradientStore(fpath)
    stored = store.rows(0, len(store))
    # reference: numpy SVD of the dense store's rows of the same projection
    dpath, _ = _log(tmp_path, "d", x, xq, factors=None)
    dense = GradientStore(dpath).rows(0, N).double()
    for m, dm in zip(meta["modules"], GradientStore(dpath).meta["modules"], strict=True):
        G = dense[:, dm["offset"] : dm["offset"] + dm["width"]].reshape(N, m["r_out"], m["r_in"])
        s = np.linalg.svd(G.numpy(), compute_uv=False)
        kept = (s[:, :2] ** 2).sum(1) / (s**2).sum(1)
        e = meta["factor_energy"][m["name"]]
        assert e["rows"] == N
        assert e["mean"] == pytest.approx(kept.mean(), rel=1e-4)
        assert e["min"] == pytest.approx(kept.min(), rel=1e-4)
        assert e["min"] < 1.0
        got = _dense64(stored, [m]).reshape(N, m["r_out"], m["r_in"])
        left, sv, vh = np.linalg.svd(G.numpy())
        best = np.einsum("nik,nk,nkj->nij", left[:, :, :2], sv[:, :2], vh[:, :2])
        np.testing.assert_allclose(got.numpy(), best, atol=1e-4 * sv.max())


# ------------------------------------------------------------------------------------ format
def test_meta_records_the_layout_and_the_revision(tmp_path):
    x, xq = _data(N, 4), _data(2, 4, seed=2)
    fpath, _ = _log(tmp_path, "f", x, xq, factors=2)
    meta = read_json(fpath / "meta.json")
    assert meta["format_revision"] == FORMAT_REVISION == 4
    assert meta["config"]["run"]["factors"] == 2
    offset = 0
    for m in meta["modules"]:
        assert m["factors"] == 2 and m["width"] == 2 * (m["r_out"] + m["r_in"])
        assert m["offset"] == offset
        offset += m["width"]
    assert meta["row_width"] == offset
    # a damaged width is refused on open, naming the rule
    bad = dict(meta, modules=[dict(meta["modules"][0], width=5), *meta["modules"][1:]])
    atomic_write_json(fpath / "meta.json", bad)
    with pytest.raises(ValueError, match=r"factors \* \(r_out \+ r_in\)"):
        GradientStore(fpath)


def test_a_dense_store_of_revision_3_opens_and_scores_as_before(tmp_path):
    x, xq = _data(N, T), _data(3, T, seed=2)
    dpath, dlog = _log(tmp_path, "d", x, xq, factors=None)
    before = compute_influence_all(dlog, dpath, preconditioner="kfac", damping=1e-3).scores
    meta = read_json(dpath / "meta.json")
    assert "factors" not in meta["config"]["run"]
    assert all("factors" not in m for m in meta["modules"])
    meta["format_revision"] = 3  # as the previous nnstat wrote it: no factor_energy
    del meta["factor_energy"]
    atomic_write_json(dpath / "meta.json", meta)
    store = GradientStore(dpath)
    assert store.verify() == len(store.shards) >= 1
    dlog.meta.update(format_revision=3)
    dlog.meta.pop("factor_energy")
    after = compute_influence_all(dlog, dpath, preconditioner="kfac", damping=1e-3).scores
    assert torch.equal(before, after)


def test_a_second_backward_in_a_block_is_refused(tmp_path):
    model = _model()
    run = nnstat.init(project="two", root_dir=tmp_path)
    nnstat.setup({"save": "grad", "rank": 8, "factors": 2})
    nnstat.watch(model)
    x = _data(4, 3)
    with pytest.raises(ValueError, match="second backward"):
        with run(data_id=[0, 1, 2, 3]):
            _loss(model, x).backward()
            _loss(model, x).backward()
    nnstat.finalize()  # the refused block stored nothing
    assert not (tmp_path / "two" / "shards").exists() or not GradientStore(tmp_path / "two").ids
    nnstat.unwatch()


@pytest.mark.parametrize("bad", [0, -2, 2.5, "8", True])
def test_bad_factors_are_refused(bad):
    with pytest.raises(ValueError, match="factors must be a positive int or None"):
        nnstat.RunConfig(rank=8, factors=bad)


def test_factors_need_a_projection_rank():
    with pytest.raises(ValueError, match=r"factors=4 .* rank is None .* rank=64, factors=8"):
        nnstat.RunConfig(factors=4)


def test_the_device_staging_path_stores_the_same_factored_rows(tmp_path, monkeypatch):
    from nnstat.run import rows as run_rows

    x, xq = _data(N, 5), _data(2, 5, seed=2)
    host, _ = _log(tmp_path, "host", x, xq, factors=2)
    # the accelerator branch (one staging buffer per block, one copy), run on the CPU
    monkeypatch.setattr(run_rows, "on_accelerator", lambda device: True)
    staged, _ = _log(tmp_path, "staged", x, xq, factors=2)
    a, b = GradientStore(host), GradientStore(staged)
    assert torch.equal(a.rows(0, N), b.rows(0, N))
    assert (
        read_json(host / "meta.json")["factor_energy"]
        == read_json(staged / "meta.json")["factor_energy"]
    )


@pytest.mark.parametrize("kind", ["embedding", "conv"])
def test_other_kronecker_kinds_store_exact_factors(tmp_path, kind):
    torch.manual_seed(0)
    if kind == "embedding":  # [B, T] tokens: T = 3 positions per sample
        model = nn.Sequential(nn.Embedding(30, 12), nn.Linear(12, 10))
        x = torch.randint(0, 30, (N, 3))
    else:  # a 1x1 convolution over 3 pixels
        model = nn.Sequential(nn.Conv2d(12, 10, 1), nn.Flatten(), nn.Linear(30, 9))
        x = torch.randn(N, 12, 3, 1)
    paths = {}
    for name, factors in (("f", 3), ("d", None)):
        run = nnstat.init(project=f"{kind}_{name}", root_dir=tmp_path)
        nnstat.setup({"save": "grad", "rank": 8, "factors": factors})
        nnstat.watch(model)
        for s in range(0, N, BATCH):
            with run(data_id=list(range(s, s + BATCH))):
                model(x[s : s + BATCH]).square().sum().backward()
            model.zero_grad()
        nnstat.finalize()
        nnstat.unwatch()
        paths[name] = tmp_path / f"{kind}_{name}"
    f, d = GradientStore(paths["f"]), GradientStore(paths["d"])
    assert f.meta["modules"][0]["factors"] == 3
    torch.testing.assert_close(
        _dense64(f.rows(0, N), f.meta["modules"]), d.rows(0, N).double(), rtol=1e-5, atol=1e-5
    )


def _mlp_store(root, project, factors):
    """A one-position MLP (exact factors), K-FAC statistics, and what refinement needs."""
    torch.manual_seed(0)
    X, Y = torch.randn(N, D_IN), torch.randint(0, 5, (N,))
    Xq, Yq = torch.randn(3, D_IN), torch.randint(0, 5, (3,))
    model = nn.Sequential(nn.Linear(D_IN, 16), nn.Tanh(), nn.Linear(16, 5))

    def loss_fn(x, y):
        return nn.functional.cross_entropy(model(x), y, reduction="sum")

    run = nnstat.init(project=project, root_dir=root)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac", "rank": 8,
                  "factors": factors})  # fmt: skip
    nnstat.watch(model)
    for s in range(0, N, BATCH):
        with run(data_id=list(range(s, s + BATCH))):
            loss_fn(X[s : s + BATCH], Y[s : s + BATCH]).backward()
        model.zero_grad()
    nnstat.finalize()
    nnstat.eval()
    with run(data_id=[f"q{i}" for i in range(3)]):
        loss_fn(Xq, Yq).backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return root / project, log, model, (X, Y), (Xq, Yq)


def test_refinement_and_the_viewer_read_a_factored_store_as_the_dense_one(tmp_path):
    from nnstat.influence import Refinement
    from nnstat.viewer import save_queries
    from nnstat.viewer.explorer import Explorer

    got = {}
    for name, factors in (("f", 1), ("d", None)):
        path, log, model, train, query = _mlp_store(tmp_path / name, "p", factors)
        refine = Refinement(model, nn.functional.cross_entropy, train, query_data=query,
                            steps=2, curvature="ggn", progress=False)  # fmt: skip
        refined = compute_influence_all(log, path, refine=refine, progress=False)
        save_queries(log, path, name="q")
        lists = Explorer(tmp_path / name).influence("p", "q", 1, k=5, mode="relatif")
        got[name] = (refined.scores, lists, GradientStore(path).meta["modules"])
    assert got["f"][2][0]["factors"] == 1 and "factors" not in got["d"][2][0]
    torch.testing.assert_close(got["f"][0], got["d"][0], rtol=1e-4, atol=1e-4)
    f_lists, d_lists = got["f"][1], got["d"][1]
    assert [e["id"] for e in f_lists["helpful"]] == [e["id"] for e in d_lists["helpful"]]
    torch.testing.assert_close(
        torch.tensor([e["score"] for e in f_lists["helpful"]]),
        torch.tensor([e["score"] for e in d_lists["helpful"]]),
        rtol=1e-4,
        atol=1e-5,
    )


# ------------------------------------------------------------------ the device branch of scoring
@pytest.mark.parametrize("pre", ["identity", "raw", "kfac"])
def test_the_device_branch_scores_a_factored_store_as_the_host_branch(tmp_path, monkeypatch, pre):
    x, xq = _data(N, 5), _data(3, 5, seed=2)
    fpath, flog = _log(tmp_path, "f", x, xq, factors=2)  # T > c: truncated factors
    kw = {"preconditioner": pre, "damping": 1e-3, "batch_size": 5}
    device_branch_staging(monkeypatch, False)
    host = {m: compute_influence_all(flog, fpath, mode=m, **kw) for m in ("dot", "relatif")}
    host_top = compute_influence_all(flog, fpath, top_k=3, **kw)
    host_own = compute_self_influence(fpath, **kw)
    staged = device_branch_staging(monkeypatch, True)
    for mode, ref in host.items():
        got = compute_influence_all(flog, fpath, mode=mode, **kw)
        assert got.train_ids == ref.train_ids
        scale = ref.scores.abs().max().item()
        torch.testing.assert_close(got.scores, ref.scores, rtol=1e-5, atol=1e-6 * scale)
    top = compute_influence_all(flog, fpath, top_k=3, **kw)
    torch.testing.assert_close(top.helpful_scores, host_top.helpful_scores, rtol=1e-5, atol=1e-3)
    assert top.helpful_ids == host_top.helpful_ids
    own = compute_self_influence(fpath, **kw)
    torch.testing.assert_close(own.scores, host_own.scores, rtol=1e-5, atol=1e-4)
    assert staged  # the device branch ran (its reader staged the blocks)


def test_the_device_branch_copies_the_stored_factored_bytes(tmp_path, monkeypatch):
    x, xq = _data(N, 5), _data(3, 5, seed=2)
    fpath, flog = _log(tmp_path, "f", x, xq, factors=2)
    store = GradientStore(fpath)
    stored_width, dense_width = store.row_width, flog.meta["row_width"]
    assert 2 * stored_width == dense_width  # factored (c=2, r=8): half the dense bytes
    staged = device_branch_staging(monkeypatch, True)
    compute_influence_all(flog, fpath, preconditioner="identity", batch_size=BATCH)
    compute_self_influence(fpath, preconditioner="identity", batch_size=BATCH)
    # every block crosses to the device as stored: BATCH float32 rows of the stored width
    assert staged and set(staged) == {(BATCH * stored_width * 4, torch.float32)}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_scoring_of_a_factored_store_copies_the_stored_bytes(tmp_path, monkeypatch):
    from nnstat.influence import pipeline

    x, xq = _data(N, 5), _data(3, 5, seed=2)
    fpath, flog = _log(tmp_path, "f", x, xq, factors=2)
    copied: list[tuple[int, int]] = []
    copy = pipeline._DeviceCopies.copy

    def counting(self, rows):
        copied.append((rows.shape[1], rows.element_size()))
        return copy(self, rows)

    monkeypatch.setattr(pipeline._DeviceCopies, "copy", counting)
    kw = {"preconditioner": "kfac", "damping": 1e-3, "batch_size": BATCH}
    for top_k in (None, 3):
        a = compute_influence_all(flog, fpath, top_k=top_k, **kw)
        b = compute_influence_all(flog, fpath, top_k=top_k, device="cuda", **kw)
        if top_k is None:
            torch.testing.assert_close(b.scores, a.scores, rtol=1e-4, atol=1e-4)
        else:
            assert b.helpful_ids == a.helpful_ids
    sa = compute_self_influence(fpath, **kw)
    sb = compute_self_influence(fpath, device="cuda", **kw)
    torch.testing.assert_close(sb.scores, sa.scores, rtol=1e-4, atol=1e-4)
    # every training block crossed to the GPU as stored: float32 rows of the stored width
    assert copied and set(copied) == {(GradientStore(fpath).row_width, 4)}
