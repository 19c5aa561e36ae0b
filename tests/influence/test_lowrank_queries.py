"""Dense queries of low rank against factored training rows (`lowrank_queries`): each factored
module's preconditioned query matrix is factored exactly where its numerical rank makes the
factors route the cheapest, and scores as the float64 numpy reference (every module multiplied
out with ``einsum``, the preconditioner applied to the dense rows) to float32 rounding.

An MLP's per-sample gradients (torch.func) are rank 1: the factors route; a sequence model's
(rank ``min(T, r)``) keep the dense route; a crafted rank-2 query gives ``k = 2``; a query with
``σ_2 = 1e-3 σ_1`` is not truncated. Identity, RelatIF/cosine, K-FAC at damping 0 (the factors of
the preconditioned query), damped K-FAC (dense), top-k, host and device branch (on CPU tensors),
and the device branch's host reads per call.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _factored_ref import dense_numpy, factored_modules, kfac_metric
from _influence_ref import layer_grads, mode_scores, tiny_problem
from _ledger import device_branch_staging, host_reads
from safetensors.torch import save_file

import nnstat.influence.factored_scores as fs
import nnstat.influence.lowrank_queries as lq
from nnstat.influence import compute_influence_all, score
from nnstat.influence.lowrank_queries import lowrank_queries, numerical_ranks, worth_trying
from nnstat.influence.precondition import Preconditioner
from nnstat.store import GradientLog, GradientStore, StoreWriter
from nnstat.store.factored import dense_layout

EPS = float(np.finfo(np.float32).eps)
# three 16 x 16 modules (c = 1), a LayerNorm, a 12 x 10 module (c = 2); with 4 queries the
# factors route is the cheapest up to rank 8 (16 x 16) and 3 (12 x 10)
SPEC = [("f", 1, 16, 16), ("p", 5), ("f", 2, 12, 10), ("f", 1, 16, 16), ("f", 1, 16, 16)]
N, N_Q, BLOCK = 70, 4, 24


def _write(root, mods, rows, statistics=None):
    width = sum(m["width"] for m in mods)
    meta = {"format_version": 1, "row_width": width, "dtype": "float32", "modules": mods}
    root.mkdir(parents=True)
    (root / "meta.json").write_text(json.dumps(meta))
    writer = StoreWriter(root / "shards", row_width=width, shard_rows=30)
    writer.put(list(range(len(rows))), rows)
    writer.close()
    if statistics is not None:
        save_file(statistics, str(root / "statistics.safetensors"))
    return meta


def _kfac_statistics(mods, seed=7):
    """Well-conditioned random K-FAC factors ``S`` (backward) and ``A`` (forward) per module."""
    g, stats = torch.Generator().manual_seed(seed), {}
    for m in mods:
        for side, r in (("backward", m["r_out"]), ("forward", m["r_in"])):
            if m.get("factors"):
                x = torch.randn(r, 3 * r, generator=g)
                stats[f"{m['name']}/{side}/covariance"] = x @ x.T / (3 * r) + 0.2 * torch.eye(r)
    return stats


def _queries(meta, ranks, n_q=N_Q, seed=1, sigma2=None):
    """float32 dense query rows whose factored modules have the given ranks (float64 products of
    Gaussian factors, rounded once); ``sigma2``: instead, every module ``u_1 v_1ᵀ + sigma2 u_2
    v_2ᵀ`` with orthonormal ``u``, ``v`` (``σ_2 / σ_1 = sigma2``)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    factored = iter(ranks)
    for m in meta["modules"]:
        if not m.get("factors"):
            parts.append(torch.randn(n_q, m["width"], generator=g, dtype=torch.float64))
            continue
        r_out, r_in, k = m["r_out"], m["r_in"], next(factored)
        if sigma2 is None:
            a = torch.randn(n_q, r_out, k, generator=g, dtype=torch.float64)
            b = torch.randn(n_q, k, r_in, generator=g, dtype=torch.float64)
            parts.append((a @ b).reshape(n_q, -1))
            continue
        u = torch.linalg.qr(torch.randn(n_q, r_out, 2, generator=g, dtype=torch.float64))[0]
        v = torch.linalg.qr(torch.randn(n_q, r_in, 2, generator=g, dtype=torch.float64))[0]
        scale = torch.tensor([1.0, sigma2], dtype=torch.float64)
        parts.append(((u * scale) @ v.transpose(1, 2)).reshape(n_q, -1))
    rows = torch.cat(parts, 1).to(torch.float32)
    return (
        GradientLog(list(range(n_q)), rows, {**meta, **dense_layout(meta)}),
        rows.double().numpy(),
    )


