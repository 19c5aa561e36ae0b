"""Shared helpers for ``torch.distributed``: rank/world size, collectives, local shards.

The one place nnstat asks "am I distributed?". It only finds and moves tensors: the local shards
of sharded parameters (``DTensor``, as ``torch.distributed.fsdp.fully_shard`` makes them; FSDP1's
flat slices viewed as DTensors), the process groups across which they are pieces of one tensor,
and the collectives that exchange small rows between ranks. What the rows mean and how they
combine is `nnstat.describe`'s (``nnstat.describe.sharded``), a layer above.

Example:
    >>> import torch
    >>> rank_world()
    (0, 1)
    >>> local_tensor(torch.ones(2)).tolist()
    [1.0, 1.0]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "rank_world",
    "is_distributed",
    "is_dtensor",
    "local_tensor",
    "shard_groups",
    "all_gather_rows",
    "all_reduce_over",
    "any_dtensor",
    "clean_name",
    "fsdp1_shards",
    "fsdp1_view",
    "fsdp1_whole",
    "fsdp1_grad",
]


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


def all_gather_rows(rows: torch.Tensor, group: Any) -> torch.Tensor:
    """Every rank's `rows` in `group`, stacked in rank order: ``[world, *rows.shape]``.

    Every rank of `group` must call it with rows of the same shape and dtype.

    Example:
        >>> all_gather_rows(torch.ones(2, 3), None).shape  # not distributed: this rank's rows
        torch.Size([1, 2, 3])
    """
    if not is_distributed() or dist.get_world_size(group) == 1:
        return rows.unsqueeze(0)
    gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, rows.contiguous(), group=group)
    return torch.stack(gathered)


def all_reduce_over(tensor: torch.Tensor, groups: Sequence[Any], op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` in place over each process group of `groups` in turn (a shard grid),
    with ``op`` one of ``"sum"``, ``"max"``, ``"min"``; returns it.

    Example:
        >>> all_reduce_over(torch.tensor([2.0]), ()).tolist()
        [2.0]
    """
    reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    for group in groups:
        dist.all_reduce(tensor, op=reduce_op[op], group=group)
    return tensor


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
    slice listed in `shards` (from `fsdp1_shards`); a sparse `t` (an optimizer state of a
    sparse gradient) dense; unchanged otherwise."""
    info = shards.get(id(param))
    if info is None:
        return t.to_dense() if t.is_sparse else t
    return fsdp1_view(t, info)


def fsdp1_grad(param: Any, shards: dict[int, tuple[int, Any, Any]]) -> torch.Tensor | None:
    """``param.grad``, for an FSDP1 slice as a DTensor of the whole gradient.

    A rank holding no slice of the parameter gets an empty local gradient once the backward ran
    (the flat parameter has a gradient), so every rank lists the same tensors. A sparse
    gradient (``nn.Embedding(sparse=True)``) comes back dense, a copy of the parameter's size:
    the statistics are those of the whole gradient, zeros included.
    """
    info = shards.get(id(param))
    if info is None:
        return None if param.grad is None else fsdp1_whole(param.grad, param, shards)
    g = param.grad
    if g is None and param.numel() == 0 and info[2].grad is not None:
        g = param.detach()
    return None if g is None else fsdp1_view(g, info)
