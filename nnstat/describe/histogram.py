"""Histograms computed on device with ``torch.histc``, two host transfers for a whole list.

Large tensors are histogrammed on an evenly spread subsample of contiguous blocks (at most
`max_elements` elements, default 2**16), because ``torch.histc`` is the slowest reduction on CPU;
the counts are then rescaled so they sum to the number of finite elements. ``min``, ``max``,
``num``, ``sum`` and ``sum_squares`` are always exact. Pass ``max_elements=None`` for exact
counts.

Example:
    >>> import torch
    >>> h = histograms([torch.tensor([0.0, 1.0, 1.0])], bins=2)[0]
    >>> h.counts.tolist(), h.num
    ([1.0, 2.0], 3.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from nnstat.describe.summary import summarize

__all__ = ["Histogram", "histograms", "HIST_SUMMARY", "DEFAULT_MAX_ELEMENTS"]

#: Columns of the summary `histograms` needs (a `nnstat.describe.summarize` table with these stats).
HIST_SUMMARY: tuple[str, ...] = ("min", "max", "numel", "nonfinite", "mean", "l2")
DEFAULT_MAX_ELEMENTS = 2**16
_BLOCK = 1024  # contiguous run length of the subsample (whole cache lines, not strided reads)


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
    n = x.numel()
    if max_elements is None or n <= max_elements or n < 2 * _BLOCK:
        return x, False
    n_blocks = n // _BLOCK
    take = max(1, max_elements // _BLOCK)
    stride = max(1, n_blocks // take)
    rows = x[: n_blocks * _BLOCK].view(n_blocks, _BLOCK)[::stride][:take]
    return rows.reshape(-1), True


def histograms(
    tensors: Sequence[torch.Tensor],
    bins: int = 64,
    max_elements: int | None = DEFAULT_MAX_ELEMENTS,
    summary: torch.Tensor | None = None,
) -> list[Histogram]:
    """Histograms of the finite elements of each tensor, over its own ``[min, max]`` range.

    `summary` may pass an already computed ``summarize(tensors, HIST_SUMMARY)`` table.

    Example:
        >>> [h.counts.sum() for h in histograms([torch.arange(10.0)], bins=5)]
        [np.float64(10.0)]
    """

    if not isinstance(bins, int) or bins < 1:
        raise ValueError(f"bins must be a positive int, got {bins!r}")
    if max_elements is not None and max_elements < 1:
        raise ValueError(f"max_elements must be positive or None, got {max_elements!r}")
    tensors = list(tensors)
    if not tensors:
        return []
    if summary is None:
        summary = summarize(tensors, HIST_SUMMARY)
    rows = summary.tolist()
    if len(rows) != len(tensors) or len(rows[0]) != len(HIST_SUMMARY):
        raise ValueError(f"summary must have shape [{len(tensors)}, {len(HIST_SUMMARY)}]")
    counts, ranges, sampled = [], [], []
    for t, (lo, hi, *_rest) in zip(tensors, rows, strict=True):
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo, hi = 0.0, 1.0  # no finite element: an empty histogram on a nominal range
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        ranges.append((lo, hi))
        x = t.detach().reshape(-1)
        x = x if x.dtype in (torch.float32, torch.float64) else x.float()
        x, was_sampled = _subsample(x, max_elements)
        sampled.append(was_sampled)
        # histc counts the elements in [lo, hi]; NaN and +-Inf fall outside and are not counted
        counts.append(torch.histc(x, bins=bins, min=lo, max=hi).to(torch.float64))
    counts_host = torch.stack([c.cpu() for c in counts]).numpy()
    out = []
    for (lo, hi), c, was_sampled, (mn, mx, numel, nonfinite, mean, l2) in zip(
        ranges, counts_host, sampled, rows, strict=True
    ):
        num = numel - nonfinite
        if was_sampled and c.sum() > 0:
            c = c * (num / c.sum())
        out.append(
            Histogram(
                counts=c,
                edges=np.linspace(lo, hi, bins + 1),
                min=mn if num else 0.0,
                max=mx if num else 0.0,
                num=num,
                sum=mean * num if num else 0.0,
                sum_squares=l2 * l2 if num else 0.0,
            )
        )
    return out
