"""SIGTERM (a scheduler stopping the job), SIGINT or SIGHUP without finalize() commits the open
shard like a normal exit, then the signal goes on to the handler installed before; a signal inside
a block or inside finalize() is held until it ends; a graceful user handler keeps every row."""

import signal

import pytest
import torch
from _child import run_script

import nnstat

SCRIPT = r"""
import os, signal, sys, time, torch
import nnstat

root, how = sys.argv[1], sys.argv[2]
if how == "user-handler":
    def mine(signum, frame):  # the user's handler: called after nnstat committed the rows
        n = len(nnstat.GradientStore(os.path.join(root, "p")))
        print(f"user handler saw {n} rows", flush=True)
        sys.exit(3)
    signal.signal(signal.SIGTERM, mine)
torch.manual_seed(0)
model = torch.nn.Linear(5, 3)
run = nnstat.init(project="p", root_dir=root)
nnstat.setup({"statistic": "none", "rank": 2, "shard_rows": 8})
nnstat.watch(model)
for lo in range(0, 20, 4):
    with run(data_id=list(range(lo, lo + 4))):
        model(torch.randn(4, 5)).square().sum().backward()
os.kill(os.getpid(), signal.SIGINT if how == "sigint" else signal.SIGTERM)
time.sleep(30)
print("not reached", flush=True)
"""


@pytest.mark.parametrize(
    "how, returncode",
    [("sigterm", -signal.SIGTERM), ("user-handler", 3), ("sigint", None)],
)
def test_a_signal_without_finalize_keeps_every_row(tmp_path, how, returncode):
    script = tmp_path / "log.py"
    script.write_text(SCRIPT)
    done = run_script(script, str(tmp_path), how)
    assert "not reached" not in done.stdout, done.stderr
    if returncode is not None:
        assert done.returncode == returncode, done.stderr
    else:  # Python's SIGINT handler: KeyboardInterrupt
        assert "KeyboardInterrupt" in done.stderr and done.returncode != 0
    if how == "user-handler":
        assert "user handler saw 20 rows" in done.stdout
    assert "flushed at a signal" in done.stderr
    store = nnstat.GradientStore(tmp_path / "p")
    assert sorted(store.ids) == list(range(20))  # before: 16 (the open shard of 4 was lost)
    assert store.rows(0, 20).shape == (20, store.row_width)


def test_handlers_are_restored_when_the_pass_ends(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    model = torch.nn.Linear(5, 3)
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "rank": 2})
    nnstat.watch(model)
    try:
        with run(data_id=[0, 1]):
            model(torch.randn(2, 5)).sum().backward()
        assert signal.getsignal(signal.SIGTERM) != before[signal.SIGTERM]
        nnstat.finalize()
    finally:
        nnstat.unwatch()
    assert {s: signal.getsignal(s) for s in before} == before


GRACEFUL = r"""
import os, signal, sys, warnings, torch
import nnstat

root, where = sys.argv[1], sys.argv[2]
stop = []
signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))  # finish the step
torch.manual_seed(0)
model = torch.nn.Linear(5, 3)
run = nnstat.init(project="p", root_dir=root)
nnstat.setup({"statistic": "none", "rank": 2, "shard_rows": 8})
nnstat.watch(model)
for step, lo in enumerate(range(0, 40, 4)):
    with run(data_id=list(range(lo, lo + 4))):
        model(torch.randn(4, 5)).square().sum().backward()
        if step == 2 and where == "inside":
            os.kill(os.getpid(), signal.SIGTERM)
    if step == 2 and where == "between":
        os.kill(os.getpid(), signal.SIGTERM)
    if stop and step >= (4 if where == "keeps-logging" else 2):
        break
    if step == 1 and where == "keeps-logging":
        os.kill(os.getpid(), signal.SIGTERM)
with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)  # "nothing was logged" would fail here
    try:
        nnstat.finalize()
    except UserWarning as w:
        print("warned:", w, flush=True)
print("stopped after", len(stop), "signal(s)", flush=True)
"""


@pytest.mark.parametrize("where, rows", [("inside", 12), ("between", 12), ("keeps-logging", 20)])
def test_a_graceful_user_handler_finishes_the_step_and_keeps_every_row(tmp_path, where, rows):
    script = tmp_path / "log.py"
    script.write_text(GRACEFUL)
    done = run_script(script, str(tmp_path), where)
    # before: an AssertionError in the block after the flush, and the open shard lost
    assert done.returncode == 0, done.stderr
    assert "stopped after 1 signal(s)" in done.stdout
    assert "warned" not in done.stdout
    store = nnstat.GradientStore(tmp_path / "p")
    assert sorted(store.ids) == list(range(rows))
    assert store.rows(0, rows).shape == (rows, store.row_width)


FINALIZE = r"""
import os, signal, sys, torch
import nnstat
from nnstat.store import writer

root = sys.argv[1]
close = writer.StoreWriter.close


def close_after_a_signal(self, progress=False):  # the scheduler's SIGTERM lands mid-flush
    os.kill(os.getpid(), signal.SIGTERM)
    return close(self, progress)


writer.StoreWriter.close = close_after_a_signal
torch.manual_seed(0)
model = torch.nn.Linear(5, 3)
run = nnstat.init(project="p", root_dir=root)
nnstat.setup({"statistic": "none", "rank": 2, "shard_rows": 8})
nnstat.watch(model)
for lo in range(0, 20, 4):
    with run(data_id=list(range(lo, lo + 4))):
        model(torch.randn(4, 5)).square().sum().backward()
nnstat.finalize()
print("not reached", flush=True)
"""


def test_sigterm_during_finalize_keeps_the_open_shard(tmp_path):
    script = tmp_path / "log.py"
    script.write_text(FINALIZE)
    done = run_script(script, str(tmp_path))
    assert "not reached" not in done.stdout
    assert done.returncode == -signal.SIGTERM, done.stderr  # still ends killed by SIGTERM
    store = nnstat.GradientStore(tmp_path / "p")
    assert sorted(store.ids) == list(range(20))  # before: 16 (the open shard of 4 was lost)


def test_sighup_without_finalize_keeps_every_row(tmp_path):
    script = tmp_path / "log.py"
    script.write_text(SCRIPT.replace("else signal.SIGTERM)", "else signal.SIGHUP)"))
    assert "else signal.SIGHUP)" in script.read_text()
    done = run_script(script, str(tmp_path), "sighup")
    assert done.returncode == -signal.SIGHUP, done.stderr
    assert "flushed at a signal" in done.stderr
    store = nnstat.GradientStore(tmp_path / "p")
    assert sorted(store.ids) == list(range(20))  # before: 16
