"""Statistics of many tensors, computed on device with one host transfer.

Why not `nnstat.describe.summarize`: it transfers to the host itself, while the recorder must
append rule hits and raw values to the same transfer, and evaluate rules on device first. The
reductions themselves are `nnstat.describe.torch_segments`' (a recorded step has hundreds of small
segments: each tensor, its gradient, and its first k samples; the core reduces them in a fixed
number of kernels per dtype, two-pass moments included). `test_recorder_activations.py` checks
that both agree.

Statistics ignore non-finite entries (a single NaN would otherwise erase every other number) and
count them in ``nonfinite``. The device pass assumes finite data: its finiteness probe flags the
(rare) segments that hold NaN/Inf, and `fix_nonfinite` recomputes only those, exactly, after the
transfer.
"""

from __future__ import annotations

import numpy as np
import torch

from nnstat.describe import partials
from nnstat.describe.sharded import summarize_sharded
from nnstat.describe.torch_segments import segment_table
from nnstat.distributed import any_dtensor, is_dtensor

STAT_NAMES: tuple[str, ...] = ("mean", "std", "min", "max", "abs_max", "norm", "nonfinite", "numel")
COL = {name: i for i, name in enumerate(STAT_NAMES)}
#: `STAT_NAMES` as `nnstat.describe` names them.
_DESCRIBE_NAMES = tuple("l2" if s == "norm" else s for s in STAT_NAMES)
# the core's names of STAT_NAMES but "nonfinite" (the flag comes from the core's probe column)
_CORE = ("mean", "std", "min", "max", "abs_max", "l2", "numel")


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
    return _with_flag(segment_table(segments, _CORE)[0])


def _with_flag(table: torch.Tensor) -> torch.Tensor:
    """The core's table (`_CORE` columns, probe last) with the probe as the non-finite flag."""
    flag = (~torch.isfinite(table[:, -1])).to(torch.float64)
    at = COL["nonfinite"]
    return torch.cat([table[:, :at], flag[:, None], table[:, at : at + 1]], dim=1)


def _sharded(segments: list[torch.Tensor]) -> torch.Tensor:
    """FSDP-sharded (DTensor) parameters: local shards reduced across ranks, exact non-finite
    counts (every rank must record the same segments: it runs collectives)."""
    return summarize_sharded(segments, _DESCRIBE_NAMES)


def light_stats(segments: list[torch.Tensor], abs_max: bool = True) -> torch.Tensor:
    """Only ``nonfinite`` (flag), ``abs_max`` and ``norm``: what rules need on unrecorded steps.

    The multi-tensor norm kernels of `nnstat.describe.torch_segments` (one per dtype, two with
    ``abs_max``); the other columns are NaN.

    Example:
        >>> light_stats([torch.tensor([3.0, -4.0])])[0, COL["norm"]].item()
        5.0
    """
    n = len(segments)
    if n == 0:
        return torch.full((0, len(STAT_NAMES)), float("nan"), dtype=torch.float64)
    if any_dtensor(segments):
        return _sharded(segments)
    cols = ("l2", "abs_max", "numel") if abs_max else ("l2", "numel")
    table = segment_table(segments, cols)[0]
    out = torch.full((n, len(STAT_NAMES)), float("nan"), dtype=torch.float64, device=table.device)
    out[:, COL["norm"]] = table[:, 0]
    if abs_max:
        out[:, COL["abs_max"]] = table[:, 1]
    out[:, COL["nonfinite"]] = (~torch.isfinite(table[:, -1])).to(torch.float64)
    out[:, COL["numel"]] = table[:, -2]
    return out


def exact_row(t: torch.Tensor) -> np.ndarray:
    """Statistics of one tensor over its finite entries, in float64 on the host
    (`nnstat.describe.partials.exact_row`); all NaN but the counts when none is finite.

    Example:
        >>> exact_row(torch.tensor([3.0, float("nan"), -4.0]))[[COL["norm"], COL["nonfinite"]]]
        array([5., 1.])
    """
    row = partials.exact_row(t).cpu()
    out = partials.finish(row[None], _DESCRIBE_NAMES, partials.eps_of(torch.float64))[0]
    if row[partials.N] == 0:
        out[COL["norm"]] = float("nan")
    return out.numpy()


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
