"""Background statistics: bit-identical to the synchronous path, guarded, nothing lost."""

import math
import os
import threading
import warnings

import numpy as np
import pytest
import scipy.stats
import torch
from torch import nn

import nnstat
import nnstat.tracker.compute
from nnstat.background import submit
from nnstat.describe import Histogram
from nnstat.tracker.pending import StepMetrics


def setup(seed=0, opt_cls=torch.optim.Adam):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    return model, opt_cls(model.parameters(), lr=0.05)


def batch(i):
    g = torch.Generator().manual_seed(100 + i)
    return torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)


def train(model, opt, i, set_to_none=True):
    opt.zero_grad(set_to_none=set_to_none)
    x, y = batch(i)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def flat(t):
    return t.detach().double().numpy().ravel()


def same(a, b):
    """Exact equality of metric values (NaN equal to NaN; histograms field by field)."""
    if isinstance(a, Histogram):
        return (
            np.array_equal(a.counts, b.counts)
            and np.array_equal(a.edges, b.edges)
            and (a.min, a.max, a.num, a.sum, a.sum_squares)
            == (b.min, b.max, b.num, b.sum, b.sum_squares)
        )
    return a == b or (math.isnan(a) and math.isnan(b))


@pytest.mark.parametrize(
    "kw",
    [{}, {"every": 2}, {"stats": None, "histograms": True, "bins": 8}],
    ids=["default", "every2", "full+hist"],
)
def test_background_bit_identical_to_sync_and_matches_numpy(kw):
    (m_bg, o_bg), (m_sy, o_sy) = setup(), setup()
    bg = nnstat.Tracker(m_bg, o_bg, background=True, **kw)
    sy = nnstat.Tracker(m_sy, o_sy, background=False, **kw)
    full = "histograms" in kw
    for i in range(5):
        # the update is the change made by the last optimizer step
        before = {n: p.detach().clone() for n, p in m_bg.named_parameters()}
        train(m_bg, o_bg, i)
        train(m_sy, o_sy, i)
        a, b = bg.step(), sy.step()
        if a is None:
            assert b is None
            continue
        assert isinstance(a, StepMetrics) and isinstance(b, dict)
        # the worker reduced step i while nothing is read yet; the values are final now
        assert sorted(a) == sorted(b) and len(a) > 40
        assert all(same(a[k], b[k]) for k in b), [k for k in b if not same(a[k], b[k])]
        for n, p in m_bg.named_parameters():
            st = o_bg.state[p]
            upd = flat(p) - flat(before[n])
            refs = {
                "weight": flat(p),
                "grad": flat(p.grad),
                "exp_avg": flat(st["exp_avg"]),
                "exp_avg_sq": flat(st["exp_avg_sq"]),
                "update": upd,
            }
            for group, x in refs.items():
                assert a[f"{group}/{n}/l2"] == pytest.approx(np.linalg.norm(x), rel=1e-5)
                assert a[f"{group}/{n}/abs_max"] == pytest.approx(np.abs(x).max(), rel=1e-5)
                if full and x.size > 3 and x.std() > 0:
                    assert a[f"{group}/{n}/skew"] == pytest.approx(
                        scipy.stats.skew(x, bias=True), rel=1e-3, abs=1e-4
                    )
                    assert a[f"{group}/{n}/kurtosis"] == pytest.approx(
                        scipy.stats.kurtosis(x, bias=True), rel=1e-3, abs=1e-4
                    )
                    counts, _ = np.histogram(x, bins=8, range=(x.min(), x.max()))
                    assert np.abs(a[f"{group}/{n}/hist"].counts - counts).sum() <= 2
            assert a[f"trust_ratio/{n}"] == pytest.approx(
                np.linalg.norm(flat(p)) / np.linalg.norm(upd), rel=1e-4
            )
    bg.close()


