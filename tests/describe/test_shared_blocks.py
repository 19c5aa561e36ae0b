"""The blocked numpy passes of `nnstat.describe.numpy_blocks` shared by two threads
(`share_blocks`): the numbers are bit for bit those of one thread and equal numpy's float64
reference (NaN/Inf blocks exact, empty tensors, float64 and overflowing float32 tensors), the
snapshot refresh is complete, a failure on the second thread is raised by the caller, and a busy
second thread holds nothing up."""

import math
import threading
import time

import numpy as np
import pytest
import torch

import nnstat.describe.block_passes as bp
import nnstat.describe.numpy_blocks as sf


def on_a_thread(fn):
    threading.Thread(target=fn, daemon=True).start()


def inline(fn):
    fn()  # the "second thread" takes every block before the caller starts: lane 1 does all


def reference(x: np.ndarray) -> list[float]:
    """[sumsq, min, max, nonfinite] over the finite elements, numpy float64."""
    x = np.asarray(x, dtype=np.float64).ravel()
    fin = x[np.isfinite(x)]
    if not fin.size:
        return [0.0, math.inf, -math.inf, float(x.size)]
    return [float(fin @ fin), fin.min(), fin.max(), float(x.size - fin.size)]


def pairs():
    g = torch.Generator().manual_seed(3)
    cur = [
        torch.randn(1000, generator=g),
        torch.randn(7, 50, generator=g, dtype=torch.float64),
        torch.randn(0),
        torch.full((130,), 1e25),  # finite, but its float32 sum of squares overflows
        torch.randn(640, generator=g) * 1e-3,
    ]
    prev = [c + 0.01 * torch.randn(c.shape, generator=g, dtype=c.dtype) for c in cur]
    cur[0][70] = math.nan  # weight and update non-finite in block 1
    prev[0][900] = math.inf  # only the update, in block 14
    cur[4][5] = -math.inf
    return cur, prev


def both_threads_take_blocks(monkeypatch, name, seen, fail_second=False):
    """Wrap block function `name`: record the threads that run it; while blocks are shared with
    a real thread, the calling thread waits until that thread has taken one (however late the
    OS starts it) and blocks take a little while, so both threads get some."""
    main, started = threading.get_ident(), threading.Event()
    real = getattr(sf, name)

    def wrapped(*args):
        seen.add(threading.get_ident())
        if threading.get_ident() != main:
            started.set()
            if fail_second:
                raise RuntimeError("boom on the second thread")
        elif bp._SECOND.get() is on_a_thread:
            assert started.wait(30), "the second thread never took a block"
        time.sleep(2e-4)
        return real(*args)

    monkeypatch.setattr(sf, name, wrapped)


@pytest.fixture
def small_slow_blocks(monkeypatch):
    """Blocks of 64 elements shared by both threads; records which threads reduced blocks."""
    monkeypatch.setattr(sf, "BLOCK", 64)
    seen = set()
    for name in ("_np_norms", "_np_pair"):
        both_threads_take_blocks(monkeypatch, name, seen)
    return seen


