"""Fused statistics of many tensors in one device pass.

Local adapter: the foundation's `nnstat/stats.py` was not available when the recorder was written,
so the recorder reduces through `segment_stats` here. Swap the body for the shared reduction once
it exists; the column order (`STAT_NAMES`) is the recorder's on-disk contract.

Statistics ignore non-finite entries (a single NaN would otherwise erase every other number) and
count them separately in ``nonfinite``.
"""

from __future__ import annotations

import torch

STAT_NAMES: tuple[str, ...] = ("mean", "std", "min", "max", "abs_max", "norm", "nonfinite", "numel")
COL = {name: i for i, name in enumerate(STAT_NAMES)}


def segment_stats(segments: list[torch.Tensor]) -> torch.Tensor:
    """Statistics of each tensor in ``segments`` as one ``[n, len(STAT_NAMES)]`` float32 tensor.

    All tensors are flattened into one buffer and reduced with segment reductions, so the number
    of kernel launches does not grow with the number of tensors. The result stays on the device
    of the inputs. ``std`` is the population standard deviation of the finite entries.

    Example:
        >>> s = segment_stats([torch.tensor([1.0, 3.0]), torch.tensor([float("nan"), -2.0])])
        >>> s[:, COL["mean"]].tolist(), s[:, COL["nonfinite"]].tolist()
        ([2.0, -2.0], [0.0, 1.0])
    """
    if not segments:
        return torch.zeros(0, len(STAT_NAMES))
    device = segments[0].device
    flat = torch.cat(
        [s.detach().reshape(-1).to(device=device, dtype=torch.float32) for s in segments]
    )
    lengths = torch.tensor([s.numel() for s in segments], device=device, dtype=torch.long)
    n = len(segments)
    seg_id = torch.repeat_interleave(torch.arange(n, device=device), lengths)
    finite = torch.isfinite(flat)
    zero = torch.zeros((), dtype=flat.dtype, device=device)
    xf = torch.where(finite, flat, zero)

    def seg_sum(v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=v.dtype, device=device).index_add_(0, seg_id, v)

    n_fin = seg_sum(finite.to(flat.dtype))
    total = seg_sum(xf)
    mean = total / n_fin.clamp(min=1)
    centred = torch.where(finite, flat - mean[seg_id], zero)
    var = seg_sum(centred * centred) / n_fin.clamp(min=1)
    norm = seg_sum(xf * xf).sqrt()
    inf = torch.tensor(float("inf"), dtype=flat.dtype, device=device)
    mx = torch.full((n,), -float("inf"), dtype=flat.dtype, device=device)
    mx = mx.scatter_reduce(0, seg_id, torch.where(finite, flat, -inf), reduce="amax")
    mn = torch.full((n,), float("inf"), dtype=flat.dtype, device=device)
    mn = mn.scatter_reduce(0, seg_id, torch.where(finite, flat, inf), reduce="amin")
    empty = n_fin == 0
    nan = torch.full_like(mean, float("nan"))
    mean, std = torch.where(empty, nan, mean), torch.where(empty, nan, var.sqrt())
    mx, mn = torch.where(empty, nan, mx), torch.where(empty, nan, mn)
    norm = torch.where(empty & (lengths > 0), nan, norm)
    abs_max = torch.maximum(mx.abs(), mn.abs())
    nonfinite = lengths.to(flat.dtype) - n_fin
    return torch.stack([mean, std, mn, mx, abs_max, norm, nonfinite, lengths.to(flat.dtype)], 1)