def test_sinks_get_every_step_in_order_when_read_flushed_or_next_step():
    model, opt = setup()
    seen = []
    tracker = nnstat.Tracker(model, opt, background=True, sinks=[lambda m, s: seen.append(s)])
    train(model, opt, 0)
    first = tracker.step(step=10)
    assert seen == []  # still on the worker
    train(model, opt, 1)  # the optimizer's pre-hook waited for step 10's statistics
    second = tracker.step(step=11)
    assert seen == [10] and "weight/0.weight/l2" in first
    assert second["grad/0.bias/l2"] == pytest.approx(np.linalg.norm(flat(model[0].bias.grad)))
    assert seen == [10, 11] and tracker.latest is second
    train(model, opt, 2)
    tracker.step(step=12)
    tracker.close()
    assert seen == [10, 11, 12] and not opt._optimizer_step_pre_hooks


def test_in_place_gradients_are_reduced_synchronously():
    (m_bg, o_bg), (m_sy, o_sy) = setup(), setup()
    bg = nnstat.Tracker(m_bg, o_bg, background=True)
    sy = nnstat.Tracker(m_sy, o_sy, background=False)
    with warnings.catch_warnings():
        # zero_grad(set_to_none=False) zeroes step t's gradients before the next optimizer
        # step: read in the background they would trip the version check (a warning)
        warnings.simplefilter("error")
        for i in range(4):
            train(m_bg, o_bg, i, set_to_none=False)
            train(m_sy, o_sy, i, set_to_none=False)
            a, b = dict(bg.step()), sy.step()
            assert a == b
            assert a["grad/2.weight/l2"] == pytest.approx(np.linalg.norm(flat(m_bg[2].weight.grad)))
    assert not bg._sync_only


def test_version_conflict_warns_skips_tensor_and_falls_back_to_sync():
    model, opt = setup()
    tracker = nnstat.Tracker(model, opt, background=True)
    train(model, opt, 0)
    tracker.step()
    train(model, opt, 1)
    out = tracker.step()
    assert isinstance(out, StepMetrics)
    with torch.no_grad():
        model[0].weight.mul_(2)  # in place, between tracker.step() and the next optimizer step
    moved_from = model[0].weight.detach().clone()
    with pytest.warns(UserWarning, match=r"weight/0\.weight.*skipped") as rec:
        train(model, opt, 2)
        nxt = tracker.step()
    assert len(rec) == 1
    # step 1: the torn tensor and what depends on it are gone, the rest was delivered
    assert not any(k.startswith(("weight/0.weight/", "update/0.weight/")) for k in out)
    assert "trust_ratio/0.weight" not in out and "trust_ratio/0.bias" in out
    assert "grad/0.weight/l2" in out and "exp_avg/0.weight/l2" in out
    # synchronous from now on; the next update is measured from the weights at the join
    assert tracker._sync_only and isinstance(nxt, dict)
    upd = flat(model[0].weight) - flat(moved_from)
    assert nxt["update/0.weight/l2"] == pytest.approx(np.linalg.norm(upd), rel=1e-4)
    assert nxt["weight/0.weight/l2"] == pytest.approx(np.linalg.norm(flat(model[0].weight)))


def test_gradient_changed_while_the_worker_reads_it_is_skipped(monkeypatch):
    model, opt = setup()
    tracker = nnstat.Tracker(model, opt, background=True)
    train(model, opt, 0)
    tracker.step()  # first logged step: gradients read synchronously (no history yet)
    tracker.flush()
    gate = threading.Event()
    original = nnstat.tracker.compute.weight_update_norms

    def held(*args, **kwargs):
        assert gate.wait(10)
        return original(*args, **kwargs)

    # the worker reduces weights first and step 1's gradients last: hold it at the weights
    monkeypatch.setattr(nnstat.tracker.compute, "weight_update_norms", held)
    train(model, opt, 1)
    out = tracker.step()
    kept = model[2].weight.grad
    kept.mul_(3)  # someone still holding step 1's gradient writes it in place
    gate.set()
    with pytest.warns(UserWarning, match=r"grad/2\.weight"):
        tracker.flush()
    assert "grad/2.weight/l2" not in out and "grad/0.weight/l2" in out
    assert "weight/2.weight/l2" in out and tracker._sync_only
    tracker.close()


