"""Fused statistic reductions over lists of tensors, computed on device.

`summarize` is the one entry point: it reduces every tensor of a list to a row of statistics and
moves the whole ``[n_tensors, n_stats]`` table to the host in a single transfer. The cheap
statistics (norms, ``abs_max``) use fused ``torch._foreach_norm`` kernels across all tensors; the
moment statistics (mean, var, skew, kurtosis, min, max, sparsity) take a two-pass per-tensor path.

Non-finite values: ``nonfinite`` counts NaN and +-Inf elements; every other statistic except
``numel`` is computed over the *finite* elements only. Tensors that contain non-finite values (or
whose float32 norm overflowed) are detected from the first transfer and recomputed exactly in
float64 with a second transfer, so the common all-finite case stays one transfer per call.

Example:
    >>> import torch
    >>> table = summarize([torch.ones(3), torch.zeros(2)], ("numel", "l2", "sparsity"))
    >>> [[round(v, 4) for v in row] for row in table.tolist()]
    [[3.0, 1.7321, 0.0], [2.0, 0.0, 1.0]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "STAT_NAMES",
    "DEFAULT_STATS",
    "Histogram",
    "summarize",
    "histograms",
    "validate_stats",
    "Description",
]

#: Every statistic `summarize` knows, in display order.
STAT_NAMES: tuple[str, ...] = (
    "numel",
    "mean",
    "var",
    "std",
    "skew",
    "kurtosis",
    "min",
    "max",
    "abs_mean",
    "abs_max",
    "l1",
    "l2",
    "rms",
    "sparsity",
    "nonfinite",
)
#: The cheap set the Tracker logs by default (all from fused norm kernels).
DEFAULT_STATS: tuple[str, ...] = ("l2", "rms", "abs_max", "nonfinite")

# statistics obtainable from _foreach_norm without a per-tensor moment pass
_NORM_STATS = frozenset({"numel", "abs_mean", "abs_max", "l1", "l2", "rms", "nonfinite"})
# statistics whose value changes sign/order when the tensor is negated
SIGNED_STATS = frozenset({"mean", "skew", "min", "max"})


def validate_stats(stats: Sequence[str] | str | None) -> tuple[str, ...]:
    """Return `stats` as a tuple of known names (None → all), raising on unknown names.

    Example:
        >>> validate_stats("l2")
        ('l2',)
    """
    if stats is None:
        return STAT_NAMES
    if isinstance(stats, str):
        stats = (stats,)
    stats = tuple(stats)
    unknown = [s for s in stats if s not in STAT_NAMES]
    if unknown:
        raise ValueError(f"unknown statistic(s) {unknown}; valid names are {list(STAT_NAMES)}")
    if not stats:
        raise ValueError(f"stats is empty; choose from {list(STAT_NAMES)}")
    return tuple(dict.fromkeys(stats))


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _moments(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Two-pass moments of a flat floating tensor (all elements finite)."""
    n = x.numel()
    if n == 0:
        nan = torch.full((), math.nan, dtype=x.dtype, device=x.device)
        return dict.fromkeys(("mean", "m2", "m3", "m4", "min", "max", "zeros"), nan)
    mean = x.sum() / n
    d = x - mean
    d2 = d * d
    m2 = d2.sum() / n
    m3 = (d2 * d).sum() / n
    m4 = (d2 * d2).sum() / n
    lo, hi = torch.aminmax(x)
    zeros = (x == 0).sum().to(x.dtype)
    # like scipy: a (numerically) constant tensor has undefined skew/kurtosis
    eps = torch.finfo(x.dtype).eps
    m2 = torch.where(m2 <= (eps * mean) ** 2, torch.zeros_like(m2), m2)
    return {"mean": mean, "m2": m2, "m3": m3, "m4": m4, "min": lo, "max": hi, "zeros": zeros}


