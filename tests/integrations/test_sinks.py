"""TensorBoard and W&B sinks, read back from event files and the offline run's summary."""

import importlib.util
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import nnstat

# an optional dependency (nnstat[wandb]): where it is not installed these tests say so
needs_wandb = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="wandb is not installed (nnstat[wandb])"
)


def tracked_run(sinks, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tracker = nnstat.Tracker(model, opt, histograms=True, bins=10, sinks=sinks)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        metrics = tracker.step()
    tracker.flush()  # background statistics: the last step reaches the sinks here
    return model, tracker, metrics


def test_tensorboard_scalars_and_histograms_read_back(tmp_path):
    from nnstat.integrations.tensorboard import TensorBoardSink
    from tensorboard.backend.event_processing.event_accumulator import (
        HISTOGRAMS,
        SCALARS,
        EventAccumulator,
    )

    sink = TensorBoardSink(tmp_path)
    model, tracker, metrics = tracked_run([sink])
    tracker.close()
    acc = EventAccumulator(str(tmp_path), size_guidance={SCALARS: 0, HISTOGRAMS: 0})
    acc.Reload()
    scalars = set(acc.Tags()["scalars"])
    expected = {k for k, v in metrics.items() if isinstance(v, float)}
    assert expected <= scalars and len(expected) > 50
    events = acc.Scalars("weight/2.weight/l2")
    assert [e.step for e in events] == [0, 1, 2]
    assert events[-1].value == pytest.approx(model[2].weight.norm().item(), rel=1e-6)
    hist = acc.Histograms("grad/0.weight/hist")[-1].histogram_value
    grad = model[0].weight.grad.double().numpy().ravel()
    assert hist.num == grad.size and sum(hist.bucket) == grad.size
    assert hist.min == pytest.approx(grad.min(), rel=1e-6)
    assert hist.sum_squares == pytest.approx((grad**2).sum(), rel=1e-5)
    counts, edges = np.histogram(grad, bins=10, range=(grad.min(), grad.max()))
    np.testing.assert_allclose(hist.bucket_limit, edges[1:], rtol=1e-5)
    assert np.abs(np.array(hist.bucket) - counts).sum() <= 2


def test_tensorboard_rejects_unloggable_values(tmp_path):
    from nnstat.integrations.tensorboard import TensorBoardSink

    sink = TensorBoardSink(tmp_path)
    with pytest.raises(TypeError, match="cannot log 'bad'"):
        sink.log({"bad": "text"}, step=0)
    with pytest.raises(TypeError, match="cannot log 'z' of type Tensor"):
        sink.log({"z": torch.tensor(1 + 2j)}, step=0)
    with pytest.raises(TypeError, match="metric keys must be strings.*got 3 of type int"):
        sink.log({3: 1.0}, step=0)
    sink.close()


@needs_wandb
def test_wandb_warns_once_when_a_step_goes_back_and_would_be_dropped(tmp_path, monkeypatch):
    """W&B ignores rows below the run's current step (a Tracker counting from 0 again on a
    resumed run) with a line on its console only; the sink warns, and the summary shows the
    row really was dropped."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from nnstat.integrations.wandb import WandbSink

    sink = WandbSink(project="nnstat-tests", dir=str(tmp_path))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            sink.log({"a": 1.0}, step=5)
        with pytest.warns(
            RuntimeWarning, match="drops the metrics of step 2: the run is at step 6"
        ):
            sink.log({"a": 2.0}, step=2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once
            sink.log({"a": 3.0}, step=5)
            sink.log({"a": 4.0}, step=7)
        assert sink.run.summary._as_dict()["a"] == 4.0
    finally:
        sink.close()


@needs_wandb
def test_wandb_offline_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from nnstat.integrations.wandb import WandbSink

    sink = WandbSink(project="nnstat-tests", dir=str(tmp_path))
    try:
        model, tracker, metrics = tracked_run([sink])
        summary = sink.run.summary._as_dict()
        assert summary["_step"] == 2
        assert summary["weight/2.weight/l2"] == pytest.approx(
            model[2].weight.norm().item(), rel=1e-6
        )
        assert summary["trust_ratio/0.bias"] == pytest.approx(metrics["trust_ratio/0.bias"])
        hist = summary["grad/0.weight/hist"]
        assert hist["_type"] == "histogram" and sum(hist["values"]) == 24
        assert len(hist["bins"]) == 11
    finally:
        tracker.close()
    assert sink.run is not None and not sink._owns


def test_integrations_import_is_lazy(run_python):
    code = (
        "import sys, nnstat.integrations.wandb, nnstat.integrations.tensorboard\n"
        "print(sorted({'wandb', 'tensorboard'} & set(sys.modules)))\n"
    )
    out = run_python("-c", code, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@needs_wandb
def test_wandb_finish_delivers_pending_background_step(tmp_path, monkeypatch):
    # the seed's loop ends with wandb.finish(), never tracker.close(): with background
    # statistics the last step is still pending then and must reach the run before it finishes
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb
    from nnstat.integrations.wandb import WandbSink

    run = wandb.init(project="nnstat-tests", dir=str(tmp_path))
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    tracker = nnstat.Tracker(model, opt, stats=["l2"], background=True, sinks=[WandbSink()])
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        tracker.step()
    logged = []
    original_log = run.log

    def log(data, **kw):  # a log into a finished run raises: this one must come first
        original_log(data, **kw)
        logged.append((kw["step"], data["weight/weight/l2"]))

    monkeypatch.setattr(run, "log", log)
    wandb.finish()
    # steps 0 and 1 went out at the following step() calls, step 2 at finish
    assert [s for s, _ in logged] == [2]
    assert logged[0][1] == pytest.approx(model.weight.norm().item(), rel=1e-6)
    tracker.close()  # nothing left to deliver: no error, no second delivery
    assert len(logged) == 1


def test_tensorboard_close_delivers_pending_background_step(tmp_path):
    from nnstat.integrations.tensorboard import TensorBoardSink
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sink = TensorBoardSink(tmp_path)
    tracker = nnstat.Tracker(model, opt, stats=["l2"], background=True, sinks=[sink])
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 4)).pow(2).mean().backward()
        opt.step()
        tracker.step()
    sink.close()  # the user closes the sink, not the Tracker: step 2 must still be written
    acc = EventAccumulator(str(tmp_path), size_guidance={SCALARS: 0})
    acc.Reload()
    events = acc.Scalars("weight/weight/l2")
    assert [e.step for e in events] == [0, 1, 2]
    assert events[-1].value == pytest.approx(model.weight.norm().item(), rel=1e-6)


@needs_wandb
def test_wandb_log_of_a_background_step_result(tmp_path, monkeypatch):
    # wandb.log(tracker.step()) is the natural loop; wandb copies what it is given
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb

    run = wandb.init(project="nnstat-tests", dir=str(tmp_path))
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        with nnstat.Tracker(model, opt, stats=["l2"], background=True) as tracker:
            for step in range(2):
                opt.zero_grad()
                model(torch.randn(8, 4)).pow(2).mean().backward()
                opt.step()
                metrics = tracker.step()
                assert type(metrics.copy()) is dict and metrics.copy() == dict(metrics)
                wandb.log(metrics, step=step, commit=True)
        summary = run.summary._as_dict()
        assert summary["_step"] == 1
        assert summary["weight/weight/l2"] == pytest.approx(model.weight.norm().item(), rel=1e-6)
    finally:
        wandb.finish()


class FakeWriter:
    """A SummaryWriter stand-in that records what reached it and whether it was closed."""

    log_dir = "unused"

    def __init__(self):
        self.scalars, self.closed = [], False

    def add_scalar(self, tag, value, global_step):
        self.scalars.append((tag, global_step))

    def close(self):
        self.closed = True


def failing_at(fail_step):
    def sink(metrics, step):
        if step == fail_step:
            raise ConnectionError(f"sink down at step {step}")

    return sink


def pending_step(model, opt, tracker):
    opt.zero_grad()
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    tracker.step()


def test_tensorboard_close_delivers_every_trackers_step_and_closes_when_one_fails():
    from nnstat.integrations.tensorboard import TensorBoardSink

    writer = FakeWriter()
    sink = TensorBoardSink(writer=writer)
    trackers = []
    for fail in (True, False):  # the first Tracker's other sink fails on its pending step
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        extra = [failing_at(0)] if fail else []
        tracker = nnstat.Tracker(
            model, opt, stats=["l2"], groups=["weight"], background=True, sinks=[*extra, sink]
        )
        pending_step(model, opt, tracker)
        trackers.append(tracker)
    with pytest.raises(ConnectionError, match="sink down at step 0"):
        sink.close()  # the user closes the sink, not the Trackers
    # both Trackers' step 0 reached the writer (the failing sink stopped neither), then it closed
    assert sorted(writer.scalars) == [("weight/bias/l2", 0)] * 2 + [("weight/weight/l2", 0)] * 2
    assert writer.closed


@needs_wandb
def test_wandb_finish_finishes_the_run_when_another_sink_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    import wandb
    from nnstat.integrations.wandb import WandbSink

    run = wandb.init(project="nnstat-tests", dir=str(tmp_path))
    try:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        tracker = nnstat.Tracker(
            model, opt, stats=["l2"], background=True, sinks=[failing_at(1), WandbSink()]
        )
        pending_step(model, opt, tracker)
        pending_step(model, opt, tracker)  # step 1 still pending when the run finishes
        logged, original_log = [], run.log

        def log(data, **kw):
            original_log(data, **kw)
            logged.append(kw["step"])

        monkeypatch.setattr(run, "log", log)
        with pytest.raises(ConnectionError, match="sink down at step 1"):
            wandb.finish()
        assert logged == [1] and wandb.run is None  # step 1 reached the run, which finished
    finally:
        if wandb.run is not None:
            wandb.finish()


def test_each_sink_gets_its_own_histogram_arrays():
    seen = []

    def zeroing(metrics, step):  # a sink that reuses what it is given, in place
        for v in metrics.values():
            if isinstance(v, nnstat.describe.Histogram):
                v.counts[:] = 0
                v.edges[:] = 0

    def keeping(metrics, step):
        seen.append(
            {
                k: (v.counts.copy(), v.edges.copy())
                for k, v in metrics.items()
                if isinstance(v, nnstat.describe.Histogram)
            }
        )

    _, tracker, metrics = tracked_run([zeroing, keeping], steps=2)
    assert seen and all(seen[-1])
    for key, (counts, edges) in seen[-1].items():
        assert counts.sum() > 0 and edges[-1] > edges[0], key  # before: the first sink's zeros
        np.testing.assert_array_equal(counts, metrics[key].counts)  # step()'s value, unchanged


# one history with a bool of each kind (Python, NumPy, torch); the reference is Python's own
# bool -> number conversion
BOOL_STEPS = [
    {"flag": True, "np_flag": np.bool_(False), "t_flag": torch.tensor([True]), "x": 0.5},
    {"flag": False, "np_flag": np.bool_(True), "t_flag": torch.tensor(False), "x": 1.5},
]
BOOL_EXPECTED = {
    k: [m[k] if k == "x" else float(bool(m[k])) for m in BOOL_STEPS] for k in BOOL_STEPS[0]
}


def test_tensorboard_jsonl_and_frames_log_a_bool_as_0_or_1(tmp_path):
    from nnstat.integrations.jsonl import JsonlLogger, read_jsonl
    from nnstat.integrations.tensorboard import TensorBoardSink
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    from nnstat.plot.frames import metrics_frame

    tb = TensorBoardSink(tmp_path / "tb")
    with JsonlLogger(tmp_path / "jsonl") as jsonl:
        for step, metrics in enumerate(BOOL_STEPS):
            tb.log(metrics, step)
            jsonl.log(metrics, step)
    tb.close()
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={SCALARS: 0})
    acc.Reload()
    assert {k: [e.value for e in acc.Scalars(k)] for k in BOOL_EXPECTED} == BOOL_EXPECTED
    rows, problems = read_jsonl(tmp_path / "jsonl")
    assert problems == []
    assert {k: [r["metrics"][k] for r in rows] for k in BOOL_EXPECTED} == BOOL_EXPECTED
    frame = metrics_frame(BOOL_STEPS)  # the plots' pandas frame of a history
    assert {k: frame[k].tolist() for k in BOOL_EXPECTED} == BOOL_EXPECTED


@needs_wandb
def test_wandb_logs_a_bool_as_0_or_1(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    from nnstat.integrations.wandb import WandbSink

    sink = WandbSink(project="nnstat-tests", dir=str(tmp_path))
    try:
        for step, metrics in enumerate(BOOL_STEPS):
            sink.log(metrics, step)
            summary = sink.run.summary._as_dict()
            logged = {k: summary[k] for k in BOOL_EXPECTED}
            assert logged == {k: v[step] for k, v in BOOL_EXPECTED.items()}
            assert not any(isinstance(v, bool) for v in logged.values())  # W&B keeps a bool
    finally:
        sink.close()