@pytest.mark.parametrize("collect", ["step", "flush", "close", "read"])
def test_worker_exception_is_raised_in_training_thread(collect, monkeypatch):
    model, opt = setup()
    tracker = nnstat.Tracker(model, opt, background=True)
    train(model, opt, 0)
    tracker.step()
    tracker.flush()  # step 0 done before the failure is injected
    where = []

    def boom(*args, **kwargs):
        where.append(threading.current_thread().name)
        raise FloatingPointError("boom in the worker")

    monkeypatch.setattr(nnstat.tracker.compute, "weight_update_norms", boom)
    train(model, opt, 1)
    out = tracker.step()  # returns: the failure happens on the worker
    train(model, opt, 2)  # the pre-hook waits and keeps the error for the training thread
    with pytest.raises(FloatingPointError, match="boom in the worker"):
        if collect == "step":
            tracker.step()
        elif collect == "flush":
            tracker.flush()
        elif collect == "close":
            tracker.close()
        else:
            out["weight/0.weight/l2"]
    assert where == ["nnstat-statistics"]
    tracker.close()
    assert not opt._optimizer_step_pre_hooks


def test_unclosed_tracker_is_flushed_at_exit(tmp_path, run_python):
    log = tmp_path / "steps.txt"
    code = f"""
import torch, nnstat
torch.manual_seed(0)
model = torch.nn.Linear(3, 2); opt = torch.optim.Adam(model.parameters())
def sink(metrics, step):
    with open({str(log)!r}, "a") as f:
        f.write(f"{{step}} {{metrics['weight/weight/l2']:.6f}}\\n")
tracker = nnstat.Tracker(model, opt, background=True, sinks=[sink])
for i in range(3):
    opt.zero_grad(); model(torch.randn(4, 3)).sum().backward(); opt.step(); tracker.step()
print(f"{{model.weight.norm().item():.6f}}")
"""
    out = run_python("-c", code, capture_output=True, text=True, check=True)
    rows = log.read_text().split("\n")[:-1]
    assert [r.split()[0] for r in rows] == ["0", "1", "2"]
    assert rows[-1].split()[1] == out.stdout.strip()


def test_worker_runs_one_thread_without_changing_the_process_setting():
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert submit(torch.get_num_threads).result() == 1
        assert torch.get_num_threads() == 2
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert seen == [2]  # new threads still inherit the training thread's setting
    finally:
        torch.set_num_threads(n)


def test_background_option_policy_and_errors():
    n = torch.get_num_threads()
    model, opt = setup()
    try:
        for threads, kind in [(1, StepMetrics), (2, dict)]:
            torch.set_num_threads(threads)
            tracker = nnstat.Tracker(model, opt, stats=["l2"])
            train(model, opt, 0)
            assert isinstance(tracker.step(), kind)
            tracker.close()
            assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(n)
    assert isinstance(nnstat.Tracker(model, background=False, groups=["weight"]).step(), dict)
    with pytest.raises(ValueError, match="needs the optimizer"):
        nnstat.Tracker(model, background=True)
    with pytest.raises(TypeError, match="background must be"):
        nnstat.Tracker(model, opt, background="yes")


