"""Fused statistic reductions over lists of tensors, computed on device.

`summarize` is the one entry point: it reduces every tensor of a list to a row of statistics and
moves the whole ``[n_tensors, n_stats]`` table to the host in a single transfer. The cheap
statistics (norms, ``abs_max``) use fused ``torch._foreach_norm`` kernels across all tensors; the
moment statistics (mean, var, skew, kurtosis, min, max, sparsity) take a two-pass per-tensor path.

On accelerators (any device but the CPU) `device_table` hands the whole list to
`nnstat.describe.segments`, which needs a fixed number of kernels per dtype group instead.

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

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from nnstat.describe.moments import _MOMENT_KEYS, Workspace, _moments
from nnstat.describe.segments import NORM_STATS, segment_table

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "partial_rows",
    "STAT_NAMES",
    "DEFAULT_STATS",
    "summarize",
    "validate_stats",
    "Description",
    "cpu_single_thread",
    "device_table",
    "pair_tables",
    "repair_table",
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

# statistics whose value changes sign/order when the tensor is negated
SIGNED_STATS = frozenset({"mean", "skew", "min", "max"})


@contextlib.contextmanager
def cpu_single_thread() -> Iterator[None]:
    """Run torch CPU ops on one intra-op thread inside the block (restored afterwards).

    The statistic passes work on cache-sized blocks; splitting each small block over threads
    costs more in synchronisation than it saves, badly so on a loaded machine. The setting is process-wide, so
    torch ops running concurrently in other Python threads are affected while the block runs.

    Example:
        >>> with cpu_single_thread():
        ...     torch.get_num_threads()
        1
    """
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


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


def _shape_stats(mo: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """mean, var, std, skew, kurtosis (excess), min and max from `_moments`' central moments
    (one tensor's, or stacked for many)."""
    m2 = mo["m2"]
    return {
        "mean": mo["mean"],
        "var": m2,
        "std": m2.sqrt(),
        "skew": mo["m3"] / m2**1.5,
        "kurtosis": mo["m4"] / (m2 * m2) - 3.0,
        "min": mo["min"],
        "max": mo["max"],
    }


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
    values = {
        "numel": torch.tensor(float(total), dtype=torch.float64, device=x.device),
        "l1": l1,
        "l2": l2,
        "abs_max": x.abs().max() if n else nan,
        "abs_mean": l1 / n if n else nan,
        "rms": l2 / math.sqrt(n) if n else nan,
        "nonfinite": nonfinite,
        **_shape_stats(mo),
        "sparsity": mo["zeros"] / n if n else nan,
    }
    return torch.stack([values[s] for s in stats])


def summarize(
    tensors: Sequence[torch.Tensor],
    stats: Sequence[str] | str | None = DEFAULT_STATS,
    workspace: Workspace | None = None,
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
    tensors = list(tensors)
    on_cpu = all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors)
    with cpu_single_thread() if on_cpu else contextlib.nullcontext():
        return _summarize(tensors, stats, workspace)


def _summarize(
    tensors: list[torch.Tensor], stats: Sequence[str] | str | None, workspace: Workspace | None
) -> torch.Tensor:
    stats = validate_stats(stats)
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"summarize expects tensors, item {i} is {type(t).__name__}")
    if not tensors:
        return torch.zeros((0, len(stats)), dtype=torch.float64)
    from nnstat.distributed import any_dtensor, summarize_sharded

    if any_dtensor(tensors):
        # sharded parameters (FSDP fully_shard): local shards reduced across ranks, no gather
        return summarize_sharded(tensors, stats, local_rows=partial_rows)
    # the single host transfer of the common case
    return repair_table(device_table(tensors, stats, workspace).cpu(), tensors, stats)


