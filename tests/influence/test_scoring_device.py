"""Scoring's device branch (shards read ahead on a thread, results read back once), run on the
CPU by switching `score._device_branch` on, and on a GPU where there is one (``cuda`` mark).

References are independent: the shards' rows read with numpy, and every score computed in float64
numpy from the closed forms of the four modes.
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings

import numpy as np
import pytest
import torch
from _influence_ref import mode_scores
from _ledger import host_reads

from nnstat.influence import compute_influence_all, compute_self_influence, score
from nnstat.influence.pipeline import read_ahead, units
from nnstat.influence.row_layout import ModuleSpec
from nnstat.influence.sources import StoreSource, TensorSource
from nnstat.store import GradientStore, StoreWriter

WIDTH, DAMPING = 12, 0.1


def _store(root, n=50, shard_rows=7, seed=0):
    meta = {
        "format_version": 1,
        "row_width": WIDTH,
        "dtype": "float32",
        "modules": [
            {"name": "fc", "kind": "linear", "offset": 0, "width": WIDTH, "r_out": 3, "r_in": 4}
        ],
    }
    root.mkdir(parents=True, exist_ok=True)
    (root / "meta.json").write_text(json.dumps(meta))
    writer = StoreWriter(root / "shards", row_width=WIDTH, shard_rows=shard_rows)
    rows = torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed))
    writer.put(list(range(n)), rows)
    writer.close()
    return root


def _numpy_rows(root):
    """The store's rows and ids read with numpy alone (shard files in order)."""
    store = GradientStore(root)
    rows = np.concatenate([np.load(p) for p in store.shards]).astype(np.float64)
    return rows, list(store.ids)


def _queries(n=5, seed=1):
    return torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(seed))


def _q(rows):
    """Query rows laid out as the store's (one module ``fc``)."""
    return TensorSource(rows, layout=[ModuleSpec("fc", 0, 3, 4)])


def _reference(q, t, mode, kind):
    """Scores ``[n_q, n_t]`` in float64 from the definitions (``raw``: ``H = TᵀT / n``)."""
    q = q.double().numpy()
    m = np.eye(WIDTH)
    if kind == "raw":
        m = np.linalg.inv(t.T @ t / len(t) + DAMPING * np.eye(WIDTH))
    return mode_scores(q, t, m, mode)


@pytest.fixture()
def device_branch(monkeypatch):
    """The device branch on the CPU (the branch a GPU takes, with host buffers)."""
    monkeypatch.setattr(score, "_device_branch", lambda device: True)


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nnstat-shard-reader"]


# ----------------------------------------------------------------------------- the reader
def test_read_ahead_yields_every_block_of_every_shard_in_order(tmp_path):
    root = _store(tmp_path / "s", n=50, shard_rows=7)
    rows, ids = _numpy_rows(root)
    got_ids, got_rows, keys = [], [], []
    for key, b_ids, b_rows in read_ahead(units(StoreSource(GradientStore(root)), 3), "cpu"):
        keys.append(key)
        got_ids += b_ids
        got_rows.append(b_rows.numpy().copy())  # valid until the next block is asked for
    assert got_ids == ids
    np.testing.assert_array_equal(np.concatenate(got_rows), rows.astype(np.float32))
    # 8 shards (7 x 7 rows + 1), blocks of 3 within each: keys in store order
    assert keys == [(s, b) for s in range(7) for b in range(3)] + [(7, 0)]
    assert not _readers()


def test_reader_error_reaches_the_consumer_and_the_thread_stops():
    def blocks():
        yield (0, 0), [0], torch.ones(1, 2)
        yield (0, 1), [1], torch.ones(1, 2)
        raise OSError("disk gone at block 2")

    seen = []
    with pytest.raises(OSError, match="disk gone at block 2"):
        for key, _, _ in read_ahead(blocks(), "cpu"):
            seen.append(key)
    assert seen == [(0, 0), (0, 1)]
    assert not _readers()