@pytest.mark.parametrize(
    "kw, jobs",
    [
        ({}, 1),  # one blocked pass shared: the 3 groups' blocks and the weight/update pairs
        ({"groups": ["weight", "update"]}, 1),  # a single task is shared too
        ({"stats": None, "histograms": True, "bins": 8}, 1),  # whole tasks split
    ],
)
def test_two_threads_split_the_synchronous_statistics_with_the_worker(monkeypatch, kw, jobs):
    """With two torch threads the synchronous statistics run on this thread and the worker at
    once (both cores: training leaves none idle to hide them behind); the numbers are those of
    the tasks run one after the other, bit for bit. The default statistics share one blocked
    pass over every group and the weight/update pairs block by block (one worker job, so one
    wait for it, per step), other statistics split the tasks (one worker job per step)."""
    import nnstat.tracker.inline as background

    submitted = []
    real = background.submit
    monkeypatch.setattr(background, "submit", lambda fn: submitted.append(1) or real(fn))
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        (m_a, o_a), (m_b, o_b) = setup(), setup()
        split = nnstat.Tracker(m_a, o_a, background=False, **kw)
        serial = nnstat.Tracker(m_b, o_b, background=False, **kw)
        serial._inline.split_ok = lambda on_cpu: False
        for i in range(3):
            train(m_a, o_a, i)
            train(m_b, o_b, i)
            a, b = split.step(), serial.step()
            assert len(submitted) == (i + 1) * jobs and isinstance(a, dict)
            assert sorted(a) == sorted(b) and all(same(a[k], b[k]) for k in b)
    finally:
        torch.set_num_threads(n)


