"""`pair_tables`: the statistics of weights and of their update in one read of both, against
`summarize` of the weights and of the materialised difference (and so against numpy/scipy,
which tests/describe/test_stats.py checks `summarize` with)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nnstat
import nnstat.describe.moments as moments
from nnstat.describe import STAT_NAMES, summarize
from nnstat.describe.summary import pair_tables
from nnstat.tracker import compute


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float) -> None:
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=rtol, atol=1e-12, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("chunk", [64, 1 << 16])
def test_pair_tables_match_summarize_of_weights_and_difference(monkeypatch, dtype, chunk):
    monkeypatch.setattr(moments, "CHUNK", chunk)
    torch.manual_seed(0)
    w = [
        torch.randn(300, 7, dtype=dtype),
        torch.rand(1000, dtype=dtype) * 1e-10,  # Adam's exp_avg_sq scale: denormal rescaling
        torch.cat([torch.rand(64) * 1e-12, torch.randn(3000) * 1e4]).to(dtype),  # overflow redo
        torch.tensor([0.0, 1.0, 0.0, -2.0], dtype=dtype),  # zeros, both signs
        1.0 + 1e-6 * torch.randn(500, dtype=dtype),  # narrow spread around 1
    ]
    p = [t + 0.01 * torch.randn_like(t) * t.abs().max() for t in w]
    p[3] = w[3].clone()  # a zero update
    tw, td = pair_tables(w, p, STAT_NAMES)
    rtol = 1e-6 if dtype == torch.float32 else 1e-12
    _close(tw, summarize(w, STAT_NAMES), rtol)
    _close(td, summarize([a - b for a, b in zip(w, p, strict=True)], STAT_NAMES), rtol)


def test_pair_tables_with_nonfinite_values_use_the_finite_elements():
    w = [torch.tensor([1.0, math.nan, 3.0, 4.0]), torch.tensor([math.inf, 2.0])]
    p = [torch.tensor([0.5, 0.0, math.inf, 4.0]), torch.tensor([0.0, 1.0])]
    tw, td = pair_tables(w, p, STAT_NAMES)
    _close(tw, summarize(w, STAT_NAMES), 1e-12)
    _close(td, summarize([a - b for a, b in zip(w, p, strict=True)], STAT_NAMES), 1e-12)
    assert td[0, STAT_NAMES.index("nonfinite")] == 2  # NaN - 0 and 3 - inf


def test_tracker_weights_and_update_read_together_equal_the_separate_passes(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(50, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    tracker = nnstat.Tracker(model, opt, stats=None, histograms=True, bins=8, background=False)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 50)).pow(2).sum().backward()
        opt.step()
    plan = tracker._plan(refresh=True)
    assert compute._paired_weights(plan) is not None
    prev_a = [t.clone() for t in plan.prev]
    plan.prev = prev_a
    paired = compute.assemble(plan, {k: fn() for k, fn in compute.tasks(plan)})
    plan_b = tracker._plan(refresh=True)
    prev_b = [t.clone() for t in plan_b.prev]
    plan_b.prev = prev_b
    monkeypatch.setattr(compute, "_paired_weights", lambda plan: None)
    separate = compute.assemble(plan_b, {k: fn() for k, fn in compute.tasks(plan_b)})
    assert paired.keys() == separate.keys()
    for k, v in paired.items():
        if k.endswith("/hist"):
            assert np.array_equal(v.counts, separate[k].counts), k
            np.testing.assert_allclose(v.edges, separate[k].edges, rtol=1e-12)
        else:
            assert v == pytest.approx(separate[k], rel=1e-6, abs=1e-12, nan_ok=True), k
    for a, b in zip(prev_a, prev_b, strict=True):
        assert torch.equal(a, b)  # the snapshot is refreshed the same way
