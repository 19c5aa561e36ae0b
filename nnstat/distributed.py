"""Shared helpers for ``torch.distributed``: rank/world size, reductions, sharded statistics.

The one place nnstat asks "am I distributed?" and reduces partial statistics across ranks.

Sharded parameters (``DTensor``, as ``torch.distributed.fsdp.fully_shard`` makes them) are never
gathered: every rank reduces its local shard to a small row of partial sums (count, sum, central
sums of squares/cubes/fourth powers, min, max, zeros, l1, sum of squares, non-finite count),
the rows are exchanged with one ``all_gather`` per process group, and combined exactly (in
float64) with the same parallel-moment formulas a single process would use on the whole tensor.

Example:
    >>> import torch
    >>> rank_world()
    (0, 1)
    >>> table = summarize_sharded([torch.tensor([1.0, 2.0, 4.0])], ("mean", "max"))
    >>> [round(v, 4) for v in table[0].tolist()]
    [2.3333, 4.0]
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "rank_world",
    "is_distributed",
    "is_dtensor",
    "local_tensor",
    "shard_groups",
    "all_reduce_sum",
    "summarize_sharded",
    "shift_power_sums",
    "norms_sharded",
    "partial_row",
    "PARTIAL_COLUMNS",
    "any_dtensor",
    "clean_name",
    "fsdp1_shards",
    "fsdp1_view",
    "fsdp1_whole",
    "fsdp1_grad",
]

# column layout of a partial row; every column but MIN/MAX combines by summation
_NUMEL, _N, _SUM, _S2, _S3, _S4, _MIN, _MAX, _ZEROS, _L1, _SQ = range(11)
_WIDTH = 11
#: The columns of a partial row (`partial_row`): element count, finite count, sum, central sums
#: of squares, cubes and fourth powers (about the part's own mean), min, max, zeros, l1, sum of
#: squares, all over the finite elements.
PARTIAL_COLUMNS = ("numel", "n", "sum", "s2", "s3", "s4", "min", "max", "zeros", "l1", "sq")


def is_distributed() -> bool:
    """True when ``torch.distributed`` is available and a process group is initialised."""
    return dist.is_available() and dist.is_initialized()


def rank_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` in `group` under an initialised process group, else ``(0, 1)``.

    Example:
        >>> rank_world()
        (0, 1)
    """
    if is_distributed():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum `tensor` in place over the ranks of `group` (no-op when not distributed); returns it.

    Example:
        >>> all_reduce_sum(torch.tensor([2.0])).tolist()
        [2.0]
    """
    if is_distributed() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor


def is_dtensor(t: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (or subclass), without importing it.

    Example:
        >>> is_dtensor(torch.ones(1))
        False
    """
    # no DTensor can exist before its module is imported: keeps `import nnstat` light
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def any_dtensor(tensors: Sequence[Any]) -> bool:
    """True when at least one item of `tensors` is a DTensor."""
    return any(is_dtensor(t) for t in tensors)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank's local shard of a DTensor (a view, no communication); other tensors unchanged.

    Example:
        >>> local_tensor(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    return t.to_local() if is_dtensor(t) else t


def shard_groups(t: torch.Tensor) -> tuple[Any, ...]:
    """Process groups across which `t`'s local shards are disjoint pieces of the whole tensor.

    One group per mesh dimension with a ``Shard`` placement (``Replicate`` dimensions hold copies
    and need no reduction); ``()`` for ordinary tensors. A ``Partial`` placement (pending sums)
    is refused: its local values are not pieces of the tensor.
    """
    if not is_dtensor(t):
        return ()
    groups = []
    for dim, placement in enumerate(t.placements):
        if placement.is_shard():
            groups.append(t.device_mesh.get_group(dim))
        elif not placement.is_replicate():
            raise ValueError(
                f"cannot describe a DTensor with a {type(placement).__name__} placement "
                f"({placement}) on mesh dim {dim}: only Shard and Replicate placements hold the "
                "tensor's values (redistribute first)"
            )
    return tuple(groups)


def partial_row(t: torch.Tensor) -> torch.Tensor:
    """The partial row (float64, ``[_WIDTH]``) of one local tensor, over its finite elements."""
    x = local_tensor(t).detach().reshape(-1)
    row = torch.zeros(_WIDTH, dtype=torch.float64, device=x.device)
    row[_NUMEL] = x.numel()
    row[_MIN], row[_MAX] = math.inf, -math.inf
    x = x.to(torch.float64)
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        x = x[finite]
    n = x.numel()
    if n == 0:
        return row
    s = x.sum()
    d = x - s / n
    d2 = d * d
    s2, s3, s4 = d2.sum(), torch.dot(d2, d), torch.dot(d2, d2)
    # s / n is rounded, so the deviations about it do not sum to zero; moving the moments to
    # the exact mean keeps that residue out of them (a constant tensor's would be its spread)
    r = d.sum() / n
    row[_N], row[_SUM] = n, s
    row[_S2] = s2 - n * r * r
    row[_S3] = s3 - 3 * r * s2 + 2 * n * r**3
    row[_S4] = s4 - 4 * r * s3 + 6 * r * r * s2 - 3 * n * r**4
    row[_MIN], row[_MAX] = torch.aminmax(x)
    row[_ZEROS] = n - torch.count_nonzero(x)
    row[_L1] = x.abs().sum()
    row[_SQ] = torch.dot(x, x)
    return row


def shift_power_sums(
    n: torch.Tensor,
    d: torch.Tensor,
    s1: torch.Tensor | float,
    s2: torch.Tensor,
    s3: torch.Tensor,
    s4: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Merge parts' power sums about their own centres into sums about one common centre.

    Part ``i`` holds ``n_i`` values with ``s_k,i = Σ (x - c_i)^k``; with ``d_i = c_i - c`` the
    sums about ``c`` are ``Σ_i Σ (x - c)^k`` (binomial expansion of ``(x - c_i + d_i)^k``),
    summed over dim 0. ``s1 = 0`` when each centre is its part's mean. The one home of the
    parallel-moment merge: `describe`'s blocked moments and the sharded statistics below both
    use it (this file is the lowest layer, under `describe`).

    Example:
        >>> x = torch.tensor([1.0, 2.0, 4.0, 7.0], dtype=torch.float64)
        >>> parts = [x[:2], x[2:]]
        >>> c = x.mean()
        >>> n = torch.tensor([2.0, 2.0], dtype=torch.float64)
        >>> d = torch.stack([p.mean() for p in parts]) - c
        >>> s = [torch.stack([((p - p.mean()) ** k).sum() for p in parts]) for k in (2, 3, 4)]
        >>> m2, m3, m4 = shift_power_sums(n, d, 0.0, *s)
        >>> torch.allclose(torch.stack([m2, m3, m4]), torch.stack([((x - c) ** k).sum() for k in (2, 3, 4)]))
        True
    """
    m2 = (s2 + 2 * d * s1 + n * d**2).sum(0)
    m3 = (s3 + 3 * d * s2 + 3 * d**2 * s1 + n * d**3).sum(0)
    m4 = (s4 + 4 * d * s3 + 6 * d**2 * s2 + 4 * d**3 * s1 + n * d**4).sum(0)
    return m2, m3, m4


def _combine(parts: torch.Tensor) -> torch.Tensor:
    """Combine partial rows ``[P, k, _WIDTH]`` over dim 0 into ``[k, _WIDTH]`` (exact shifts)."""
    n_i = parts[..., _N]
    n = n_i.sum(0)
    total = parts[..., _SUM].sum(0)
    mean = torch.where(n > 0, total / n.clamp_min(1), torch.zeros_like(n))
    mean_i = torch.where(n_i > 0, parts[..., _SUM] / n_i.clamp_min(1), mean.expand_as(n_i))
    dl = mean_i - mean  # each part's mean relative to the combined mean
    out = parts.sum(0)
    # partial rows hold sums about their own mean, so s1 = 0
    out[:, _S2], out[:, _S3], out[:, _S4] = shift_power_sums(
        n_i, dl, 0.0, parts[..., _S2], parts[..., _S3], parts[..., _S4]
    )
    out[:, _MIN] = parts[..., _MIN].amin(0)
    out[:, _MAX] = parts[..., _MAX].amax(0)
    return out


def _reduce_rows(rows: torch.Tensor, groups: tuple[Any, ...]) -> torch.Tensor:
    """Combine ``[k, _WIDTH]`` partial rows over each process group in turn (a shard grid)."""
    for group in groups:
        world = dist.get_world_size(group)
        if world == 1:
            continue
        gathered = [torch.empty_like(rows) for _ in range(world)]
        dist.all_gather(gathered, rows.contiguous(), group=group)
        rows = _combine(torch.stack(gathered))
    return rows


def _rows_one_by_one(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack([partial_row(t).cpu() for t in tensors])


def _global_rows(
    tensors: Sequence[torch.Tensor], local_rows: Callable[..., torch.Tensor] | None = None
) -> torch.Tensor:
    """Partial rows of the whole (unsharded) tensors: one collective per distinct group set.
    `local_rows` gives the local shards' rows ``[k, _WIDTH]`` (float64, CPU) at once (the
    statistics core's, `nnstat.describe.summary.partial_rows`); default one tensor at a time."""
    rows = (local_rows or _rows_one_by_one)(tensors)
    by_groups: dict[tuple[int, ...], tuple[tuple[Any, ...], list[int]]] = {}
    for i, t in enumerate(tensors):
        groups = shard_groups(t)
        if groups:
            key = tuple(id(g) for g in groups)
            by_groups.setdefault(key, (groups, []))[1].append(i)
    for groups, idx in by_groups.values():
        rows[idx] = _reduce_rows(rows[idx], groups)
    return rows


def _finish(rows: torch.Tensor, stats: Sequence[str], eps: float) -> torch.Tensor:
    """Statistics (columns in `stats` order) from combined partial rows ``[k, _WIDTH]``."""
    n = rows[:, _N]
    nan = torch.full_like(n, math.nan)
    safe = n.clamp_min(1)
    has = n > 0
    mean = torch.where(has, rows[:, _SUM] / safe, nan)
    m2 = torch.where(has, rows[:, _S2] / safe, nan)
    # like scipy (and nnstat.describe): a numerically constant tensor has zero variance and
    # undefined skew/kurtosis
    constant = m2 <= (eps * mean) ** 2
    m2 = torch.where(constant, torch.zeros_like(m2), m2)
    m3 = torch.where(has & ~constant, rows[:, _S3] / safe, nan)
    m4 = torch.where(has & ~constant, rows[:, _S4] / safe, nan)
    lo = torch.where(has, rows[:, _MIN], nan)
    hi = torch.where(has, rows[:, _MAX], nan)
    l1, l2 = rows[:, _L1], rows[:, _SQ].sqrt()
    cols = {
        "numel": rows[:, _NUMEL],
        "mean": mean,
        "var": m2,
        "std": m2.sqrt(),
        "skew": m3 / m2**1.5,
        "kurtosis": m4 / (m2 * m2) - 3.0,
        "min": lo,
        "max": hi,
        "abs_mean": torch.where(has, l1 / safe, nan),
        "abs_max": torch.maximum(hi, -lo),
        "l1": l1,
        "l2": l2,
        "rms": torch.where(has, l2 / safe.sqrt(), nan),
        "sparsity": torch.where(has, rows[:, _ZEROS] / safe, nan),
        "nonfinite": rows[:, _NUMEL] - n,
    }
    return torch.stack([cols[s] for s in stats], dim=1)


def summarize_sharded(
    tensors: Sequence[torch.Tensor],
    stats: Sequence[str],
    combine: bool = False,
    local_rows: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """`nnstat.describe.summarize` for lists that hold DTensors: statistics of the whole tensors.

    Every rank must call it with the same list (it runs collectives). Ordinary tensors are taken
    as replicated (each rank already holds all of it). With ``combine=True`` the result is one
    row describing all tensors as if concatenated (``NetDict.describe(layerwise=False)``).
    `local_rows`: the local shards' partial rows at once (`nnstat.describe.summary.partial_rows`:
    the statistics core, a fixed number of kernels per dtype); default one tensor at a time.
    Returns a float64 CPU tensor ``[len(tensors) or 1, len(stats)]``; semantics (finite elements,
    population variance, scipy's biased skew/kurtosis) are those of ``summarize``.

    Example:
        >>> summarize_sharded([torch.tensor([3.0, -4.0])], ["l2", "abs_max", "mean"]).tolist()
        [[5.0, 4.0, -0.5]]
    """
    stats = tuple(stats)
    rows = _global_rows(tensors, local_rows)
    dtypes = {local_tensor(t).dtype for t in tensors}
    eps = torch.finfo(torch.float64 if dtypes == {torch.float64} else torch.float32).eps
    if combine:
        rows = _combine(rows.unsqueeze(1))
    return _finish(rows, stats, eps)


def norms_sharded(tensors: Sequence[torch.Tensor], p: float = 2) -> list[float]:
    """The p-norm of each whole tensor (DTensors reduced across their shards, never gathered).

    Example:
        >>> norms_sharded([torch.tensor([3.0, 4.0])], 2)
        [5.0]
    """
    if p == 2:
        return _global_rows(tensors)[:, _SQ].sqrt().tolist()
    out = []
    for t in tensors:
        x = local_tensor(t).detach().reshape(-1).to(torch.float64)
        if p in (math.inf, -math.inf):
            if x.numel() == 0:
                part = torch.tensor(-math.inf if p > 0 else math.inf, dtype=torch.float64)
            else:
                part = x.abs().max() if p > 0 else x.abs().min()
            op = dist.ReduceOp.MAX if p > 0 else dist.ReduceOp.MIN
        else:
            part = torch.count_nonzero(x).double() if p == 0 else x.abs().pow(p).sum()
            op = dist.ReduceOp.SUM
        part = part.reshape(1).cpu()
        for group in shard_groups(t):
            dist.all_reduce(part, op=op, group=group)
        v = float(part)
        out.append(v if p in (0, math.inf, -math.inf) else v ** (1.0 / p))
    return out


# --------------------------------------------------------------------------- FSDP1 (flat slices)
_FSDP_PREFIX = "_fsdp_wrapped_module."
_MESHES: dict[int, Any] = {}


def clean_name(name: str) -> str:
    """A parameter name without FSDP1's wrapper prefixes (the unwrapped model's name).

    Example:
        >>> clean_name("_fsdp_wrapped_module.0.weight")
        '0.weight'
    """
    return name.replace(_FSDP_PREFIX, "")


def fsdp1_shards(model: Any) -> dict[int, tuple[int, Any, Any]]:
    """``id(param) -> (numel of the whole parameter, process group, flat parameter)`` for the
    parameters of FSDP1 units that are currently sharded (``{}`` for any other model).

    With ``use_orig_params=True`` each such parameter is this rank's contiguous slice of the
    flattened parameter (possibly empty); `fsdp1_view` turns it into a 1-D DTensor of the whole.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    if fsdp is None:
        return {}
    out: dict[int, tuple[int, Any, Any]] = {}
    for mod in model.modules():
        handle = (
            getattr(mod, "_handle", None)
            if isinstance(mod, fsdp.FullyShardedDataParallel)
            else None
        )
        if handle is None or not handle.is_sharded(handle.flat_param):
            continue
        flat = handle.flat_param
        if not handle._use_orig_params:
            raise ValueError(
                "statistics of an FSDP1 model need FullyShardedDataParallel(..., "
                "use_orig_params=True) (or wrap the call in FSDP.summon_full_params)"
            )
        for p, numel in zip(flat._params, flat._numels, strict=True):
            out[id(p)] = (int(numel), mod.process_group, flat)
    return out


def fsdp1_view(local: torch.Tensor, info: tuple[int, Any, Any]) -> torch.Tensor:
    """This rank's flat FSDP1 slice as a 1-D DTensor of the whole parameter (no communication).

    Statistics of the result are those of the whole (flattened) parameter, reduced across ranks.
    """
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    numel, group, _ = info
    mesh = _MESHES.get(id(group))
    if mesh is None:
        mesh = _MESHES[id(group)] = DeviceMesh.from_group(group, local.device.type)
    return DTensor.from_local(
        local.detach().reshape(-1),
        mesh,
        [Shard(0)],
        run_check=False,
        shape=torch.Size([numel]),
        stride=(1,),
    )


def fsdp1_whole(t: torch.Tensor, param: Any, shards: dict[int, tuple[int, Any, Any]]) -> Any:
    """`t` (a tensor belonging to `param`) as a DTensor of the whole when `param` is an FSDP1
    slice listed in `shards` (from `fsdp1_shards`); unchanged otherwise."""
    info = shards.get(id(param))
    return t if info is None else fsdp1_view(t, info)


def fsdp1_grad(param: Any, shards: dict[int, tuple[int, Any, Any]]) -> torch.Tensor | None:
    """``param.grad``, for an FSDP1 slice as a DTensor of the whole gradient.

    A rank holding no slice of the parameter gets an empty local gradient once the backward ran
    (the flat parameter has a gradient), so every rank lists the same tensors.
    """
    info = shards.get(id(param))
    if info is None:
        return param.grad
    g = param.grad
    if g is None and param.numel() == 0 and info[2].grad is not None:
        g = param.detach()
    return None if g is None else fsdp1_view(g, info)
