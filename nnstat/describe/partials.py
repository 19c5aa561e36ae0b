"""The one partial-row layout of tensor statistics, its `merge` and its `finish` (pure maths).

Every backend of `nnstat.describe` (numpy blocks, torch segments, Triton rows), the exact host
recomputation and the sharded statistics reduce a tensor, or a piece of one (a cache-sized
block, a local shard, one rank's rows), to a float64 row of `COLUMNS`:

=========  =================================================================================
``numel``  elements, non-finite ones included
``n``      finite elements (every column below is over these)
``centre`` the centre ``c`` the power sums are taken about (any value, e.g. a rounded mean)
``s1``     ``sum (x - c)``, and ``s2``, ``s3``, ``s4``: the sums of its 2nd to 4th powers
``min``    ``max``, ``amax`` (``max |x|``): ``+inf``/``-inf``/``-inf`` for an empty part
``zeros``  elements equal to zero
``l1``     ``sum |x|``; ``sq``: ``sum x^2``
=========  =================================================================================

`merge` combines the rows of parts into the row of their union, exactly in float64 (the same
code for blocks, shards and ranks); `finish` turns rows into statistic columns, including the
constant-tensor rule (a numerically constant tensor has zero variance and NaN skew/kurtosis, as
scipy gives). A backend fills only the columns the requested statistics read; `finish` reads
no others.

Example:
    >>> import torch
    >>> x = torch.tensor([1.0, 2.0, 4.0, 7.0], dtype=torch.float64)
    >>> whole = merge(torch.stack([exact_row(x[:2]), exact_row(x[2:])]))
    >>> finish(whole[None], ("mean", "var", "max"), 1e-16).tolist()
    [[3.5, 5.25, 7.0]]
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "COLUMNS",
    "WIDTH",
    "NORM_STATS",
    "shift_power_sums",
    "merge",
    "finish",
    "exact_row",
    "from_columns",
    "probe_table",
    "eps_of",
    "work_dtype",
]

COLUMNS = ("numel", "n", "centre", "s1", "s2", "s3", "s4", "min", "max", "amax", "zeros", "l1")
COLUMNS += ("sq",)
NUMEL, N, CENTRE, S1, S2, S3, S4, MIN, MAX, AMAX, ZEROS, L1, SQ = range(len(COLUMNS))
WIDTH = len(COLUMNS)
#: Statistics obtainable from norm kernels (counts, sums of squares, l1, max |x|), no moments.
NORM_STATS = frozenset({"numel", "abs_mean", "abs_max", "l1", "l2", "rms", "nonfinite"})

_SHAPE = frozenset({"var", "std", "skew", "kurtosis"})


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype data of `dtype` is reduced in: float64 for float64 data, float32 otherwise
    (lower precisions are reduced in float32).

    Raises:
        TypeError: complex data (a real reduction would drop the imaginary part).

    Example:
        >>> work_dtype(torch.bfloat16), work_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    if dtype.is_complex:
        raise TypeError(
            f"cannot describe {dtype} data: describe its magnitude (`nd.abs()`) or its real "
            "and imaginary parts (`nd.apply(torch.view_as_real)`)"
        )
    return torch.float64 if dtype == torch.float64 else torch.float32


def eps_of(dtype: torch.dtype) -> float:
    """The epsilon of the constant-tensor rule for data of `dtype`: that of its `work_dtype`.

    Example:
        >>> eps_of(torch.bfloat16) == torch.finfo(torch.float32).eps
        True
    """
    return torch.finfo(work_dtype(dtype)).eps


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
    summed over dim 0. ``s1 = 0`` when each centre is its part's mean.

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


def from_columns(numel: torch.Tensor, n: torch.Tensor | None = None, **columns: torch.Tensor):
    """Partial rows ``[k, WIDTH]`` from the columns a backend has, ``[k]`` each by name in
    `COLUMNS` (``n`` defaults to `numel`: data assumed finite). The other columns are zero:
    placeholders that `finish` does not read for statistics that do not need them (a backend
    fills what the requested statistics need; `exact_row` fills every column).

    Example:
        >>> one = torch.tensor([2.0], dtype=torch.float64)
        >>> from_columns(one, sq=one)[0, [N, SQ, MIN]].tolist()
        [2.0, 2.0, 0.0]
    """
    unknown = set(columns) - set(COLUMNS)
    if unknown:
        raise ValueError(f"unknown partial columns {sorted(unknown)}; valid: {list(COLUMNS)}")
    cols = {"numel": numel, "n": numel if n is None else n, **columns}
    zero = torch.zeros_like(numel) if len(cols) < WIDTH else None
    return torch.stack([cols.get(c, zero) for c in COLUMNS], dim=1)


def merge(parts: torch.Tensor) -> torch.Tensor:
    """The rows of the unions of parts: ``[P, ..., WIDTH]`` rows combined over dim 0.

    Counts, zeros, l1 and sums of squares add up, extrema take their extremum, and the power
    sums are moved to the union's mean (`shift_power_sums`, each part's ``s1`` included), which
    becomes the result's centre (``s1 = 0``). An empty part (``n = 0``, finite centre) adds
    nothing. Exact in float64 up to rounding; the same for blocks, shards and ranks.

    Args:
        parts: float64 partial rows, the parts along dim 0.

    Returns:
        ``parts.shape[1:]`` float64 rows.

    Example:
        >>> x = torch.tensor([1.0, 2.0, 4.0], dtype=torch.float64)
        >>> m = merge(torch.stack([exact_row(x[:1]), exact_row(x[1:])]))
        >>> [round(m[i].item(), 12) for i in (N, CENTRE, S2, MIN, MAX)]
        [3.0, 2.333333333333, 4.666666666667, 1.0, 4.0]
    """
    n_i, c_i, s1 = parts[..., N], parts[..., CENTRE], parts[..., S1]
    n = n_i.sum(0)
    mean = (n_i * c_i + s1).sum(0) / n.clamp_min(1)
    out = parts.sum(0)
    out[..., CENTRE], out[..., S1] = mean, 0.0
    m2, m3, m4 = shift_power_sums(
        n_i, c_i - mean, s1, parts[..., S2], parts[..., S3], parts[..., S4]
    )
    out[..., S2], out[..., S3], out[..., S4] = m2, m3, m4
    out[..., MIN] = parts[..., MIN].amin(0)
    out[..., MAX] = parts[..., MAX].amax(0)
    out[..., AMAX] = parts[..., AMAX].amax(0)
    return out


def finish(rows: torch.Tensor, stats: Sequence[str], eps: float | torch.Tensor) -> torch.Tensor:
    """Statistic columns ``[k, len(stats)]`` (in `stats` order) from partial rows ``[k, WIDTH]``.

    Population ``var``/``std``, scipy's biased ``skew`` and excess ``kurtosis``; every statistic
    but ``numel`` and ``nonfinite`` is over the finite elements, NaN when there are none (the
    norms ``l1``/``l2`` are then 0). A tensor whose variance is at most ``(eps * mean)^2`` is
    numerically constant: zero variance, NaN skew and kurtosis (not a ratio of rounding residues).
    Only the columns `stats` read are computed (few kernels on an accelerator).

    Args:
        rows: float64 partial rows (`COLUMNS`), with the columns `stats` read filled.
        stats: names of `nnstat.describe.STAT_NAMES`.
        eps: the relative precision of the data (`eps_of`), a float or one per row ``[k]``.

    Returns:
        float64 ``[k, len(stats)]`` on the rows' device.

    Example:
        >>> finish(exact_row(torch.tensor([2.0, 2.0, 2.0]))[None], ("var", "skew", "l2"), 1e-7)
        tensor([[0.0000,    nan, 3.4641]], dtype=torch.float64)
    """
    cols = _columns(rows, set(stats), eps)
    return torch.stack([cols[s] for s in stats], dim=1)


def _columns(rows: torch.Tensor, want: set[str], eps: float | torch.Tensor) -> dict:
    """`finish`'s columns by name: those of `want` (and a few computed on the way)."""
    n = rows[:, N]
    empty = n == 0
    # NaN for a row without finite elements: every ratio over it is then NaN, no guard each
    # (masked_fill takes the scalar as it is: no scalar tensor made on the device)
    per = n.masked_fill(empty, math.nan)
    cols: dict[str, torch.Tensor] = {"numel": rows[:, NUMEL], "nonfinite": rows[:, NUMEL] - n}
    if want & (_SHAPE | {"mean"}):
        centre, s1 = rows[:, CENTRE], rows[:, S1]
        cols["mean"] = mean = centre + s1 / per
    if want & _SHAPE:
        # the sums about the centre moved to the exact mean (one part per row: d = c - mean)
        parts = [v.unsqueeze(0) for v in (n, centre - mean, s1, rows[:, S2], rows[:, S3])]
        m2, m3, m4 = (m / per for m in shift_power_sums(*parts, rows[:, S4].unsqueeze(0)))
        constant = m2 <= (eps * mean) ** 2
        m2 = m2.masked_fill(constant, 0.0)
        cols["var"], cols["std"] = m2, m2.sqrt()
        cols["skew"] = m3.masked_fill(constant, math.nan) / m2**1.5
        cols["kurtosis"] = m4.masked_fill(constant, math.nan) / (m2 * m2) - 3.0
    for name, at in (("min", MIN), ("max", MAX), ("abs_max", AMAX)):
        if name in want:
            cols[name] = rows[:, at].masked_fill(empty, math.nan)
    cols["l1"] = rows[:, L1]
    if "abs_mean" in want:
        cols["abs_mean"] = rows[:, L1] / per
    if want & {"l2", "rms"}:
        cols["l2"] = rows[:, SQ].sqrt()
    if "rms" in want:
        cols["rms"] = cols["l2"] / per.sqrt()
    if "sparsity" in want:
        cols["sparsity"] = rows[:, ZEROS] / per
    return cols


