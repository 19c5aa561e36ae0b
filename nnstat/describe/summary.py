"""Statistics of lists of tensors, computed on device with one host transfer.

`summarize` is the one entry point: it reduces every tensor of a list to a row of statistics and
moves the whole ``[n_tensors, n_stats]`` table to the host in a single transfer. The tensors go
to the statistics core (`nnstat.describe.core.partial_table`: CPU blocks, or on accelerators
`nnstat.describe.torch_segments` in a fixed number of kernels per dtype group), which gives one
partial row per tensor; `nnstat.describe.partials.finish` turns the rows into the columns.

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

from nnstat.describe import partials as pr
from nnstat.describe.block_passes import BlockPass
from nnstat.describe.core import partial_table, to_repair
from nnstat.describe.moments import Workspace
from nnstat.describe.numpy_blocks import norm_partials_pass

if TYPE_CHECKING:
    import pandas as pd

__all__ = [
    "STAT_NAMES",
    "DEFAULT_STATS",
    "summarize",
    "summarize_pass",
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
#: The cheap set the Tracker logs by default (all from norm kernels, no moment pass).
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


def _exact_row(t: torch.Tensor, stats: tuple[str, ...]) -> torch.Tensor:
    """All statistics of one tensor in float64, over its finite elements (on the host)."""
    return pr.finish(pr.exact_row(t)[None], stats, pr.eps_of(torch.float64))[0].cpu()


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
    from nnstat.describe.sharded import summarize_sharded
    from nnstat.distributed import any_dtensor

    if any_dtensor(tensors):
        # sharded parameters (FSDP fully_shard): local shards reduced across ranks, no gather
        return summarize_sharded(tensors, stats)
    # the single host transfer of the common case
    table = device_table(tensors, stats, workspace)
    try:
        host = table.cpu()
    except NotImplementedError as e:  # torch's "Cannot copy out of meta tensor"
        if not table.is_meta:
            raise
        raise RuntimeError(
            "the tensors are on the meta device and have no values to describe: build the "
            "model on a real device (or load its weights) to compute its statistics; on meta "
            "they count operations only"
        ) from e
    return repair_table(host, tensors, stats)


def summarize_pass(tensors: Sequence[torch.Tensor], stats: tuple[str, ...]) -> BlockPass | None:
    """``summarize(tensors, stats)`` as a blocked pass (`nnstat.describe.block_passes.BlockPass`,
    its result is that table) to run with other passes in one (`block_passes.run_passes`):
    plain CPU tensors whose statistics need no moment pass. None otherwise (call `summarize`).

    Args:
        tensors: the tensors, one row each.
        stats: statistic names (`STAT_NAMES`).

    Returns:
        The pass, or None where `summarize` takes another path (no tensors, a tensor off the
        CPU or a DTensor, statistics that need the moment pass).

    Raises:
        ValueError: an unknown statistic name.

    Example:
        >>> from nnstat.describe.block_passes import run_passes
        >>> x = [torch.tensor([3.0, -4.0])]
        >>> run_passes([summarize_pass(x, ("l2", "abs_max"))])[0].tolist()
        [[5.0, 4.0]]
    """
    from nnstat.distributed import any_dtensor

    stats = validate_stats(stats)
    tensors = list(tensors)
    if (
        not tensors
        or set(stats) - pr.NORM_STATS
        or not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in tensors)
        or any_dtensor(tensors)
    ):
        return None
    with cpu_single_thread():
        blocked = norm_partials_pass(tensors, stats)

    def table(partial: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # what `summarize` does with `partial_table`'s rows (`device_table`, then the repair)
        with cpu_single_thread():
            return repair_table(pr.probe_table(*partial, stats).cpu(), tensors, stats)

    return blocked.then(table)


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
    return pr.probe_table(*partial_table(tensors, stats, workspace), stats)


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
        eps = torch.tensor([pr.eps_of(c.dtype) for c in current], dtype=torch.float64)
        tw = pr.probe_table(torch.stack([a for a, _ in pairs]), eps, stats)
        td = pr.probe_table(torch.stack([b for _, b in pairs]), eps, stats)
        # NaN/Inf (rare): exact rows over the finite elements; the difference is formed only then
        tw = _repair(tw, [t.numel() for t in current], lambda i: _exact_row(current[i], stats))
        td = _repair(
            td,
            [t.numel() for t in current],
            lambda i: _exact_row(current[i].detach() - previous[i], stats),
        )
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
    bad = to_repair(table[:, -1], numels)
    table = table[:, :-1].contiguous()
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
