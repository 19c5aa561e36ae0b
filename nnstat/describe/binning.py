"""Histogram binning on the tensors' device: where the sample of a tensor lies, the range of
each histogram and the counts of many samples at once, with no host synchronisation.

The pieces `nnstat.describe.histogram` (the public `histograms`) and the device core
`nnstat.describe.torch_segments` share, so that both bin the same elements the same way.

Example:
    >>> import torch
    >>> bin_counts([torch.tensor([0.0, 0.5, 1.0])], torch.tensor([0.0]), torch.tensor([1.0]), 2)
    tensor([[1., 2.]], dtype=torch.float64)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["sample_runs", "bin_counts", "bin_flat", "count_indices", "hist_ranges"]

SUBSAMPLE_RUN = (
    1024  # contiguous run length of the subsample (whole cache lines, not strided reads)
)


def sample_runs(numel: int, max_elements: int | None) -> tuple[list[int], int, bool]:
    """Where the histogram sample of a flat tensor of `numel` elements lies: the start of each
    run, the run length and whether it is a subsample (else one run, the whole tensor).

    The one definition of the sample positions: the CPU path's views and the device path's
    cached gather index both come from it, so both bin the same elements.

    Example:
        >>> sample_runs(10, 4), sample_runs(8192, 2048)
        (([0], 10, False), ([0, 4096], 1024, True))
    """
    if max_elements is None or numel <= max_elements or numel < 2 * SUBSAMPLE_RUN:
        return [0], numel, False
    n_blocks = numel // SUBSAMPLE_RUN
    take = max(1, max_elements // SUBSAMPLE_RUN)
    stride = max(1, n_blocks // take)
    return [r * SUBSAMPLE_RUN for r in range(0, n_blocks, stride)[:take]], SUBSAMPLE_RUN, True


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
