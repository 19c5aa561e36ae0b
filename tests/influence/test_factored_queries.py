"""Factored queries against factored rows (`FactoredScores`' factors route, `factored_queries`):
queries logged into a factored store score ``Σ (u_qi · u_j)(v_qi · v_j)`` where the
preconditioner keeps them factored (identity; K-FAC at damping 0), and as dense queries where it
does not (K-FAC at damping > 0, EK-FAC, raw), with the same scores as a float64 numpy reference
that multiplies every module out with ``einsum`` and preconditions the dense rows.

The training store has per-module factor counts (``factors={"*": 1, "x": 4}``), the queries other
counts, one module dense; host and device branch (on CPU tensors), top-k, RelatIF,
self-influence, the CLI, and the device branch's ops per block on ``meta``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _factored_ref import dense_numpy, kfac_metric
from _influence_ref import mode_scores
from _ledger import DeviceLedger, LargestTensor, device_branch_staging, host_reads
from safetensors.torch import save_file

import nnstat.influence.factored_scores as fs
from nnstat.influence import compute_influence_all, compute_self_influence
from nnstat.influence.cli import main as cli_main
from nnstat.influence.factored_queries import factors_preserved, stored_queries
from nnstat.influence.factored_scores import FactoredScores, cheapest_route
from nnstat.influence.ondevice import stream_scores
from nnstat.influence.precondition import Preconditioner
from nnstat.influence.sources import StoreSource, as_source
from nnstat.store import GradientLog, StoreWriter
from nnstat.store.factored import dense_layout, densify

# (name, factor pairs or None: dense, r_out, r_in); ("ln", width): a LayerNorm (flat, dense)
TRAIN = [("a", 1, 6, 6), ("ln", 5), ("x", 4, 12, 10), ("b", 1, 6, 6), ("c", 1, 8, 10)]
QUERY = [("a", 2, 6, 6), ("ln", 5), ("x", 1, 12, 10), ("b", 2, 6, 6), ("c", None, 8, 10)]
N, N_Q, BLOCK = 70, 5, 24


def _modules(spec):
    mods, off = [], 0
    for s in spec:
        if s[0] == "ln":
            m = {"name": "ln", "kind": "layernorm", "width": s[1], "r_out": None, "r_in": s[1]}
        else:
            name, c, r_out, r_in = s
            w = r_out * r_in if c is None else c * (r_out + r_in)
            m = {"name": name, "kind": "linear", "width": w, "r_out": r_out, "r_in": r_in}
            m.update({"factors": c} if c else {})
        mods.append({**m, "offset": off})
        off += m["width"]
    return mods


def _store(root, spec, n, seed, statistics=None):
    mods = _modules(spec)
    width = sum(m["width"] for m in mods)
    meta = {"format_version": 1, "row_width": width, "dtype": "float32", "modules": mods}
    root.mkdir(parents=True)
    (root / "meta.json").write_text(json.dumps(meta))
    rows = torch.randn(n, width, generator=torch.Generator().manual_seed(seed))
    writer = StoreWriter(root / "shards", row_width=width, shard_rows=30)
    writer.put(list(range(n)), rows)
    writer.close()
    if statistics is not None:
        save_file(statistics, str(root / "statistics.safetensors"))
    return meta, rows


def _kfac_statistics(seed=7):
    """Well-conditioned random K-FAC factors, ``S`` (backward) and ``A`` (forward) per module."""
    g, stats = torch.Generator().manual_seed(seed), {}
    for name, _, r_out, r_in in [s for s in TRAIN if s[0] != "ln"]:
        for side, r in (("backward", r_out), ("forward", r_in)):
            x = torch.randn(r, 3 * r, generator=g)
            stats[f"{name}/{side}/covariance"] = x @ x.T / (3 * r) + 0.2 * torch.eye(r)
    return stats


@pytest.fixture()
def stores(tmp_path):
    stats = _kfac_statistics()
    t_meta, t_rows = _store(tmp_path / "train", TRAIN, N, 0, stats)
    q_meta, q_rows = _store(tmp_path / "query", QUERY, N_Q, 1)
    t = dense_numpy(t_rows, t_meta["modules"])
    q = dense_numpy(q_rows, q_meta["modules"])
    return tmp_path, (t_meta, t), (q_meta, q_rows, q), stats


@pytest.fixture()
def spies(monkeypatch):
    """Rows of the chunks scored by the factors route; training rows multiplied out by
    `StoreSource.dense` (the training store is the one named ``train``)."""
    pairs, dense = [], []
    real_pairs, real_dense = fs._pair_scores, StoreSource.dense

    def spy_dense(source, rows):
        if source.root.name == "train":
            dense.append(len(rows))
        return real_dense(source, rows)

    monkeypatch.setattr(fs, "_pair_scores", lambda *a: pairs.append(len(a[1])) or real_pairs(*a))
    monkeypatch.setattr(StoreSource, "dense", spy_dense)
    return pairs, dense


# ----------------------------------------------------------------------------- the scorer
def test_the_route_is_the_one_of_fewest_multiply_adds():
    # counted by hand, rank 64, 32 queries: dense queries densify ((c + 32) 64²) or, for c = 1,
    # contract directly (32 (64² + 64)); factored ones contract the factors (32 c_q c 129)
    assert cheapest_route(32, 1, 64, 64) == "direct"  # 133,120 vs 135,168
    assert cheapest_route(32, 1, 64, 64, query_c=1) == "factors"  # 4,128 vs 133,120
    assert cheapest_route(32, 4, 64, 64, query_c=4) == "factors"  # 66,048 vs 147,456
    assert cheapest_route(32, 8, 64, 64, query_c=8) == "densify"  # 264,192 vs 163,840
    assert cheapest_route(1, 8, 64, 64) == cheapest_route(1, 8, 64, 64, query_c=64) == "direct"
    assert cheapest_route(1, 8, 64, 64, query_c=4) == "factors"  # 4,128 vs 33,280


@pytest.mark.parametrize("n_q", [1, 5])
def test_factored_queries_score_as_numpy_with_mixed_routes(monkeypatch, n_q):
    monkeypatch.setattr(fs, "SCRATCH_BYTES", 1)  # chunks of 16 rows: several per block
    t_mods, q_mods = _modules(TRAIN), _modules(QUERY)
    g = torch.Generator().manual_seed(n_q)
    rows = torch.randn(37, sum(m["width"] for m in t_mods), generator=g)
    q_rows = torch.randn(n_q, sum(m["width"] for m in q_mods), generator=g)
    q = dense_numpy(q_rows, q_mods)
    want = dense_numpy(rows, t_mods) @ q.T
    score = FactoredScores(densify(q_rows, q_mods), t_mods, queries=(q_rows, q_mods))
    # a and b (c = 1, 6 x 6, queries c = 2) and x (c = 4, queries c = 1) by their factors;
    # c, dense in the queries, by the dense route
    assert sorted((g.c, g.r_out, g.modules, uq.shape[1]) for g, uq, _, _ in score._pairs) == [
        (1, 6, 2, 2 * n_q),
        (4, 12, 1, n_q),
    ]
    assert [(g.c, g.r_out, g.modules) for g, *_ in score._parts] == [(1, 8, 1)]
    tol = {"rtol": 1e-4, "atol": 1e-4 * np.abs(want).max()}
    np.testing.assert_allclose(score(rows).double().numpy(), want, **tol)
    np.testing.assert_allclose(score(rows, query_major=True).double().numpy(), want.T, **tol)


def test_factored_queries_of_another_layout_are_refused():
    t_mods, q_mods = _modules(TRAIN), _modules(QUERY[:-1])
    q_rows = torch.zeros(2, sum(m["width"] for m in q_mods))
    with pytest.raises(ValueError, match="factored queries of .* store's configuration"):
        FactoredScores(torch.zeros(2, 277), t_mods, queries=(q_rows, q_mods))


def test_which_preconditioners_keep_queries_factored(stores):
    root, *_ = stores
    t = as_source(root / "train")
    q = as_source(root / "query")
    mods, cpu = q.meta["modules"], torch.device("cpu")
    for kind, damping, kept in [("identity", None, True), ("kfac", 0.0, True),
                                ("kfac", 0.1, False), ("kfac", None, False),
                                ("ekfac", 0.0, False), ("raw", 0.0, False)]:  # fmt: skip
        pre = Preconditioner.fit(t, kind)
        assert factors_preserved(pre, damping, mods) is kept, (kind, damping)
        assert (stored_queries(q, pre, damping, 8, cpu) is not None) is kept
    # dense queries (a log made dense) have no factors to keep
    dense_q = as_source(GradientLog([0], torch.zeros(1, 277), {**q.meta, **dense_layout(q.meta)}))
    assert stored_queries(dense_q, Preconditioner.fit(t, "identity"), None, 8, cpu) is None


# ----------------------------------------------------------------------------- the public API
CASES = [("identity", None, "dot"), ("identity", None, "relatif"), ("kfac", 0.0, "dot"),
         ("kfac", 0.3, "dot"), ("kfac", 0.3, "relatif")]  # fmt: skip


@pytest.mark.parametrize("branch", ["host", "device"])
@pytest.mark.parametrize("query_as", ["store", "log"])
@pytest.mark.parametrize("kind,damping,mode", CASES)
def test_factored_queries_score_as_numpy(
    stores, spies, monkeypatch, branch, query_as, kind, damping, mode
):
    root, (t_meta, t), (q_meta, q_rows, q), stats = stores
    pairs, dense = spies
    device_branch_staging(monkeypatch, on=branch == "device")
    query = root / "query" if query_as == "store" else GradientLog(list(range(N_Q)), q_rows, q_meta)
    ref = mode_scores(q, t, kfac_metric(t_meta, t, kind, damping or 0.0, stats), mode)
    kw = dict(preconditioner=kind, damping=damping, mode=mode, batch_size=BLOCK, progress=False)
    compute_influence_all(query, root / "train", **kw)  # fits K-FAC (the LayerNorm's rows): cached
    pairs.clear(), dense.clear()
    full = compute_influence_all(query, root / "train", **kw)
    tol = dict(rtol=2e-4, atol=2e-4 * np.abs(ref).max())
    np.testing.assert_allclose(full.scores.double().numpy(), ref, **tol)
    top = compute_influence_all(query, root / "train", top_k=4, **kw)
    order = np.argsort(-ref, axis=1, kind="stable")
    assert top.helpful_ids == [row[:4].tolist() for row in order]
    assert top.harmful_ids == [row[::-1][:4].tolist() for row in order]
    np.testing.assert_allclose(top.helpful_scores.double().numpy(), -np.sort(-ref)[:, :4], **tol)
    # the factors route where the preconditioner keeps the queries factored: every row of both
    # calls, for both shapes (a and b; x); K-FAC at damping > 0 makes the queries full rank:
    # the dense queries' route
    factored = kind == "identity" or damping == 0
    assert (sum(pairs) == 2 * 2 * N) if factored else not pairs, pairs
    # no training row multiplied out, except for K-FAC's norms (RelatIF): identity's come from
    # the factors (`norm_parts_as_stored`)
    assert bool(dense) == (mode != "dot" and kind == "kfac")


@pytest.mark.parametrize("branch", ["host", "device"])
def test_factored_queries_against_a_dense_store_are_multiplied_out(
    stores, spies, monkeypatch, branch
):
    root, _, (q_meta, q_rows, q), _ = stores
    pairs, _ = spies
    device_branch_staging(monkeypatch, on=branch == "device")
    # the training store dense: every module as r_out x r_in columns (no factors)
    dense_spec = [s if s[0] == "ln" else (s[0], None, *s[2:]) for s in TRAIN]
    t_meta, t_rows = _store(root / "dense", dense_spec, N, 2)
    t = dense_numpy(t_rows, t_meta["modules"])
    got = compute_influence_all(root / "query", root / "dense", preconditioner="identity",
                                batch_size=BLOCK, progress=False)  # fmt: skip
    ref = q @ t.T
    np.testing.assert_allclose(got.scores.double().numpy(), ref, rtol=2e-4,
                               atol=2e-4 * np.abs(ref).max())  # fmt: skip
    assert pairs == []  # no factors on the training side: the queries were multiplied out


@pytest.mark.parametrize("branch", ["host", "device"])
@pytest.mark.parametrize("mode", ["relatif", "cosine", "l2"])
def test_identity_norms_from_factors_neither_underflow_nor_divide_by_zero(
    tmp_path, spies, monkeypatch, branch, mode
):
    _, dense = spies
    device_branch_staging(monkeypatch, on=branch == "device")
    mods = _modules(TRAIN)
    width = sum(m["width"] for m in mods)
    meta = {"format_version": 1, "row_width": width, "dtype": "float32", "modules": mods}
    root = tmp_path / "train"
    root.mkdir()
    (root / "meta.json").write_text(json.dumps(meta))
    rows = torch.randn(N, width, generator=torch.Generator().manual_seed(4))
    ln = next(m for m in mods if m["name"] == "ln")
    rows[:10] *= 1e-15  # factors ~1e-15, so dense entries ~1e-30: their squares underflow
    rows[:10, ln["offset"] : ln["offset"] + ln["width"]] *= 1e-15  # the plain columns too
    rows[10] = 0.0  # numerically zero: scores 0, never first
    writer = StoreWriter(root / "shards", row_width=width, shard_rows=30)
    writer.put(list(range(N)), rows)
    writer.close()
    t = dense_numpy(rows, mods)
    q = torch.randn(N_Q, t.shape[1], generator=torch.Generator().manual_seed(5))
    log = GradientLog(list(range(N_Q)), q, {**meta, **dense_layout(meta)})
    got = compute_influence_all(log, root, mode=mode, preconditioner="identity", batch_size=BLOCK)
    with np.errstate(invalid="ignore"):
        ref = np.nan_to_num(mode_scores(q.double().numpy(), t, np.eye(t.shape[1]), mode))
    scores = got.scores.double().numpy()
    np.testing.assert_allclose(scores, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
    if mode != "l2":  # the tiny rows' normalised scores are of order one, the zero row's 0
        np.testing.assert_allclose(scores[:, :10], ref[:, :10], rtol=2e-4)
        assert np.abs(ref[:, :10]).min() > 1e-6 and (scores[:, 10] == 0).all()
    assert dense == []  # the norms came from the factors


@pytest.mark.parametrize("branch", ["host", "device"])
def test_self_influence_of_factored_rows_under_identity_is_numpy_without_dense_rows(
    stores, spies, monkeypatch, branch
):
    root, (t_meta, t), *_ = stores
    _, dense = spies
    device_branch_staging(monkeypatch, on=branch == "device")
    got = compute_self_influence(root / "train", preconditioner="identity", batch_size=BLOCK)
    np.testing.assert_allclose(got.scores.double().numpy(), (t * t).sum(1), rtol=1e-4)
    assert got.ids == list(range(N)) and dense == []
    # K-FAC (damping > 0): the rows multiplied out, the same values as the definition
    stats = _kfac_statistics()
    kfac = compute_self_influence(
        root / "train", preconditioner="kfac", damping=0.3, batch_size=BLOCK, progress=False
    )
    want = np.einsum("ij,jk,ik->i", t, kfac_metric(t_meta, t, "kfac", 0.3, stats), t)
    np.testing.assert_allclose(kfac.scores.double().numpy(), want, rtol=2e-4)
    assert sum(dense) >= N


def test_the_cli_scores_a_factored_query_store_by_its_factors(stores, spies, tmp_path):
    root, (_, t), (_, _, q), _ = stores
    pairs, dense = spies
    out = tmp_path / "scores.csv"
    argv = [str(root / "train"), "--query", str(root / "query"), "--out", str(out)]
    assert cli_main([*argv, "--preconditioner", "identity"]) == 0
    import pandas as pd

    frame = pd.read_csv(out)
    got = np.zeros((N_Q, N))
    got[frame["test_id"].to_numpy(), frame["train_id"].to_numpy()] = frame["score"].to_numpy()
    np.testing.assert_allclose(got, q @ t.T, rtol=2e-4, atol=2e-4 * np.abs(q @ t.T).max())
    assert sum(pairs) == 2 * N and dense == []  # two shapes by their factors


# ----------------------------------------------------------------------------- per block
class _Factored:
    """What the device branch reads of a store of factored rows (`StoreSource`)."""

    factored = True

    def __init__(self, mods):
        self.meta = {"modules": mods}

    def stored_rows(self):
        return self

    def dense(self, rows):  # identity multiplies nothing out, for scores or norms
        raise AssertionError("a block was multiplied out")


@pytest.mark.parametrize("mode", ["dot", "relatif"])  # relatif: identity's norms from factors
@pytest.mark.parametrize("top_k", [None, 3])
def test_factored_query_ops_per_block_on_meta_do_not_grow_with_modules(spies, top_k, mode):
    pairs, _ = spies
    per_block, n, n_q = {}, 64, 4
    for k in (2, 6):
        # k modules of one shape (c = 2, 16 x 16) and a LayerNorm; the queries c = 1
        t_mods = _modules([(f"m{i}", 2, 16, 16) for i in range(k)] + [("ln", 4)])
        q_mods = _modules([(f"m{i}", 1, 16, 16) for i in range(k)] + [("ln", 4)])
        width = sum(m["width"] for m in t_mods)
        q = torch.randn(n_q, k * 256 + 4, device="meta")
        queries = (torch.randn(n_q, k * 32 + 4, device="meta"), q_mods)
        counted = {}
        for n_blocks in (2, 5):
            blocks = [((0, b), list(range(b * n, (b + 1) * n)), torch.randn(n, width, device="meta"))
                      for b in range(n_blocks)]  # fmt: skip
            kw = dict(top_k=top_k, n_rows=None, verify=lambda bad: None, source=_Factored(t_mods))
            pre = Preconditioner("identity", [], {})

            def run(blocks=blocks, kw=kw, pre=pre, q=q, queries=queries):
                q_norm = torch.ones(n_q, device="meta") if mode != "dot" else None
                stream_scores(q, q_norm, iter(blocks), pre, None, mode, **kw, queries=queries)

            with DeviceLedger():  # index tensors copied to meta once, then cached
                run()
            pairs.clear()
            with DeviceLedger() as ledger, LargestTensor() as ops:
                run()
            assert sum(pairs) == n * n_blocks  # every row by the factors route
            counted[n_blocks] = (sum(ops.ops.values()), ledger.counts())
            # no op makes a tensor larger than the block's stored rows (a dense block: 4x)
            assert ops.largest <= n * width * 4, (ops.largest, n * width * 4)
        (ops2, led2), (ops5, led5) = counted[2], counted[5]
        assert led2 == led5 and led5[2] == 0 and led5[3] == 0  # nothing per block
        assert (ops5 - ops2) % 3 == 0
        per_block[k] = (ops5 - ops2) // 3
    assert per_block[2] == per_block[6] > 0, per_block


@pytest.mark.parametrize("top_k", [None, 3])
def test_device_branch_with_factored_queries_reads_the_host_once_per_call(
    stores, monkeypatch, top_k
):
    root, *_ = stores
    device_branch_staging(monkeypatch)
    kw = dict(preconditioner="identity", top_k=top_k, batch_size=BLOCK, progress=False)
    counts = []
    for n in (48, 240):  # 2 and 10 blocks
        _store(root / f"train{n}", TRAIN, n, 3)
        compute_influence_all(root / "query", root / f"train{n}", **kw)
        reads: list[str] = []
        with host_reads(reads, this_thread=True):
            compute_influence_all(root / "query", root / f"train{n}", **kw)
        counts.append(reads)
    # per call, not per block: the query store's finiteness (its dense rows, its factors), the
    # blocks' flags, the results
    assert counts[0] == counts[1] and len(counts[1]) <= 4, counts
