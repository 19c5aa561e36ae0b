"""Recorder files after a script that stops early, and damaged files read back."""

from __future__ import annotations

import gc
import json
import signal

import numpy as np
import pytest
import torch
from _child import run_script

from nnstat.recorder import Recorder, read_step_meta, read_step_stats
from nnstat.recorder.storage import read_kpis

SCRIPT = r"""
import json, os, signal, sys, time, torch, nnstat
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
rec = nnstat.Recorder(sys.argv[1], group="g", trial="t", every=1000, overwrite=True)
rec.track_module(model)
for step in range(50):
    rec.start_batch(step)
    loss = rec.register_tensor("loss", model(torch.randn(3, 4)).pow(2).mean(), role="loss")
    loss.backward()
    rec.record_kpi("loss", loss.detach())
    rec.finish_batch()
    print(json.dumps([step, float(loss.detach())]), flush=True)
    if step == 40:  # the script ends without rec.close()
        if sys.argv[2] == "raise":
            raise KeyboardInterrupt
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        time.sleep(30)
        print("not reached", flush=True)
"""


def _steps(rec: Recorder, n: int) -> list[float]:
    model = torch.nn.Linear(4, 2)
    rec.track_module(model)
    losses = []
    for step in range(n):
        rec.start_batch(step)
        loss = rec.register_tensor("loss", model(torch.randn(3, 4)).pow(2).mean(), role="loss")
        loss.backward()
        rec.record_kpi("loss", loss.detach())
        rec.finish_batch()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(
    "how, returncode",
    [("raise", None), ("SIGTERM", -signal.SIGTERM), ("SIGHUP", -signal.SIGHUP), ("SIGINT", None)],
)
def test_kpis_of_a_script_stopped_early_are_written(tmp_path, how, returncode) -> None:
    script = tmp_path / "rec.py"
    script.write_text(SCRIPT)
    proc = run_script(script, str(tmp_path), how)
    assert "not reached" not in proc.stdout
    if returncode is None:  # Python's KeyboardInterrupt (raised, or SIGINT's handler) ends it
        assert "KeyboardInterrupt" in proc.stderr and proc.returncode != 0, proc.stderr
    else:  # killed by the signal, as without nnstat, after the KPIs were written
        assert proc.returncode == returncode, proc.stderr
    printed = [json.loads(line) for line in proc.stdout.splitlines()]
    kpis = read_kpis(tmp_path / "g" / "t")
    # every step's KPI, not only those flushed by a recorded step (step 0)
    assert [r["step"] for r in kpis] == [s for s, _ in printed] == list(range(41))
    assert [r["kpis"]["loss"] for r in kpis] == pytest.approx([v for _, v in printed])


def test_close_puts_the_signal_handlers_back(tmp_path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    rec = Recorder(tmp_path, every=1000)
    assert signal.getsignal(signal.SIGTERM) != before
    rec.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_kpis_of_a_recorder_dropped_without_close_are_written(tmp_path) -> None:
    torch.manual_seed(0)
    rec = Recorder(tmp_path, every=1000)
    path = rec.path
    losses = _steps(rec, 7)
    del rec
    gc.collect()
    kpis = read_kpis(path)
    assert [r["step"] for r in kpis] == list(range(7))
    assert [r["kpis"]["loss"] for r in kpis] == pytest.approx(losses)


def test_close_writes_the_kpis_once(tmp_path) -> None:
    rec = Recorder(tmp_path, every=1000)
    _steps(rec, 5)
    rec.close()
    rec.close()
    path = rec.path
    del rec
    gc.collect()
    assert [r["step"] for r in read_kpis(path)] == list(range(5))


def test_a_damaged_kpi_line_is_refused_naming_it_not_skipped(tmp_path) -> None:
    rec = Recorder(tmp_path, every=1000)
    _steps(rec, 4)
    rec.close()
    path = rec.path / "kpis.jsonl"
    lines = path.read_bytes().split(b"\n")
    lines[1] = lines[1][:5] + b"\xff" + lines[1][6:]  # a flipped byte in the second record
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match=r"kpis\.jsonl: line 2 is not JSON.*repair or delete"):
        read_kpis(rec.path)
    lines[1] = b'{"type":"train","st'  # cut short, then more records appended after it
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(ValueError, match="line 2"):
        read_kpis(rec.path)
    path.write_bytes(b"\n".join(lines[:1] + lines[2:]) + b'{"type":"tr')  # a line being written
    assert [r["step"] for r in read_kpis(rec.path)] == [0, 2, 3]


def test_a_cut_short_step_file_is_refused_naming_it(tmp_path) -> None:
    rec = Recorder(tmp_path, every=1)
    _steps(rec, 2)
    rec.close()
    stem = f"{read_step_meta(rec.path)[1]['type_of_execution']}-{1:09d}"
    npy = rec.path / "steps" / f"{stem}.npy"
    assert read_step_stats(rec.path, stem).shape == np.load(npy).shape
    npy.write_bytes(npy.read_bytes()[:-8])
    with pytest.raises(ValueError, match=f"{stem}.npy"):
        read_step_stats(rec.path, stem)
