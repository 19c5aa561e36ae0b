"""Fused row kernels (Triton) for `nnstat.describe.torch_segments` on CUDA: one read per pass.

`torch_segments` lays a dtype group out in rows of ``B`` elements, each tensor starting a new row.
With torch's kernels that layout needs a copy of the group into a flat buffer and then one
kernel per partial (sum, sum of squares, l1, non-zeros, min/max, then the centred powers):
about 13 passes over the group for the full statistics. These kernels read each row where it
lies, in its own tensor (a table of the tensors' addresses and each row's tensor and start), and
compute every partial of a pass in that one read:

- `pass_a`: per row ``[sum, sum x^2, sum |x|, non-zeros, min, max]``;
- `pass_b`: per row ``[sum d, sum d^2, sum d^3, sum d^4]`` with ``d = x * s - c * s`` formed in
  the work dtype (``s`` a power of two and ``c`` the tensor's centre, as `torch_segments` defines
  them, so ``d`` is exactly its definition there);
- `gather`: the histogram samples at flat positions of that layout.

Sums accumulate in float64 (what `torch_segments` adds rows up in), min and max are exact. NaN/Inf
make the row's sum of squares non-finite, which the callers' probe already routes to the exact
host recomputation. Nothing is read back: the results are device tensors.

Used on CUDA when Triton is importable (``NNSTAT_TRITON=0`` turns it off). With
``NNSTAT_TRITON=interpret`` and ``TRITON_INTERPRET=1`` (set before triton is imported) they run
on CPU tensors under Triton's interpreter: how the tests check them where there is no GPU.

Example:
    >>> import torch
    >>> t = RowTable.build([5, 2], 4, torch.device("cpu"))  # rows of 4: tensor 0 takes two
    >>> t.row_t.tolist(), t.row_s.tolist()
    ([0, 0, 1], [0, 4, 0])
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["available", "RowTable", "Bound", "bind", "pass_a", "pass_b", "gather", "FLOAT_DTYPES"]

#: Element types the kernels read (others take the torch path).
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=1)
def _importable() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # any failure (missing, broken install): the torch path is used
        return False
    return True


#: The kernels launched in this process (once all have, a failure is an error) and whether
#: one failed before that (then the torch path serves, see `fall_back`).
_LAUNCHED: set[str] = set()
_STATE = {"broken": False}


def fall_back(error: BaseException) -> bool:
    """Whether to serve statistics by torch's kernels after `error` from the fused ones: only
    while some kernel has not run yet in this process (a Triton that cannot build it here),
    with one warning naming the error; once all have run, the caller raises it."""
    if _LAUNCHED >= {"pass_a", "pass_b", "gather"}:
        return False
    _STATE["broken"] = True
    warnings.warn(
        f"nnstat: the fused statistics kernels failed on first use ({type(error).__name__}: "
        f"{error}); statistics use torch's kernels instead (same numbers, more passes). Set "
        "NNSTAT_TRITON=0 to choose that without trying.",
        RuntimeWarning,
        stacklevel=3,
    )
    return True


def available(device: torch.device) -> bool:
    """Whether the fused kernels serve tensors on `device`: CUDA with Triton importable (unless
    ``NNSTAT_TRITON=0``), or the CPU when ``NNSTAT_TRITON=interpret`` under Triton's
    interpreter (``TRITON_INTERPRET=1`` before triton is imported: how the tests run them)."""
    mode = os.environ.get("NNSTAT_TRITON", "1")
    if mode == "0" or _STATE["broken"]:
        return False
    if device.type == "cuda":
        return _importable()
    return device.type == "cpu" and mode == "interpret" and _interpreting() and _importable()


@dataclass(frozen=True)
class RowTable:
    """Where each row of a group's layout lies: its tensor (`row_t`, int32) and its first
    element in that tensor (`row_s`, int64), plus each tensor's element count; built once per
    layout (host ints copied once)."""

    block: int
    rows: int
    row_t: torch.Tensor
    row_s: torch.Tensor
    numels: torch.Tensor

    @staticmethod
    def build(numels: Sequence[int], block: int, device: torch.device) -> RowTable:
        """The table of tensors of `numels` elements in rows of `block`.

        Example:
            >>> t = RowTable.build([5, 2], 4, torch.device("cpu"))
            >>> t.rows, t.row_t.tolist(), t.row_s.tolist()
            (3, [0, 0, 1], [0, 4, 0])
        """
        counts = [-(-k // block) for k in numels]
        row_t = torch.repeat_interleave(
            torch.arange(len(numels), dtype=torch.int32),
            torch.tensor(counts),
            output_size=sum(counts),
        )
        firsts = torch.tensor(counts).cumsum(0) - torch.tensor(counts)
        row_s = (torch.arange(sum(counts)) - firsts[row_t.long()]) * block
        dev = torch.device(device)
        nb = dev.type != "cpu"
        return RowTable(
            block,
            sum(counts),
            row_t.to(dev, non_blocking=nb),
            row_s.to(dev, non_blocking=nb),
            torch.tensor(list(numels), dtype=torch.int64).to(dev, non_blocking=nb),
        )


def _pointers(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' addresses on their device (a small host-to-device copy that does not wait:
    pageable memory is staged by the driver). The tensors must stay referenced until the
    kernels that read them are queued (they are: the callers hold them)."""
    ptrs = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    dev = tensors[0].device
    return ptrs if dev.type == "cpu" else ptrs.to(dev, non_blocking=True)