@pytest.mark.parametrize("submit", [on_a_thread, inline])
@pytest.mark.parametrize("refresh", [True, False])
def test_shared_weight_update_pass_is_the_one_thread_pass(small_slow_blocks, submit, refresh):
    cur, prev = pairs()
    old = [p.clone() for p in prev]
    alone = sf.weight_update_norms(cur, [p.clone() for p in prev], refresh=refresh)
    small_slow_blocks.clear()
    with bp.share_blocks(submit):
        shared = sf.weight_update_norms(cur, prev, refresh=refresh)
    if submit is on_a_thread:
        assert len(small_slow_blocks) == 2  # both threads reduced blocks
    torch.testing.assert_close(shared, alone, rtol=0, atol=0, equal_nan=True)
    for i, (c, p) in enumerate(zip(cur, old, strict=True)):
        c64, p64 = c.double().numpy(), p.double().numpy()
        rtol = 1e-6 if c.dtype == torch.float32 else 1e-12
        want = reference(c64) + reference(c64 - p64)
        np.testing.assert_allclose(shared[i].numpy(), want, rtol=rtol, err_msg=str(i))
        torch.testing.assert_close(prev[i], c if refresh else p, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("submit", [on_a_thread, inline])
def test_shared_sumsq_min_max_is_the_one_thread_pass(small_slow_blocks, submit):
    xs, _ = pairs()
    alone = sf.sumsq_min_max(xs)
    with bp.share_blocks(submit):
        shared = sf.sumsq_min_max(xs)
    torch.testing.assert_close(shared, alone, rtol=0, atol=0, equal_nan=True)
    for i, x in enumerate(xs):
        ref = reference(x.double().numpy())[:3]
        if not x.numel():
            assert shared[i, 0] == 0 and shared[i, 1:].isnan().all()
            continue
        if not torch.isfinite(x).all():
            ref[0] = math.nan  # callers recompute exactly from the NaN sum of squares
        rtol = 1e-6 if x.dtype == torch.float32 else 1e-12
        np.testing.assert_allclose(shared[i].numpy(), ref, rtol=rtol, err_msg=str(i))


def test_a_failure_on_the_second_thread_is_raised_here_after_its_blocks(monkeypatch):
    monkeypatch.setattr(sf, "BLOCK", 64)
    running = [0]
    real = sf._np_norms

    def counted(b):
        running[0] += 1
        try:
            return real(b)
        finally:
            running[0] -= 1

    monkeypatch.setattr(sf, "_np_norms", counted)
    both_threads_take_blocks(monkeypatch, "_np_norms", set(), fail_second=True)
    with bp.share_blocks(on_a_thread), pytest.raises(RuntimeError, match="boom"):
        sf.sumsq_min_max([torch.randn(64 * 40)])
    assert running[0] == 0  # nothing still reads the caller's tensors


def test_a_busy_second_thread_holds_nothing_up(monkeypatch):
    monkeypatch.setattr(sf, "BLOCK", 64)
    queued = []
    xs = [torch.randn(64 * 10), torch.randn(64 * 3 + 5)]
    with bp.share_blocks(queued.append):  # the second thread never gets to it in time
        shared = sf.sumsq_min_max(xs)
    torch.testing.assert_close(shared, sf.sumsq_min_max(xs), rtol=0, atol=0)
    queued[0]()  # when it finally runs, no block is left: it returns at once


@pytest.mark.parametrize("submit", [on_a_thread, inline])
def test_several_passes_run_as_one_hand_the_second_thread_one_job(small_slow_blocks, submit):
    """`run_passes`: two norm passes and the weight/update pass as ONE pass (one job for the
    second thread, so one wait for it) give each pass' result of running it alone, bit for bit,
    and refresh the snapshot; those results equal numpy's float64 reference."""
    cur, prev = pairs()
    grads = [c * 0.5 for c in cur]
    moments_ = [torch.randn(257), torch.randn(64 * 5, dtype=torch.float64), torch.randn(0)]
    old = [p.clone() for p in prev]
    alone = [
        sf.sumsq_min_max(grads),
        sf.sumsq_min_max(moments_),
        sf.weight_update_norms(cur, [p.clone() for p in prev], refresh=True),
    ]
    jobs = []

    def counted(fn):
        jobs.append(fn)
        submit(fn)

    small_slow_blocks.clear()
    with bp.share_blocks(counted):
        together = bp.run_passes(
            [
                sf.sumsq_min_max_pass(grads),
                sf.sumsq_min_max_pass(moments_),
                sf.weight_update_pass(cur, prev, refresh=True),
            ]
        )
    assert len(jobs) == 1  # one hand-over for the three passes (separately: one each)
    if submit is on_a_thread:
        assert len(small_slow_blocks) == 2  # both threads reduced blocks
    for a, b in zip(together, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    for i, (c, p) in enumerate(zip(cur, old, strict=True)):
        c64, p64 = c.double().numpy(), p.double().numpy()
        rtol = 1e-6 if c.dtype == torch.float32 else 1e-12
        want = reference(c64) + reference(c64 - p64)
        np.testing.assert_allclose(together[2][i].numpy(), want, rtol=rtol, err_msg=str(i))
        torch.testing.assert_close(prev[i], c, rtol=0, atol=0, equal_nan=True)
    for i, x in enumerate(moments_):
        if x.numel():
            rtol = 1e-6 if x.dtype == torch.float32 else 1e-12
            ref = reference(x.numpy())[:3]
            np.testing.assert_allclose(together[1][i].numpy(), ref, rtol=rtol, err_msg=str(i))


def test_a_failure_in_one_of_several_passes_is_raised_after_every_block_is_done(monkeypatch):
    monkeypatch.setattr(sf, "BLOCK", 64)
    running = [0]
    real = sf._np_pair

    def counted(*args):
        running[0] += 1
        try:
            return real(*args)
        finally:
            running[0] -= 1

    monkeypatch.setattr(sf, "_np_pair", counted)
    both_threads_take_blocks(monkeypatch, "_np_pair", set(), fail_second=True)
    w = [torch.randn(64 * 30)]
    passes = [sf.sumsq_min_max_pass([torch.randn(64 * 10)]), sf.weight_update_pass(w, [w[0] + 1])]
    with bp.share_blocks(on_a_thread), pytest.raises(RuntimeError, match="boom"):
        bp.run_passes(passes)
    assert running[0] == 0  # nothing still reads the caller's tensors
