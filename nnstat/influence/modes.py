"""The scoring modes as functions of one block of training rows: the maths both scoring branches
(CPU and device, see `nnstat.influence.score`) share.

Modes (higher = more similar/helpful in all four), with ``M = (H + λI)⁻¹``:

* ``dot``: ``g_qᵀ M g_i``
* ``relatif``: ``g_qᵀ M g_i / ‖g_i‖_M``, the training side divided by the square root of its
  self-influence (RelatIF's ℓ-relative influence, Barshan et al. 2020), so that a few
  high-loss, large-gradient examples no longer top every query's list; per query it ranks the
  training examples as ``cosine`` does (they differ by one positive factor per query, the
  query's own norm), while the scores keep the query's scale
* ``cosine``: ``g_qᵀ M g_i / (‖g_q‖_M ‖g_i‖_M)``
* ``l2``: ``−(g_q − g_i)ᵀ M (g_q − g_i)``

Example:
    >>> q_pre, rows = torch.eye(2), torch.tensor([[3.0, 4.0]])
    >>> raw_scores(q_pre, rows).tolist()
    [[3.0, 4.0]]
"""

from __future__ import annotations

from typing import Any

import torch

MODES = ("dot", "relatif", "cosine", "l2")


def check_mode(mode: str) -> None:
    """Refuse an unknown mode.

    Example:
        >>> check_mode("dot")
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid: {list(MODES)}")


def raw_scores(
    q_pre: torch.Tensor,
    rows: torch.Tensor,
    out: torch.Tensor | None = None,
    query_major: bool = False,
) -> torch.Tensor:
    """``g_qᵀ M g_i`` as ``[b, n_test]`` (train-major: a block is a contiguous slice of the
    all-pairs output), or ``[n_test, b]`` with ``query_major`` (what a per-query selection reads
    contiguously); ``q_pre`` holds the preconditioned queries ``Q M``.

    Example:
        >>> raw_scores(torch.ones(3, 2), torch.ones(5, 2), query_major=True).shape
        torch.Size([3, 5])
    """
    rows = rows.to(torch.float32)
    if query_major:
        return torch.mm(q_pre, rows.T, out=out)
    return torch.matmul(rows, q_pre.T, out=out)


def normalise(
    scores: torch.Tensor,
    q_norm: torch.Tensor | None,
    rows: torch.Tensor,
    pre: Any,
    damping: float | None,
    mode: str,
    query_major: bool = False,
    t_parts: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """``mode``'s scores from the ``dot`` ones of `raw_scores` (in place); ``q_norm`` holds the
    queries' ``‖g_q‖_M`` (:func:`m_norms`) and ``pre`` applies ``M`` to the rows, unless
    ``t_parts`` gives the rows' ``‖g_i‖_M`` already as ``(scale, unit)`` (:func:`m_norm_parts`'
    form; ``rows`` are then not read: factored rows' norms from their factors,
    `factored_queries.norm_parts_as_stored`).

    ``relatif`` and ``cosine`` divide by norms computed where they cannot underflow
    (:func:`m_norm_parts`); a numerically zero training row (or query, for ``cosine``) scores
    0, never first by a division by zero; a cosine is clamped to ``[-1, 1]``.

    Example:
        >>> from nnstat.influence.precondition import Preconditioner
        >>> pre = Preconditioner("identity", [], {})
        >>> rows, q = torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0, 0.0]])
        >>> normalise(raw_scores(q, rows), m_norms(q, q), rows, pre, None, "cosine").tolist()
        [[0.6000000238418579]]
    """
    if mode == "dot":
        return scores
    if t_parts is None:
        rows = rows.to(torch.float32)
        applied = pre.apply(rows, damping)
    if mode == "l2":
        # g_iᵀ M g_i
        t_norm = (applied * rows).sum(1) if t_parts is None else (t_parts[0] * t_parts[1]).square()
        tn, qn = _oriented(t_norm, q_norm.square(), query_major)
        return scores.mul_(2).sub_(tn).sub_(qn)
    scale, unit = m_norm_parts(rows, applied) if t_parts is None else t_parts
    ok = (scale > 0) & (unit > 0)  # the floor: a numerically zero row scores 0
    one = torch.ones_like(scale)
    # two divisions, never by their product: a row of 1e-29 has a norm of 1e-29, its dot
    # products ~1e-29 too, all normal float32 numbers; the score is then of order one
    for d in (torch.where(ok, scale, one), torch.where(ok, unit, one)):
        scores /= _oriented(d, None, query_major)[0]
    scores.masked_fill_(~_oriented(ok, None, query_major)[0], 0.0)
    if mode == "cosine":
        q_ok = q_norm > 0
        qn = _oriented(scale, torch.where(q_ok, q_norm, torch.ones_like(q_norm)), query_major)[1]
        scores /= qn
        scores.masked_fill_(~_oriented(scale, q_ok, query_major)[1], 0.0)
        scores.clamp_(-1.0, 1.0)  # a cosine; float32 rounding may pass 1 by an ulp
    return scores


def _oriented(
    t: torch.Tensor, q: torch.Tensor | None, query_major: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-training-row ``t`` and per-query ``q`` values shaped to broadcast against a block
    of scores (``[b, n_test]``, or ``[n_test, b]`` with ``query_major``)."""
    if query_major:
        return t[None, :], None if q is None else q[:, None]
    return t[:, None], None if q is None else q[None]


def m_norm_parts(rows: torch.Tensor, applied: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``‖g‖_M = sqrt(gᵀ M g)`` as ``scale * unit``, computed where it cannot
    underflow: ``scale`` is the row's largest ``|entry|`` and ``unit`` the M-norm of the row
    divided by it (of order one). A row of 1e-29 (a well-fitted example) has ``gᵀ M g`` ~1e-58,
    zero in float32: dividing by that would rank it first for every query.

    The floor: a row whose largest entry is below float32's smallest normal number
    (``torch.finfo(torch.float32).tiny``, 1.2e-38: zeros and subnormals, whose direction is
    not represented) has ``scale`` 0: numerically zero.

    Args:
        rows: ``[n, d]`` float32 rows ``g``.
        applied: ``[n, d]`` the rows with ``M`` applied (``M g``; ``M`` is linear).

    Returns:
        ``(scale, unit)``, each ``[n]``.

    Example:
        >>> rows = torch.tensor([[3e-29, 4e-29], [0.0, 0.0]])
        >>> scale, unit = m_norm_parts(rows, rows)
        >>> [f"{v:.3g}" for v in (scale * unit).tolist()]
        ['5e-29', '0']
    """
    tiny = torch.finfo(torch.float32).tiny
    scale = rows.abs().amax(1)
    normal = scale >= tiny
    div = torch.where(normal, scale, torch.ones_like(scale))[:, None]
    unit = ((applied / div) * (rows / div)).sum(1).clamp_min(0).sqrt()
    return torch.where(normal, scale, torch.zeros_like(scale)), unit


def m_norms(rows: torch.Tensor, applied: torch.Tensor) -> torch.Tensor:
    """``‖g‖_M`` of each row (float32; 0 below the floor of :func:`m_norm_parts`, or where the
    norm itself is below float32's range).

    Args:
        rows: ``[n, d]`` rows ``g``.
        applied: ``[n, d]`` the rows with ``M`` applied.

    Returns:
        ``[n]`` norms.

    Example:
        >>> g = torch.tensor([[3e-29, 4e-29]])
        >>> f"{m_norms(g, g).item():.3g}"
        '5e-29'
    """
    scale, unit = m_norm_parts(rows.to(torch.float32), applied.to(torch.float32))
    return scale * unit