def _exact_row(t: torch.Tensor, stats: tuple[str, ...]) -> torch.Tensor:
    """All statistics of one tensor in float64, over its finite elements."""
    x = t.detach().reshape(-1).to(torch.float64)
    finite = torch.isfinite(x)
    total = x.numel()
    nonfinite = (total - finite.sum()).to(torch.float64)
    x = x[finite]
    n = x.numel()
    nan = torch.tensor(math.nan, dtype=torch.float64, device=x.device)
    l1 = x.abs().sum()
    l2 = torch.linalg.vector_norm(x)
    mo = _moments(x)
    m2 = mo["m2"]
    values = {
        "numel": torch.tensor(float(total), dtype=torch.float64, device=x.device),
        "l1": l1,
        "l2": l2,
        "abs_max": x.abs().max() if n else nan,
        "abs_mean": l1 / n if n else nan,
        "rms": l2 / math.sqrt(n) if n else nan,
        "nonfinite": nonfinite,
        "mean": mo["mean"],
        "var": m2,
        "std": m2.sqrt(),
        "skew": mo["m3"] / m2**1.5,
        "kurtosis": mo["m4"] / (m2 * m2) - 3.0,
        "min": mo["min"],
        "max": mo["max"],
        "sparsity": mo["zeros"] / n if n else nan,
    }
    return torch.stack([values[s] for s in stats])


def summarize(
    tensors: Sequence[torch.Tensor], stats: Sequence[str] | str | None = DEFAULT_STATS
) -> torch.Tensor:
    """Statistics of each tensor: a float64 CPU tensor of shape ``[len(tensors), len(stats)]``.

    Statistics are computed on the tensors' device; column ``j`` holds ``stats[j]``. ``skew`` and
    ``kurtosis`` (excess) equal ``scipy.stats.skew/kurtosis(bias=True)``; ``var``/``std`` are the
    population (biased) versions. ``nonfinite`` counts NaN/Inf; the other statistics except
    ``numel`` use only the finite elements.

    Example:
        >>> summarize([torch.tensor([3.0, -4.0])], ["l2", "abs_max", "mean"]).tolist()
        [[5.0, 4.0, -0.5]]
    """
    stats = validate_stats(stats)
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"summarize expects tensors, item {i} is {type(t).__name__}")
    if not tensors:
        return torch.zeros((0, len(stats)), dtype=torch.float64)
    flat = [t.detach().reshape(-1) for t in tensors]
    flat = [t if t.is_floating_point() else t.to(torch.float32) for t in flat]
    numels = [t.numel() for t in flat]
    dev = flat[0].device

    def column(values: Sequence[torch.Tensor]) -> torch.Tensor:
        # tiny per-tensor scalars; moving them to one device is free compared to the reductions
        return torch.stack([v.to(device=dev, dtype=torch.float64) for v in values])

    need = set(stats)
    n_vec = torch.tensor(numels, dtype=torch.float64, device=dev)
    # l2 doubles as the finiteness probe: NaN/Inf anywhere (or float32 overflow) makes it non-finite
    l2 = column(torch._foreach_norm(flat, 2))
    cols: dict[str, torch.Tensor] = {
        "numel": n_vec,
        "l2": l2,
        "rms": l2 / n_vec.sqrt(),
        "nonfinite": torch.zeros_like(l2),
    }
    if need & {"l1", "abs_mean"}:
        cols["l1"] = column(torch._foreach_norm(flat, 1))
        cols["abs_mean"] = cols["l1"] / n_vec
    if "abs_max" in need:
        # the inf-norm of an empty tensor is an error; empty tensors are recomputed below anyway
        cols["abs_max"] = column(
            torch._foreach_norm([x if x.numel() else x.new_zeros(1) for x in flat], math.inf)
        )
    if need - _NORM_STATS:
        mo = [_moments(x.to(_work_dtype(x))) for x in flat]
        m = {k: column([row[k] for row in mo]) for k in mo[0]}
        m2 = m["m2"]
        cols.update(
            mean=m["mean"],
            var=m2,
            std=m2.sqrt(),
            skew=m["m3"] / m2**1.5,
            kurtosis=m["m4"] / (m2 * m2) - 3.0,
            min=m["min"],
            max=m["max"],
            sparsity=m["zeros"] / n_vec,
        )
    # the single host transfer of the common case
    table = torch.stack([cols[s] for s in stats] + [l2], dim=1).cpu()
    probe = table[:, -1]
    table = table[:, :-1].contiguous()
    bad = (~torch.isfinite(probe)).nonzero().flatten().tolist()
    bad += [i for i, n in enumerate(numels) if n == 0 and i not in bad]
    if bad:
        fixed = torch.stack([_exact_row(tensors[i], stats) for i in bad]).cpu()
        table[bad] = fixed
    return table


