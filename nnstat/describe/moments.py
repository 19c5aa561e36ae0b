"""The blocked moment pass behind `nnstat.describe.summarize` (every statistic but the norms).

Each cache-sized block is reduced ~12 times while it is in L2 (sum, centred powers up to the
fourth, min, max, sign dot products for l1 and the zero count), and the blocks are combined
exactly in float64. `Workspace` keeps the scratch buffers between calls.

Each tensor's result is its partial row (`nnstat.describe.partials`): the block rows are
combined by `partials.merge`, the same code that combines shards and ranks.

Example:
    >>> import torch
    >>> from nnstat.describe.partials import CENTRE, MAX, S2
    >>> r = moment_row(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    >>> float(r[CENTRE]), float(r[S2]) / 4, float(r[MAX])
    (3.0, 3.5, 6.0)
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from nnstat.describe import partials as pr
from nnstat.describe.partials import exact_row, merge

__all__ = ["Workspace", "CHUNK", "moment_row", "moments_of_pair", "pair_ok", "numpy_ok"]


class Workspace:
    """Reusable scratch buffers for the moment pass (fresh large allocations cost page faults).

    A long-lived caller (the Tracker) keeps one; `summarize` makes a temporary one otherwise.

    Example:
        >>> ws = Workspace()
        >>> a, b = ws.get(10, torch.float32, torch.device("cpu"))
        >>> a.shape, b.shape
        (torch.Size([10]), torch.Size([10]))
    """

    def __init__(self) -> None:
        self._bufs: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._extra: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._flat: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        #: layouts of the lists `nnstat.describe.torch_segments` has reduced (index tensors, cached)
        self.layouts: OrderedDict[tuple, Any] = OrderedDict()

    def get(
        self, n: int, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two flat buffers of `n` elements (contents undefined)."""
        key = (dtype, device)
        buf = self._bufs.get(key)
        if buf is None or buf.shape[1] < n:
            buf = torch.empty((2, n), dtype=dtype, device=device)
            self._bufs[key] = buf
        return buf[0, :n], buf[1, :n]

    def scratch(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A third flat buffer of `n` elements, apart from `get`'s two (contents undefined)."""
        key = (dtype, device)
        buf = self._extra.get(key)
        if buf is None or buf.numel() < n:
            buf = torch.empty(n, dtype=dtype, device=device)
            self._extra[key] = buf
        return buf[:n]

    def flat(self, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The flat buffer of `nnstat.describe.torch_segments` (one per dtype and device, grown to
        the largest group seen; contents undefined). Work on one stream reuses it safely: each use
        is queued after the previous one."""
        key = (dtype, device)
        buf = self._flat.get(key)
        if buf is None or buf.numel() < n:
            self._flat.pop(key, None)  # free the smaller one before allocating
            buf = torch.empty(n, dtype=dtype, device=device)
            self._flat[key] = buf
        return buf[:n]


#: Elements per block of the CPU moment pass: a block and its two scratch copies stay in the L2
#: cache, so the ~8 reductions per block read cache, not memory (about 2.5x faster than
#: full-tensor passes on CPU). Accelerators use one block (kernel launches dominate there).
CHUNK = 1 << 16


def _denormal_scale(head: torch.Tensor) -> float:
    """A power of two bringing a CPU float32 tensor's magnitude near 1 when it is far from it.

    Fourth powers of deviations of values around 1e-10 (Adam's ``exp_avg_sq``) are float32
    denormals, which the CPU computes several times slower and with fewer significant bits. The magnitude comes from the first block.
    """
    if head.device.type != "cpu" or head.dtype != torch.float32 or not head.numel():
        return 1.0
    a = max(abs(head.amin().item()), abs(head.amax().item()))
    if not math.isfinite(a) or a == 0.0:
        return 1.0
    exponent = math.frexp(a)[1]
    return math.ldexp(1.0, -exponent) if abs(exponent) > 16 else 1.0


def _moment_rows(
    x: torch.Tensor, chunk: int, scale: float, d_buf: torch.Tensor, d2_buf: torch.Tensor
) -> torch.Tensor:
    """Per block ``[c, sum d, sum d^2, sum d^3, sum d^4, min, max, #non-zeros, l1]`` (float64),
    with ``d = (x - c) * scale`` and ``c`` the block mean rounded to the dtype of `x`.

    ``sum d`` is not zero: ``c`` and the block sum it comes from are rounded, and for data whose
    spread is a few ulps of its mean (a LayerNorm weight near 1, a constant tensor) that residue
    is as large as the spread. Keeping it makes the combination exact in the centre used.
    """
    rows = []
    for start in range(0, x.numel(), chunk):
        xc = x[start : start + chunk]
        m = xc.numel()
        d, d2 = d_buf[:m], d2_buf[:m]
        c = xc.sum() / m
        torch.sub(xc, c, out=d)
        if scale != 1.0:
            d.mul_(scale)  # a power of two: exact, only the exponent moves
        torch.mul(d, d, out=d2)
        s1, s2, s3, s4 = d.sum(), d2.sum(), torch.dot(d2, d), torch.dot(d2, d2)
        # sign(x) . sign(x) counts non-zeros and sign(x) . x is the l1 norm: two dot products
        # on cached data instead of the (several times slower) count_nonzero and 1-norm kernels
        torch.sign(xc, out=d)
        # amin + amax beat the one aminmax kernel on CPU
        rows.append(
            torch.stack(
                [c, s1, s2, s3, s4, xc.amin(), xc.amax(), torch.dot(d, d), torch.dot(d, xc)]
            )
        )
    return torch.stack(rows).to(torch.float64)


def numpy_ok(x: torch.Tensor) -> bool:
    """Whether the CPU block passes reduce `x` with numpy calls on views of its memory (the one
    test for this module's moment pass and `nnstat.describe.numpy_blocks`' norm passes): a
    plain CPU float32/float64 tensor.

    numpy's calls cost ~0.5 us against torch's ~5 us, its BLAS dot reads a cached block at ~5 us
    per 64K floats, its SIMD min/max/abs are as fast, and its reductions return scalars (no
    per-block stacking): the numpy moment pass measured ~3x faster than the torch one (the same
    ~12 reductions per block) on one core, the norm pass ~7 us less per block. Plain tensors
    only: a subclass (FSDP2's DTensor) has no ``.numpy()`` and its local shard is not the whole
    tensor.

    Example:
        >>> numpy_ok(torch.ones(2)), numpy_ok(torch.ones(2, dtype=torch.float16))
        (True, False)
    """
    plain = type(x) in (torch.Tensor, torch.nn.Parameter)
    return plain and x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64)


def _ones(n: int, dtype: np.dtype) -> np.ndarray:
    """A cached read-only vector of ones: ``b.dot(ones)`` is a BLAS sum, ~2.5x faster than
    numpy's pairwise ``b.sum()`` on float32 blocks."""
    key = np.dtype(dtype)
    buf = _ONES.get(key)
    if buf is None or buf.size < n:
        buf = np.ones(max(n, CHUNK), dtype=key)
        buf.flags.writeable = False
        _ONES[key] = buf
    return buf[:n]


_ONES: dict[np.dtype, np.ndarray] = {}


def _np_block_row(
    b: np.ndarray, o: np.ndarray, dd: np.ndarray, dd2: np.ndarray, scale: float
) -> tuple[float, ...]:
    """``[c, s1, s2, s3, s4, min, max, #non-zeros, l1]`` of one block (see `_np_moment_rows`);
    `o` are ones and `dd`/`dd2` scratch of the block's length."""
    m = b.size
    dt = b.dtype.type
    c = dt(float(b.dot(o)) / m)
    np.subtract(b, c, out=dd)
    if scale != 1.0:
        dd *= dt(scale)  # a power of two: exact, only the exponent moves
    np.multiply(dd, dd, out=dd2)
    s1, s2 = float(dd.dot(o)), float(dd.dot(dd))
    s3, s4 = float(dd2.dot(dd)), float(dd2.dot(dd2))
    lo, hi = float(b.min()), float(b.max())
    if lo > 0.0 or hi < 0.0:
        # one sign: nothing is zero and sum |x| = |sum x| (the centre and the residue in
        # float64, as the mean uses them)
        nnz, l1 = float(m), abs(m * float(c) + s1 / scale)
    else:
        np.abs(b, out=dd)
        l1 = float(dd.dot(o))
        nnz = float(m - (m - np.count_nonzero(b) if dd.min() == 0.0 else 0))
    return (float(c), s1, s2, s3, s4, lo, hi, nnz, l1)


def _np_moment_rows(
    x: np.ndarray, chunk: int, scale: float, d: np.ndarray, d2: np.ndarray
) -> np.ndarray:
    """`_moment_rows` in numpy on a CPU array (same columns and centres, float64 result).

    Per block: one BLAS sum for the centre, the centred copy and its square (the only writes),
    four dot products for the power sums, min and max. ``l1`` and the non-zero count need no
    pass when the block has one sign (then ``l1 = |sum x|`` and nothing is zero); otherwise
    one ``abs`` and a dot give ``l1``, and zeros are counted only if ``min |x|`` is 0.
    """
    n = x.size
    out = np.empty(((n + chunk - 1) // chunk, 9), dtype=np.float64)
    ones = _ones(min(chunk, n), x.dtype)
    for k, start in enumerate(range(0, n, chunk)):
        b = x[start : start + chunk]
        m = b.size
        out[k] = _np_block_row(b, ones[:m], d[:m], d2[:m], scale)
    return out


def _np_pair_rows(
    w: np.ndarray,
    p: np.ndarray,
    chunk: int,
    scales: tuple[float, float],
    bufs: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """`_np_moment_rows` of `w` and of ``w - p`` in one read of both: each block's difference
    is formed in cache (`bufs[0]`) and reduced there, never written to memory."""
    n = w.size
    rows_w = np.empty(((n + chunk - 1) // chunk, 9), dtype=np.float64)
    rows_d = np.empty_like(rows_w)
    ones = _ones(min(chunk, n), w.dtype)
    diff, d, d2 = bufs
    for k, start in enumerate(range(0, n, chunk)):
        wb = w[start : start + chunk]
        m = wb.size
        db = diff[:m]
        np.subtract(wb, p[start : start + chunk], out=db)
        rows_w[k] = _np_block_row(wb, ones[:m], d[:m], d2[:m], scales[0])
        rows_d[k] = _np_block_row(db, ones[:m], d[:m], d2[:m], scales[1])
    return rows_w, rows_d


def pair_ok(w: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether `moments_of_pair` applies: same shape and dtype, CPU float32/float64, non-empty."""
    same = p.dtype == w.dtype and p.device == w.device and p.shape == w.shape
    return numpy_ok(w) and w.numel() > 0 and same


def moments_of_pair(
    w: torch.Tensor, p: torch.Tensor, ws: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moment_row` (partial rows) of `w` and of ``w - p`` (flat CPU tensors, `pair_ok`),
    reading each once.

    The weights and their update of a Tracker step: the difference is never materialised, which
    saves writing and re-reading a tensor of the model's size.
    """
    ws = ws or Workspace()
    n = w.numel()
    chunk = min(CHUNK, n)
    d_buf, d2_buf = ws.get(chunk, w.dtype, w.device)
    diff = ws.scratch(chunk, w.dtype, w.device)
    scales = [_denormal_scale(w[:chunk]), _denormal_scale(w[:chunk] - p[:chunk])]
    bufs = (diff.numpy(), d_buf.numpy(), d2_buf.numpy())
    while True:
        # overflow is detected below (non-finite power sums), so numpy need not warn
        with np.errstate(over="ignore", invalid="ignore"):
            rw, rd = _np_pair_rows(w.numpy(), p.numpy(), chunk, (scales[0], scales[1]), bufs)
        redo = False
        for i, r in enumerate((rw, rd)):
            if scales[i] != 1.0 and not np.isfinite(r[:, 1:5]).all():
                scales[i], redo = 1.0, True  # a later block overflowed once scaled
        if not redo:
            break
    return (
        merge(_block_partials(torch.from_numpy(rw), n, chunk, scales[0])),
        merge(_block_partials(torch.from_numpy(rd), n, chunk, scales[1])),
    )


def moment_row(x: torch.Tensor, ws: Workspace | None = None) -> torch.Tensor:
    """The partial row (`nnstat.describe.partials.COLUMNS`, float64 ``[WIDTH]``) of a flat
    tensor, assumed finite (NaN/Inf make its sums non-finite, which callers detect).

    Blocks are centred on their own (rounded) mean ``c`` and merged in float64 with the
    binomial shift ``sum (x - mu)^k = sum_j C(k, j) (c - mu)^(k - j) sum (x - c)^j``, the
    ``j = 1`` term included (`partials.merge`).
    """
    n = x.numel()
    if n == 0:
        return exact_row(x)  # the empty row: no elements, extrema at their neutral values
    chunk = CHUNK if x.device.type == "cpu" else n
    d_buf, d2_buf = (ws or Workspace()).get(min(chunk, n), x.dtype, x.device)
    scale = _denormal_scale(x[:chunk])
    rows = _moment_rows
    if numpy_ok(x):

        def rows(x: torch.Tensor, chunk: int, scale: float, a: torch.Tensor, b: torch.Tensor):
            # overflow is detected below (non-finite power sums), so numpy need not warn
            with np.errstate(over="ignore", invalid="ignore"):
                return torch.from_numpy(
                    _np_moment_rows(x.numpy(), chunk, scale, a.numpy(), b.numpy())
                )

    r = rows(x, chunk, scale, d_buf, d2_buf)
    if scale != 1.0 and not bool(torch.isfinite(r[:, 1:5]).all()):
        # a later block far larger than the first overflowed once scaled: plain pass instead
        scale = 1.0
        r = rows(x, chunk, scale, d_buf, d2_buf)
    return merge(_block_partials(r, n, chunk, scale))


def _block_partials(r: torch.Tensor, n: int, chunk: int, scale: float) -> torch.Tensor:
    """Partial rows ``[blocks, WIDTH]`` from `_moment_rows`' (blocks of `chunk`, the last
    shorter; power sums scaled by `scale`, a power of two: unscaling is exact)."""
    counts = torch.full((r.shape[0],), float(chunk), dtype=torch.float64)
    counts[-1] = n - chunk * (r.shape[0] - 1)
    c, s1 = r[:, 0], r[:, 1] / scale
    s2, s3, s4 = (r[:, k] / scale**k for k in (2, 3, 4))
    lo, hi = r[:, 5], r[:, 6]
    return pr.from_columns(
        counts,
        centre=c,
        s1=s1,
        s2=s2,
        s3=s3,
        s4=s4,
        min=lo,
        max=hi,
        amax=torch.maximum(hi, -lo),
        zeros=counts - r[:, 7],  # r[:, 7] counts non-zeros
        l1=r[:, 8],
        sq=s2 + 2 * c * s1 + counts * c * c,  # sum x^2 from the sums about c
    )
