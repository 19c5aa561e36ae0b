"""SIGTERM (a scheduler stopping the job) while a Tracker has a step on its way (the background
worker's, or a device copy not yet arrived) delivers it to the sinks like ``close()`` would,
then hands the signal on to the handler installed before; a signal arriving inside
``tracker.step()`` waits for the step to be complete; ``close()`` removes the handler."""

import json
import signal
import subprocess

import pytest
import torch
from _child import run_script

import nnstat

SCRIPT = r"""
import json, os, signal, sys, time, torch
import nnstat

out, mode, how, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
if mode == "deferred":  # the accelerator path on CPU tensors; no copy arrives before a flush
    from nnstat.background.transfer import LocalCopy
    import nnstat.describe.moments as moments
    import nnstat.describe.numpy_blocks as blocks
    from nnstat.tracker import tracker as tracker_module
    tracker_module._on_cpu = lambda params: False
    LocalCopy.ready = False
    moments.numpy_ok = lambda x: False
    moments.CHUNK = blocks.BLOCK = 1 << 30
    moments._denormal_scale = lambda head: 1.0
if how == "user-handler":
    def mine(signum, frame):  # the user's handler: called after the Tracker flushed
        rows = sum(1 for _ in open(out))
        print(f"user handler saw {rows} rows", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, mine)


class Lines:  # a JSONL sink: one line per step, flushed
    def __init__(self, path):
        self.f = open(path, "w")
    def log(self, metrics, step):
        row = {k: float(v) for k, v in metrics.items()}
        self.f.write(json.dumps({"step": step, **row}) + "\n"); self.f.flush()
    def close(self):
        self.f.close()


torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
opt = torch.optim.Adam(model.parameters(), lr=0.05)
tracker = nnstat.Tracker(model, opt, stats=["l2", "mean"], sinks=[Lines(out)],
                         background=None if mode == "deferred" else True)
calls = []
def provider():  # runs inside step(), after the worker got the step (before it is complete)
    calls.append(1)
    if how == "inside" and len(calls) == kill_at:
        os.kill(os.getpid(), signal.SIGTERM)  # handled between the bytecodes of step()
    return {"provider/calls": float(len(calls))}
tracker.add_provider(provider)
for i in range(kill_at):
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    tracker.step()
if how == "close":
    tracker.close()
    sys.exit(0)
if how != "inside":
    os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
print("not reached", flush=True)
"""


def _run(tmp_path, mode: str, how: str, steps: int) -> tuple[subprocess.CompletedProcess, list]:
    script, out = tmp_path / "train.py", tmp_path / f"{mode}-{how}.jsonl"
    script.write_text(SCRIPT)
    done = run_script(script, str(out), mode, how, str(steps), timeout=300)
    assert "not reached" not in done.stdout and out.exists(), done.stderr
    return done, [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["background", "deferred"])
@pytest.mark.parametrize(
    "how, returncode", [("sigterm", -signal.SIGTERM), ("user-handler", 3), ("inside", None)]
)
def test_sigterm_delivers_every_completed_step_as_a_normal_close(tmp_path, mode, how, returncode):
    steps = 12
    closed, reference = _run(tmp_path, mode, "close", steps)
    assert closed.returncode == 0, closed.stderr
    assert [r["step"] for r in reference] == list(range(steps))
    done, rows = _run(tmp_path, mode, how, steps)
    # before: the step on its way was lost (11 of 12 rows in background, fewer deferred)
    assert rows == reference, done.stderr  # same steps, same keys, same values
    # the previous handler still ends the process: the default action, or the user's handler
    # (called after the flush: it sees every row)
    assert done.returncode == (-signal.SIGTERM if returncode is None else returncode), done.stderr
    if how == "user-handler":
        assert f"user handler saw {steps} rows" in done.stdout


def test_close_removes_the_handler_and_a_synchronous_tracker_installs_none():
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = nnstat.Tracker(model, opt, stats=["l2"], background=False)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    sync.step()
    assert {s: signal.getsignal(s) for s in before} == before  # nothing on its way: no handler
    tracker = nnstat.Tracker(model, opt, stats=["l2"], background=True)
    try:
        opt.step()
        tracker.step()  # on its way to the sinks: the flush on a signal is installed
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
    finally:
        tracker.close()
        sync.close()
    assert {s: signal.getsignal(s) for s in before} == before