@dataclass(frozen=True)
class Histogram:
    """A histogram computed on device: ``counts[i]`` elements fall in ``[edges[i], edges[i+1])``.

    ``num``/``sum``/``sum_squares``/``min``/``max`` describe the finite elements (what
    TensorBoard's histogram protocol expects). Sinks turn it into their native format.

    Example:
        >>> h = histograms([torch.tensor([0.0, 1.0, 1.0])], bins=2)[0]
        >>> h.counts.tolist(), h.num
        ([1.0, 2.0], 3.0)
    """

    counts: np.ndarray
    edges: np.ndarray
    min: float
    max: float
    num: float
    sum: float
    sum_squares: float


def histograms(tensors: Sequence[torch.Tensor], bins: int = 64) -> list[Histogram]:
    """Histograms of the finite elements of each tensor (``torch.histc`` on device).

    Two host transfers for the whole list (ranges, then counts), not one per tensor.

    Example:
        >>> [h.counts.sum() for h in histograms([torch.arange(10.0)], bins=5)]
        [np.float64(10.0)]
    """
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    tensors = list(tensors)
    if not tensors:
        return []
    table = summarize(tensors, ("min", "max", "numel", "nonfinite", "mean", "l2"))
    counts = []
    ranges = []
    for t, (lo, hi, *_rest) in zip(tensors, table.tolist(), strict=True):
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo, hi = 0.0, 1.0  # no finite element: empty histogram on a nominal range
        if lo == hi:
            lo, hi = lo - 0.5, hi + 0.5
        ranges.append((lo, hi))
        x = t.detach().reshape(-1)
        x = x if x.dtype in (torch.float32, torch.float64) else x.float()
        # histc counts every element in [lo, hi] and ignores NaN; Inf lies outside the range
        counts.append(torch.histc(x, bins=bins, min=lo, max=hi).to(torch.float64))
    counts_host = torch.stack([c.cpu() for c in counts]).numpy()
    out = []
    for (lo, hi), c, (mn, mx, numel, nonfinite, mean, l2) in zip(
        ranges, counts_host, table.tolist(), strict=True
    ):
        num = numel - nonfinite
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


def _fmt(v: float) -> str:
    if v != v or v in (math.inf, -math.inf):
        return str(v)
    if v == int(v) and abs(v) < 1e12:
        return str(int(v))
    return f"{v:.4g}"


class Description(dict):
    """Result of `NetDict.describe`: a dict with a readable table as `repr` and `to_frame()`.

    Whole network: ``{stat: value}``. Per layer: ``{layer: {stat: value}}``.

    Example:
        >>> d = Description({"l2": 5.0, "numel": 2.0})
        >>> print(d)
        stat   value
        l2     5
        numel  2
    """

    @property
    def layerwise(self) -> bool:
        return bool(self) and all(isinstance(v, dict) for v in self.values())

    def to_frame(self) -> pd.DataFrame:
        """Layers as rows and statistics as columns (one row ``"all"`` for the whole network)."""
        import pandas as pd

        if self.layerwise:
            return pd.DataFrame.from_dict(dict(self), orient="index")
        return pd.DataFrame([dict(self)], index=["all"])

    def __repr__(self) -> str:
        if not self:
            return "(no statistics)"
        if self.layerwise:
            stats = list(next(iter(self.values())))
            rows = [["layer", *stats]] + [[k, *map(_fmt, v.values())] for k, v in self.items()]
        else:
            rows = [["stat", "value"]] + [[k, _fmt(v)] for k, v in self.items()]
        widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join(line.rstrip() for line in lines)

    __str__ = __repr__
