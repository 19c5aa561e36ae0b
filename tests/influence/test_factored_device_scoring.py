"""The device branch of scoring on a store of factored rows: the blocks cross to the device as
stored and are scored there by `FactoredScores`, chunk by chunk, never as a dense block.

Run on CPU tensors (the branch switched on, as in ``test_scoring_device.py``) against a float64
numpy reference that multiplies every module out with ``einsum``; on ``meta`` under the op and
host-read counters of ``tests/_ledger.py`` for what a GPU would run per block.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _factored_ref import dense_numpy, factored_modules
from _influence_ref import mode_scores
from _ledger import DeviceLedger, LargestTensor, device_branch_staging, host_reads

from nnstat.influence import compute_influence_all, compute_self_influence, score
from nnstat.influence.ondevice import stream_scores
from nnstat.influence.precondition import Preconditioner
from nnstat.influence.refine.memory import Allocations
from nnstat.influence.sources import StoreSource
from nnstat.store import GradientLog, GradientStore, StoreWriter
from nnstat.store.factored import dense_layout, densify

# two shapes of factored module (one of them three times, not adjacent) between plain modules;
# every factored module is smaller stored than dense (3.5x in all)
SPEC = [("f", 2, 16, 12), ("p", 5), ("f", 1, 8, 10), ("f", 2, 16, 12), ("f", 2, 16, 12),
        ("p", 3), ("f", 1, 8, 10)]  # fmt: skip
N, BLOCK, DAMPING = 150, 48, 1.0


def _store(root, n=N, shard_rows=60, seed=0):
    mods = factored_modules(SPEC)
    width = sum(m["width"] for m in mods)
    meta = {"format_version": 1, "row_width": width, "dtype": "float32", "modules": mods}
    root.mkdir(parents=True, exist_ok=True)
    (root / "meta.json").write_text(json.dumps(meta))
    writer = StoreWriter(root / "shards", row_width=width, shard_rows=shard_rows)
    writer.put(list(range(n)), torch.randn(n, width, generator=torch.Generator().manual_seed(seed)))
    writer.close()
    store = GradientStore(root)
    rows = np.concatenate([np.load(p) for p in store.shards])  # numpy alone
    return root, meta, rows


def _queries(meta, n_q, seed=1):
    dense = dense_layout(meta)
    q = torch.randn(n_q, dense["row_width"], generator=torch.Generator().manual_seed(seed))
    return GradientLog([f"q{i}" for i in range(n_q)], q, {**meta, **dense}), q.double().numpy()


def _reference(q, t, mode, kind, mods=()):
    """Scores ``[n_q, n_t]`` in float64 from the definitions (``raw``: per module of the dense
    layout ``mods``, ``M = (TᵀT/n + λI)⁻¹``)."""
    m = np.eye(t.shape[1])
    if kind == "raw":
        for mod in mods:
            s = slice(mod["offset"], mod["offset"] + mod["width"])
            m[s, s] = np.linalg.inv(t[:, s].T @ t[:, s] / len(t) + DAMPING * np.eye(mod["width"]))
    return mode_scores(q, t, m, mode)


@pytest.fixture()
def device_branch(monkeypatch):
    """The device branch on the CPU; returns ``(rows of every StoreSource.dense call, (bytes,
    dtype) of every host staging buffer the reader fills: what crosses to the device)``."""
    dense_calls: list[int] = []
    staged = device_branch_staging(monkeypatch)
    real = StoreSource.dense
    monkeypatch.setattr(StoreSource, "dense", lambda s, r: dense_calls.append(len(r)) or real(s, r))
    return dense_calls, staged


# ----------------------------------------------------------------------------- the public API
@pytest.mark.parametrize("n_q", [1, 5])  # one query: the direct contraction
@pytest.mark.parametrize("mode,kind", [("dot", "identity"), ("dot", "raw"), ("relatif", "raw"),
                                       ("cosine", "identity"), ("l2", "raw")])  # fmt: skip
def test_device_branch_scores_factored_rows_as_numpy_without_a_dense_block(
    tmp_path, device_branch, mode, kind, n_q
):
    dense_calls, staged = device_branch
    root, meta, stored = _store(tmp_path / "s")
    t = dense_numpy(stored, meta["modules"])
    log, q = _queries(meta, n_q)
    ref = _reference(q, t, mode, kind, dense_layout(meta)["modules"])
    kw = dict(mode=mode, preconditioner=kind, damping=DAMPING, batch_size=BLOCK, progress=False)
    compute_influence_all(log, root, **kw)  # fits ``raw`` (dense rows, on the host): cached
    dense_calls.clear(), staged.clear()
    full = compute_influence_all(log, root, **kw)
    assert full.train_ids == list(range(N))
    tol = dict(rtol=2e-4, atol=2e-4 * np.abs(ref).max())
    np.testing.assert_allclose(full.scores.double().numpy(), ref, **tol)
    top = compute_influence_all(log, root, top_k=3, **kw)
    order = np.argsort(-ref, axis=1, kind="stable")
    assert top.helpful_ids == [row[:3].tolist() for row in order]
    assert top.harmful_ids == [row[::-1][:3].tolist() for row in order]
    np.testing.assert_allclose(top.helpful_scores.double().numpy(), -np.sort(-ref)[:, :3], **tol)
    # dot: no row was multiplied out outside the scorer, nor for identity's norms (from the
    # factors); raw's norms: a chunk at a time, never a whole block (blocks of 48 rows, 3.5x
    # denser dense: chunks of at most 16 rows)
    if mode == "dot" or kind == "identity":
        assert dense_calls == []
    else:
        assert dense_calls and max(dense_calls) < BLOCK and sum(dense_calls) == 2 * N
    # every block crossed as stored: float32 rows of the stored width
    assert set(staged) == {(BLOCK * stored.shape[1] * 4, torch.float32)}


def test_device_branch_self_influence_of_factored_rows_is_numpy_a_chunk_at_a_time(
    tmp_path, device_branch
):
    dense_calls, staged = device_branch
    root, meta, stored = _store(tmp_path / "s")
    t = dense_numpy(stored, meta["modules"])
    kw = dict(preconditioner="raw", damping=DAMPING, batch_size=BLOCK, progress=False)
    compute_self_influence(root, **kw)  # fits ``raw`` (dense rows, on the host): cached
    dense_calls.clear(), staged.clear()
    got = compute_self_influence(root, **kw)
    want = _reference(t, t, "dot", "raw", dense_layout(meta)["modules"]).diagonal()
    np.testing.assert_allclose(got.scores.double().numpy(), want, rtol=2e-4, atol=2e-4)
    assert got.ids == list(range(N))
    # the blocks cross as stored and are multiplied out a chunk at a time, never whole
    assert set(staged) == {(BLOCK * stored.shape[1] * 4, torch.float32)}
    assert max(dense_calls) < BLOCK and sum(dense_calls) == N


@pytest.mark.parametrize("top_k", [None, 3])
def test_device_branch_on_factored_rows_equals_the_cpu_branch(tmp_path, monkeypatch, top_k):
    root, meta, _ = _store(tmp_path / "s")
    log, _ = _queries(meta, 5)
    kw = dict(preconditioner="raw", damping=DAMPING, batch_size=BLOCK, progress=False)
    for mode in ("dot", "cosine"):
        monkeypatch.setattr(score, "_device_branch", lambda device: False)
        host = compute_influence_all(log, root, mode=mode, top_k=top_k, **kw)
        monkeypatch.setattr(score, "_device_branch", lambda device: True)
        dev = compute_influence_all(log, root, mode=mode, top_k=top_k, **kw)
        if top_k is None:
            torch.testing.assert_close(dev.scores, host.scores, rtol=1e-5, atol=1e-5)
            assert dev.train_ids == host.train_ids
        else:
            torch.testing.assert_close(dev.helpful_scores, host.helpful_scores)
            assert dev.helpful_ids == host.helpful_ids and dev.harmful_ids == host.harmful_ids


@pytest.mark.parametrize("top_k", [None, 3])
def test_a_nonfinite_factor_is_refused_naming_its_shard(tmp_path, device_branch, top_k):
    root, meta, _ = _store(tmp_path / "s")
    store = GradientStore(root)
    array = np.load(store.shards[1], mmap_mode="r+")
    array[7, 3] = np.nan  # a U entry of row 60 + 7 = id 67
    array.flush()
    del array
    log, _ = _queries(meta, 3)
    pattern = r"00001\.npy: rows of ids \[67\] hold NaN/Inf"
    with pytest.raises(ValueError, match=pattern):
        compute_influence_all(log, root, preconditioner="identity", top_k=top_k, batch_size=BLOCK)
    with pytest.raises(ValueError, match=pattern):
        compute_self_influence(root, preconditioner="identity", batch_size=BLOCK)


@pytest.mark.parametrize("top_k", [None, 3])
def test_device_branch_on_factored_rows_reads_the_host_once_per_call(
    tmp_path, device_branch, top_k
):
    counts = []
    for n in (60, 300):  # 2 and 7 blocks
        root, meta, _ = _store(tmp_path / f"s{n}", n=n)
        log, _ = _queries(meta, 5)
        kw = dict(preconditioner="identity", top_k=top_k, batch_size=BLOCK, progress=False)
        compute_influence_all(log, root, **kw)  # opens nothing new below: counts the scoring
        reads: list[str] = []
        with host_reads(reads, this_thread=True):
            compute_influence_all(log, root, **kw)
        counts.append(reads)
    # per call, not per block: the query log's finiteness, the blocks' flags, the results
    assert counts[0] == counts[1] and len(counts[1]) <= 3, counts


# ----------------------------------------------------------------------------- per block
def _blocks(n_blocks, k, n, device, seed=0):
    """``n_blocks`` blocks of ``n`` stored rows of ``k`` modules of one shape (c=2, 16 x 16:
    64 stored columns, 256 dense) and one plain module of 4 columns."""
    spec = [("f", 2, 16, 16)] * k + [("p", 4)]
    mods = factored_modules(spec)
    width = sum(m["width"] for m in mods)
    g = torch.Generator().manual_seed(seed)
    blocks = [((0, b), list(range(b * n, (b + 1) * n)), torch.randn(n, width, generator=g))
              for b in range(n_blocks)]  # fmt: skip
    return mods, [(key, ids, rows.to(device)) for key, ids, rows in blocks]


class _Factored:
    """What the device branch reads of a store of factored rows (`StoreSource`)."""

    factored = True

    def __init__(self, mods: list[dict]) -> None:
        self.meta = {"modules": mods}

    def stored_rows(self) -> _Factored:
        return self

    def dense(self, rows: torch.Tensor) -> torch.Tensor:
        return densify(rows, self.meta["modules"])


def _stream(mods, blocks, q, top_k, n_rows=None):
    pre = Preconditioner("identity", [], {})
    kw = dict(top_k=top_k, n_rows=n_rows, verify=lambda bad: None, source=_Factored(mods))
    return stream_scores(q, None, iter(blocks), pre, None, "dot", **kw)


@pytest.mark.parametrize("n_q", [1, 4])  # one query: the direct contraction
@pytest.mark.parametrize("top_k", [None, 3])
def test_ops_per_block_on_meta_do_not_grow_with_modules_and_no_op_makes_a_dense_block(n_q, top_k):
    per_block, n = {}, 64
    for k in (2, 6):
        counted = {}
        for n_blocks in (2, 5):
            mods, blocks = _blocks(n_blocks, k, n, "meta")
            q = torch.randn(n_q, k * 256 + 4, device="meta")
            with DeviceLedger():  # index tensors copied to meta once, then cached
                _stream(mods, blocks, q, top_k)
            with DeviceLedger() as ledger, LargestTensor() as ops:
                _stream(mods, blocks, q, top_k)
            counted[n_blocks] = (sum(ops.ops.values()), ledger.counts())
            stored_block = n * blocks[0][2].shape[1] * 4
            # the block's stored rows are the largest tensor: no dense block (4x as large)
            assert ops.largest <= stored_block, (ops.largest, stored_block)
        (ops2, led2), (ops5, led5) = counted[2], counted[5]
        assert led2 == led5  # reads, copies to the host: none per block
        assert led5[2] == 0 and led5[3] == 0  # no copy to the device, no sync-prone op
        assert (ops5 - ops2) % 3 == 0
        per_block[k] = (ops5 - ops2) // 3
    assert per_block[2] == per_block[6] > 0, per_block


@pytest.mark.parametrize("n_q", [1, 8])
def test_memory_per_block_on_cpu_tensors_stays_within_twice_the_stored_block(n_q):
    n, k = 96, 3
    mods, blocks = _blocks(4, k, n, "cpu")
    q = torch.randn(n_q, k * 256 + 4, generator=torch.Generator().manual_seed(5))
    stored_block = n * blocks[0][2].shape[1] * 4
    with Allocations() as mem:
        got = _stream(mods, blocks, q, None, n_rows=4 * n)
    # the blocks themselves (made before, first seen when sliced) are counted too
    peak = mem.peak - 4 * stored_block
    scores = 4 * n * n_q * 4  # the all-pairs buffer, and one block's scores at a time
    assert peak <= 2 * stored_block + scores + n * n_q * 4, (peak, stored_block)
    # a dense block would have been 4 times the stored one
    assert n * (k * 256 + 4) * 4 > 3.5 * stored_block
    rows = np.concatenate([b[2].numpy() for b in blocks])
    want = dense_numpy(rows, mods) @ q.double().numpy().T
    np.testing.assert_allclose(got.scores.double().numpy(), want, rtol=1e-4, atol=1e-4)