@pytest.fixture()
def store(tmp_path):
    mods = factored_modules(SPEC)
    width = sum(m["width"] for m in mods)
    rows = torch.randn(N, width, generator=torch.Generator().manual_seed(0))
    stats = _kfac_statistics(mods)
    meta = _write(tmp_path / "train", mods, rows, stats)
    return tmp_path / "train", meta, dense_numpy(rows, mods), stats


@pytest.fixture()
def routes(monkeypatch):
    """``(rows scored by the factors route, factor pairs per module name of each call's
    factored queries ({} where none))``; the singular values taken whatever the store's size
    (:data:`SVD_SHARE`: the small stores here would not pay for them)."""
    monkeypatch.setattr(lq, "SVD_SHARE", 1e12)
    pairs, calls = [], []
    real_pairs, real = fs._pair_scores, score.lowrank_queries

    def spy(*args):
        got = real(*args)
        calls.append({} if got is None else {m["name"]: m.get("factors") for m in got[1]})
        return got

    monkeypatch.setattr(fs, "_pair_scores", lambda *a: pairs.append(len(a[1])) or real_pairs(*a))
    monkeypatch.setattr(score, "lowrank_queries", spy)
    return pairs, calls


def _rounding(q, t, m=None):
    """A float32 dense computation's rounding bound per score: ``n eps Σ_a |q_a| |(M t)_a|``
    with ``n`` the largest module's columns (256)."""
    mt = t if m is None else t @ m
    return 256 * EPS * (np.abs(q) @ np.abs(mt).T)


# ----------------------------------------------------------------------------- the pieces
def test_the_tolerance_is_numpy_matrix_rank():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randn(16, 2, generator=g), torch.randn(2, 16, generator=g)
    two = a @ b  # rank 2, rounded to float32: σ_3 at float32's rounding of σ_1
    s = torch.linalg.svdvals(two.double())
    assert s[2] < s[0] * EPS * 16 < s[1]
    near = torch.diag(torch.tensor([1.0, 1e-3] + [0.0] * 14)) @ torch.linalg.qr(two)[0]
    ranks = numerical_ranks(torch.stack([two, near, torch.zeros(16, 16), torch.eye(16)]))
    want = [np.linalg.matrix_rank(x.numpy()) for x in (two, near)]  # float32: its eps
    assert ranks.tolist() == [2, 2, 0, 16] and want == [2, 2]


def test_the_singular_values_are_taken_where_they_cost_a_tenth_of_the_dense_route():
    # 32 queries, 64 x 64, c = 1: 32 (20 * 64³ + 200,000) = 174,172,160 multiply-adds against
    # 0.1 n 133,120 (the direct route): worth it from 13,084 rows
    assert worth_trying(32, 13_100, 1, 64, 64) and not worth_trying(32, 13_000, 1, 64, 64)
    # never where the factors route at rank 1 is not the cheapest
    assert not worth_trying(32, 10**9, 8, 8, 8)


# ----------------------------------------------------------------------------- the public API
@pytest.mark.parametrize("branch", ["host", "device"])
@pytest.mark.parametrize("mode", ["dot", "relatif", "cosine"])
def test_an_mlps_dense_queries_score_by_their_factors(tmp_path, routes, monkeypatch, branch, mode):
    pairs, calls = routes
    device_branch_staging(monkeypatch, on=branch == "device")
    model, (x, y), (xq, yq) = tiny_problem(n_train=60, n_query=6)
    spec = {"0": (12, 6), "2": (3, 13)}
    mods, off = [], 0
    for name, (r_out, r_in) in spec.items():
        mods.append({"name": name, "kind": "linear", "offset": off, "width": r_out + r_in,
                     "r_out": r_out, "r_in": r_in, "factors": 1})  # fmt: skip
        off += r_out + r_in
    # training rows: each per-sample gradient (rank 1) as its one factor pair
    parts = []
    for g in layer_grads(model, x, y).values():
        left, s, vh = torch.linalg.svd(g)
        parts += [left[:, :, 0] * s[:, :1], vh[:, 0]]
    rows = torch.cat(parts, 1).to(torch.float32)
    meta = _write(tmp_path / "train", mods, rows)
    q = torch.cat([g.reshape(6, -1) for g in layer_grads(model, xq, yq).values()], 1)
    log = GradientLog(list(range(6)), q.to(torch.float32), {**meta, **dense_layout(meta)})
    q, t = q.to(torch.float32).double().numpy(), dense_numpy(rows, mods)
    kw = dict(preconditioner="identity", mode=mode, batch_size=BLOCK, progress=False)
    got = compute_influence_all(log, tmp_path / "train", **kw).scores.double().numpy()
    assert calls == [{"0": 1, "2": 1}] and sum(pairs) == 2 * 60  # both modules, every row
    ref = mode_scores(q, t, np.eye(t.shape[1]), mode)
    dot = mode_scores(q, t, np.eye(t.shape[1]), "dot")
    bound = _rounding(q, t) * np.abs(ref / np.where(dot == 0, 1, dot)) + 1e-6 * np.abs(ref)
    assert (np.abs(got - ref) <= bound).all(), np.abs(got - ref).max()
    top = compute_influence_all(log, tmp_path / "train", top_k=5, **kw)
    order = np.argsort(-ref, axis=1, kind="stable")
    assert top.helpful_ids == [row[:5].tolist() for row in order]
    assert top.harmful_ids == [row[::-1][:5].tolist() for row in order]


