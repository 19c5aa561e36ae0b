"""The CPU backend: blocked passes over cache-sized blocks (numpy calls where the dtype allows).

`block_partials` is the backend `nnstat.describe.core.partial_table` dispatches CPU tensors to
(the moment pass of `nnstat.describe.moments`, or the norm passes below). The norm passes also
serve the Tracker's default statistics of weights and their update in one pass.

For each parameter the pass reads ``W_t`` and the snapshot ``W_{t-1}`` block by block, and while
a block is in cache it computes ``sum(x^2)``, ``min`` and ``max`` of the block and of the
difference, and (optionally) writes ``W_t`` over the snapshot block it has just read, so the
snapshot is refreshed without a second buffer and without fetching fresh cache lines to write
into. Weights and updates
cost three memory streams in total instead of about eight with separate reductions, a
subtraction and a copy.

On CPU (float32/float64) the block reductions are numpy calls on views of the same memory: they
cost less per call than torch's and return scalars, so nothing is stacked per block. Each
block's result goes to its own slot and the slots are combined per tensor in block order, so
two threads can share a pass block by block (`nnstat.describe.block_passes.share_blocks`: the
Tracker's two-thread synchronous path) with the numbers of one thread, bit for bit. Each pass
also comes as a `BlockPass` (``*_pass``), so that several run as one (`run_passes`). Blocks holding NaN/Inf (or whose
float32 sum of squares overflows) are reduced exactly in float64 over their finite elements on
the spot, before the snapshot block is overwritten, so the result is exact without keeping the
old snapshot around.

Example:
    >>> import torch
    >>> w, prev = [torch.tensor([3.0, -4.0])], [torch.tensor([3.0, -5.0])]
    >>> weight_update_norms(w, prev, refresh=True).tolist()
    [[25.0, -4.0, 3.0, 0.0, 1.0, 0.0, 1.0, 0.0]]
    >>> prev[0].tolist()
    [3.0, -4.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from nnstat.describe import moments
from nnstat.describe import partials as pr
from nnstat.describe.block_passes import BlockPass, run_passes
from nnstat.describe.moments import Workspace

__all__ = [
    "weight_update_norms",
    "weight_update_pass",
    "LIGHT_STATS",
    "light_rows",
    "block_partials",
    "norm_partials_pass",
    "sumsq_min_max",
    "sumsq_min_max_pass",
]

#: Statistics the weight/update norm pass (`weight_update_norms`, `light_rows`) can produce.
LIGHT_STATS = frozenset({"numel", "l2", "rms", "abs_max", "nonfinite"})
#: Block length on CPU: a block (with its snapshot and difference) stays in L2 cache while it
#: is reduced. Longer blocks mean fewer numpy calls, so two threads sharing the blocks hand the
#: GIL over less often (faster at two threads at 128K than at 64K elements, one thread as
#: fast); each block's float32 dot product costs ~5e-8 relative error in the sum of squares
#: (float64 accumulation would cost 5x).
BLOCK = 1 << 17


# the ufuncs' reductions themselves: ``ndarray.min`` adds a Python wrapper per call
_MIN, _MAX = np.minimum.reduce, np.maximum.reduce


def _np_norms(b: np.ndarray) -> tuple[float, float, float, float]:
    """``[sum(b^2), min, max, #non-finite]`` of one block, over its finite elements."""
    # the dot product first: it streams the block in from memory faster than min does (per
    # 42 MB on one core, in CPU time: dot, min, max 1.85-2.10 ms; min, max, dot 2.15-2.48 ms;
    # the dot alone 1.2-1.3 ms); min and max then read the block from cache
    sq, lo, hi = b.dot(b), _MIN(b), _MAX(b)
    if math.isfinite(sq):
        return sq, lo, hi, 0.0
    # NaN/Inf (or a float32 sum of squares that overflowed): exact, in float64
    return tuple(_finite_part(torch.from_numpy(b)).tolist())


def _np_pair(wb: np.ndarray, pb: np.ndarray, d: np.ndarray, refresh: bool) -> list[float]:
    """`_np_norms` of ``wb`` and of ``wb - pb``; then ``pb[:] = wb`` if `refresh`.

    The difference is formed in `d`, or with `refresh` in ``pb`` itself (its old values are
    not needed once the difference exists, and the block stays smaller in cache); it is
    reduced, exactly if it holds NaN/Inf, before ``pb`` is overwritten."""
    if refresh:
        d = pb
    np.subtract(wb, pb, out=d)
    sw, sd = wb.dot(wb), d.dot(d)
    if math.isfinite(sw + sd):
        row = [sw, _MIN(wb), _MAX(wb), 0.0, sd, _MIN(d), _MAX(d), 0.0]
    else:
        row = [*_np_norms(wb), *_np_norms(d)]
    if refresh:
        np.copyto(pb, wb)
    return row


def _per_tensor(res: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """Per tensor ``[sumsq, min, max, nonfinite]`` (repeated per group of 4 columns of `res`)
    from the rows of its blocks ``spans[i] = (first, stop)`` (consecutive, none empty), in
    block order: a few segment reductions for all tensors, not a few per tensor. It is
    `partials.merge` restricted to the norm columns (sums and extrema: no moments to shift),
    over blocks of unequal counts per tensor, in numpy."""
    if not spans:
        return np.empty((0, res.shape[1]))
    first = np.array([a for a, _ in spans], dtype=np.intp)
    out = np.empty((len(spans), res.shape[1]))
    for lo in range(0, res.shape[1], 4):
        out[:, lo] = np.add.reduceat(res[:, lo], first)
        out[:, lo + 1] = np.minimum.reduceat(res[:, lo + 1], first)
        out[:, lo + 2] = np.maximum.reduceat(res[:, lo + 2], first)
        out[:, lo + 3] = np.add.reduceat(res[:, lo + 3], first)
    return out


def _spans(sizes: Sequence[int], block: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Block index ranges per tensor of `sizes` elements, and each block's start element."""
    spans, starts = [], []
    for n in sizes:
        first = len(starts)
        starts += range(0, n, block)
        spans.append((first, len(starts)))
    return spans, starts


def _finite_part(x: torch.Tensor) -> torch.Tensor:
    """``[sum(x^2), min(x), max(x), #non-finite]`` over the finite elements, in float64 on the
    host (from `partials.exact_row`; no finite element: ``[0, inf, -inf, numel]``)."""
    r = pr.exact_row(x).cpu()
    return torch.stack([r[pr.SQ], r[pr.MIN], r[pr.MAX], r[pr.NUMEL] - r[pr.N]])


def weight_update_norms(
    current: Sequence[torch.Tensor],
    previous: Sequence[torch.Tensor],
    refresh: bool = False,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Per tensor ``[sumsq, min, max, nonfinite]`` of ``W`` then of ``W - P`` (CPU float64).

    Statistics are over the finite elements (``nonfinite`` counts the others; a tensor without
    finite elements has ``min = inf``, ``max = -inf``). With ``refresh=True`` each block of
    `current` is copied over the block of `previous` it was just compared with, so `previous`
    ends up equal to `current`; otherwise `previous` is left untouched.
    """
    return run_passes([weight_update_pass(current, previous, refresh, workspace)])[0]


def weight_update_pass(
    current: Sequence[torch.Tensor],
    previous: Sequence[torch.Tensor],
    refresh: bool = False,
    workspace: Workspace | None = None,
) -> BlockPass:
    """`weight_update_norms` as a `BlockPass` (its result is that table), to run with other
    passes (`run_passes`). Tensors the numpy blocks do not take (half precision, other
    devices) are reduced now, with torch ops (and refreshed now if `refresh`).

    Raises:
        ValueError: the lists differ in length, a pair in shape, or (``refresh``) a tensor of
            `previous` is not contiguous.

    Example:
        >>> w, prev = [torch.tensor([3.0, -4.0])], [torch.tensor([3.0, -5.0])]
        >>> run_passes([weight_update_pass(w, prev)])[0].tolist()
        [[25.0, -4.0, 3.0, 0.0, 1.0, 0.0, 1.0, 0.0]]
    """
    if len(current) != len(previous):
        raise ValueError("current and previous must have the same number of tensors")
    ws = workspace or Workspace()
    rows: list[torch.Tensor | None] = []
    on_numpy: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    for i, (w, p) in enumerate(zip(current, previous, strict=True)):
        if w.shape != p.shape:
            raise ValueError(f"tensor {i}: shapes {tuple(w.shape)} and {tuple(p.shape)} differ")
        if refresh and not p.is_contiguous():
            # its flat view would be a copy, and the refresh written into that copy lost
            raise ValueError(f"tensor {i}: previous must be contiguous to be refreshed in place")
        w, p = w.detach().reshape(-1), p.reshape(-1)
        rows.append(None)
        if w.numel() == 0:
            rows[i] = torch.tensor([0.0, math.inf, -math.inf, 0.0] * 2, dtype=torch.float64)
        elif moments.numpy_ok(w) and p.dtype == w.dtype and p.device == w.device:
            on_numpy.append((i, w, p))
        else:
            rows[i] = _torch_pair(w, p, ws, refresh)
    # every tensor's blocks in one pass, so two threads can share them
    numpy_pass = _np_pairs([w for _, w, _ in on_numpy], [p for _, _, p in on_numpy], ws, refresh)

    def finish(found: np.ndarray) -> torch.Tensor:
        for (i, _, _), row in zip(on_numpy, torch.from_numpy(found), strict=True):
            rows[i] = row
        if not rows:
            return torch.zeros((0, 8), dtype=torch.float64)
        return torch.stack(rows)

    return numpy_pass.then(finish)


def _np_pairs(
    current: list[torch.Tensor], previous: list[torch.Tensor], ws: Workspace, refresh: bool
) -> BlockPass:
    """`weight_update_norms`' rows of flat CPU float32/float64 pairs, block by block (the
    pass' result: ``[len(current), 8]``)."""
    spans, starts = _spans([w.numel() for w in current], BLOCK)
    owner = [i for i, (a, b) in enumerate(spans) for _ in range(a, b)]
    ws_np, ps_np = [w.numpy() for w in current], [p.numpy() for p in previous]
    # one difference buffer per thread (lane) and dtype
    bufs = {}
    for w in current:
        if w.dtype not in bufs:
            longest = max(t.numel() for t in current if t.dtype == w.dtype)
            bufs[w.dtype] = [b.numpy() for b in ws.get(min(BLOCK, longest), w.dtype, w.device)]
    dts = [bufs[w.dtype] for w in current]
    res = np.empty((len(starts), 8))

    def one(k: int, lane: int) -> None:
        i, s = owner[k], starts[k]
        wb, pb = ws_np[i][s : s + BLOCK], ps_np[i][s : s + BLOCK]
        res[k] = _np_pair(wb, pb, dts[i][lane][: wb.size], refresh)

    return BlockPass(len(starts), one, lambda: _per_tensor(res, spans))


def sum_sq(b: torch.Tensor) -> torch.Tensor:
    """``sum(b^2)`` of one block, accumulated and returned in `partials.work_dtype` (a half
    precision dot product returns its sum rounded to that precision: 0.4% off in bfloat16).

    Example:
        >>> sum_sq(torch.tensor([3.0, 4.0], dtype=torch.bfloat16)).dtype
        torch.float32
    """
    if b.dtype in (torch.float32, torch.float64):
        return torch.dot(b, b)
    return torch.linalg.vector_norm(b, dtype=pr.work_dtype(b.dtype)).square()


def _torch_pair(w: torch.Tensor, p: torch.Tensor, ws: Workspace, refresh: bool) -> torch.Tensor:
    """One row of `weight_update_norms` with torch ops (accelerators, half precision)."""
    n = w.numel()
    block = BLOCK if w.device.type == "cpu" else n
    d_buf, _ = ws.get(min(block, n), w.dtype, w.device)
    parts, exact = [], {}
    for k, start in enumerate(range(0, n, block)):
        wb, pb = w[start : start + block], p[start : start + block]
        d = d_buf[: wb.numel()]
        torch.sub(wb, pb, out=d)
        dw, dd = sum_sq(wb), sum_sq(d)
        # amin + amax are faster than the one aminmax kernel on CPU
        parts.append(torch.stack([dw, wb.amin(), wb.amax(), dd, d.amin(), d.amax()]))
        # one cheap check per block: NaN/Inf (or float32 overflow) makes a sum non-finite;
        # such a block is reduced exactly now, while its old snapshot still exists
        if not math.isfinite(dw.item() + dd.item()):
            exact[k] = torch.cat([_finite_part(wb), _finite_part(d)])
        if refresh:
            pb.copy_(wb)
    r = torch.stack(parts).to(torch.float64).cpu()
    bad = torch.zeros((len(parts), 2), dtype=torch.float64)
    for k, e in exact.items():
        r[k] = e[[0, 1, 2, 4, 5, 6]]
        bad[k] = e[[3, 7]]
    return torch.stack(
        [
            r[:, 0].sum(),
            r[:, 1].min(),
            r[:, 2].max(),
            bad[:, 0].sum(),
            r[:, 3].sum(),
            r[:, 4].min(),
            r[:, 5].max(),
            bad[:, 1].sum(),
        ]
    )


def light_rows(numel: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """Partial rows (`nnstat.describe.partials`) from per-tensor ``[sumsq, min, max]`` columns
    and optionally ``nonfinite`` (`weight_update_norms`' four of W or of W - P; `sumsq_min_max`),
    all over the finite elements; `partials.finish` gives the `LIGHT_STATS` from them.

    Example:
        >>> from nnstat.describe.partials import finish
        >>> norms = torch.tensor([[16.0, -3.0, 1.0, 1.0]], dtype=torch.float64)
        >>> finish(light_rows(torch.tensor([5.0]), norms), ("l2", "rms", "abs_max"), 0.0).tolist()
        [[4.0, 2.0, 3.0]]
    """
    lo, hi = norms[:, 1], norms[:, 2]
    n = numel - norms[:, 3] if norms.shape[1] > 3 else None
    amax = torch.maximum(hi, -lo)
    return pr.from_columns(numel.to(norms.dtype), n, sq=norms[:, 0], min=lo, max=hi, amax=amax)


def sumsq_min_max(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor ``[sum(x^2), min(x), max(x)]`` (float64, on the tensors' device), blocked.

    Each block is reduced three times while it is in cache (dot product, min, max), so the
    tensor is read from memory once. Empty tensors give ``[0, nan, nan]``.

    Example:
        >>> sumsq_min_max([torch.tensor([3.0, -4.0])]).tolist()
        [[25.0, -4.0, 3.0]]
    """
    return run_passes([sumsq_min_max_pass(tensors)])[0]


def sumsq_min_max_pass(tensors: Sequence[torch.Tensor]) -> BlockPass:
    """`sumsq_min_max` as a `BlockPass` (its result is that table), to run with other passes
    (`run_passes`); tensors the numpy blocks do not take are reduced now, with torch ops.

    Example:
        >>> run_passes([sumsq_min_max_pass([torch.tensor([3.0, -4.0])])])[0].tolist()
        [[25.0, -4.0, 3.0]]
    """
    rows: list[torch.Tensor | None] = []
    on_numpy: list[tuple[int, torch.Tensor]] = []
    for i, t in enumerate(tensors):
        x = t.detach().reshape(-1)
        n = x.numel()
        rows.append(None)
        if n == 0:
            rows[i] = torch.tensor([0.0, float("nan"), float("nan")], device=x.device)
            continue
        if moments.numpy_ok(x):
            on_numpy.append((i, x))
            continue
        block = BLOCK if x.device.type == "cpu" else n
        parts = []
        for start in range(0, n, block):
            b = x[start : start + block]
            parts.append(torch.stack([torch.dot(b, b), b.amin(), b.amax()]))
        r = torch.stack(parts).to(torch.float64)
        rows[i] = torch.stack([r[:, 0].sum(), r[:, 1].min(), r[:, 2].max()])
    numpy_pass = _np_norm_rows([x for _, x in on_numpy])

    def finish(found: np.ndarray) -> torch.Tensor:
        if on_numpy:
            # non-finite blocks give their finite part here; callers detect non-finite values
            # from the sum of squares, so keep NaN there for them (they recompute exactly)
            found[found[:, 3] > 0, 0] = math.nan
            if len(on_numpy) == len(tensors):  # the common case: the table as it is, no row loop
                return torch.from_numpy(np.ascontiguousarray(found[:, :3]))
            for (i, _), row in zip(on_numpy, torch.from_numpy(found[:, :3]), strict=True):
                rows[i] = row
        dev = rows[0].device if rows else torch.device("cpu")
        return torch.stack([r.to(device=dev, dtype=torch.float64) for r in rows])

    return numpy_pass.then(finish)


def _np_norm_rows(tensors: list[torch.Tensor]) -> BlockPass:
    """``[sumsq, min, max, nonfinite]`` of flat CPU float32/float64 tensors, block by block
    (all tensors' blocks in one pass, so two threads can share them)."""
    spans, starts = _spans([x.numel() for x in tensors], BLOCK)
    owner = [i for i, (a, b) in enumerate(spans) for _ in range(a, b)]
    arrays = [x.numpy() for x in tensors]
    res = np.empty((len(starts), 4))

    def one(k: int, lane: int) -> None:
        s = starts[k]
        res[k] = _np_norms(arrays[owner[k]][s : s + BLOCK])

    return BlockPass(len(starts), one, lambda: _per_tensor(res, spans))


def block_partials(
    tensors: Sequence[torch.Tensor], stats: tuple[str, ...], workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The CPU backend of `nnstat.describe.core.partial_table` (same arguments and result):
    partial rows ``[n, WIDTH]`` and epsilons ``[n]`` of CPU tensors, block by block (numpy
    where `moments.numpy_ok`, torch otherwise): the moment pass (`moments.moment_row`) when
    `stats` need more than norms, else the norm passes (`sumsq_min_max`, ``_foreach_norm``).

    Example:
        >>> rows, _ = block_partials([torch.tensor([3.0, -4.0])], ("abs_max",))
        >>> rows[:, [pr.SQ, pr.AMAX]].tolist()
        [[25.0, 4.0]]
    """
    flat, eps = _flat_work(tensors)
    need = set(stats)
    if need - pr.NORM_STATS:
        # one blocked pass gives every statistic (l2, l1, abs_max included)
        ws = workspace or Workspace()
        return (
            torch.stack([moments.moment_row(x.to(pr.work_dtype(x.dtype)), ws) for x in flat]),
            eps,
        )
    return run_passes([_norm_partials_pass(flat, eps, need)])[0]


def norm_partials_pass(tensors: Sequence[torch.Tensor], stats: tuple[str, ...]) -> BlockPass:
    """`block_partials` of statistics that need no moment pass (`partials.NORM_STATS`) as a
    `BlockPass` (its result is ``(rows, eps)``), to run with other passes (`run_passes`).

    Raises:
        ValueError: `stats` need the moment pass (use `block_partials`).

    Example:
        >>> (rows, _), = run_passes([norm_partials_pass([torch.tensor([3.0, -4.0])], ("l2",))])
        >>> rows[:, pr.SQ].tolist()
        [25.0]
    """
    need = set(stats)
    if need - pr.NORM_STATS:
        raise ValueError(f"{sorted(need - pr.NORM_STATS)} need the moment pass: block_partials")
    return _norm_partials_pass(*_flat_work(tensors), need)


def _flat_work(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`tensors` flat in the dtype they are reduced in, and each one's epsilon (of its own
    dtype, for the constant rule)."""
    flat = [t.detach().reshape(-1) for t in tensors]
    eps = torch.tensor([pr.eps_of(t.dtype) for t in flat], dtype=torch.float64)
    # reduced in float32 (`partials.work_dtype`, as the moment pass does): a bfloat16 dot
    # product or norm returns its sum rounded to bfloat16 (up to 0.4% off), integers have none
    return [t.to(pr.work_dtype(t.dtype)) for t in flat], eps


def _norm_partials_pass(flat: list[torch.Tensor], eps: torch.Tensor, need: set[str]) -> BlockPass:
    n_vec = torch.tensor([float(t.numel()) for t in flat], dtype=torch.float64)

    def finish(smm: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        cols: dict[str, torch.Tensor] = {}
        if smm is not None:
            cols |= {"sq": smm[:, 0], "amax": torch.maximum(smm[:, 2], -smm[:, 1])}
        else:
            cols["sq"] = torch.stack(torch._foreach_norm(flat, 2)).to(torch.float64).square()
        if need & {"l1", "abs_mean"}:
            cols["l1"] = torch.stack(torch._foreach_norm(flat, 1)).to(torch.float64)
        return pr.from_columns(n_vec, **cols), eps

    if "abs_max" in need:
        # one blocked read gives l2 and abs_max (the inf-norm kernel is slow on CPU);
        # empty tensors are recomputed by repair_table anyway
        return sumsq_min_max_pass(flat).then(finish)
    return BlockPass(0, _no_blocks, lambda: finish(None))


def _no_blocks(k: int, lane: int) -> None:
    raise AssertionError("a pass of no blocks has no block to reduce")