def exact_row(t: torch.Tensor) -> torch.Tensor:
    """The partial row of one plain tensor, exactly in float64 over its finite elements, on its
    device (reads its finiteness back: a host-side recomputation, not a step-path reduction).

    Args:
        t: any tensor (a DTensor's local shard, not the DTensor).

    Returns:
        float64 ``[WIDTH]`` (every column filled; centre: the finite elements' mean).

    Example:
        >>> r = exact_row(torch.tensor([1.0, float("nan"), -3.0, 0.0]))
        >>> [r[i].item() for i in (NUMEL, N, CENTRE, MIN, AMAX, ZEROS, L1, SQ)]
        [4.0, 3.0, -0.6666666666666666, -3.0, 3.0, 1.0, 4.0, 10.0]
    """
    x = t.detach().reshape(-1)
    row = torch.zeros(WIDTH, dtype=torch.float64, device=x.device)
    row[NUMEL] = x.numel()
    row[MIN], row[MAX], row[AMAX] = math.inf, -math.inf, -math.inf
    x = x.to(torch.float64)
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        x = x[finite]
    n = x.numel()
    if n == 0:
        return row
    c = x.sum() / n
    d = x - c
    d2 = d * d
    row[N], row[CENTRE], row[S1] = n, c, d.sum()
    row[S2], row[S3], row[S4] = d2.sum(), torch.dot(d2, d), torch.dot(d2, d2)
    row[MIN], row[MAX] = torch.aminmax(x)
    a = x.abs()
    row[AMAX], row[ZEROS] = a.max(), n - torch.count_nonzero(x)
    row[L1], row[SQ] = a.sum(), torch.dot(x, x)
    return row


def probe_table(
    rows: torch.Tensor, eps: float | torch.Tensor, stats: Sequence[str]
) -> torch.Tensor:
    """`finish` of `rows` with a finiteness probe as last column: the l2 norm, non-finite
    exactly when a part held NaN/Inf or its sum of squares overflowed (rows to recompute on
    the host with `exact_row`), ``[k, len(stats) + 1]``.

    Example:
        >>> probe_table(exact_row(torch.tensor([3.0, -4.0]))[None], 1e-7, ("max",)).tolist()
        [[3.0, 5.0]]
    """
    cols = _columns(rows, {*stats, "l2"}, eps)
    return torch.stack([cols[s] for s in stats] + [cols["l2"]], dim=1)
