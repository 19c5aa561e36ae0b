"""The statistics core's dispatcher: partial rows of many tensors from the right backend.

Every statistic of `nnstat.describe` comes from partial rows (`nnstat.describe.partials`: one
layout, one `merge`, one `finish`). `partial_table` picks the backend that computes them:

- ``torch_segments`` (`nnstat.describe.torch_segments`): tensors on an accelerator, a fixed
  number of kernels per dtype group; within it, ``triton_rows`` (`nnstat.describe.triton_rows`,
  the fused Triton row kernels: one read per pass) serves float groups on CUDA where Triton is
  importable;
- ``numpy_blocks`` / torch blocks (`nnstat.describe.moments`, `nnstat.describe.numpy_blocks`): CPU
  tensors, reduced block by block while each block is in cache.

All take the same arguments (tensors, validated statistic names, a `Workspace`) and give the same
rows, so `summarize`, ``NetDict.describe``, the Tracker, the recorder and the sharded statistics
(`nnstat.describe.sharded`) share one code path from partial sums to columns.

Example:
    >>> import torch
    >>> rows, eps = partial_table([torch.tensor([1.0, 2.0, 3.0, 6.0])], ("var",))
    >>> pr.finish(rows, ("var",), eps).tolist()
    [[3.5]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nnstat.describe import partials as pr
from nnstat.describe.moments import Workspace
from nnstat.describe.numpy_blocks import block_partials
from nnstat.describe.torch_segments import segment_partials

__all__ = ["partial_table", "local_partial_rows", "to_repair"]


def _host_path(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether `device_table` takes the per-tensor CPU path (numpy blocks, cache-sized torch
    blocks) rather than the grouped device core: all tensors on the CPU."""
    return all(t.device.type == "cpu" for t in tensors)


def partial_table(
    tensors: Sequence[torch.Tensor], stats: tuple[str, ...], workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The statistics core's dispatcher: partial rows ``[n, WIDTH]`` (`nnstat.describe.partials`,
    float64, the columns `stats` need) of plain tensors, on their device, and each tensor's
    epsilon for the constant rule (``[n]``). No host read.

    Tensors on accelerators go to the torch-segment backend (`nnstat.describe.torch_segments`: a
    fixed number of kernels per dtype group, the Triton-row kernels where they serve); CPU to
    the blocked passes (numpy blocks where the dtype allows, torch blocks otherwise). The data
    is assumed finite: a tensor holding NaN/Inf gets a non-finite ``sq`` column, which
    `repair_table` and `local_partial_rows` recompute exactly on the host.

    Example:
        >>> rows, eps = partial_table([torch.tensor([3.0, -4.0])], ("l2",))
        >>> rows[:, pr.SQ].tolist(), eps.tolist() == [torch.finfo(torch.float32).eps]
        ([25.0], True)
    """
    backend = block_partials if _host_path(tensors) else segment_partials
    return backend(tensors, stats, workspace)


def local_partial_rows(tensors: Sequence[torch.Tensor], stats: tuple[str, ...]) -> torch.Tensor:
    """``[k, WIDTH]`` float64 CPU partial rows of plain tensors (a DTensor's local shards):
    `partial_table` (one host read) with the rows of tensors holding NaN/Inf, and of empty
    ones, recomputed exactly over their finite elements (`partials.exact_row`).

    Example:
        >>> x = torch.tensor([1.0, 2.0, 4.0, float("nan")])
        >>> torch.allclose(local_partial_rows([x], ("mean",))[0], pr.exact_row(x), atol=1e-12)
        True
    """
    tensors = [t.detach() for t in tensors]
    if not tensors:
        return torch.zeros((0, pr.WIDTH), dtype=torch.float64)
    rows = partial_table(tensors, stats)[0].cpu()
    bad = to_repair(rows[:, pr.SQ], [t.numel() for t in tensors])
    if bad:
        rows[bad] = torch.stack([pr.exact_row(tensors[i]).cpu() for i in bad])
    return rows


def to_repair(probe: torch.Tensor, numels: Sequence[int]) -> list[int]:
    """The rows whose device result is not to be used (a host read of `probe`): non-finite
    probe (the tensor holds NaN/Inf or its float32 sum of squares overflowed) or no elements.
    Their statistics are recomputed from `partials.exact_row`, over the finite elements.

    Example:
        >>> to_repair(torch.tensor([1.0, float("nan"), 0.0]), [2, 2, 0])
        [1, 2]
    """
    bad = (~torch.isfinite(probe)).nonzero().flatten().tolist()
    return bad + [i for i, n in enumerate(numels) if n == 0 and i not in bad]