def test_one_pass_gives_the_tasks_results_bit_for_bit():
    """`compute.one_pass` (the two-thread default statistics: every group's blocks and the
    weight/update pairs in one pass shared with the worker) returns what the tasks give run
    one after the other, bit for bit, with NaN/Inf, float64, bfloat16 (torch blocks) and empty
    tensors in the groups, and refreshes the snapshot the same way."""
    from nnstat.describe.block_passes import share_blocks
    from nnstat.tracker.compute import StepPlan, one_pass, tasks

    g = torch.Generator().manual_seed(5)
    w = [torch.randn(300_000, generator=g), torch.randn(40, 7, generator=g, dtype=torch.float64)]
    prev = [t + 0.01 * torch.randn(t.shape, generator=g, dtype=t.dtype) for t in w]
    grads = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in w]
    grads[0][123_456] = math.nan
    states = [torch.randn(200_000, generator=g).bfloat16(), torch.zeros(0)]
    names = ["a", "b"]
    stats = ("l2", "rms", "abs_max", "nonfinite")

    def plan(snapshot):
        groups = [("grad", names, grads), ("exp_avg", names, states)]
        return StepPlan(
            names, stats, paired=True, weights=w, prev=snapshot, refresh=True, groups=groups
        )

    snap_a, snap_b = [p.clone() for p in prev], [p.clone() for p in prev]
    want = {k: fn() for k, fn in tasks(plan(snap_a))}
    with share_blocks(submit):
        got = one_pass(plan(snap_b))
    assert list(got) == list(want)
    exact = {"rtol": 0, "atol": 0, "equal_nan": True}
    for k in want:
        if k == "update":
            torch.testing.assert_close(got[k], want[k], **exact)
        else:
            torch.testing.assert_close(got[k][0], want[k][0], **exact)
            assert got[k][1] is None and want[k][1] is None
    assert want["group:grad"][0][0, 3] == 1  # the NaN is counted, the rest over finite values
    assert all(torch.equal(a, b) for a, b in zip(snap_a, snap_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(snap_b, w, strict=True))


class Wrapped(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: never runs Optimizer.__init__, delegates."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def state(self):
        return self.optimizer.state

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=True):
        self.optimizer.zero_grad(set_to_none)


def test_optimizer_wrapper_is_hooked_through_its_inner_optimizer():
    (m_bg, o_bg), (m_sy, o_sy) = setup(), setup()
    wrapped = Wrapped(o_bg)
    bg = nnstat.Tracker(m_bg, wrapped, background=True)
    sy = nnstat.Tracker(m_sy, o_sy, background=False)
    for i in range(3):
        train(m_bg, wrapped, i)
        train(m_sy, o_sy, i)
        a, b = bg.step(), sy.step()
        assert isinstance(a, StepMetrics) and len(o_bg._optimizer_step_pre_hooks) == 1
        assert dict(a) == b
    bg.close()
    assert not o_bg._optimizer_step_pre_hooks
    # nothing to hook: synchronous
    orphan = Wrapped(None)
    model, _ = setup()
    assert isinstance(
        nnstat.Tracker(model, orphan, background=True, groups=["weight"]).step(), dict
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_drops_the_parents_pending_step():
    model, opt = setup()
    seen = []
    tracker = nnstat.Tracker(model, opt, background=True, sinks=[lambda m, s: seen.append(s)])
    train(model, opt, 0)
    tracker.step()
    pid = os.fork()
    if pid == 0:  # child: no worker thread here; flushing must neither hang nor deliver
        tracker.flush()
        os._exit(0 if seen == [] and tracker._worker.pending is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    tracker.flush()
    assert seen == [0]


class Collect:
    def __init__(self):
        self.rows = []

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))


class FailsAt(Collect):
    def __init__(self, fail_step):
        super().__init__()
        self.fail_step = fail_step

    def log(self, metrics, step):
        super().log(metrics, step)
        if step == self.fail_step:
            raise ConnectionError(f"sink down at step {step}")


@pytest.mark.parametrize("background", [True, False])
def test_failing_sink_loses_no_step_for_any_sink(background):
    (model, opt), (m_ref, o_ref) = setup(), setup()
    bad, good = FailsAt(1), Collect()
    tracker = nnstat.Tracker(model, opt, background=background, sinks=[bad, good])
    ref = nnstat.Tracker(m_ref, o_ref, background=False)
    raised_at, expected = [], []
    for i in range(4):
        train(model, opt, i)
        train(m_ref, o_ref, i)
        expected.append(ref.step())
        try:
            tracker.step()
        except ConnectionError as e:
            raised_at.append(i)
            err = e
    tracker.flush()  # raised once: nothing more to report
    tracker.close()
    # synchronous: raised by the step that failed; background: step 1 reaches the sinks in the
    # next step() call, which schedules its own step before raising
    # every sink got every step, and the numbers are the synchronous reference's
    assert [s for s, _ in good.rows] == [s for s, _ in bad.rows] == [0, 1, 2, 3]
    for (_, got), want in zip(good.rows, expected, strict=True):
        assert got == want
    assert raised_at == ([2] if background else [1])
    assert "sink down at step 1" in str(err)
    if hasattr(err, "__notes__"):
        assert any("failed on step 1" in n and "other sink" in n for n in err.__notes__)


def test_close_closes_every_sink_and_raises_after():
    model, opt = setup()
    closed = []

    class Sink(Collect):
        def __init__(self, name, fail_log=None, fail_close=False):
            super().__init__()
            self.name, self.fail_log, self.fail_close = name, fail_log, fail_close

        def log(self, metrics, step):
            super().log(metrics, step)
            if step == self.fail_log:
                raise ValueError(f"{self.name} cannot log")

        def close(self):
            closed.append(self.name)
            if self.fail_close:
                raise OSError(f"{self.name} cannot close")

    sinks = [Sink("a", fail_log=0), Sink("b", fail_close=True), Sink("c")]
    tracker = nnstat.Tracker(model, opt, background=True, sinks=sinks)
    train(model, opt, 0)
    tracker.step()  # pending: delivered by close()
    with pytest.raises(ValueError, match="a cannot log") as e:
        tracker.close()
    assert closed == ["a", "b", "c"] and all(s.rows[0][0] == 0 for s in sinks)
    if hasattr(e.value, "__notes__"):
        assert any("b cannot close" in n for n in e.value.__notes__)
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def test_failure_of_the_exit_time_flush_gives_a_nonzero_exit_status(tmp_path, run_python):
    log = tmp_path / "steps.txt"
    code = f"""
import atexit, torch, nnstat
atexit.register(lambda: print("earlier atexit callback ran", flush=True))
torch.manual_seed(0)
model = torch.nn.Linear(3, 2); opt = torch.optim.Adam(model.parameters())
def bad(metrics, step):
    if step == 2:  # the step still pending at exit
        raise ConnectionError("sink down at exit")
def good(metrics, step):
    with open({str(log)!r}, "a") as f:
        f.write(f"{{step}}\\n")
tracker = nnstat.Tracker(model, opt, background=True, sinks=[bad, good])
for i in range(3):
    opt.zero_grad(); model(torch.randn(4, 3)).sum().backward(); opt.step(); tracker.step()
print("done")
"""
    out = run_python("-c", code, capture_output=True, text=True)
    assert out.returncode != 0, out.stderr
    assert "ConnectionError: sink down at exit" in out.stderr
    assert "exits with status 120" in out.stderr
    # the other sink still got the last step; the callbacks after the flush still ran
    assert log.read_text().split() == ["0", "1", "2"]
    assert out.stdout.split() == ["done", "earlier", "atexit", "callback", "ran"]


@pytest.mark.parametrize("edit", ["scale", "one element"])
def test_a_data_edit_after_step_warns_and_skips_that_weight(monkeypatch, edit):
    """``p.data`` writes bump no version counter: the weight's norm taken at ``step()`` tells."""
    model, opt = setup()
    tracker = nnstat.Tracker(model, opt, background=True)
    train(model, opt, 0)
    tracker.step()
    tracker.flush()
    gate = threading.Event()
    original = nnstat.tracker.compute.weight_update_norms

    def held(*args, **kwargs):
        assert gate.wait(10)
        return original(*args, **kwargs)

    monkeypatch.setattr(nnstat.tracker.compute, "weight_update_norms", held)
    train(model, opt, 1)
    before = flat(model[2].weight)
    out = tracker.step()
    if edit == "scale":
        model[2].weight.data.mul_(2)  # after step(), before the worker read it
    else:
        model[2].weight.data[1, 4] += 0.5
    gate.set()
    pattern = r"weight/2\.weight.*p\.data edit.*tracker\.flush\(\) before editing.*background=False"
    with pytest.warns(UserWarning, match=pattern):
        tracker.flush()
    # step 1's values of the edited weight are dropped, not computed from the edited values
    assert "weight/2.weight/l2" not in out
    assert out["weight/0.weight/l2"] == pytest.approx(np.linalg.norm(flat(model[0].weight)))
    assert np.linalg.norm(before) != pytest.approx(np.linalg.norm(flat(model[2].weight)))
    assert tracker._sync_only
    tracker.close()


def test_no_data_edit_no_warning():
    model, opt = setup()
    tracker = nnstat.Tracker(model, opt, background=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(4):
            train(model, opt, i)
            tracker.step()
        tracker.flush()
    assert not tracker._sync_only
    tracker.close()


@pytest.mark.parametrize("value", [float("inf"), float("nan")], ids=["inf", "nan"])
def test_nonfinite_weights_are_not_taken_for_data_edits(value):
    """A weight holding Inf or NaN keeps an infinite or NaN norm: it is unchanged, not edited
    (inf - inf is NaN), so its statistics are delivered with their nonfinite counts."""
    model, opt = setup()
    tracker = nnstat.Tracker(model, opt, background=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(3):
            train(model, opt, i)
            if i == 2:
                with torch.no_grad():
                    model[0].bias[1] = value
            out = tracker.step()
        tracker.flush()
    assert out["weight/0.bias/nonfinite"] == 1
    w = model[0].bias.detach().double()
    assert out["weight/0.bias/l2"] == pytest.approx(float(w[torch.isfinite(w)].norm()), rel=1e-6)
    assert not tracker._sync_only
    tracker.close()