@dataclass(frozen=True)
class Bound:
    """A group's tensors as the kernels read them: contiguous (a strided one as a contiguous
    copy, held here while the kernels are queued) and their addresses on the device, made once
    for all the passes over the group (`bind`)."""

    tensors: list[torch.Tensor]
    ptrs: torch.Tensor


def bind(tensors: Sequence[torch.Tensor]) -> Bound:
    """`Bound` of `tensors` (one dtype, in the order of their `RowTable`): a contiguous tensor
    as it is (no view to make, a few microseconds each on the step's host path).

    Example:
        >>> b = bind([torch.zeros(3), torch.zeros(4, 2).t()])
        >>> [t.is_contiguous() for t in b.tensors], b.ptrs.shape
        ([True, True], torch.Size([2]))
    """
    flat = [t if t.is_contiguous() else t.detach().contiguous() for t in tensors]
    return Bound(flat, _pointers(flat))


def _warps(block: int) -> int:
    """Warps per row program: 16 elements per thread at most (float64 partials in registers)."""
    return max(1, min(8, block // 512))


def _kernels() -> Any:
    """The jit'd kernels (`nnstat.describe.triton_kernels`, imported on first use)."""
    from nnstat.describe import triton_kernels

    return triton_kernels


def pass_a(table: RowTable, bound: Bound, moments: bool = True) -> torch.Tensor:
    """``[6, rows]`` float64: per row sum, sum of squares, l1, non-zeros, min, max (one read
    of every tensor, no copy); with ``moments=False`` only the sum of squares, l1 and, in the
    last row, max |x| (rows 0, 3 and 4 are left unwritten). `bound`: the group's tensors
    (`bind`)."""
    views = bound.tensors
    out = torch.empty((6, table.rows), dtype=torch.float64, device=views[0].device)
    k = _kernels().pass_a
    k[(table.rows,)](
        bound.ptrs,
        table.row_t,
        table.row_s,
        table.numels,
        out,
        table.rows,
        views[0],
        BLOCK=table.block,
        MOMENTS=moments,
        num_warps=_warps(table.block),
    )
    _LAUNCHED.add("pass_a")
    return out


def pass_b(
    table: RowTable, bound: Bound, neg_cs: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """``[4, rows]`` float64: per row the sums of ``d, d^2, d^3, d^4``, ``d = x * s + neg_cs``
    in the dtype of `neg_cs`/`scale` (``[m]`` per tensor, the work dtype)."""
    views = bound.tensors
    m = len(views)
    shift = torch.cat([neg_cs, scale])
    out = torch.empty((4, table.rows), dtype=torch.float64, device=views[0].device)
    k = _kernels().pass_b
    k[(table.rows,)](
        bound.ptrs,
        table.row_t,
        table.row_s,
        table.numels,
        shift,
        out,
        table.rows,
        m,
        views[0],
        BLOCK=table.block,
        num_warps=_warps(table.block),
    )
    _LAUNCHED.add("pass_b")
    return out


def gather(table: RowTable, bound: Bound, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The elements at flat positions `idx` (int64, ``row * block + offset``) of the layout, as
    `dtype`."""
    views = bound.tensors
    n = idx.numel()
    out = torch.empty(n, dtype=dtype, device=views[0].device)
    if n == 0:
        return out
    block = 1024
    k = _kernels().gather
    k[(-(-n // block),)](
        bound.ptrs,
        table.row_t,
        table.row_s,
        idx,
        out,
        n,
        views[0],
        B=table.block,
        BLOCK=block,
    )
    _LAUNCHED.add("gather")
    return out
