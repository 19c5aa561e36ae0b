"""Fused statistics of many tensors, computed on device with one host transfer.

Why not `nnstat.describe.summarize`: it transfers to the host itself (the recorder must append rule
hits and raw values to the same transfer, and evaluate rules on device first) and runs a
per-tensor moment pass, while a recorded step here has hundreds of small segments (each tensor,
its gradient, and its first k samples). `test_recorder_activations.py` checks that both agree.

Statistics ignore non-finite entries (a single NaN would otherwise erase every other number) and
count them in ``nonfinite``. The device pass assumes finite data: a float64 segment sum is
finite exactly when its segment is, so that sum flags the (rare) segments that hold NaN/Inf,
and `fix_nonfinite` recomputes only those, exactly, after the transfer.
"""

from __future__ import annotations

import numpy as np
import torch

from nnstat.distributed import any_dtensor, is_dtensor, summarize_sharded

STAT_NAMES: tuple[str, ...] = ("mean", "std", "min", "max", "abs_max", "norm", "nonfinite", "numel")
COL = {name: i for i, name in enumerate(STAT_NAMES)}


def _plain(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1)
    return t.to(torch.uint8) if t.dtype == torch.bool else t


def device_stats(segments: list[torch.Tensor]) -> torch.Tensor:
    """``[n, len(STAT_NAMES)]`` float64 statistics on the segments' device, without a sync.

    Rows of segments holding NaN/Inf have ``nonfinite = 1`` as a flag (the exact count and
    finite-only statistics come from `fix_nonfinite`).

    Example:
        >>> device_stats([torch.tensor([1.0, 3.0])])[0, COL["mean"]].item()
        2.0
    """
    n = len(segments)
    if n == 0:
        return torch.zeros(0, len(STAT_NAMES), dtype=torch.float64)
    if any_dtensor(segments):
        return _sharded(segments)
    device = segments[0].device
    # float32 first (one cast for the few non-float32 tensors), one float64 cast of the buffer
    flat = [_plain(s) for s in segments]
    flat = [t if t.dtype == torch.float32 else t.float() for t in flat]
    lengths = torch.tensor([t.numel() for t in flat], device=device)
    x = torch.cat(flat).to(device=device, dtype=torch.float64)
    s1 = torch.segment_reduce(x, "sum", lengths=lengths)
    s2 = torch.segment_reduce(x * x, "sum", lengths=lengths)
    # per-tensor aminmax is one vectorised kernel each and faster than segment max/min on CPU
    nan = torch.tensor(float("nan"), dtype=torch.float64, device=device)
    nan32 = nan.float()
    mm = [torch.aminmax(t) if t.numel() else (nan32, nan32) for t in flat]
    mn = torch.stack([m[0] for m in mm]).to(device=device, dtype=torch.float64)
    mx = torch.stack([m[1] for m in mm]).to(device=device, dtype=torch.float64)
    count = lengths.to(torch.float64)
    mean = s1 / count
    var = (s2 / count - mean * mean).clamp(min=0.0)
    empty = lengths == 0
    mean = torch.where(empty, nan, mean)
    std = torch.where(empty, nan, var.sqrt())
    flag = (~torch.isfinite(s1)).to(torch.float64)
    abs_max = torch.maximum(mn.abs(), mx.abs())
    return torch.stack([mean, std, mn, mx, abs_max, s2.sqrt(), flag, count], 1)


def _sharded(segments: list[torch.Tensor]) -> torch.Tensor:
    """FSDP-sharded (DTensor) parameters: local shards reduced across ranks, exact non-finite
    counts (every rank must record the same segments: it runs collectives)."""
    names = ["l2" if s == "norm" else s for s in STAT_NAMES]
    return summarize_sharded(segments, names)


def light_stats(segments: list[torch.Tensor], abs_max: bool = True) -> torch.Tensor:
    """Only ``nonfinite`` (flag), ``abs_max`` and ``norm``: what rules need on unrecorded steps.

    One fused multi-tensor norm kernel (two with ``abs_max``); the other columns are NaN.

    Example:
        >>> light_stats([torch.tensor([3.0, -4.0])])[0, COL["norm"]].item()
        5.0
    """
    n = len(segments)
    out = torch.full((n, len(STAT_NAMES)), float("nan"), dtype=torch.float64)
    if n == 0:
        return out
    if any_dtensor(segments):
        return _sharded(segments)
    device = segments[0].device
    flat = [_plain(s).float() for s in segments]
    norm = torch.stack(torch._foreach_norm(flat, 2)).to(torch.float64)
    out = out.to(device)
    out[:, COL["norm"]] = norm
    if abs_max:
        nz = [t if t.numel() else t.new_zeros(1) for t in flat]
        out[:, COL["abs_max"]] = torch.stack(torch._foreach_norm(nz, float("inf"))).double()
    out[:, COL["nonfinite"]] = (~torch.isfinite(norm)).to(torch.float64)
    out[:, COL["numel"]] = torch.tensor(
        [t.numel() for t in flat], dtype=torch.float64, device=device
    )
    return out


def exact_row(t: torch.Tensor) -> np.ndarray:
    """Statistics of one tensor over its finite entries, in float64 on the host."""
    x = t.detach().reshape(-1).to("cpu", torch.float64).numpy()
    ok = np.isfinite(x)
    f = x[ok]
    if f.size == 0:
        nan = float("nan")
        return np.array([nan, nan, nan, nan, nan, nan, float((~ok).sum()), float(x.size)])
    return np.array(
        [
            f.mean(),
            f.std(),
            f.min(),
            f.max(),
            np.abs(f).max(),
            np.sqrt((f * f).sum()),
            float((~ok).sum()),
            float(x.size),
        ]
    )


def fix_nonfinite(stats: np.ndarray, segments: list[torch.Tensor]) -> list[int]:
    """Recompute, in place, the rows flagged non-finite by `device_stats`; returns their indices."""
    bad = np.nonzero(stats[:, COL["nonfinite"]] > 0)[0].tolist()
    for i in bad:
        if not is_dtensor(segments[i]):  # sharded rows are exact already
            stats[i] = exact_row(segments[i])
    return bad


def segment_stats(segments: list[torch.Tensor]) -> torch.Tensor:
    """Statistics of each tensor as a ``[n, len(STAT_NAMES)]`` float64 CPU tensor.

    ``std`` is the population standard deviation of the finite entries; ``nonfinite`` counts
    NaN/Inf entries.

    Example:
        >>> s = segment_stats([torch.tensor([1.0, 3.0]), torch.tensor([float("nan"), -2.0])])
        >>> s[:, COL["mean"]].tolist(), s[:, COL["nonfinite"]].tolist()
        ([2.0, -2.0], [0.0, 1.0])
    """
    stats = device_stats(segments).cpu().numpy().copy()
    fix_nonfinite(stats, segments)
    return torch.from_numpy(stats)
