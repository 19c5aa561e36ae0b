"""Histograms computed on device, all tensors of a list counted by one ``bincount``.

Large tensors are histogrammed on an evenly spread subsample of contiguous runs of 1024
elements (at most `max_elements` elements, default 2**16), because binning is the slowest
reduction per element; the counts are then rescaled so they sum to the number of finite
elements. ``min``, ``max``, ``num``, ``sum`` and ``sum_squares`` are always exact.

Count error of a sampled histogram: a bin holding a fraction ``p`` of a tensor's elements gets
``p * sample`` sampled elements, so (for elements in no particular order) its rescaled count has
a relative standard error of about ``sqrt((1 - p) / (p * sample))``: 1.2% for a bin with 10% of
the mass at the default 65,536-element sample, ~12% for a bin with 0.1%; bins in the tails may
read 0 or a multiple of ``numel / sample``. Runs of 1024 neighbours are not independent draws
when neighbouring values are correlated (a weight matrix's rows), which can widen that error.
Pass ``max_elements=None`` for exact counts (tested in tests/describe/test_histograms_batched.py).

Example:
    >>> import torch
    >>> h = histograms([torch.tensor([0.0, 1.0, 1.0])], bins=2)[0]
    >>> h.counts.tolist(), h.num
    ([1.0, 2.0], 3.0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nnstat.describe.binning import (
    SUBSAMPLE_RUN,
    bin_counts,
    bin_flat,
    count_indices,
    hist_ranges,
    sample_runs,
)
from nnstat.describe.summary import summarize

__all__ = [
    "Histogram",
    "histograms",
    "bin_counts",
    "count_indices",
    "bin_flat",
    "sample_runs",
    "hist_ranges",
    "HIST_SUMMARY",
    "DEFAULT_MAX_ELEMENTS",
]

#: Columns of the summary `histograms` needs (a `nnstat.describe.summarize` table with these stats).
HIST_SUMMARY: tuple[str, ...] = ("min", "max", "numel", "nonfinite", "mean", "l2")
DEFAULT_MAX_ELEMENTS = 2**16


@dataclass(frozen=True)
class Histogram:
    """``counts[i]`` elements fall in ``[edges[i], edges[i+1])`` (the last bin includes its edge).

    ``num``/``sum``/``sum_squares``/``min``/``max`` describe the finite elements (what
    TensorBoard's histogram protocol expects). Sinks turn it into their native format.

    Example:
        >>> Histogram(np.ones(2), np.arange(3.0), 0.0, 2.0, 2.0, 2.0, 2.0).counts.sum()
        np.float64(2.0)
    """

    counts: np.ndarray
    edges: np.ndarray
    min: float
    max: float
    num: float
    sum: float
    sum_squares: float


def _subsample(x: torch.Tensor, max_elements: int | None) -> tuple[torch.Tensor, bool]:
    runs, _, sampled = sample_runs(x.numel(), max_elements)
    if not sampled:
        return x, False
    n_blocks = x.numel() // SUBSAMPLE_RUN
    stride = runs[1] // SUBSAMPLE_RUN - runs[0] // SUBSAMPLE_RUN if len(runs) > 1 else 1
    rows = x[: n_blocks * SUBSAMPLE_RUN].view(n_blocks, SUBSAMPLE_RUN)[::stride][: len(runs)]
    return rows.reshape(-1), True


def sample_for_histogram(
    t: torch.Tensor, max_elements: int | None = DEFAULT_MAX_ELEMENTS
) -> tuple[torch.Tensor, bool]:
    """The flat elements `histograms` bins for `t` (a float view or copy) and whether sampled.

    Example:
        >>> x, sampled = sample_for_histogram(torch.arange(10))
        >>> x.dtype, sampled
        (torch.float32, False)
    """
    x = t.detach().reshape(-1)
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return _subsample(x, max_elements)


def build_histograms(
    counts: np.ndarray,
    lo: Sequence[float],
    hi: Sequence[float],
    summary_rows: Sequence[Sequence[float]],
    sampled: Sequence[bool],
    bins: int,
) -> list[Histogram]:
    """`Histogram` objects from host counts (``[n, bins]``), ranges and `HIST_SUMMARY` rows;
    sampled counts are rescaled to the finite element count."""
    out: list[Histogram] = []
    if not len(lo):
        return out
    # every row's edges in one call (np.linspace over arrays: the same arithmetic per row)
    edges = np.linspace(
        np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64), bins + 1, axis=1
    )
    totals = np.asarray(counts).sum(axis=1)
    for a_b, c, total, was_sampled, (mn, mx, numel, nonfinite, mean, l2) in zip(
        edges, counts, totals, sampled, summary_rows, strict=True
    ):
        num = numel - nonfinite
        if was_sampled and total > 0:
            c = c * (num / total)
        out.append(
            Histogram(
                counts=c,
                edges=a_b,
                min=mn if num else 0.0,
                max=mx if num else 0.0,
                num=num,
                sum=mean * num if num else 0.0,
                sum_squares=l2 * l2 if num else 0.0,
            )
        )
    return out


def _check_args(bins: int, max_elements: int | None) -> None:
    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    if max_elements is not None and max_elements < 1:
        raise ValueError(f"max_elements must be positive or None, got {max_elements!r}")


def histograms(
    tensors: Sequence[torch.Tensor],
    bins: int = 64,
    max_elements: int | None = DEFAULT_MAX_ELEMENTS,
    summary: torch.Tensor | None = None,
) -> list[Histogram]:
    """Histograms of the finite elements of each tensor, over its own ``[min, max]`` range.

    `summary` may pass an already computed ``summarize(tensors, HIST_SUMMARY)`` table. The
    counts of all tensors come from one batched `bin_counts` and one host transfer.

    Example:
        >>> [h.counts.sum() for h in histograms([torch.arange(10.0)], bins=5)]
        [np.float64(10.0)]
    """
    _check_args(bins, max_elements)
    tensors = list(tensors)
    if not tensors:
        return []
    if summary is None:
        summary = summarize(tensors, HIST_SUMMARY)
    if summary.dim() != 2 or tuple(summary.shape) != (len(tensors), len(HIST_SUMMARY)):
        raise ValueError(f"summary must have shape [{len(tensors)}, {len(HIST_SUMMARY)}]")
    lo, hi = hist_ranges(summary[:, 0], summary[:, 1])
    picked = [sample_for_histogram(t, max_elements) for t in tensors]
    counts = bin_counts([x for x, _ in picked], lo, hi, bins).cpu().numpy()
    sampled = [was for _, was in picked]
    return build_histograms(counts, lo.tolist(), hi.tolist(), summary.tolist(), sampled, bins)
