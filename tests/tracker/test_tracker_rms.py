"""The Tracker's ``rms`` of every group on its paired norms-only and moment paths, vs numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import nnstat


def _rms(t: torch.Tensor) -> float:
    a = t.detach().double().numpy().ravel()
    return float(np.sqrt(np.mean(a * a)))


@pytest.mark.parametrize("stats", [["rms"], ["l2", "rms"], ["rms", "abs_max"], ["rms", "std"]])
@pytest.mark.parametrize("background", [False, True])
def test_tracker_rms_is_root_mean_square(stats, background):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    tracker = nnstat.Tracker(model, opt, stats=stats, background=background)
    for _ in range(2):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        metrics = dict(tracker.step())
    tracker.close()
    for n, p in model.named_parameters():
        st = opt.state[p]
        refs = {
            "weight": p,
            "grad": p.grad,
            "update": p.detach() - before[n],
            "exp_avg": st["exp_avg"],
            "exp_avg_sq": st["exp_avg_sq"],
        }
        for group, ref in refs.items():
            got = metrics[f"{group}/{n}/rms"]
            assert got == pytest.approx(_rms(ref), rel=1e-4), (group, n)
