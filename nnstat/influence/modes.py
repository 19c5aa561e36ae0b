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
) -> torch.Tensor:
    """``mode``'s scores from the ``dot`` ones of `raw_scores` (in place); ``q_norm`` holds the
    queries' ``g_qᵀ M g_q`` and ``pre`` applies ``M`` to the rows.

    Example:
        >>> from nnstat.influence.precondition import Preconditioner
        >>> pre = Preconditioner("identity", [], {})
        >>> rows, q = torch.tensor([[3.0, 4.0]]), torch.tensor([[1.0, 0.0]])
        >>> normalise(raw_scores(q, rows), torch.ones(1), rows, pre, None, "cosine").tolist()
        [[0.6000000238418579]]
    """
    if mode == "dot":
        return scores
    rows = rows.to(torch.float32)
    t_norm = (pre.apply(rows, damping) * rows).sum(1)  # g_iᵀ M g_i
    tn, qn = (t_norm[None, :], q_norm[:, None]) if query_major else (t_norm[:, None], q_norm[None])
    if mode == "relatif":
        scores /= tn.clamp_min(0).sqrt().clamp_min(torch.finfo(torch.float32).tiny)
    elif mode == "cosine":
        denom = tn.clamp_min(0).sqrt() * qn.clamp_min(0).sqrt()
        scores /= denom.clamp_min(torch.finfo(torch.float32).tiny)
    else:
        scores.mul_(2).sub_(tn).sub_(qn)
    return scores
