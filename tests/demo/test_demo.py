"""The demo's pieces that need no full run: arguments, planted labels, clean re-runs (the run
folder is replaced, so TensorBoard and W&B hold one run), the batch-size advice.

The end-to-end run (console, report, self-influence recall) is in tests/demo/test_demo_report.py.
Every demo run here is the quick configuration (NNSTAT_DEMO_QUICK: 400 digits) shortened to
one epoch and to the steps that write logs."""

from __future__ import annotations

import importlib.util
import json
import math

import numpy as np
import pytest
import torch

from nnstat.demo import main
from nnstat.demo.train import (
    MARKER,
    DemoConfig,
    build,
    load_digits_data,
    plant_mislabels,
    prepare_log_dir,
    report,
    run,
    train,
)
from nnstat.demo.write import (
    B_SIMPLE_OVER_CRIT_EARLY,
    B_SIMPLE_OVER_CRIT_LATE,
    batch_advice,
    noise_stages,
)


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--epochs", "0"])


def test_plant_mislabels_changes_exactly_the_chosen_labels():
    labels = torch.randint(0, 10, (1000,), generator=torch.Generator().manual_seed(3))
    noisy, where = plant_mislabels(labels, 0.025, seed=7)
    assert len(where) == 25 and len(set(where)) == 25
    changed = (noisy != labels).nonzero().flatten().tolist()
    assert changed == sorted(where)  # every planted label differs, no other one does
    assert bool(((noisy >= 0) & (noisy < 10)).all())
    again, where_again = plant_mislabels(labels, 0.025, seed=7)
    assert where_again == where and torch.equal(again, noisy)  # fixed seed: same plant
    assert plant_mislabels(labels, 0.025, seed=8)[1] != where


