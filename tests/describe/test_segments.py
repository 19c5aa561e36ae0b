"""The accelerator core `nnstat.describe.torch_segments`, run on CPU tensors (the same torch
kernels), against numpy float64 references: every statistic of `summarize`, histogram counts, on
data that is hard for float32 (a large mean with a tiny spread, values near 1e-12, zeros,
NaN/Inf)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nnstat.describe.torch_segments as segments
from nnstat.describe import STAT_NAMES, core, summarize
from nnstat.describe.moments import Workspace
from nnstat.describe.torch_segments import HistSpec, segment_table, segment_tables


@pytest.fixture
def device_path(monkeypatch):
    """`summarize` on CPU tensors takes the accelerator branch (the segments core)."""
    monkeypatch.setattr(core, "_host_path", lambda tensors: False)


def reference(t: torch.Tensor) -> dict[str, float]:
    """Every statistic of `summarize` in float64 over the finite elements (definitions). A
    spread below the data type's epsilon times the mean is a constant (as scipy has it)."""
    eps = np.finfo(np.float64 if t.dtype == torch.float64 else np.float32).eps
    x = t.double().numpy().ravel()
    f = x[np.isfinite(x)]
    n = f.size
    out = {"numel": float(x.size), "nonfinite": float(x.size - n), "l1": np.abs(f).sum()}
    out["l2"] = math.sqrt((f * f).sum())
    if n == 0:
        return out | dict.fromkeys(set(STAT_NAMES) - set(out), math.nan)
    mean = f.mean()
    m = [((f - mean) ** k).mean() for k in (2, 3, 4)]
    constant = m[0] <= (eps * mean) ** 2
    return out | {
        "mean": mean,
        "var": 0.0 if constant else m[0],
        "std": 0.0 if constant else math.sqrt(m[0]),
        "skew": math.nan if constant else m[1] / m[0] ** 1.5,
        "kurtosis": math.nan if constant else m[2] / m[0] ** 2 - 3.0,
        "min": f.min(),
        "max": f.max(),
        "abs_mean": np.abs(f).mean(),
        "abs_max": np.abs(f).max(),
        "rms": math.sqrt((f * f).mean()),
        "sparsity": float((f == 0).sum()) / n,
    }


def assert_stats(row: dict[str, float], ref: dict[str, float], what: str, loose: float = 1) -> None:
    """Float32-data tolerances: exact counts and extrema, ~1e-6 relative sums; the mean to a
    millionth of the spread (two-pass centred), skew/kurtosis (order-1 ratios) absolutely.
    `loose` widens the float tolerances."""
    for s in STAT_NAMES:
        a, b = row[s], ref[s]
        msg = f"{what}: {s} = {a!r}, numpy {b!r}"
        if math.isnan(b):
            assert math.isnan(a), msg
        elif s in ("numel", "nonfinite", "sparsity", "min", "max", "abs_max"):
            assert a == b, msg
        elif s == "mean":
            assert abs(a - b) <= loose * 1e-6 * ref["std"] + 1e-15 * abs(b), msg
        elif s in ("skew", "kurtosis"):
            assert abs(a - b) <= loose * 2e-6, msg
        else:
            assert a == pytest.approx(b, rel=loose * 1e-6, abs=0.0), msg


def hard_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    with_zeros = randn(40, 50)
    with_zeros[with_zeros.abs() < 0.5] = 0.0
    nonfinite = randn(3 * 4096 + 17)
    nonfinite[[5, 4200, 9000]] = torch.tensor([math.nan, math.inf, -math.inf])
    return [
        randn(300, 70) * 1e-3 + 1000.0,  # a spread of ~16 ulps of the mean
        1.0 + randn(768) * 1e-4,  # a LayerNorm weight
        randn(9000) * 1e-12,  # fourth powers far below float32's normal range
        randn(5000).square() * 1e-10,  # Adam's exp_avg_sq: one sign, tiny
        with_zeros,
        torch.zeros(10),  # constant: zero variance, undefined skew/kurtosis
        torch.full((33,), 0.1),
        randn(3 * 4096 + 17) * 5 - 2,  # several rows of the flat layout
        nonfinite,
        torch.full((4,), math.nan),  # nothing finite
        torch.zeros(0),
        randn(7, 9).double() * 1e-3 + 1e6,  # float64: its own group and epsilon
        randn(500).to(torch.bfloat16),  # a third dtype group
        torch.arange(-50, 70),  # integers
        torch.tensor([True, False, True]),
        torch.tensor([3.0]),
    ]


@pytest.mark.parametrize("kernels", [False, True], ids=["CPU sums", "accelerator norms"])
def test_every_statistic_matches_numpy_float64(device_path, monkeypatch, kernels):
    """Both ways of forming the power sums: pairwise sums of formed powers (CPU), and the
    row-wise 2- and 4-norms accelerators use. Here on CPU, whose norm kernels accumulate
    sequentially, the latter is held to looser tolerances (its accuracy on a GPU is checked
    there: benchmarks or a CUDA machine)."""
    monkeypatch.setattr(segments, "_norm_kernels", lambda device: kernels)
    xs = hard_tensors()
    table = summarize(xs, STAT_NAMES)
    for i, (x, row) in enumerate(zip(xs, table.tolist(), strict=True)):
        ref = reference(x)
        row = dict(zip(STAT_NAMES, row, strict=True))
        assert_stats(row, ref, f"tensor {i}", loose=20 if kernels else 1)