def test_consumer_stopping_early_stops_the_reader():
    blocks = (((0, i), [i], torch.full((1, 2), float(i))) for i in range(100))
    for key, _, _ in read_ahead(blocks, "cpu"):
        if key == (0, 3):
            break
    # the generator is closed when the loop leaves it: the thread has been joined
    assert not _readers()


def test_a_shard_replaced_after_opening_is_refused_in_the_reader_thread(tmp_path, device_branch):
    root = _store(tmp_path / "s")
    store = GradientStore(root)  # the headers were checked here
    np.save(store.shards[3], np.zeros((7, WIDTH + 1), np.float32))
    with pytest.raises(ValueError, match=r"00003\.npy: shape \(7, 13\), expected \(7, 12\)"):
        compute_influence_all(_q(_queries()), store, preconditioner="identity")
    assert not _readers()


@pytest.mark.parametrize("top_k", [None, 3])
def test_nonfinite_rows_are_refused_naming_the_shard(tmp_path, device_branch, top_k):
    root = _store(tmp_path / "s")
    store = GradientStore(root)
    array = np.load(store.shards[2], mmap_mode="r+")
    array[4, 5] = np.nan  # row 2 * 7 + 4 = id 18
    array.flush()
    del array
    pattern = r"00002\.npy: rows of ids \[18\] hold NaN/Inf, but .*nonfinite='error'"
    q = _q(_queries())
    with pytest.raises(ValueError, match=pattern):
        compute_influence_all(q, root, preconditioner="identity", top_k=top_k, batch_size=4)
    with pytest.raises(ValueError, match=pattern):
        compute_self_influence(root, preconditioner="identity", batch_size=4)


# ----------------------------------------------------------------------------- scores
@pytest.mark.parametrize("mode", ["dot", "relatif", "cosine", "l2"])
@pytest.mark.parametrize("kind", ["identity", "raw"])
def test_device_branch_scores_equal_numpy(tmp_path, device_branch, mode, kind):
    root = _store(tmp_path / "s")
    rows, ids = _numpy_rows(root)
    q = _queries()
    ref = _reference(q, rows, mode, kind)
    kw = dict(mode=mode, preconditioner=kind, damping=DAMPING, batch_size=4)
    full = compute_influence_all(_q(q), root, **kw)
    assert full.train_ids == ids
    np.testing.assert_allclose(full.scores.numpy(), ref, rtol=2e-4, atol=2e-4)
    top = compute_influence_all(_q(q), root, top_k=3, **kw)
    order = np.argsort(-ref, axis=1, kind="stable")
    assert top.helpful_ids == [[ids[j] for j in row[:3]] for row in order]
    assert top.harmful_ids == [[ids[j] for j in row[::-1][:3]] for row in order]
    np.testing.assert_allclose(top.helpful_scores.numpy(), -np.sort(-ref, 1)[:, :3], rtol=2e-4)
    if mode == "dot":
        self_inf = compute_self_influence(root, preconditioner=kind, damping=DAMPING, batch_size=4)
        assert self_inf.ids == ids
        diag = _reference(torch.from_numpy(rows), rows, "dot", kind).diagonal()
        np.testing.assert_allclose(self_inf.scores.numpy(), diag, rtol=2e-4, atol=2e-4)


def test_device_branch_all_pairs_equal_the_cpu_branch_bit_for_bit(tmp_path, monkeypatch):
    root = _store(tmp_path / "s")
    q = _q(_queries())
    kw = dict(preconditioner="raw", damping=DAMPING, batch_size=4, mode="cosine")
    host = compute_influence_all(q, root, **kw)
    monkeypatch.setattr(score, "_device_branch", lambda device: True)
    dev = compute_influence_all(q, root, **kw)
    assert torch.equal(dev.scores, host.scores) and dev.train_ids == host.train_ids


# ----------------------------------------------------------------------------- host reads
def _reads(root, top_k):
    q = _q(_queries())
    kw = dict(preconditioner="identity", top_k=top_k, batch_size=4, progress=False)
    compute_influence_all(q, root, **kw)  # opens nothing new below: counts the scoring alone
    counter: list[str] = []
    with host_reads(counter):
        compute_influence_all(q, root, **kw)
    return counter


