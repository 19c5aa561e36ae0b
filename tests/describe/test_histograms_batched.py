"""Batched histogram counts (one bincount for a list of tensors) against numpy, and the
documented count error of sampled histograms."""

import math

import numpy as np
import pytest
import torch

from nnstat.describe import histograms
from nnstat.describe.histogram import DEFAULT_MAX_ELEMENTS, bin_counts, hist_ranges


def test_bin_counts_match_numpy_for_many_tensors_at_once():
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(n).astype(np.float32) for n in (1, 7, 1000, 5000)]
    xs.append(np.array([0.0, 0.0, 3.0], dtype=np.float32))
    lo = torch.tensor([x.min() for x in xs], dtype=torch.float64)
    hi = torch.tensor([x.max() for x in xs], dtype=torch.float64)
    lo, hi = hist_ranges(lo, hi)
    counts = bin_counts([torch.from_numpy(x) for x in xs], lo, hi, 16).numpy()
    for x, c, a, b in zip(xs, counts, lo.tolist(), hi.tolist(), strict=True):
        ref, _ = np.histogram(x.astype(np.float64), bins=16, range=(a, b))
        # numpy corrects its bin index at inner edges; the two may differ by an edge element
        assert np.abs(c - ref).sum() <= 2 and c.sum() == x.size


def test_bin_counts_leave_out_nonfinite_and_out_of_range_elements():
    x = torch.tensor([math.nan, -math.inf, math.inf, -1.0, 0.0, 0.25, 1.0, 2.0])
    c = bin_counts([x], torch.tensor([0.0]), torch.tensor([1.0]), 4)
    assert c.tolist() == [[1.0, 1.0, 0.0, 1.0]]  # 0 | 0.25 | - | 1.0 (last bin holds hi)


def test_hist_ranges_of_empty_and_constant_tensors():
    lo, hi = hist_ranges(torch.tensor([math.inf, 2.0]), torch.tensor([-math.inf, 2.0]))
    assert lo.tolist() == [0.0, 1.5] and hi.tolist() == [1.0, 2.5]


def test_histograms_of_several_tensors_match_numpy_one_by_one():
    torch.manual_seed(0)
    xs = [torch.randn(300), torch.rand(50, dtype=torch.float64), torch.arange(10)]
    hs = histograms(xs, bins=8)
    for x, h in zip(xs, hs, strict=True):
        x = x.double().numpy()
        ref, edges = np.histogram(x, bins=8, range=(x.min(), x.max()))
        np.testing.assert_allclose(h.edges, edges, rtol=1e-12)
        assert np.abs(h.counts - ref).sum() <= 2 and h.counts.sum() == x.size


@pytest.mark.parametrize("seed", [0, 1])
def test_sampled_histogram_count_error_is_within_its_documented_bound(seed):
    """Above `max_elements` the counts come from a sample of 64 evenly spread runs of 1024
    elements, rescaled to the finite count: exact totals, per-bin counts as a sample gives them.
    On i.i.d. data each bin's relative error is about 1/sqrt(sample count in that bin); the
    module docstring documents it, this checks the bulk bins stay within 5 standard errors."""
    torch.manual_seed(seed)
    x = torch.randn(1_000_000)
    (h,) = histograms([x], bins=32)
    ref, _ = np.histogram(x.double().numpy(), bins=32, range=(h.edges[0], h.edges[-1]))
    assert h.counts.sum() == pytest.approx(x.numel())
    frac = DEFAULT_MAX_ELEMENTS / x.numel()
    for c, r in zip(h.counts, ref, strict=True):
        if r * frac > 100:  # bins with enough sampled elements for the normal approximation
            sd = math.sqrt(r * frac) / frac
            assert abs(c - r) < 5 * sd
