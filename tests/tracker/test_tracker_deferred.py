"""Deferred delivery on accelerators (`nnstat.tracker.delivery`): nothing read back inside
``tracker.step()``, every step handed to the sinks later, exactly and in order.

Run on CPU: `tracker._on_cpu` is patched so CPU tensors take the accelerator path, with the
torch-only kernels an accelerator runs (`torch_only`), and `LocalCopy.ready` stands in for the
CUDA event: False holds every copy back (an event not yet reached), True lets the next poll
deliver it. Values are checked against norms computed directly from the tensors of each step
and against the synchronous CPU Tracker.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _ledger import host_reads
from test_tracker_device_path import _same, torch_only  # noqa: F401  (fixture)
from torch import nn

import nnstat
from nnstat.background.transfer import LocalCopy
from nnstat.tracker import compute, delivery
from nnstat.tracker import tracker as tracker_module
from nnstat.tracker.pending import StepMetrics


@pytest.fixture
def deferred(torch_only, monkeypatch):  # noqa: F811
    """CPU tensors take the accelerator path; copies arrive only when a test says so."""
    monkeypatch.setattr(tracker_module, "_on_cpu", lambda params: False)
    monkeypatch.setattr(LocalCopy, "ready", False)


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _train(model, opt, i, set_to_none=True):
    opt.zero_grad(set_to_none=set_to_none)
    g = torch.Generator().manual_seed(100 + i)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _norms(model) -> dict[str, float]:
    """l2 of every weight and gradient, straight from the tensors (float64)."""
    out = {}
    for n, p in model.named_parameters():
        out[f"weight/{n}/l2"] = torch.linalg.vector_norm(p.detach().double()).item()
        out[f"grad/{n}/l2"] = torch.linalg.vector_norm(p.grad.double()).item()
    return out


def _reference(steps: int, **kw) -> list[dict | None]:
    """The synchronous CPU Tracker on the same training."""
    model, opt = _setup()
    tracker = nnstat.Tracker(model, opt, background=False, **kw)
    out = []
    for i in range(steps):
        _train(model, opt, i)
        metrics = tracker.step()
        out.append(None if metrics is None else dict(metrics))
    return out


@pytest.mark.parametrize(
    "kw",
    [{}, {"every": 2}, {"stats": None, "histograms": True, "bins": 8}],
    ids=["default", "every2", "full+hist"],
)
def test_step_reads_nothing_and_flush_delivers_every_step_exactly_in_order(deferred, kw):
    model, opt = _setup()
    got: list[tuple[int, dict]] = []
    tracker = nnstat.Tracker(model, opt, sinks=[lambda m, s: got.append((s, m))], **kw)
    reads: list[str] = []
    direct, handles = [], []
    for i in range(6):
        _train(model, opt, i)
        direct.append(_norms(model))
        with host_reads(reads):
            handles.append(tracker.step())
    assert reads == []  # not one value read back inside tracker.step()
    logged = [i for i, h in enumerate(handles) if h is not None]
    assert got == [] and all(isinstance(handles[i], StepMetrics) for i in logged)
    assert logged == list(range(0, 6, kw.get("every", 1)))
    tracker.flush()
    assert [s for s, _ in got] == logged
    ref = _reference(6, **kw)
    for (_, metrics), i in zip(got, logged, strict=True):
        for key, value in direct[i].items():
            assert metrics[key] == pytest.approx(value, rel=1e-6), key
        _same(metrics, ref[i])
        assert dict(handles[i]) == metrics


def test_arrived_steps_reach_the_sinks_at_the_next_step(deferred, monkeypatch):
    monkeypatch.setattr(LocalCopy, "ready", True)  # each copy has arrived by the next poll
    model, opt = _setup()
    got: list[int] = []
    tracker = nnstat.Tracker(model, opt, sinks=[lambda m, s: got.append(s)])
    for i in range(3):
        _train(model, opt, i)
        tracker.step()
        assert got == list(range(i))  # step i is polled by step i + 1
    tracker.close()
    assert got == [0, 1, 2]


def test_reading_a_step_delivers_it_and_the_steps_before_it(deferred):
    model, opt = _setup()
    got: list[int] = []
    tracker = nnstat.Tracker(model, opt, sinks=[lambda m, s: got.append(s)])
    handles = []
    for i in range(3):
        _train(model, opt, i)
        handles.append(tracker.step())
    assert "weight/0.weight/l2" in handles[1]  # the caller chose to wait for step 1
    assert got == [0, 1]
    assert tracker.latest is handles[2] and got == [0, 1, 2]


def test_a_failing_sink_still_raises_and_the_others_get_every_step(deferred):
    model, opt = _setup()
    got: list[int] = []

    def broken(metrics, step):
        raise OSError(f"disk full at {step}")

    tracker = nnstat.Tracker(model, opt, sinks=[broken, lambda m, s: got.append(s)])
    _train(model, opt, 0)
    tracker.step()
    with pytest.raises(OSError, match="disk full at 0"):
        tracker.flush()
    assert got == [0]


@pytest.mark.parametrize("kind", ["default", "full"])
def test_finish_reads_only_the_tensors_rereads_names(torch_only, kind):  # noqa: F811
    """`rereads` says which tensors `finish` reads again (NaN/Inf rows): swapping every other
    tensor for a meta tensor (no values) changes nothing."""
    model, opt = _setup()
    kw = {"stats": None, "histograms": True, "bins": 8} if kind == "full" else {}
    tracker = nnstat.Tracker(model, opt, background=False, **kw)
    for i in range(2):
        _train(model, opt, i)
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
        model[2].bias.grad[1] = math.inf
    plans = [tracker._plan(refresh=True) for _ in range(2)]
    plans[1].prev = [p.clone() for p in plans[0].prev]
    staged = [compute.stage(plan) for plan in plans]
    host = compute.to_host(staged[0].parts)
    ref = compute.assemble(plans[0], compute.finish(plans[0], staged[0], host))

    plan, st = plans[1], staged[1]
    read = {id(t) for _, _, t in delivery.rereads(plan, st, host)}
    assert len(read) >= 2  # the NaN weight and the Inf gradient at least

    def blind(tensors):
        return [t if id(t) in read else torch.empty_like(t, device="meta") for t in tensors]

    st.groups = {k: (blind(ts), at, *rest) for k, (ts, at, *rest) in st.groups.items()}
    plan.weights, plan.prev = blind(plan.weights), blind(plan.prev)
    plan.refresh = False
    _same(compute.assemble(plan, compute.finish(plan, st, host)), ref)


def test_nan_rows_of_unchanged_tensors_stay_exact(deferred):
    """A step skipped after NaN gradients (as ``GradScaler`` does) changes nothing, and fresh
    gradients (``set_to_none``) stay as they were until delivery: the NaN row is recomputed
    over the finite elements, as on the synchronous path."""
    model, opt = _setup()
    got: list[dict] = []
    tracker = nnstat.Tracker(model, opt, sinks=[lambda m, s: got.append(m)])
    ref_model, ref_opt = _setup()
    ref = nnstat.Tracker(ref_model, ref_opt, background=False)
    expected = []
    for i in range(3):
        for m, o in ((model, opt), (ref_model, ref_opt)):
            o.zero_grad()
            m(torch.ones(2, 6)).sum().backward()
            if i == 1:
                m[0].weight.grad[0, 0] = math.nan
            else:
                o.step()
        if i == 1:
            grad_1 = model[0].weight.grad.clone()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tracker.step()
            expected.append(dict(ref.step()))
        assert not [w for w in caught if "NaN/Inf" in str(w.message)]  # nothing dropped
    tracker.flush()
    assert got[1]["grad/0.weight/nonfinite"] == 1.0
    finite = grad_1[torch.isfinite(grad_1)].double()
    assert got[1]["grad/0.weight/l2"] == pytest.approx(torch.linalg.vector_norm(finite).item())
    for a, b in zip(got, expected, strict=True):
        _same(a, b)
    assert not tracker._sync_only


def test_nan_rows_of_tensors_changed_before_delivery_are_dropped_with_a_warning(deferred):
    """``zero_grad(set_to_none=False)`` zeroes step t's gradients in place before step t
    arrives: a NaN row cannot be recomputed then. It is left out (not a wrong value), the
    warning says so, and the Tracker reads later steps back synchronously (exact)."""
    model, opt = _setup()
    got: list[dict] = []
    tracker = nnstat.Tracker(model, opt, sinks=[lambda m, s: got.append(m)])
    _train(model, opt, 0)
    tracker.step()
    opt.zero_grad()
    model(torch.ones(2, 6)).sum().backward()
    model[0].weight.grad[0, 0] = math.nan  # and no optimizer step (as GradScaler skips it)
    with pytest.warns(UserWarning, match="optimizer.step.. has not run"):
        tracker.step()
    _train(model, opt, 2, set_to_none=False)  # step 1's gradients zeroed in place
    with pytest.warns(UserWarning, match=r"grad/0.weight.*NaN/Inf at step 1.*changed in place"):
        third = tracker.step()  # polls: nothing has arrived (LocalCopy.ready is False)
        tracker.flush()
    assert not any(k.startswith("grad/0.weight/") for k in got[1])
    assert "grad/0.bias/l2" in got[1] and "weight/0.weight/l2" in got[1]
    assert "grad/0.weight/l2" in got[0] and "grad/0.weight/l2" in got[2]
    assert tracker._sync_only and isinstance(third, StepMetrics)
    _train(model, opt, 3)
    assert isinstance(tracker.step(), dict) and len(got) == 4  # synchronous from now on


def test_meta_model_steps_without_reads_and_delivers_nothing(torch_only):  # noqa: F811
    """On the meta device (operation counting) a step queues its work and reads nothing; the
    values do not exist: the sinks get nothing (warned), and reading a step raises instead of
    inventing numbers."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got: list[int] = []
    tracker = nnstat.Tracker(model, opt, sinks=[lambda m, s: got.append(s)])
    reads: list[str] = []
    handles = []
    with pytest.warns(UserWarning, match="meta device"):
        for _ in range(2):
            model(torch.ones(4, 6, device="meta")).sum().backward()
            opt.step()
            with host_reads(reads):
                handles.append(tracker.step())
    assert reads == []
    tracker.close()
    assert got == []
    with pytest.raises(RuntimeError, match="step 1: a model on the meta device has no values"):
        dict(handles[1])