def test_device_table_probe_flags_exactly_the_tensors_to_repair():
    xs = hard_tensors()
    table = segment_table(xs, STAT_NAMES)[0]
    flagged = [i for i, v in enumerate(table[:, -1].tolist()) if not math.isfinite(v)]
    assert flagged == [8, 9]  # the ones holding NaN/Inf; empty tensors have their exact row


@pytest.mark.parametrize("kernels", [True, False], ids=["norm kernels", "flat pass"])
@pytest.mark.parametrize("stats", [("l2", "rms", "abs_max", "nonfinite"), ("l1", "abs_mean")])
def test_norm_statistics_match_numpy(device_path, monkeypatch, stats, kernels):
    """Accelerators take the multi-tensor norm kernels (float64 accumulation), the CPU the
    flat pass; both are checked here on CPU tensors."""
    monkeypatch.setattr(segments, "_norm_kernels", lambda device: kernels)
    xs = hard_tensors()
    table = summarize(xs, stats)
    for i, (x, row) in enumerate(zip(xs, table.tolist(), strict=True)):
        ref = reference(x)
        for s, v in zip(stats, row, strict=True):
            if math.isnan(ref[s]):
                assert math.isnan(v), (i, s)
            else:
                assert v == pytest.approx(ref[s], rel=1e-12 if kernels else 1e-6), (i, s)


def test_subsets_of_statistics_agree_with_the_full_set(device_path):
    xs = hard_tensors()[:8]
    full = summarize(xs, STAT_NAMES)
    for subset in (("mean",), ("min", "max"), ("var", "numel"), ("skew",), ("sparsity", "l2")):
        got = summarize(xs, subset)
        want = full[:, [STAT_NAMES.index(s) for s in subset]]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12, equal_nan=True)


def np_sample(x: np.ndarray, max_elements: int | None) -> np.ndarray:
    """The documented histogram sample: evenly strided runs of 1024 elements."""
    n = x.size
    if max_elements is None or n <= max_elements or n < 2048:
        return x
    blocks = n // 1024
    take = max(1, max_elements // 1024)
    stride = max(1, blocks // take)
    return x[: blocks * 1024].reshape(blocks, 1024)[::stride][:take].ravel()


@pytest.mark.parametrize("max_elements", [None, 3000])
def test_histogram_counts_equal_numpy_over_the_sample(max_elements):
    g = torch.Generator().manual_seed(1)
    xs = [
        torch.randn(20_000, generator=g),
        torch.rand(4100, generator=g) * 3 + 7,
        torch.randn(37, generator=g).double(),
        torch.full((5,), 2.0),
        torch.randn(3, 1500, generator=g) * 1e-3 + 100,
    ]
    bins = 16
    _, hist, sampled = segment_table(xs, ("mean",), None, HistSpec(bins, max_elements))
    assert_histograms(xs, hist, sampled, bins, max_elements)


def assert_histograms(xs, hist, sampled, bins: int, max_elements: int | None) -> None:
    """Each row ``[lo, hi, counts...]`` is numpy's histogram of the documented sample over the
    tensor's range (a single value spans it +- 0.5)."""
    for x, row, was in zip(xs, hist.tolist(), sampled, strict=True):
        x = x.reshape(-1).float().numpy() if x.dtype == torch.bfloat16 else x.reshape(-1).numpy()
        lo, hi = float(x.min()), float(x.max())
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        assert row[:2] == [lo, hi]
        sample = np_sample(x, max_elements)
        assert was == (sample.size < x.size)
        want, _ = np.histogram(sample.astype(np.float64), bins=bins, range=(lo, hi))
        np.testing.assert_array_equal(row[2:], want)


def test_lists_reduced_together_equal_lists_reduced_alone():
    g = torch.Generator().manual_seed(2)
    lists = [
        [torch.randn(5000, generator=g), torch.randn(3, generator=g)],
        [torch.randn(70, generator=g).double(), torch.zeros(0)],
        [],
        [torch.randn(4096, generator=g) * 10],
    ]
    ws = Workspace()
    together = segment_tables(lists, STAT_NAMES, ws, HistSpec(8, 2048))
    for ts, (table, hist, sampled) in zip(lists, together, strict=True):
        if not ts:
            assert table.shape == (0, len(STAT_NAMES) + 1)
            continue
        alone = segment_table(ts, STAT_NAMES, Workspace(), HistSpec(8, 2048))
        torch.testing.assert_close(table, alone[0], rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(hist, alone[1], rtol=0, atol=0, equal_nan=True)
        assert sampled == alone[2]
    again = segment_tables(lists, STAT_NAMES, ws, HistSpec(8, 2048))  # cached layouts
    for (a, ha, _), (b, hb, _) in zip(together, again, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        if ha is not None:
            torch.testing.assert_close(ha, hb, rtol=0, atol=0, equal_nan=True)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_every_statistic_matches_numpy_float64_at_full_tolerance():
    """The accelerator branch where it runs: row-wise norm kernels (tree reductions) for the
    power sums, the multi-tensor norms accumulating in float64."""
    xs = hard_tensors()
    table = summarize([x.cuda() for x in xs], STAT_NAMES)
    for i, (x, row) in enumerate(zip(xs, table.tolist(), strict=True)):
        assert_stats(dict(zip(STAT_NAMES, row, strict=True)), reference(x), f"tensor {i}")
    norms = ("l2", "rms", "abs_max", "nonfinite", "l1", "abs_mean")
    table = summarize([x.cuda() for x in xs], norms)
    for i, (x, row) in enumerate(zip(xs, table.tolist(), strict=True)):
        ref = reference(x)
        for s, v in zip(norms, row, strict=True):
            assert v == pytest.approx(ref[s], rel=1e-12, nan_ok=True), (i, s)