@pytest.mark.parametrize("branch", ["host", "device"])
def test_a_sequence_models_queries_keep_the_dense_route(store, routes, monkeypatch, branch):
    root, meta, t, _ = store
    pairs, calls = routes
    device_branch_staging(monkeypatch, on=branch == "device")
    # T = 12 positions: rank 12 (16 x 16, above 8) and 10 (12 x 10, above 3)
    log, q = _queries(meta, [12, 10, 12, 16])
    got = compute_influence_all(log, root, preconditioner="identity", batch_size=BLOCK)
    assert calls == [{}] and pairs == []
    ref = q @ t.T
    assert (np.abs(got.scores.double().numpy() - ref) <= _rounding(q, t)).all()


@pytest.mark.parametrize("chunks", ["all queries at once", "a query a chunk"])
@pytest.mark.parametrize("branch", ["host", "device"])
def test_modules_of_low_and_high_rank_in_one_pass(store, routes, monkeypatch, branch, chunks):
    root, meta, t, _ = store
    pairs, calls = routes
    device_branch_staging(monkeypatch, on=branch == "device")
    if chunks == "a query a chunk":
        monkeypatch.setattr(lq, "SVD_BYTES", 1)
    # 16 x 16: m0 rank 2 and m3 rank 5 by 5 pairs each (one group: the largest rank the factors
    # route takes), m4 rank 9 dense; 12 x 10: m2 rank 3 (its largest)
    log, q = _queries(meta, [2, 3, 5, 9])
    got = compute_influence_all(log, root, preconditioner="identity", batch_size=BLOCK)
    assert calls == [{"m0": 5, "m1": None, "m2": 3, "m3": 5, "m4": None}]
    assert sum(pairs) == 2 * N  # the two shapes' factored modules: every row once each
    ref = q @ t.T
    assert (np.abs(got.scores.double().numpy() - ref) <= _rounding(q, t)).all()


@pytest.mark.parametrize("branch", ["host", "device"])
def test_a_near_rank_deficient_query_is_not_truncated(store, routes, monkeypatch, branch):
    root, meta, t, _ = store
    _, calls = routes
    device_branch_staging(monkeypatch, on=branch == "device")
    log, q = _queries(meta, [2, 2, 2, 2], sigma2=1e-3)
    got = compute_influence_all(log, root, preconditioner="identity", batch_size=BLOCK)
    assert calls == [{"m0": 2, "m1": None, "m2": 2, "m3": 2, "m4": 2}]
    ref = q @ t.T
    err = np.abs(got.scores.double().numpy() - ref)
    assert (err <= _rounding(q, t)).all(), err.max()
    # what truncating σ_2 would change: above that bound, and far above the error seen
    _, q1 = _queries(meta, [2, 2, 2, 2], sigma2=0.0)
    assert (np.abs(q1 @ t.T - ref) / _rounding(q, t)).max() > 5
    assert np.abs(q1 @ t.T - ref).max() > 100 * err.max()


CASES = [("identity", None, "dot", True), ("identity", None, "relatif", True),
         ("kfac", 0.0, "dot", True), ("kfac", 0.0, "cosine", True),
         ("kfac", 0.3, "dot", False), ("kfac", 0.3, "relatif", False)]  # fmt: skip


