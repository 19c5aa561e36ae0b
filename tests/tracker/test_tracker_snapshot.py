"""`Tracker.snapshot` (the caller picks the logged steps as they come) and `Tracker.poll`.

References: the update of a logged step is ``W_after - W_before`` around its one optimizer
step, computed with torch from copies taken by the test; trust ratios from the same tensors.
Three paths: synchronous CPU, the background worker, and the deferred accelerator path on CPU
tensors (`tracker._on_cpu` patched, `LocalCopy.ready` standing in for the CUDA event).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nnstat
from nnstat.background.transfer import LocalCopy
from nnstat.tracker import tracker as tracker_module


@pytest.fixture(params=["sync", "background", "deferred"])
def path(request, monkeypatch):
    if request.param == "deferred":
        monkeypatch.setattr(tracker_module, "_on_cpu", lambda params: False)
        monkeypatch.setattr(LocalCopy, "ready", False)
    return {"sync": False, "background": True, "deferred": None}[request.param]


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def _backward(model, i):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(8, 5, generator=g), torch.randint(0, 2, (8,), generator=g)
    nn.functional.cross_entropy(model(x), y).backward()


@pytest.mark.parametrize("stats", [["l2", "rms"], ["l2", "mean"]], ids=["norms", "moments"])
def test_snapshot_makes_each_logged_update_exactly_one_optimizer_step(path, stats):
    model, opt = _setup()
    got: list[tuple[int, dict]] = []
    tracker = nnstat.Tracker(
        model, opt, stats=stats, background=path, sinks=[lambda m, s: got.append((s, m))]
    )
    expected = {}
    for step in range(1, 9):
        opt.zero_grad(set_to_none=True)
        _backward(model, step)
        log = step in (3, 4, 7)  # two in a row, then a gap of optimizer steps
        if log:
            tracker.snapshot()
            before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        if log:
            tracker.step(step)
            expected[step] = {}
            for (n, p), w0 in zip(model.named_parameters(), before, strict=True):
                du = (p.detach() - w0).double()
                expected[step][f"update/{n}/l2"] = torch.linalg.vector_norm(du).item()
                expected[step][f"trust_ratio/{n}"] = (
                    torch.linalg.vector_norm(p.detach().double()) / torch.linalg.vector_norm(du)
                ).item()
    tracker.close()
    assert [s for s, _ in got] == [3, 4, 7]
    for step, metrics in got:
        for key, value in expected[step].items():
            assert metrics[key] == pytest.approx(value, rel=1e-5), (step, key)


def test_a_logged_step_without_a_snapshot_after_one_leaves_its_update_out():
    model, opt = _setup()
    tracker = nnstat.Tracker(model, opt, stats=["l2"], background=False)
    _backward(model, 0)
    tracker.snapshot()
    opt.step()
    assert "update/0.weight/l2" in tracker.step()
    opt.step()
    with pytest.warns(UserWarning, match=r"no snapshot\(\) since the previous logged step"):
        metrics = tracker.step()
    # the snapshot now holds the previous update, not weights: no update, no ratios
    assert not any(k.startswith(("update/", "trust_ratio/", "update_ratio/")) for k in metrics)
    assert "weight/0.weight/l2" in metrics and "grad/0.weight/l2" in metrics
    tracker.snapshot()
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "trust_ratio/0.weight" in tracker.step()  # a fresh snapshot: measured again


def test_snapshot_with_no_optimizer_step_before_the_logged_step_leaves_the_update_out():
    model, opt = _setup()
    tracker = nnstat.Tracker(model, opt, stats=["l2"], background=False)
    _backward(model, 0)
    opt.step()  # before the snapshot: not this step's
    tracker.snapshot()
    with pytest.warns(UserWarning, match=r"optimizer\.step\(\) has not run since"):
        metrics = tracker.step()
    assert not any(k.startswith("update/") for k in metrics) and "weight/0.bias/l2" in metrics


def test_poll_delivers_what_is_ready_and_never_waits(monkeypatch):
    monkeypatch.setattr(tracker_module, "_on_cpu", lambda params: False)
    monkeypatch.setattr(LocalCopy, "ready", False)
    waited = []
    real = LocalCopy.wait
    monkeypatch.setattr(LocalCopy, "wait", lambda c: waited.append(c.done()) or real(c))
    model, opt = _setup()
    got: list[int] = []
    tracker = nnstat.Tracker(model, opt, stats=["l2"], sinks=[lambda m, s: got.append(s)])
    for step in range(3):
        _backward(model, step)
        opt.step()
        tracker.step(step * 10)
    tracker.poll()
    assert got == [] and waited == []  # nothing arrived: nothing delivered, nothing waited for
    monkeypatch.setattr(LocalCopy, "ready", True)
    tracker.poll()
    assert got == [0, 10, 20] and all(waited)  # read only once arrived


def test_poll_delivers_a_finished_background_step():
    model, opt = _setup()
    got: list[int] = []
    tracker = nnstat.Tracker(
        model, opt, stats=["l2"], background=True, sinks=[lambda m, s: got.append(s)]
    )
    _backward(model, 0)
    opt.step()
    handle = tracker.step(5)
    tracker._worker.pending.job.wait()  # the worker is done; poll must not need to wait for it
    tracker.poll()
    assert got == [5] and tracker._worker.pending is None and handle["weight/0.bias/l2"] > 0