def _short_run(log_dir, monkeypatch) -> None:
    """Only the steps that write TensorBoard, W&B and JSON lines, one epoch of quick data."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = DemoConfig(epochs=1, log_dir=log_dir, quick=True)
    run(cfg, steps=[prepare_log_dir, load_digits_data, build, train, report])


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="wandb is not installed (nnstat[wandb])"
)  # the demo logs to W&B only where wandb is installed; this test counts its run
def test_rerun_replaces_the_run_folder(tmp_path, monkeypatch, capsys):
    log_dir = tmp_path / "logs"
    threads = torch.get_num_threads()
    _short_run(log_dir, monkeypatch)
    assert torch.get_num_threads() == threads  # the demo's one thread is its own
    first = sorted(p.name for p in (log_dir / "tensorboard").iterdir())
    _short_run(log_dir, monkeypatch)
    # one event file, one W&B run, one JSON-lines header: TensorBoard would otherwise draw
    # every curve twice, and the viewer would read two runs as one
    events = sorted(p.name for p in (log_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events != first
    assert len(list((log_dir / "wandb").glob("offline-run-*"))) == 1
    lines = (log_dir / "metrics" / "metrics.jsonl").read_text().splitlines()
    headers = [line for line in lines if "nnstat_jsonl" in json.loads(line)]
    assert len(headers) == 1 and len(lines) > 1
    assert (log_dir / MARKER).exists()


def test_rerun_keeps_foreign_files_and_refuses_foreign_folders(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / MARKER).touch()
    (mine / "report.html").write_text("old")
    (mine / "notes.txt").write_text("keep me")
    state = type("S", (), {"config": DemoConfig(log_dir=mine)})()
    prepare_log_dir(state)
    assert not (mine / "report.html").exists() and (mine / "notes.txt").read_text() == "keep me"
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "thesis.tex").write_text("precious")
    (theirs / "wandb").mkdir()
    with pytest.raises(SystemExit, match="thesis.tex"):
        prepare_log_dir(type("S", (), {"config": DemoConfig(log_dir=theirs)})())
    assert (theirs / "thesis.tex").read_text() == "precious" and (theirs / "wandb").is_dir()


def _history(values: list[float], lows: list[float], highs: list[float]) -> list[dict]:
    return [
        {
            "step": 10 * i,
            "noise_scale/b_simple": v,
            "noise_scale/low": lo,
            "noise_scale/high": hi,
            "train/loss": 2.0 / (i + 1),
        }
        for i, (v, lo, hi) in enumerate(zip(values, lows, highs, strict=True))
    ]


def test_noise_stages_split_training_in_thirds():
    values = [50.0, 60.0, 55.0, 200.0, 300.0, 250.0, 900.0, 1200.0, 1000.0]
    lows = [v * 0.8 for v in values]
    highs = [v * 1.3 for v in values]
    stages = noise_stages(_history(values, lows, highs))
    assert [s.name for s in stages] == ["early", "middle", "late"]
    # steps 0..80: thirds end at 26.7 and 53.3
    assert [s.values for s in stages] == [tuple(values[:3]), tuple(values[3:6]), tuple(values[6:])]
    late = stages[-1]
    assert late.median == float(np.median(values[6:]))
    assert (late.low, late.high) == (min(lows[6:]), max(highs[6:]))
    assert late.train_loss == pytest.approx(np.mean([2.0 / 7, 2.0 / 8, 2.0 / 9]))


def test_batch_advice_follows_the_late_estimates_and_states_their_spread():
    values = [50.0, 60.0, 55.0, 200.0, 300.0, 250.0, 4400.0, 4800.0, 4000.0]
    stages = noise_stages(_history(values, [v * 0.8 for v in values], [v * 1.3 for v in values]))
    summary, text = batch_advice(stages, batch=64, n_train=10000)
    # the power of two below the lowest late bootstrap bound (0.8 x 4000 = 3200) divided by the
    # largest over-estimate of the critical batch size measured (13.8): 232 -> 128
    assert B_SIMPLE_OVER_CRIT_LATE[1] == 13.8
    assert "64 early, 128 late" in summary and "below 232" in text
    assert "4000–4800" in text and f"factor {4800 / 4000:.1f}" in text
    # early median 55 implies a critical batch size of 55/3.6-55/2.1 = 15-26, below 64 / 2
    assert "Early on, batch 64 was above it" in text
    summary, text = batch_advice(stages, batch=1024, n_train=10000)
    assert "about right" in summary  # 4000/13.8 = 290 .. 4800/2.8 = 1714 brackets 1024
    inf_stages = noise_stages(
        _history([50.0, 60.0, math.inf], [40.0, 50.0, 800.0], [60.0, 70.0, math.inf])
    )
    summary, text = batch_advice(inf_stages, batch=64, n_train=300)
    assert "only a lower bound" in text and "exceed the 300 training digits" in text
    assert "lost resolution" in text and "not as evidence that full-batch" in text
    # estimates within the training set size make no resolution claim
    assert "lost resolution" not in batch_advice(stages, batch=64, n_train=10000)[1]
    summary, text = batch_advice(stages, batch=64, n_train=1100)
    assert "exceed the 1100 training digits (bootstrap intervals up to 6240)" in text
    assert batch_advice([], 64, 100)[0] == "n/a"


def test_batch_advice_sentence_is_computed_from_the_estimates():
    """Two different sets of estimates give two different sentences, each with the critical
    batch size its own estimates imply (B_simple divided by the measured over-estimates)."""
    texts = []
    for late in ([4000.0, 4400.0, 4800.0], [300.0, 330.0, 360.0]):
        values = [50.0, 60.0, 55.0, 200.0, 300.0, 250.0, *late]
        stages = noise_stages(
            _history(values, [0.8 * v for v in values], [1.3 * v for v in values])
        )
        summary, text = batch_advice(stages, batch=64, n_train=10000)
        lo, hi = min(late), max(late)
        implied = (
            f"{lo / B_SIMPLE_OVER_CRIT_LATE[1]:.0f}–{hi / B_SIMPLE_OVER_CRIT_LATE[0]:.0f} late"
        )
        early = 55.0 / B_SIMPLE_OVER_CRIT_EARLY[1], 55.0 / B_SIMPLE_OVER_CRIT_EARLY[0]
        assert implied in text and f"about {early[0]:.0f}–{early[1]:.0f} early" in text
        assert f"late B_simple {lo:.0f}–{hi:.0f}" in summary
        texts.append(text)
    assert texts[0] != texts[1]


def test_batch_advice_factors_are_the_documented_measurements():
    """The over-estimate factors the advice divides by are the extremes of the
    B_simple / B_crit column of docs/noise-scale.md's table (first target early, last late)."""
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "noise-scale.md").read_text()
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in page.splitlines()
        if line.startswith("| digits ") or line.startswith("| char ")
    ]
    by_task: dict[str, list[float]] = {}
    for row in rows:
        by_task.setdefault(row[0], []).append(float(row[7]))
    assert len(by_task) == 3 and all(len(r) >= 2 for r in by_task.values())
    early = [r[0] for r in by_task.values()]
    late = [r[-1] for r in by_task.values()]
    assert B_SIMPLE_OVER_CRIT_EARLY == (round(min(early), 1), round(max(early), 1))
    assert B_SIMPLE_OVER_CRIT_LATE == (round(min(late), 1), round(max(late), 1))