@pytest.mark.parametrize("top_k", [None, 3])
def test_device_branch_reads_the_host_once_per_call_not_per_block(tmp_path, device_branch, top_k):
    few = _reads(_store(tmp_path / "few", n=14, shard_rows=7), top_k)  # 2 shards, 4 blocks
    many = _reads(_store(tmp_path / "many", n=200, shard_rows=7), top_k)  # 29 shards, 58 blocks
    assert len(few) == len(many), (few, many)
    # the blocks' finiteness flags, and the results (top-k: one packed tensor)
    assert len(many) <= 2, many


# ----------------------------------------------------------------------------- on a GPU
@contextlib.contextmanager
def main_thread_syncs():
    """The synchronising CUDA calls of the main thread (``set_sync_debug_mode`` warnings); the
    reader thread's waits for its own copies stall no queue and are left out."""
    syncs: list[str] = []

    def record(message, *args, **kwargs):
        main = threading.current_thread() is threading.main_thread()
        if main and "called a synchronizing" in str(message):  # not the mode's own notice
            syncs.append(str(message))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["dot", "cosine"])
def test_cuda_scoring_equals_cpu_and_synchronises_once_per_result(tmp_path, mode):
    root = _store(tmp_path / "s", n=300, shard_rows=50)
    q_cpu = _q(_queries())
    q_gpu = _q(_queries().cuda())
    kw = dict(mode=mode, preconditioner="raw", damping=DAMPING, batch_size=16, progress=False)
    for top_k in (None, 4):
        a = compute_influence_all(q_cpu, root, top_k=top_k, **kw)
        compute_influence_all(q_gpu, root, top_k=top_k, **kw)  # the damped blocks copied once
        with main_thread_syncs() as syncs:
            b = compute_influence_all(q_gpu, root, top_k=top_k, **kw)
        # 19 blocks: the flags and the results come back at the end, nothing per block
        assert len(syncs) <= 2, syncs
        if top_k is None:
            torch.testing.assert_close(b.scores, a.scores, rtol=1e-4, atol=1e-4)
            assert b.scores.device.type == "cpu" and b.train_ids == a.train_ids
        else:
            torch.testing.assert_close(b.helpful_scores, a.helpful_scores, rtol=1e-4, atol=1e-4)
            assert b.helpful_ids == a.helpful_ids and b.harmful_ids == a.harmful_ids
    sa = compute_self_influence(root, preconditioner="raw", damping=DAMPING, batch_size=16)
    sb = compute_self_influence(
        root, preconditioner="raw", damping=DAMPING, batch_size=16, device="cuda"
    )
    torch.testing.assert_close(sb.scores, sa.scores, rtol=1e-4, atol=1e-4)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_training_rows_already_on_the_device_pass_through():
    rows = torch.randn(40, WIDTH, generator=torch.Generator().manual_seed(2))
    kw = dict(preconditioner="identity", top_k=3, batch_size=16, progress=False)
    a = compute_influence_all(_q(_queries()), _q(rows), **kw)
    with main_thread_syncs() as syncs:
        b = compute_influence_all(_q(_queries().cuda()), _q(rows.cuda()), **kw)
    torch.testing.assert_close(b.helpful_scores, a.helpful_scores, rtol=1e-4, atol=1e-4)
    assert b.helpful_ids == a.helpful_ids and b.harmful_ids == a.harmful_ids
    assert len(syncs) <= 4, syncs  # two TensorSources' finiteness checks, the flags, the results


def test_self_influence_on_an_empty_log_names_the_store_and_the_fix(tmp_path):
    root = _store(tmp_path / "empty", n=0)
    with pytest.raises(ValueError, match="empty log") as err:
        compute_self_influence(str(root))
    assert str(root) in str(err.value) and "log rows" in str(err.value)
    with pytest.raises(ValueError, match="in-memory log holds no rows; log rows"):
        compute_self_influence(_q(torch.zeros(0, WIDTH)))
