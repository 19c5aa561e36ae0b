"""The accelerator path of the Tracker (`nnstat.tracker.compute.device_results`): every
reduction of a step queued on the device and ONE host transfer. Run on CPU with the numpy
fast paths switched off (so the same torch kernels as on a GPU run), checked against the
per-group tasks the CPU path runs and for host reads before the transfer."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nnstat
import nnstat.describe.moments as moments
import nnstat.describe.numpy_blocks as blocks
import nnstat.describe.torch_segments as segments
from nnstat.tracker import compute


@pytest.fixture
def torch_only(monkeypatch):
    """CPU tensors take the kernels an accelerator runs (no numpy, no block loop)."""
    monkeypatch.setattr(moments, "numpy_ok", lambda x: False)
    monkeypatch.setattr(moments, "CHUNK", 1 << 30)
    # on accelerators it returns 1 before reading anything (float32 denormals are a CPU cost)
    monkeypatch.setattr(moments, "_denormal_scale", lambda head: 1.0)
    monkeypatch.setattr(blocks, "BLOCK", 1 << 30)


class _HostReads:
    """Counts reads of tensor values by the host (what stalls an accelerator's queue)."""

    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        self.active = False
        for name in self.names:
            real = getattr(torch.Tensor, name)

            def counted(t, *a, _real=real, **k):
                if self.active:
                    self.count += 1
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)


def _model_and_plan(kind: str):
    torch.manual_seed(0)
    width = 80 if kind == "sampled" else 6  # 80 x 80 weights: histograms of sampled runs
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 3)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    kw = {"stats": None, "histograms": True, "bins": 8} if kind != "default" else {}
    if kind == "sampled":
        kw["hist_max_elements"] = 2048
    tracker = nnstat.Tracker(model, opt, background=False, **kw)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, width)).pow(2).sum().backward()
        opt.step()
    return model, tracker


def _same(a, b):
    """Equal up to float32 summation order: the device path reduces rows of a flat buffer,
    the CPU path cache-sized blocks (both accumulate partials in float64). Counts, ranges,
    minima and maxima are exact on both."""
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if hasattr(x, "counts"):
            np.testing.assert_array_equal(x.counts, y.counts)
            np.testing.assert_array_equal(x.edges, y.edges)
            assert (x.min, x.max, x.num) == (y.min, y.max, y.num)
            assert x.sum == pytest.approx(y.sum, rel=1e-6, abs=1e-12)
        elif math.isnan(x):
            assert math.isnan(y), k
        else:
            # skew and kurtosis are ratios of order 1: absolute error of float32 power sums
            shape = k.endswith(("/skew", "/kurtosis"))
            assert x == pytest.approx(y, rel=1e-6, abs=1e-6 if shape else 0.0), k


@pytest.mark.parametrize("kind", ["default", "default-kernels", "full", "sampled"])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_device_path_matches_the_per_group_tasks_with_one_transfer(
    torch_only, monkeypatch, kind, nonfinite
):
    if kind == "default-kernels":  # the multi-tensor norms accelerators use (CPU: flat pass)
        monkeypatch.setattr(segments, "_norm_kernels", lambda device: True)
        kind = "default"
    model, tracker = _model_and_plan(kind)
    if nonfinite:  # a NaN and an Inf: exact recomputation over the finite part on both paths
        with torch.no_grad():
            model[0].weight[0, 0] = math.nan
            model[2].bias.grad[1] = math.inf
    plan_a = tracker._plan(refresh=True)
    prev_a = [p.clone() for p in plan_a.prev]
    plan_a.prev = prev_a
    ref = compute.assemble(plan_a, {k: fn() for k, fn in compute.tasks(plan_a)})

    plan_b = tracker._plan(refresh=True)
    prev_b = [p.clone() for p in plan_b.prev]
    plan_b.prev = prev_b
    reads = _HostReads(monkeypatch)
    reads.active = True
    staged = compute.stage(plan_b)
    reads.active = False
    assert reads.count == 0  # nothing read back while the reductions are queued
    host = compute.to_host(staged.parts)
    got = compute.assemble(plan_b, compute.finish(plan_b, staged, host))
    _same(got, ref)
    for a, b in zip(prev_a, prev_b, strict=True):  # snapshot refreshed the same way
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def test_to_host_is_one_transfer(monkeypatch):
    parts = [torch.arange(6.0).view(2, 3), torch.tensor([1, 2]), torch.zeros(0)]
    calls = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: calls.append(1) or real(t))
    out = compute.to_host(parts)
    assert len(calls) == 1
    assert out[0].tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and out[1].tolist() == [1.0, 2.0]
    assert out[2].shape == (0,)


def test_scatter_counting_of_accelerators_matches_bincount():
    """The counting accelerators use (CUDA's bincount reads back its input's max)."""
    from nnstat.describe.histogram import count_indices

    idx = torch.randint(0, 50, (10_000,))
    torch.testing.assert_close(
        count_indices(idx, 60, bincount=False), count_indices(idx, 60, bincount=True)
    )
