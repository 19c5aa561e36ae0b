"""The critical batch size fitted from a batch-size sweep, against the hyperbola it comes from."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest

import nnstat
from nnstat.gradient_noise import critical_batch_size, steps_to_target

SIZES = (4, 8, 16, 32, 64, 128, 256, 512)


def _on_hyperbola(s_min: float, e_min: float, b: float) -> float:
    """Steps at batch ``b`` solved from ``(S/S_min - 1)(B S/E_min - 1) = 1`` directly (the
    positive root of ``B/E_min S^2 - (1 + B S_min/E_min) S = 0``), not from ``S_min + E_min/B``."""
    return s_min * (1 + b * s_min / e_min) / (b * s_min / e_min)


def _two_point(b1: float, s1: float, b2: float, s2: float) -> tuple[float, float]:
    """The hyperbola through two (B, S) points: ``S_min``, ``E_min`` in closed form."""
    e_min = (s1 - s2) * b1 * b2 / (b2 - b1)
    return (b2 * s2 - b1 * s1) / (b2 - b1), e_min


def test_noiseless_points_give_the_closed_form_exactly():
    s_min, e_min = 37.0, 5000.0
    sweep = {b: _on_hyperbola(s_min, e_min, b) for b in (16, 50, 100, 300, 1000)}
    r = critical_batch_size(sweep, n_boot=0)
    ref_s, ref_e = _two_point(16, sweep[16], 1000, sweep[1000])
    assert ref_s == pytest.approx(s_min, rel=1e-12) and ref_e == pytest.approx(e_min, rel=1e-12)
    assert r.s_min == pytest.approx(ref_s, rel=1e-10)
    assert r.e_min == pytest.approx(ref_e, rel=1e-10)
    assert r.b_crit == pytest.approx(e_min / s_min, rel=1e-10)
    assert r.residual < 1e-12
    # every point lies on the fitted hyperbola
    for b, s in sweep.items():
        assert (s / r.s_min - 1) * (b * s / r.e_min - 1) == pytest.approx(1.0, rel=1e-9)
        assert r.predicted_steps(b) == pytest.approx(s, rel=1e-12)


@pytest.mark.parametrize("seeds", [1, 3])
def test_noisy_sweeps_recover_the_truth_within_the_interval(seeds):
    """Coverage of the 95% intervals over many synthetic sweeps (5% multiplicative noise)."""
    rng = np.random.default_rng(seeds)
    s_min, e_min = 120.0, 120.0 * 48
    covered = np.zeros(3)
    trials = 200
    for trial in range(trials):
        sweep = {
            b: list(_on_hyperbola(s_min, e_min, b) * np.exp(0.05 * rng.standard_normal(seeds)))
            for b in SIZES
        }
        r = critical_batch_size(sweep, n_boot=500, seed=trial)
        assert r.method == ("seed bootstrap" if seeds > 1 else "residual bootstrap")
        for i, (iv, truth) in enumerate(
            ((r.s_min_interval, s_min), (r.e_min_interval, e_min), (r.b_crit_interval, 48.0))
        ):
            assert iv[0] < iv[1]
            covered[i] += iv[0] <= truth <= iv[1]
    # nominal 0.95, about 0.90-0.95 reached with so few seeds or points (the binomial sd over
    # 200 trials is 0.016); without the t/z widening it covers about 0.85-0.9
    assert np.all(covered / trials >= 0.86), covered / trials
    # and a single sweep is close, with a narrow interval for this noise level
    lo, hi = r.b_crit_interval
    assert lo < r.b_crit < hi and hi / lo < 2.0


def test_steps_to_target_interpolates_and_reads_logs():
    assert steps_to_target([(0, 2.0), (10, 1.0), (20, 0.5)], 0.75) == 15.0
    assert steps_to_target(np.array([[0, 2.0], [10, 1.0]]), 1.0) == 10.0
    assert steps_to_target([(5, 0.1), (10, 0.05)], 1.0) == 5.0
    assert steps_to_target([(0, 2.0), (10, 1.0)], 0.5) is None
    rows = [{"step": 0, "train/loss": 2.0}, {"step": 5, "test/acc": 0.3},
            {"step": 10, "train/loss": 0.0}]  # fmt: skip
    assert steps_to_target(rows, 0.5) == 7.5
    assert steps_to_target(rows, 0.5, key="test/acc") == 5.0  # its only row
    assert steps_to_target(rows, 0.1, key="test/acc") is None
    # a trailing mean over 2 rows: 2.0, 1.5, 0.5 -> crosses 1.0 between steps 10 and 20
    noisy = [(0, 2.0), (10, 1.0), (20, 0.0)]
    assert steps_to_target(noisy, 1.0, window=2) == pytest.approx(10 + 10 * 0.5 / 1.0)
    pd = pytest.importorskip("pandas")
    frame = pd.DataFrame({"_step": [0, 10], "loss": [1.0, 0.0]})
    assert steps_to_target(frame, 0.5, key="loss", step_key="_step") == 5.0


def test_a_sweep_from_histories_round_trips():
    """Loss histories generated so that the target is reached at a known step per batch size."""
    s_min, e_min = 50.0, 3200.0
    sweep = {}
    for b in (8, 32, 128, 512):
        reach = _on_hyperbola(s_min, e_min, b)
        steps = np.arange(0, 4 * reach, 1.0)
        loss = np.exp(-steps / reach * math.log(4.0))  # 1 at step 0, 0.25 at `reach`
        sweep[b] = steps_to_target(np.stack([steps, loss], 1), 0.25)
    r = nnstat.critical_batch_size(sweep, n_boot=0)
    assert r.b_crit == pytest.approx(64.0, rel=1e-3)


def test_bad_input_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=">= 3 distinct batch sizes"):
        critical_batch_size({8: 100.0, 16: 60.0})
    with pytest.raises(ValueError, match="finite and > 0; batch size 16"):
        critical_batch_size({8: 100.0, 16: 0.0, 32: 40.0})
    with pytest.raises(ValueError, match="finite and > 0"):
        critical_batch_size({8: 100.0, 16: [60.0, -1.0], 32: 40.0})
    with pytest.raises(ValueError, match="never reached the target"):
        critical_batch_size({8: 100.0, 16: None, 32: 40.0})
    with pytest.raises(ValueError, match="ints >= 1"):
        critical_batch_size({0: 100.0, 16: 60.0, 32: 40.0})
    with pytest.raises(TypeError, match="dict"):
        critical_batch_size([(8, 100.0), (16, 60.0), (32, 40.0)])
    # steps that grow with the batch: no hyperbola with positive E_min
    with pytest.raises(ValueError, match="do not fall as the batch grows"):
        critical_batch_size({8: 50.0, 16: 60.0, 32: 80.0})
    # steps that halve per doubling to the end: B_crit above the sweep
    with pytest.raises(ValueError, match="lies above the sweep; add larger"):
        critical_batch_size({8: 800.0, 16: 390.0, 32: 180.0})
    with pytest.raises(ValueError, match="level"):
        critical_batch_size({8: 100.0, 16: 60.0, 32: 40.0}, level=95)
    with pytest.raises(ValueError, match="increase strictly"):
        steps_to_target([(10, 1.0), (5, 0.5)], 0.7)
    with pytest.raises(ValueError, match="holds both"):
        steps_to_target([{"step": 1}], 0.7)
    with pytest.raises(ValueError, match="window"):
        steps_to_target([(0, 1.0)], 0.7, window=0)


def test_benchmark_quick_mode_writes_table_figure_and_results(tmp_path, capsys, monkeypatch):
    """``benchmarks/critical_batch.py --quick``: every task and target gets a row, a fit (or the
    reason there is none) and the noise scale at the same model state."""
    pytest.importorskip("sklearn")
    pytest.importorskip("matplotlib")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "critical_batch.py"
    spec = importlib.util.spec_from_file_location("critical_batch_bench", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts benchmarks/ first
    spec.loader.exec_module(bench)
    img, out = tmp_path / "cb.png", tmp_path / "cb.json"
    bench.main(["--quick", "--img", str(img), "--json", str(out)])
    stdout = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [t["name"] for t in result["tasks"]] == ["digits MLP", "digits CNN", "char LM"]
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| task | target loss | B_crit (95% interval)")
    assert len(rows) == 1 + sum(len(t["targets"]) for t in result["tasks"])
    for task in result["tasks"]:
        assert len(task["fits"]) == len(task["noise"]) == len(task["targets"])
        for fit in task["fits"]:
            if "error" in fit:
                continue
            lo, hi = fit["b_crit_interval"]
            assert lo <= fit["b_crit"] <= hi
            assert fit["b_crit"] == pytest.approx(fit["e_min"] / fit["s_min"])
            # the row carries the fitted value and the measured ratio
            row = next(r for r in rows if r.startswith(f"| {task['name']} | {fit['target']} |"))
            assert f"{fit['b_crit']:.3g}" in row
        for ns in task["noise"]:
            assert ns["b_simple"] > 0 and ns["b_noise"] > 0
    for name in ("digits MLP", "digits CNN"):
        task = next(t for t in result["tasks"] if t["name"] == name)
        assert any("error" not in f for f in task["fits"]), task["fits"]
    assert img.stat().st_size > 10_000
