"""The statistic columns of `nnstat.describe.segments` from its per-tensor partials (pure maths).

`segments` reduces each dtype group to a few rows of float64 partials per tensor (counts, sums,
sums of squares, l1, non-zeros, min/max, and for the moments the centre, scale and centred power
sums); these functions turn the partials of every group at once into the requested columns and
the finiteness probe (the l2 norm), with a handful of small kernels and no host read.

Example:
    >>> import torch
    >>> p = torch.tensor([[2.0], [3.0], [5.0]], dtype=torch.float64)  # n, sum, sum of squares
    >>> moment_columns(p, ("mean", "l2"), frozenset({"sq"})).tolist()
    [[1.5, 2.23606797749979, 2.23606797749979]]
"""

from __future__ import annotations

import math

import torch

from nnstat.distributed import shift_power_sums

__all__ = ["moment_columns", "norm_columns", "centre_scale"]

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


def moment_columns(p: torch.Tensor, stats: tuple[str, ...], needs: frozenset[str]) -> torch.Tensor:
    """The statistic columns (and the probe) from the moment partials of every group at once
    (rows in `segments._moment_partials`' order)."""
    n = p[0]
    i = 1
    total = p[i]
    i += 1
    sq = l1 = nnz = lo = hi = None
    if "sq" in needs:
        sq, i = p[i], i + 1
    if "l1" in needs:
        l1, i = p[i], i + 1
    if "nnz" in needs:
        nnz, i = p[i], i + 1
    if "minmax" in needs:
        lo, hi, i = p[i], p[i + 1], i + 2
    nan = torch.full_like(n, math.nan)
    cols: dict[str, torch.Tensor] = {"numel": n, "nonfinite": torch.zeros_like(n)}
    if "pass_b" in needs:
        c, scale = p[i], p[i + 1]
        s = p[i + 2 : i + 4]
        s1, s2 = s[0] / scale, s[1] / scale**2
        i += 4
        s3 = s4 = torch.zeros_like(n)
        if "s3" in needs:
            s3, i = p[i] / scale**3, i + 1
        if "s4" in needs:
            s4, i = p[i] / scale**4, i + 1
        r = s1 / n
        mean = c + r
        # sums about c moved to the exact mean (one part per tensor: d = c - mean = -r)
        parts = [v.unsqueeze(0) for v in (n, r.neg(), s1, s2, s3, s4)]
        m2, m3, m4 = (m / n for m in shift_power_sums(*parts))
        l2 = (m2 * n + n * mean * mean).sqrt()
        eps = p[i]
        # like scipy (and the CPU path): a numerically constant tensor has zero variance and
        # undefined skew/kurtosis, not the ratio of rounding residues
        constant = m2 <= (eps * mean) ** 2
        m2 = torch.where(constant, torch.zeros_like(m2), m2)
        m3 = torch.where(constant, nan, m3)
        m4 = torch.where(constant, nan, m4)
        cols |= {
            "var": m2,
            "std": m2.sqrt(),
            "skew": m3 / m2**1.5,
            "kurtosis": m4 / (m2 * m2) - 3.0,
        }
    else:
        mean = total / n
        assert sq is not None
        l2 = sq.sqrt()
    cols |= {"mean": mean, "l2": l2, "rms": l2 / n.sqrt()}
    if lo is not None and hi is not None:
        cols |= {"min": lo, "max": hi, "abs_max": torch.maximum(hi, lo.neg())}
    if l1 is not None:
        cols |= {"l1": l1, "abs_mean": l1 / n}
    if nnz is not None:
        cols["sparsity"] = (n - nnz) / n
    return torch.stack([cols[s] for s in stats] + [l2], dim=1)


def norm_columns(p: torch.Tensor, stats: tuple[str, ...], needs: frozenset[str]) -> torch.Tensor:
    """Columns of the norm path from `_norm_partials` of every group at once."""
    n, l2 = p[0], p[1]
    cols = {"numel": n, "l2": l2, "rms": l2 / n.sqrt(), "nonfinite": torch.zeros_like(l2)}
    i = 2
    if "abs_max" in needs:
        cols["abs_max"], i = p[i], i + 1
    if "l1" in needs:
        cols["l1"] = p[i]
        cols["abs_mean"] = p[i] / n
    return torch.stack([cols[s] for s in stats] + [l2], dim=1)
