"""The partial rows of `nnstat.describe.torch_segments` from its per-tensor partials (pure maths).

`torch_segments` reduces each dtype group to a few rows of float64 partials per tensor (counts,
sums, sums of squares, l1, non-zeros, min/max, and for the moments the centre, scale and centred
power sums: only what the statistics need); these functions lay the partials of every group at once
out as the rows of `nnstat.describe.partials`, which `partials.finish` turns into columns, with a
handful of small kernels and no host read.

Example:
    >>> import torch
    >>> from nnstat.describe.partials import finish
    >>> p = torch.tensor([[2.0], [3.0], [5.0], [1e-7]], dtype=torch.float64)  # n, sum, sq, eps
    >>> rows, eps = moment_rows(p, frozenset({"sq"}))
    >>> finish(rows, ("mean", "l2"), eps).tolist()
    [[1.5, 2.23606797749979]]
"""

from __future__ import annotations

import torch

from nnstat.describe.partials import from_columns

__all__ = ["moment_rows", "norm_rows", "centre_scale"]

#: Largest |exponent| of the moment scale in each work dtype (float32's normal range).
_EXP_LIMIT = {torch.float32: 120, torch.float64: 1000}


def centre_scale(
    total: torch.Tensor, n: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, work: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The moment pass' centre (the mean rounded to the `work` dtype, as float64) and the power
    of two bringing ``max |x - c|`` near 1 (so ``d^4`` neither overflows nor underflows).

    Example:
        >>> f = lambda *v: torch.tensor(v, dtype=torch.float64)
        >>> c, s = centre_scale(f(30.0), f(3.0), f(9.0), f(11.0), torch.float32)
        >>> c.tolist(), s.tolist()
        ([10.0], [0.5])
    """
    c64 = (total / n).to(work).to(torch.float64)
    spread = torch.maximum(hi - c64, c64 - lo)
    limit = _EXP_LIMIT[work]
    return c64, torch.exp2(torch.frexp(spread).exponent.clamp_(-limit, limit).neg_().double())


def moment_rows(p: torch.Tensor, needs: frozenset[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial rows ``[m, WIDTH]`` (`nnstat.describe.partials`) and each tensor's epsilon from
    the moment partials of every group at once (rows in `torch_segments`' moment partials' order).
    """
    n = p[0]
    cols: dict[str, torch.Tensor] = {}
    i = 2
    for name, key in (("sq", "sq"), ("l1", "l1"), ("zeros", "nnz")):
        if key in needs:
            cols[name], i = p[i], i + 1
    if "nnz" in needs:
        cols["zeros"] = n - cols["zeros"]  # the partial counts non-zeros
    if "minmax" in needs:
        lo, hi, i = p[i], p[i + 1], i + 2
        cols |= {"min": lo, "max": hi, "amax": torch.maximum(hi, lo.neg())}
    if "pass_b" in needs:
        c, scale = p[i], p[i + 1]
        # the sums of d = (x - c) * scale, unscaled exactly (scale is a power of two)
        s1, s2 = p[i + 2] / scale, p[i + 3] / scale**2
        i += 4
        cols |= {"centre": c, "s1": s1, "s2": s2, "sq": s2 + 2 * c * s1 + n * c * c}
        for k in (3, 4):
            if f"s{k}" in needs:
                cols[f"s{k}"], i = p[i] / scale**k, i + 1
    else:
        cols["s1"] = p[1]  # the sum, about the centre 0
    return from_columns(n, **cols), p[i]


def norm_rows(p: torch.Tensor, needs: frozenset[str]) -> torch.Tensor:
    """Partial rows ``[m, WIDTH]`` of the norm path from `_norm_partials` of every group at once
    (count, l2, then max |x| and l1 where needed)."""
    cols = {"sq": p[1].square()}  # one kernel for every group (the norm kernels give l2)
    i = 2
    if "abs_max" in needs:
        cols["amax"], i = p[i], i + 1
    if "l1" in needs:
        cols["l1"] = p[i]
    return from_columns(p[0], **cols)
