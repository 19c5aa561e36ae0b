"""Crash safety: a logging process SIGKILLed mid-pass leaves whole shards; resuming completes it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import nnstat

SCRIPT = r"""
import sys, time, torch
from torch import nn
import nnstat

root, project, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
g = torch.Generator().manual_seed(1)
x, y = torch.randn(300, 6, generator=g), torch.randint(0, 3, (300,), generator=g)
run = nnstat.init(project=project, root_dir=root)
nnstat.setup({"statistic": "none", "shard_rows": 10})
nnstat.watch(model)
nnstat.add_projection(rank=4, seed=3)
for lo in range(0, 300, 10):
    with run(data_id=[f"id{i}" for i in range(lo, lo + 10)]):
        nn.functional.cross_entropy(model(x[lo:lo+10]), y[lo:lo+10], reduction="sum").backward()
    print(lo, flush=True)
    time.sleep(delay)
nnstat.finalize()
print("done", flush=True)
"""


def _launch(tmp_path, project, delay):
    script = tmp_path / "log.py"
    script.write_text(SCRIPT)
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), project, str(delay)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_sigkill_mid_pass_then_resume(tmp_path):
    proc = _launch(tmp_path, "crash", 0.03)
    shards = Path(tmp_path) / "crash" / "shards"
    deadline = time.time() + 120
    while time.time() < deadline and len(list(shards.glob("*.npy"))) < 6:
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL

    store = nnstat.GradientStore(tmp_path / "crash")
    n = len(store)
    assert 60 <= n < 300, n  # killed mid-pass, with whole shards only
    assert n % 10 == 0
    for npy in store.shards:  # every counted shard is whole and matches its ids file
        ids = json.loads(npy.with_name(npy.name[: -len(".npy")] + ".ids.json").read_text())
        assert np.load(npy, mmap_mode="r").shape == (len(ids), store.row_width)
    assert len(set(store.ids)) == n

    proc = _launch(tmp_path, "crash", 0.0)  # the same script again: resumes
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    store = nnstat.GradientStore(tmp_path / "crash")
    assert sorted(store.ids) == sorted(f"id{i}" for i in range(300))  # every id exactly once
    assert not list(store.path.glob("shards/*.tmp"))

    proc = _launch(tmp_path, "reference", 0.0)  # an uninterrupted pass: same rows per id
    proc.communicate(timeout=300)
    ref = nnstat.GradientStore(tmp_path / "reference")
    ref_rows = dict(zip(ref.ids, ref.rows(0, len(ref)), strict=True))
    got = store.rows(0, len(store))
    for i, rid in enumerate(store.ids):
        torch.testing.assert_close(got[i], ref_rows[rid])