@pytest.mark.parametrize("branch", ["host", "device"])
@pytest.mark.parametrize("kind,damping,mode,factored", CASES)
def test_preconditioned_rank_one_queries_score_as_numpy(
    store, routes, monkeypatch, branch, kind, damping, mode, factored
):
    root, meta, t, stats = store
    pairs, calls = routes
    device_branch_staging(monkeypatch, on=branch == "device")
    log, q = _queries(meta, [1, 1, 1, 1])
    kw = dict(preconditioner=kind, damping=damping, mode=mode, batch_size=BLOCK, progress=False)
    compute_influence_all(log, root, **kw)  # fits K-FAC (the LayerNorm's rows): cached
    pairs.clear(), calls.clear()
    full = compute_influence_all(log, root, **kw)
    # K-FAC at damping 0 keeps rank 1 (S⁻¹ Q A⁻¹); damped, M(Q) has full rank: not even tried
    want = {"m0": 1, "m1": None, "m2": 1, "m3": 1, "m4": 1} if factored else {}
    assert calls == [want] and sum(pairs) == (2 * N if factored else 0)
    ref = mode_scores(q, t, kfac_metric(meta, t, kind, damping or 0.0, stats), mode)
    tol = dict(rtol=2e-4, atol=2e-4 * np.abs(ref).max())
    np.testing.assert_allclose(full.scores.double().numpy(), ref, **tol)
    top = compute_influence_all(log, root, top_k=4, **kw)
    order = np.argsort(-ref, axis=1, kind="stable")
    assert top.helpful_ids == [row[:4].tolist() for row in order]
    np.testing.assert_allclose(top.helpful_scores.double().numpy(), -np.sort(-ref)[:, :4], **tol)


def test_a_dense_store_or_a_small_one_takes_no_singular_values(store, tmp_path, monkeypatch):
    root, meta, _, _ = store
    seen = []
    real = lq.numerical_ranks
    monkeypatch.setattr(lq, "numerical_ranks", lambda *a: seen.append(1) or real(*a))
    log, _ = _queries(meta, [1, 1, 1, 1])
    q = log.rows
    pre = Preconditioner("identity", [], {})
    source = score.as_source(root)
    # 70 rows: the singular values would cost more than a tenth of scoring them densely
    assert lowrank_queries(q, source, pre, None) is None and seen == []
    monkeypatch.setattr(lq, "SVD_SHARE", 1e12)
    rows, mods = lowrank_queries(q, source, pre, None)
    assert [m.get("factors") for m in mods] == [1, None, 1, 1, 1] and seen
    assert lowrank_queries(q, score.as_source(log), pre, None) is None  # dense rows: no factors


def test_the_device_branch_reads_the_host_once_more_per_call_for_the_ranks(
    tmp_path, routes, monkeypatch
):
    device_branch_staging(monkeypatch)
    mods = factored_modules(SPEC)
    width = sum(m["width"] for m in mods)
    counts = []
    for n in (48, 240):  # 2 and 10 blocks
        rows = torch.randn(n, width, generator=torch.Generator().manual_seed(n))
        meta = _write(tmp_path / f"train{n}", mods, rows)
        log, _ = _queries(meta, [1, 1, 1, 1])
        kw = dict(preconditioner="identity", batch_size=BLOCK, progress=False)
        compute_influence_all(log, tmp_path / f"train{n}", **kw)
        reads: list[str] = []
        with host_reads(reads, this_thread=True):
            compute_influence_all(log, tmp_path / f"train{n}", **kw)
        counts.append(reads)
    # per call: the query log's finiteness, the ranks, the blocks' flags, the results
    assert counts[0] == counts[1] and len(counts[1]) <= 4, counts
    assert routes[1][-1] == {"m0": 1, "m1": None, "m2": 1, "m3": 1, "m4": 1}


def test_an_mlps_eval_log_against_its_factored_store_takes_the_factors_route(tmp_path, routes):
    import nnstat

    pairs, calls = routes
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 10))
    g = torch.Generator().manual_seed(1)
    x, xq = torch.randn(40, 12, generator=g), torch.randn(5, 12, generator=g)
    run = nnstat.init(project="mlp", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac", "rank": 8, "factors": 1})
    nnstat.watch(model)
    for s in range(0, 40, 8):
        with run(data_id=list(range(s, s + 8))):
            model(x[s : s + 8]).square().sum().backward()
        model.zero_grad()
    nnstat.finalize()
    nnstat.eval()  # one position per sample: each query's projected gradient has rank 1
    with run(data_id=[f"q{i}" for i in range(5)]):
        model(xq).square().sum().backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    assert all("factors" not in m for m in log.meta["modules"])  # logged dense
    got = compute_influence_all(log, tmp_path / "mlp", preconditioner="identity", progress=False)
    store = score.as_source(tmp_path / "mlp")
    mods = [m for m in store.meta["modules"] if m.get("factors")]
    shapes = {(m["factors"], m["r_out"], m["r_in"]) for m in mods}  # one call per shape
    assert len(mods) == 2 and calls == [{m["name"]: 1 for m in mods}]
    assert sum(pairs) == 40 * len(shapes)
    stored = np.concatenate([np.load(p) for p in GradientStore(tmp_path / "mlp").shards])
    t = dense_numpy(stored, store.meta["modules"])
    q = log.rows.double().numpy()
    ref = q @ t.T
    assert (np.abs(got.scores.double().numpy() - ref) <= _rounding(q, t)).all()
