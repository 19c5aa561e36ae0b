"""Anomaly rules: forced recording, first non-finite offender, correlations against numpy."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest
import torch

from nnstat.recorder import (
    NonFiniteError,
    Recorder,
    Rule,
    abs_max_above,
    correlate,
    grad_norm_below,
    nonfinite,
    norm_ratio_above,
    phi_table,
    read_step_meta,
)


def chain_step(rec: Recorder, step: int, w: torch.nn.Parameter, x: torch.Tensor, poison: str = ""):
    """x -> a = x*w -> b = log(a) (NaN for negative a) -> c = sqrt(b^2) -> loss."""
    rec.start_batch(step)
    rec.register_tensor("x", x, role="input")
    a = rec.register_tensor("a", x * w)
    b = rec.register_tensor("b", torch.log(a) if poison == "forward" else a * 1.0)
    if poison == "backward":
        c = rec.register_tensor("c", torch.sqrt(b - b.min()))  # sqrt'(0) = inf
    else:
        c = rec.register_tensor("c", b * 2.0)
    loss = rec.register_tensor("loss", c.sum(), role="loss")
    w.grad = None
    loss.backward()
    return rec.finish_batch()


def test_nonfinite_forces_recording_and_names_first_forward_offender(tmp_path, caplog) -> None:
    w = torch.nn.Parameter(torch.ones(4))
    rec = Recorder(tmp_path, every=100, rules=[nonfinite()])
    rec.track_module(torch.nn.ParameterDict({"w": w}))
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, -1.0, 2.0, 0.5]])
    assert chain_step(rec, 0, w, x)["reason"] == "schedule"
    assert chain_step(rec, 1, w, x) is None  # clean and not scheduled: nothing written
    with caplog.at_level(logging.WARNING, logger="nnstat.recorder"):
        record = chain_step(rec, 2, w, x, poison="forward")
    assert record["reason"] == "anomaly"
    # b = log(a) turns NaN first; c and loss (downstream) are not named
    assert record["first_offender"] == {"tensor": "b", "iteration": 0, "stream": "forward"}
    assert "first offender: b (forward" in caplog.text
    fired = {a["indicator"] for a in record["anomalies"]}
    assert {"nonfinite @ b", "nonfinite @ c", "nonfinite @ loss"} <= fired
    assert "nonfinite @ a" not in fired and record["indicators"]["nonfinite @ a"] == 0
    assert [m["step"] for m in read_step_meta(rec.path)] == [0, 2]


def test_backward_offender_and_raise_after_writing(tmp_path) -> None:
    w = torch.nn.Parameter(torch.ones(3))
    rec = Recorder(tmp_path, every=None, rules=[nonfinite()], on_nonfinite="raise")
    rec.track_module(torch.nn.ParameterDict({"w": w}))
    x = torch.tensor([[1.0, 2.0, 3.0]])
    with pytest.raises(NonFiniteError, match="first offender: b \\(gradient"):
        chain_step(rec, 7, w, x, poison="backward")
    meta = read_step_meta(rec.path)
    assert [m["step"] for m in meta] == [7]  # the record exists before the error is raised
    # forward is finite; the gradient of b (input of sqrt at 0) is the first non-finite one,
    # c's gradient is finite (ones), w's gradient comes after a's
    assert meta[0]["first_offender"]["stream"] == "gradient"
    offenders = {a["indicator"] for a in meta[0]["anomalies"]}
    assert "nonfinite @ c.grad" not in offenders
    assert {"nonfinite @ b.grad", "nonfinite @ a.grad", "nonfinite @ w.grad"} <= offenders


def test_threshold_rules_vanishing_and_exploding(tmp_path) -> None:
    w = torch.nn.Parameter(torch.ones(4))
    rules = [
        abs_max_above(10.0, pattern="^a$"),
        grad_norm_below(1e-6, pattern="^w$"),
        norm_ratio_above(5.0, pattern="^a$", stream="forward"),
    ]
    rec = Recorder(tmp_path, every=None, rules=rules)
    rec.track_module(torch.nn.ParameterDict({"w": w}))
    x = torch.ones(2, 4)
    records = []
    for step, scale in enumerate([1.0, 2.0, 40.0, 41.0]):
        with torch.no_grad():
            w.fill_(scale)
        records.append(chain_step(rec, step, w, x))
    assert records[0] is None and records[1] is None
    hits = {a["indicator"] for a in records[2]["anomalies"]}
    assert hits == {"abs_max>10 @ a", "norm_ratio>5 @ a"}  # 40/2 = 20-fold jump
    assert {a["indicator"] for a in records[3]["anomalies"]} == {"abs_max>10 @ a"}
    value = [a["value"] for a in records[2]["anomalies"] if a["rule"] == "abs_max>10"][0]
    assert value == pytest.approx(40.0)
    # vanishing: a zero input kills the gradient of w
    rec.start_batch(4)
    w.grad = None
    a = rec.register_tensor("a", torch.zeros(2, 4) * w)
    a.sum().backward()
    rec4 = rec.finish_batch()
    assert {h["indicator"] for h in rec4["anomalies"]} == {"norm<1e-06 @ w.grad"}
    with pytest.raises(ValueError, match="valid kinds"):
        Rule("explodes", 1.0)
    with pytest.raises(TypeError, match="Rule objects"):
        Recorder(tmp_path, group="other", rules=["nonfinite"])


def test_phi_table_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    a = rng.random(200) < 0.3
    b = np.where(rng.random(200) < 0.8, a, rng.random(200) < 0.5)
    c = rng.random(200) < 0.4
    df = pd.DataFrame({"a": a, "b": b, "c": c}).astype(int)
    table = phi_table(df)
    assert len(table) == 6
    for _, row in table.iterrows():
        xa, xb = df[row["a"]].to_numpy(), df[row["b"]].to_numpy()
        assert row["phi"] == pytest.approx(np.corrcoef(xa, xb)[0, 1])
        assert row["count"] == int((xa & xb).sum())
        assert row["p_b_given_a"] == pytest.approx((xa & xb).sum() / xa.sum())
    assert list(table["phi"]) == sorted(table["phi"], reverse=True)
    assert set(table.iloc[0][["a", "b"]]) == {"a", "b"}


def test_correlate_reads_recorded_indicators(tmp_path) -> None:
    """High loss co-occurs with a small hidden tensor (comgra's wish-list example)."""
    torch.manual_seed(0)
    rules = [abs_max_above(3.0, pattern="^loss$"), Rule("norm_below", 0.5, "^h$", "forward")]
    rec = Recorder(tmp_path, every=1, rules=rules, sample_k=0)
    small = [s % 3 == 0 for s in range(12)]
    for step in range(12):
        rec.start_batch(step)
        h = rec.register_tensor("h", torch.full((2, 2), 0.1 if small[step] else 1.0))
        rec.register_tensor("loss", (1.0 / h).mean() + (step % 4 == 1) * 20.0, role="loss")
        rec.finish_batch()
    df = correlate(tmp_path)
    top = df.iloc[0]
    assert {top["a"], top["b"]} == {"abs_max>3 @ loss", "norm<0.5 @ h"}
    high = np.array([small[s] or s % 4 == 1 for s in range(12)], dtype=int)
    low = np.array(small, dtype=int)
    ab = df[(df["a"] == "norm<0.5 @ h") & (df["b"] == "abs_max>3 @ loss")].iloc[0]
    assert ab["phi"] == pytest.approx(np.corrcoef(low, high)[0, 1])
    assert ab["p_b_given_a"] == pytest.approx(1.0) and ab["count"] == low.sum()
    with pytest.raises(ValueError, match="no recorded steps"):
        correlate(tmp_path / "default" / "baseline" / "graphs")


def test_rules_that_match_no_tensor_leave_recording_intact(tmp_path) -> None:
    rec = Recorder(tmp_path, every=2, rules=[nonfinite(pattern="^nothing$")])
    for step in range(3):
        rec.start_batch(step)
        rec.register_tensor("h", torch.full((2,), float(step)))
        record = rec.finish_batch()
        assert (record is not None) == (step % 2 == 0)
    assert record["indicators"] == {} and record["anomalies"] == []
