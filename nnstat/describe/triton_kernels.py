"""The Triton kernels of `nnstat.describe.triton_rows` (imported only where they run: Triton
decides at import whether kernels are compiled or interpreted). See that module for what they
compute; it checks the arguments and owns the launches."""

# mypy: ignore-errors
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def row_x(ptrs, row_t, row_s, numels, r, REF, BLOCK: tl.constexpr):
    """Row `r` (masked lanes 0): as float32 (float64 for float64 data; exact either way) and as
    float64, its mask and its tensor."""
    t = tl.load(row_t + r)
    start = tl.load(row_s + r)
    n = tl.load(numels + t)
    base = tl.load(ptrs + t).to(tl.pointer_type(REF.dtype.element_ty))
    offs = start + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(base + offs, mask=m, other=0.0)
    # half types through float32: their direct conversion to float64 is not everywhere
    if REF.dtype.element_ty == tl.float64:
        xn = x
    else:
        xn = x.to(tl.float32)
    return xn, xn.to(tl.float64), m, t


@triton.jit
def pass_a(ptrs, row_t, row_s, numels, out, R, REF, BLOCK: tl.constexpr, MOMENTS: tl.constexpr):
    """Per row: sum of squares and l1 (float64 sums); with MOMENTS the sum, non-zeros, min and
    max, else max |x| (in row 5): min/max in the data's own precision (exact)."""
    r = tl.program_id(0)
    xn, xd, m, t = row_x(ptrs, row_t, row_s, numels, r, REF, BLOCK)
    tl.store(out + R + r, tl.sum(xd * xd, axis=0))
    tl.store(out + 2 * R + r, tl.sum(tl.abs(xd), axis=0))
    if MOMENTS:
        tl.store(out + r, tl.sum(xd, axis=0))
        nnz = tl.sum((xn != 0.0).to(tl.int32), axis=0)
        tl.store(out + 3 * R + r, nnz.to(tl.float64))
        tl.store(out + 4 * R + r, tl.min(tl.where(m, xn, float("inf")), axis=0).to(tl.float64))
        tl.store(out + 5 * R + r, tl.max(tl.where(m, xn, float("-inf")), axis=0).to(tl.float64))
    else:
        tl.store(out + 5 * R + r, tl.max(tl.abs(xn), axis=0).to(tl.float64))


@triton.jit
def pass_b(ptrs, row_t, row_s, numels, shift, out, R, M, REF, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    xn, xd, m, t = row_x(ptrs, row_t, row_s, numels, r, REF, BLOCK)
    neg_cs = tl.load(shift + t)  # -c * s and s in the work dtype (exact: s is 2^k)
    s = tl.load(shift + M + t)
    d = xn.to(neg_cs.dtype) * s + neg_cs  # x in the work dtype: exact
    d = tl.where(m, d, 0.0).to(tl.float64)
    d2 = d * d
    tl.store(out + r, tl.sum(d, axis=0))
    tl.store(out + R + r, tl.sum(d2, axis=0))
    tl.store(out + 2 * R + r, tl.sum(d2 * d, axis=0))
    tl.store(out + 3 * R + r, tl.sum(d2 * d2, axis=0))


@triton.jit
def gather(ptrs, row_t, row_s, idx, out, N, REF, B: tl.constexpr, BLOCK: tl.constexpr):
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mj = j < N
    p = tl.load(idx + j, mask=mj, other=0)
    r = p // B
    t = tl.load(row_t + r, mask=mj, other=0)
    start = tl.load(row_s + r, mask=mj, other=0)
    base = tl.load(ptrs + t, mask=mj, other=0).to(tl.pointer_type(REF.dtype.element_ty))
    v = tl.load(base + start + (p - r * B), mask=mj, other=0.0)
    tl.store(out + j, v.to(out.dtype.element_ty), mask=mj)