def _host_path(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `device_table` takes the per-tensor CPU path (numpy blocks, cache-sized torch
    blocks) rather than the grouped device core: all tensors on the CPU."""
    return all(t.device.type == "cpu" for t in tensors)


def device_table(
    tensors: Sequence[torch.Tensor], stats: tuple[str, ...], workspace: Workspace | None = None
) -> torch.Tensor:
    """The statistics of `summarize` left on the tensors' device: ``[n, len(stats) + 1]`` float64.

    The last column is the finiteness probe (l2, NaN/Inf when a tensor holds non-finite values
    or overflowed in float32); nothing is read back to the host (no ``.item()``), so callers can
    move the tables of many groups in one transfer and then call `repair_table` on the host.
    `stats` must be validated; `tensors` non-empty plain tensors on one device.

    Example:
        >>> device_table([torch.tensor([3.0, -4.0])], ("l2", "max")).tolist()
        [[5.0, 3.0, 5.0]]
    """
    if not _host_path(tensors):
        # accelerators: O(dtype groups) kernels for the whole list (nnstat.describe.segments)
        return segment_table(tensors, stats, workspace)[0]
    flat = [t.detach().reshape(-1) for t in tensors]
    flat = [t if t.is_floating_point() else t.to(torch.float32) for t in flat]
    numels = [t.numel() for t in flat]
    dev = flat[0].device

    def column(values: Sequence[torch.Tensor]) -> torch.Tensor:
        # tiny per-tensor scalars; moving them to one device is free compared to the reductions
        return torch.stack([v.to(device=dev, dtype=torch.float64) for v in values])

    need = set(stats)
    # non_blocking: a pageable host-to-device copy then does not wait for the queued kernels
    n_vec = torch.tensor(numels, dtype=torch.float64).to(dev, non_blocking=True)
    cols: dict[str, torch.Tensor] = {"numel": n_vec}
    if need - NORM_STATS:
        # one blocked pass gives every statistic (l2, l1, abs_max included)
        ws = workspace or Workspace()
        mo = [_moments(x.to(_work_dtype(x)), ws) for x in flat]
        return _moment_table(mo, n_vec, stats)
    else:
        if "abs_max" in need:
            from nnstat.describe.fused import sumsq_min_max

            # one blocked read gives l2 and abs_max (the inf-norm kernel is slow on CPU);
            # empty tensors are recomputed by repair_table anyway
            smm = sumsq_min_max(flat).to(dev)
            cols["l2"] = smm[:, 0].sqrt()
            cols["abs_max"] = torch.maximum(smm[:, 2], -smm[:, 1])
        else:
            cols["l2"] = column(torch._foreach_norm(flat, 2))
        if need & {"l1", "abs_mean"}:
            cols["l1"] = column(torch._foreach_norm(flat, 1))
    # l2 doubles as the finiteness probe: NaN/Inf anywhere (or float32 overflow) makes it non-finite
    l2 = cols["l2"]
    cols["rms"] = l2 / n_vec.sqrt()
    cols["nonfinite"] = torch.zeros_like(l2)
    if "l1" in cols:
        cols["abs_mean"] = cols["l1"] / n_vec
    return torch.stack([cols[s] for s in stats] + [l2], dim=1)


def _moment_table(
    mo: Sequence[dict[str, torch.Tensor]], n_vec: torch.Tensor, stats: tuple[str, ...]
) -> torch.Tensor:
    """`device_table`'s table (probe column last) from per-tensor `_moments` dicts."""
    dev = n_vec.device
    m = {
        k: torch.stack([row[k].to(device=dev, dtype=torch.float64) for row in mo])
        for k in _MOMENT_KEYS
    }
    l1, l2 = m["l1"], m["l2"]
    cols = {
        "numel": n_vec,
        **_shape_stats(m),
        "abs_max": torch.maximum(m["max"], -m["min"]),
        "sparsity": m["zeros"] / n_vec,
        "l1": l1,
        "l2": l2,
        "rms": l2 / n_vec.sqrt(),
        "nonfinite": torch.zeros_like(l2),
        "abs_mean": l1 / n_vec,
    }
    return torch.stack([cols[s] for s in stats] + [l2], dim=1)


def pair_tables(
    current: Sequence[torch.Tensor],
    previous: Sequence[torch.Tensor],
    stats: Sequence[str] | str | None,
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``summarize(current, stats)`` and ``summarize([c - p ...], stats)`` with one read of
    each pair and no difference tensor (CPU float32/float64 pairs of equal shapes, see
    `nnstat.describe.moments.pair_ok`): a Tracker's weights and their update.

    Example:
        >>> w, u = pair_tables([torch.tensor([3.0, -4.0])], [torch.tensor([3.0, -5.0])], ["l2"])
        >>> w.tolist(), u.tolist()
        ([[5.0]], [[1.0]])
    """
    from nnstat.describe.moments import moments_of_pair

    stats = validate_stats(stats)
    current, previous = list(current), list(previous)
    ws = workspace or Workspace()
    with cpu_single_thread():
        pairs = [
            moments_of_pair(c.detach().reshape(-1), p.reshape(-1), ws)
            for c, p in zip(current, previous, strict=True)
        ]
        n_vec = torch.tensor([float(c.numel()) for c in current], dtype=torch.float64)
        tw = _moment_table([a for a, _ in pairs], n_vec, stats)
        td = _moment_table([b for _, b in pairs], n_vec, stats)
        # NaN/Inf (rare): exact rows over the finite elements; the difference is formed only then
        tw = _repair(tw, [t.numel() for t in current], lambda i: _exact_row(current[i], stats))
        td = _repair(
            td, [t.numel() for t in current],
            lambda i: _exact_row(current[i].detach() - previous[i], stats),
        )  # fmt: skip
    return tw, td


def repair_table(
    table: torch.Tensor, tensors: Sequence[torch.Tensor], stats: tuple[str, ...]
) -> torch.Tensor:
    """`device_table`'s result, on the host, without its probe column and with the rows of
    tensors holding NaN/Inf (or empty) recomputed exactly in float64 over the finite elements.

    Only those rows cost a second transfer; the common all-finite case costs none.
    """
    return _repair(table, [t.numel() for t in tensors], lambda i: _exact_row(tensors[i], stats))


def _repair(
    table: torch.Tensor, numels: Sequence[int], exact: Callable[[int], torch.Tensor]
) -> torch.Tensor:
    probe = table[:, -1]
    table = table[:, :-1].contiguous()
    bad = (~torch.isfinite(probe)).nonzero().flatten().tolist()
    bad += [i for i, n in enumerate(numels) if n == 0 and i not in bad]
    if bad:
        table[bad] = torch.stack([exact(i) for i in bad]).cpu()
    return table


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


#: What `partial_rows` reads of each local shard (all over its finite elements).
_ROW_STATS = ("numel", "nonfinite", "mean", "var", "skew", "kurtosis", "min", "max")
_ROW_STATS += ("sparsity", "l1", "l2")


def partial_rows(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[k, 11]`` float64 CPU partial rows (`nnstat.distributed.PARTIAL_COLUMNS`) of the local
    shards of `tensors`, from ONE `summarize` of them all (the statistics core: a fixed number
    of kernels per dtype and one host read), instead of ~20 kernels and two reads per tensor.

    The central sums come back from the moments (``s2 = n var``, ``s3 = n skew var^1.5``,
    ``s4 = n (kurtosis + 3) var^2``; zero for a constant part), exact to float64 rounding.

    Example:
        >>> from nnstat.distributed import partial_row
        >>> x = torch.tensor([1.0, 2.0, 4.0, float("nan")])
        >>> torch.allclose(partial_rows([x])[0], partial_row(x), rtol=1e-12)
        True
    """
    from nnstat.distributed import local_tensor

    local = [local_tensor(t).detach() for t in tensors]
    col = dict(zip(_ROW_STATS, summarize(local, _ROW_STATS).unbind(1), strict=True))
    n = col["numel"] - col["nonfinite"]
    has = n > 0
    zero = torch.zeros_like(n)
    var = torch.where(has, col["var"], zero)
    moving = var > 0  # a constant part's higher central sums are zero (its skew is NaN)
    s3 = torch.where(moving, col["skew"] * var.pow(1.5) * n, zero)
    s4 = torch.where(moving, (col["kurtosis"] + 3.0) * var * var * n, zero)
    inf = torch.full_like(n, math.inf)
    return torch.stack(
        [
            col["numel"],
            n,
            torch.where(has, col["mean"] * n, zero),
            var * n,
            s3,
            s4,
            torch.where(has, col["min"], inf),
            torch.where(has, col["max"], -inf),
            torch.where(has, torch.round(col["sparsity"] * n), zero),  # a count
            torch.where(has, col["l1"], zero),
            torch.where(has, col["l2"] * col["l2"], zero),
        ],
        dim=1,
    )
