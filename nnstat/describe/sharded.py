"""Statistics of sharded tensors (DTensors: FSDP's ``fully_shard``), never gathered.

Every rank reduces its local shards with the statistics core to partial rows
(`nnstat.describe.partials`), the rows are exchanged with one ``all_gather`` per process group
(`nnstat.distributed.all_gather_rows`) and combined with `partials.merge`, the same code that
combines a tensor's blocks; `partials.finish` turns them into columns. Ordinary tensors in the
list are taken as replicated (each rank holds all of it).

Example:
    >>> import torch
    >>> table = summarize_sharded([torch.tensor([1.0, 2.0, 4.0])], ("mean", "max"))
    >>> [round(v, 4) for v in table[0].tolist()]
    [2.3333, 4.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from nnstat.describe.core import local_partial_rows
from nnstat.describe.partials import SQ, eps_of, finish, merge
from nnstat.distributed import all_gather_rows, all_reduce_over, local_tensor, shard_groups

__all__ = ["summarize_sharded", "norms_sharded", "global_rows"]


def global_rows(tensors: Sequence[torch.Tensor], stats: Sequence[str]) -> torch.Tensor:
    """Partial rows ``[k, WIDTH]`` (float64, CPU) of the whole tensors: the local shards' rows
    from the statistics core (`nnstat.describe.core.local_partial_rows`), merged over every
    shard group (one collective per distinct set of groups).

    Example:
        >>> global_rows([torch.ones(3)], ("l2",)).shape
        torch.Size([1, 13])
    """
    rows = local_partial_rows([local_tensor(t) for t in tensors], tuple(stats))
    by_groups: dict[tuple[int, ...], tuple[tuple[Any, ...], list[int]]] = {}
    for i, t in enumerate(tensors):
        groups = shard_groups(t)
        if groups:
            key = tuple(id(g) for g in groups)
            by_groups.setdefault(key, (groups, []))[1].append(i)
    for groups, idx in by_groups.values():
        part = rows[idx]
        for group in groups:  # a shard grid: one mesh dimension after the other
            part = merge(all_gather_rows(part, group))
        rows[idx] = part
    return rows


def summarize_sharded(
    tensors: Sequence[torch.Tensor], stats: Sequence[str], combine: bool = False
) -> torch.Tensor:
    """`nnstat.describe.summarize` for lists that hold DTensors: statistics of the whole tensors.

    Every rank must call it with the same list (it runs collectives). Semantics (finite
    elements, population variance, scipy's biased skew/kurtosis) are those of ``summarize``.

    Args:
        tensors: DTensors and ordinary tensors (taken as replicated).
        stats: validated names of `nnstat.describe.STAT_NAMES`.
        combine: one row describing all tensors as if concatenated
            (``NetDict.describe(layerwise=False)``).

    Returns:
        float64 CPU ``[len(tensors) or 1, len(stats)]``.

    Raises:
        ValueError: a DTensor with a ``Partial`` placement (`nnstat.distributed.shard_groups`).

    Example:
        >>> summarize_sharded([torch.tensor([3.0, -4.0])], ["l2", "abs_max", "mean"]).tolist()
        [[5.0, 4.0, -0.5]]
    """
    stats = tuple(stats)
    rows = global_rows(tensors, stats)
    dtypes = {local_tensor(t).dtype for t in tensors}
    eps = eps_of(torch.float64 if dtypes == {torch.float64} else torch.float32)
    if combine:
        rows = merge(rows.unsqueeze(1))
    return finish(rows, stats, eps)


def norms_sharded(tensors: Sequence[torch.Tensor], p: float = 2) -> list[float]:
    """The p-norm of each whole tensor (DTensors reduced across their shards, never gathered).

    Args:
        tensors: DTensors and ordinary tensors.
        p: the order (``inf``/``-inf``: max/min of ``|x|``; 0: the non-zero count).

    Returns:
        One float per tensor.

    Example:
        >>> norms_sharded([torch.tensor([3.0, 4.0])], 2)
        [5.0]
    """
    if p == 2:
        return global_rows(tensors, ("l2",))[:, SQ].sqrt().tolist()
    out = []
    for t in tensors:
        x = local_tensor(t).detach().reshape(-1).to(torch.float64)
        if p in (math.inf, -math.inf):
            if x.numel() == 0:
                part = torch.tensor(-math.inf if p > 0 else math.inf, dtype=torch.float64)
            else:
                part = x.abs().max() if p > 0 else x.abs().min()
            op = "max" if p > 0 else "min"
        else:
            part = torch.count_nonzero(x).double() if p == 0 else x.abs().pow(p).sum()
            op = "sum"
        v = float(all_reduce_over(part.reshape(1).cpu(), shard_groups(t), op))
        out.append(v if p in (0, math.inf, -math.inf) else v ** (1.0 / p))
    return out
