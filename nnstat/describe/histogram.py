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


def sample_runs(numel: int, max_elements: int | None) -> tuple[list[int], int, bool]:
    """Where the histogram sample of a flat tensor of `numel` elements lies: the start of each
    run, the run length and whether it is a subsample (else one run, the whole tensor).

    The one definition of the sample positions: the CPU path's views and the device path's
    cached gather index both come from it, so both bin the same elements.

    Example:
        >>> sample_runs(10, 4), sample_runs(8192, 2048)
        (([0], 10, False), ([0, 4096], 1024, True))
    """
    if max_elements is None or numel <= max_elements or numel < 2 * _BLOCK:
        return [0], numel, False
    n_blocks = numel // _BLOCK
    take = max(1, max_elements // _BLOCK)
    stride = max(1, n_blocks // take)
    return [r * _BLOCK for r in range(0, n_blocks, stride)[:take]], _BLOCK, True


def _subsample(x: torch.Tensor, max_elements: int | None) -> tuple[torch.Tensor, bool]:
    runs, _, sampled = sample_runs(x.numel(), max_elements)
    if not sampled:
        return x, False
    n_blocks = x.numel() // _BLOCK
    stride = runs[1] // _BLOCK - runs[0] // _BLOCK if len(runs) > 1 else 1
    rows = x[: n_blocks * _BLOCK].view(n_blocks, _BLOCK)[::stride][: len(runs)]
    return rows.reshape(-1), True


def bin_counts(
    samples: Sequence[torch.Tensor], lo: torch.Tensor, hi: torch.Tensor, bins: int
) -> torch.Tensor:
    """Counts ``[len(samples), bins]`` (float64) of each flat sample over ``[lo[i], hi[i]]``.

    Bin ``k`` holds ``lo + k w <= x < lo + (k + 1) w`` (``w = (hi - lo) / bins``; ``x == hi`` in
    the last bin), as ``torch.histc`` bins; non-finite and out-of-range elements are not counted.
    `lo`/`hi` are tensors on the samples' device and nothing is read back to the host: the
    samples are concatenated and counted at once by `bin_flat`.

    Example:
        >>> bin_counts([torch.tensor([0.0, 0.5, 1.0])], torch.tensor([0.0]), torch.tensor([1.0]), 2)
        tensor([[1., 2.]], dtype=torch.float64)
    """
    n = len(samples)
    if n == 0:
        return torch.zeros((0, bins), dtype=torch.float64)
    dev = samples[0].device
    flat = [s.reshape(-1).to(device=dev, dtype=torch.float64) for s in samples]
    sizes = [s.numel() for s in flat]
    lengths = torch.tensor(sizes, device=dev)
    seg = torch.repeat_interleave(torch.arange(n, device=dev), lengths, output_size=sum(sizes))
    return bin_flat(torch.cat(flat), seg, lo, hi, bins, n)


def bin_flat(
    x: torch.Tensor, seg: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bins: int, n: int
) -> torch.Tensor:
    """`bin_counts` of `n` samples given flat: `x` holds them all, ``seg[j]`` the sample of
    ``x[j]`` (int64). A handful of element-wise kernels give every element's bin, offset by its
    sample (one extra bin per sample takes what is not counted), and ONE ``bincount`` (CPU) or
    ``scatter_add_`` counts them all.

    Example:
        >>> bin_flat(torch.tensor([0.0, 1.0, 5.0]), torch.tensor([0, 0, 1]),
        ...          torch.tensor([0.0, 4.0]), torch.tensor([1.0, 6.0]), 2, 2).tolist()
        [[1.0, 1.0], [0.0, 1.0]]
    """
    dev = x.device
    lo = lo.to(device=dev, dtype=torch.float64)
    hi = hi.to(device=dev, dtype=torch.float64)
    # float64 positions: the bin of an element does not depend on float32 rounding of (x - lo)
    x = x.to(torch.float64)
    per = torch.stack([lo, hi, bins / (hi - lo)]).index_select(1, seg)
    inside = (x >= per[0]) & (x <= per[1])  # False for NaN, +-Inf and out-of-range elements
    # NaN maps to some integer here; `inside` sends it to the extra bin
    k = ((x - per[0]) * per[2]).clamp_(0, bins - 1).to(torch.int64)
    k = torch.where(inside, k, bins).add_(seg * (bins + 1))
    counts = count_indices(k, n * (bins + 1), bincount=dev.type == "cpu")
    return counts.view(n, bins + 1)[:, :bins].to(torch.float64)


def count_indices(idx: torch.Tensor, size: int, bincount: bool) -> torch.Tensor:
    """How often each of ``0 .. size - 1`` occurs in `idx` (int64 counts).

    ``bincount`` is the fastest on CPU; CUDA's reads the largest index back to the host to size
    its output, so accelerators add ones with ``scatter_add_`` into a zeroed buffer instead.

    Example:
        >>> count_indices(torch.tensor([0, 2, 2]), 4, bincount=False).tolist()
        [1, 0, 2, 0]
    """
    if bincount:
        return torch.bincount(idx, minlength=size)
    counts = torch.zeros(size, dtype=torch.int64, device=idx.device)
    return counts.scatter_add_(0, idx, torch.ones_like(idx))


def hist_ranges(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The histogram range of each tensor from its finite minimum and maximum (tensor ops).

    No finite element: the nominal ``[0, 1]``; a single value ``v``: ``[v - 0.5, v + 0.5]``.

    Example:
        >>> [t.tolist() for t in hist_ranges(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 2.0]))]
        [[1.0, 1.5], [3.0, 2.5]]
    """
    ok = torch.isfinite(lo) & torch.isfinite(hi)
    lo = torch.where(ok, lo, torch.zeros_like(lo))
    hi = torch.where(ok, hi, torch.ones_like(hi))
    same = lo == hi
    return torch.where(same, lo - 0.5, lo), torch.where(same, hi + 0.5, hi)


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
    out = []
    for a, b, c, was_sampled, (mn, mx, numel, nonfinite, mean, l2) in zip(
        lo, hi, counts, sampled, summary_rows, strict=True
    ):
        num = numel - nonfinite
        if was_sampled and c.sum() > 0:
            c = c * (num / c.sum())
        out.append(
            Histogram(
                counts=c,
                edges=np.linspace(a, b, bins + 1),
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
