"""JsonlLogger: the file it writes, read back by plain ``json`` and by `read_jsonl`."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from nnstat.integrations import JsonlLogger
from nnstat.integrations.jsonl import METRICS_FILE, read_jsonl

import nnstat
from nnstat.describe import Histogram


def _lines(run_dir):
    return [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines()]


def test_round_trip_scalars_tensors_nonfinite(tmp_path):
    with JsonlLogger(tmp_path / "run") as log:
        log.log({"loss": 2.5, "n": np.int64(3), "t": torch.tensor(0.25), "ok": True}, step=0)
        log.log({"loss": float("nan"), "g": float("inf"), "h": -math.inf}, step=7)
    raw = _lines(tmp_path / "run")
    # independent of read_jsonl: the header, then one plain JSON object per log() call
    assert raw[0]["nnstat_jsonl"] == 1
    assert raw[1]["step"] == 0 and raw[1]["metrics"] == {"loss": 2.5, "n": 3, "t": 0.25, "ok": 1}
    assert raw[2]["metrics"] == {"loss": "NaN", "g": "Infinity", "h": "-Infinity"}
    rows, problems = read_jsonl(tmp_path / "run")
    assert problems == []
    assert [r["step"] for r in rows] == [0, 7]
    assert rows[0]["metrics"]["t"] == 0.25
    m = rows[1]["metrics"]
    assert math.isnan(m["loss"]) and m["g"] == math.inf and m["h"] == -math.inf


def test_tracker_histograms_compact_form(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logger = JsonlLogger(tmp_path)
    seen = []
    tracker = nnstat.Tracker(
        model, opt, sinks=[logger, lambda m, s: seen.append(dict(m))], histograms=True
    )
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    tracker.step()
    tracker.close()
    logger.close()
    rows, problems = read_jsonl(tmp_path)
    assert problems == [] and len(rows) == 1 and len(seen) == 1
    hists = {k: v for k, v in seen[0].items() if isinstance(v, Histogram)}
    assert hists, "the Tracker logged no histogram"
    for key, h in hists.items():
        got = rows[0]["metrics"][key]
        np.testing.assert_allclose(got["counts"], h.counts)
        np.testing.assert_allclose(got["edges"], h.edges)
        assert got["num"] == pytest.approx(h.num) and got["max"] == pytest.approx(h.max)
    for key, v in seen[0].items():
        if not isinstance(v, Histogram):
            assert rows[0]["metrics"][key] == pytest.approx(float(v), nan_ok=True)


def test_truncated_last_line_is_skipped_and_reported(tmp_path):
    with JsonlLogger(tmp_path) as log:
        for step in range(3):
            log.log({"loss": 1.0 / (step + 1)}, step=step)
    path = tmp_path / METRICS_FILE
    data = path.read_bytes()
    path.write_bytes(data[:-9])  # a kill in the middle of the last write
    rows, problems = read_jsonl(tmp_path)
    assert [r["step"] for r in rows] == [0, 1]
    assert len(problems) == 1 and "truncated last line" in problems[0]
    # a resumed run appends on a fresh line; the broken line is reported, later rows are kept
    with JsonlLogger(tmp_path) as log:
        log.log({"loss": 0.1}, step=3)
    rows, problems = read_jsonl(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 3]
    assert len(problems) == 1 and "not valid JSON" in problems[0]


def test_bad_input_errors(tmp_path):
    log = JsonlLogger(tmp_path)
    with pytest.raises(TypeError, match="'name'.*str"):
        log.log({"name": "text"}, step=0)
    with pytest.raises(TypeError, match="step must be an int"):
        log.log({"loss": 1.0}, step=1.5)
    with pytest.raises(TypeError, match="one-element"):
        log.log({"v": torch.zeros(3)}, step=0)
    log.close()
    log.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        log.log({"loss": 1.0}, step=0)
    with pytest.raises(FileNotFoundError, match="not a JsonlLogger run"):
        read_jsonl(tmp_path / "nothing")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / METRICS_FILE).write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="not an nnstat JSONL run"):
        read_jsonl(tmp_path / "other")


def _hist(**change):
    h = {"edges": [0.0, 1.0, 2.0], "counts": [1.0, 2.0], "min": 0.0, "max": 2.0, "num": 3.0}
    h.update(sum=3.0, sum_squares=5.0)
    h.update(change)
    return {k: v for k, v in h.items() if v is not None}


# what both readers (read_jsonl and the viewer's) refuse
BAD_RECORDS = [
    (_hist(edges=[0.0, 2.0, 1.0]), "edges decrease"),
    (_hist(edges=[0.0, "NaN", 2.0]), "edge 1 is nan"),
    (_hist(counts=[1.0, "NaN"], num=1.0), "count 1 is nan"),
    (_hist(counts=["Infinity", 2.0]), "count 0 is inf"),
    (_hist(counts=[1.0, 5.0]), "counts total 6, but its num is 3"),
    (_hist(min=3.0, max=2.0), "min 3.0 is above its max 2.0"),
    (_hist(counts=[4.0, -1.0]), "negative count"),
]


@pytest.mark.parametrize(
    "bad, message",
    [
        (_hist(edges=[1.0], counts=[1.0, 2.0]), "2 counts but 1 edges"),
        (_hist(edges=[0.0, 1.0, 2.0, 3.0]), "2 counts but 4 edges"),
        (_hist(counts=[]), "non-empty lists"),
        (_hist(counts=[1.0, -2.0]), "negative count"),
        (_hist(num=None), "must hold edges, counts"),
        (_hist(extra=1.0), "must hold edges, counts"),
        (_hist(edges="0 1 2"), "non-empty lists"),
        (_hist(counts=[1.0, "x"]), "unexpected string"),
    ]
    + BAD_RECORDS,
)
def test_histogram_records_whose_parts_disagree_are_skipped_and_named(tmp_path, bad, message):
    with JsonlLogger(tmp_path) as log:
        log.log({"loss": 1.0}, step=0)
    path = tmp_path / METRICS_FILE
    with open(path, "a") as f:
        f.write(json.dumps({"step": 1, "time": 0.0, "metrics": {"w/hist": {"hist": bad}}}) + "\n")
        f.write(json.dumps({"step": 2, "time": 0.0, "metrics": {"w/hist": {"hist": _hist()}}}))
        f.write("\n")
    rows, problems = read_jsonl(tmp_path)
    assert [r["step"] for r in rows] == [0, 2]  # the good record after it is kept
    assert rows[1]["metrics"]["w/hist"]["counts"] == [1.0, 2.0]
    assert len(problems) == 1 and f"{METRICS_FILE}:3" in problems[0] and message in problems[0]


@pytest.mark.parametrize("bad, message", BAD_RECORDS)
def test_the_viewer_refuses_what_read_jsonl_refuses(tmp_path, bad, message):
    from nnstat.viewer.runs import load_run

    with JsonlLogger(tmp_path / "run") as log:
        log.log({"loss": 1.0}, step=0)
    with open(tmp_path / "run" / METRICS_FILE, "a") as f:
        f.write(json.dumps({"step": 1, "time": 0.0, "metrics": {"w/hist": {"hist": bad}}}) + "\n")
    reported = []
    run = load_run(tmp_path, tmp_path / "run", lambda path, why: reported.append(why))
    assert run is not None and not run["hists"]  # before: drawn (negative counts included)
    assert len(reported) == 1 and message in reported[0]
    _, problems = read_jsonl(tmp_path / "run")
    assert len(problems) == 1 and message in problems[0]


def test_complex_scalars_are_refused_naming_the_key_and_real_scalars_keep_their_value(tmp_path):
    with JsonlLogger(tmp_path) as log:
        for value in (torch.tensor(1 + 2j), np.complex64(1 + 2j), 3j):
            with pytest.raises(TypeError, match="cannot log 'z' of type complex"):
                log.log({"z": value}, step=0)
        log.log({"t": torch.tensor([0.25]), "n": np.float32(1.5), "b": torch.tensor(True)}, step=1)
    rows, problems = read_jsonl(tmp_path)
    assert problems == [] and [r["step"] for r in rows] == [1]
    assert rows[0]["metrics"] == {"t": 0.25, "n": 1.5, "b": 1}
