"""Influence through exact inverse-Hessian-vector products (Koh & Liang 2017), for small models.

``score(q, i) = g_qᵀ (H + λI)⁻¹ g_i`` where ``H`` is the true Hessian of the **mean** training loss,
obtained matrix-free: Hessian-vector products by double backward on the real training loss
(`nnstat.curvature.streamed.kept_curvature`, the gradient graph of the data built once), solved
by conjugate gradient (default) or LiSSA through `damped_solve.damped_solve`, the solve
refinement uses. Per-example gradients come from
``torch.func.vmap(grad(...))``. Everything runs in float64 by default: this is the reference the
approximations are measured against.

Conjugate gradient solves all queries as one block (`krylov.block_cg`, ``solver="block"``, when
its search space, at most two ``P × P`` matrices, fits ``memory``): it ends within ``⌈P / k⌉``
passes for ``k`` queries, and the Ritz values of its whole space find negative curvature of
``H + λI`` that each query's own recurrence can miss for hundreds of steps. Otherwise one
recurrence per query (``solver="cg"``), stopped at ``max_iter``; the Lanczos tridiagonal of its
coefficients gives the curvature it reports; LiSSA's series diverges there, which it detects
by its growing terms. Where ``H + λI`` is not positive definite the reference is undefined:
``indefinite="raise"`` (default) stops with the damping that would do, ``indefinite="damp"``
raises ``λ`` by refinement's rule (`damped_solve.raised_damping`: at least 1.5 x the Hessian's
most negative curvature found), with a warning and ``result.meta["damping_rule"]`` saying so.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(3, 2)
    >>> X, Y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    >>> res = exact(model, torch.nn.functional.cross_entropy, (X, Y), (X[:2], Y[:2]), damping=0.1)
    >>> res.scores.shape
    torch.Size([2, 20])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from nnstat.curvature.products import Batch, FunctionalLoss, ParamLayout, iter_batches
from nnstat.curvature.streamed import kept_curvature

from .arguments import check_damping
from .damped_solve import (
    DAMPING_RAISE,
    DampedOperator,
    IndefiniteError,
    conjugate_gradient,
    damped_solve,
)
from .krylov import lissa
from .refine.memory import available_memory
from .result import InfluenceResult

__all__ = ["conjugate_gradient", "exact", "iter_batches", "lissa"]


def _batches(data: Any, batch_size: int, dtype: torch.dtype) -> list[Batch]:
    """All of `iter_batches` in memory (the exact path holds its data: small models only)."""
    out = list(iter_batches(data, batch_size, dtype))
    if not out:
        raise ValueError("empty data")
    return out


INDEFINITE = ("raise", "damp")


def _indefinite_error(e: IndefiniteError) -> ValueError:
    """The user's error of an indefinite ``H + λI`` (``e``)."""
    found = (
        f"conjugate gradient ({e.solver}) found a Ritz value {min(e.curvature):.3g} of it"
        if e.solver != "lissa"
        else f"LiSSA's iterate grew along a direction of Rayleigh quotient {min(e.curvature):.3g}"
    )
    return ValueError(
        f"exact influence: H + damping·I is not positive definite (damping {e.lam:.3g}): "
        f"{found}, i.e. the Hessian has curvature {e.theta:.3g} < -damping there, so (H + λI)⁻¹ "
        f"is no influence reference. Pass damping >= {e.need:.3g} ({DAMPING_RAISE} x that "
        "curvature, the rule Refinement uses), or indefinite='damp' to raise it so "
        "(result.meta['damping_rule'] says to what)"
    )


def exact(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    train_data: Any,
    query_data: Any,
    damping: float,
    loss_reduction: str = "mean",
    method: str = "cg",
    batch_size: int = 256,
    tol: float = 1e-10,
    max_iter: int | None = None,
    lissa_depth: int = 5000,
    dtype: torch.dtype = torch.float64,
    indefinite: str = "raise",
    solver: str | None = None,
    memory: int | None = None,
) -> InfluenceResult:
    """Exact influence ``g_qᵀ (H + λI)⁻¹ g_i`` with ``H`` the Hessian of the mean training loss.

    ``loss_fn(outputs, targets)`` returns the batch loss reduced as ``loss_reduction`` declares
    (``"mean"`` or ``"sum"``); per-example losses are that function on single-example batches.
    Data may be an ``(inputs, targets)`` tuple of tensors, a Dataset or a DataLoader (held in memory:
    this is for small models). ``method="cg"`` solves by conjugate gradient to relative residual
    ``tol`` (``solver``: ``"block"``, all queries in one search space, at most ``max_iter``
    passes, default ``⌈P / k⌉ + 2``, when ``2 · P²`` values fit ``memory`` bytes, default
    `refine.memory.available_memory`; ``"cg"``: one recurrence per query, at most ``max_iter``
    steps, default ``min(2P, 1000)``); ``method="lissa"`` uses the Neumann series with a
    power-iteration scale, ``lissa_depth`` terms at most, and refuses (or, with
    ``indefinite="damp"``, damps) a series that diverges. ``indefinite``: where ``H + λI``
    turns out not positive definite, ``"raise"`` stops with the damping that would do,
    ``"damp"`` raises ``λ`` to 1.5 x the Hessian's most negative curvature found (as
    `Refinement` does), with a warning;
    ``result.meta["damping"]`` is the ``λ`` used, ``["damping_rule"]`` how it was chosen. Ids
    are positions in the data. Put the model in ``eval()`` mode if it has dropout or batch norm.

    Args:
        model: the trained model (all its trainable parameters are ``H``'s).
        loss_fn: ``loss_fn(outputs, targets)`` -> the batch loss reduced as ``loss_reduction``.
        train_data: the training data: a tuple of tensors, a Dataset or a DataLoader.
        query_data: the queries, in the same forms.
        damping: ``λ >= 0``.
        loss_reduction: ``"mean"`` or ``"sum"``.
        method: ``"cg"`` or ``"lissa"``.
        batch_size: examples per batch of tensor or Dataset data.
        tol: the relative residual (CG) or relative change (LiSSA) to stop at.
        max_iter: CG's passes at most (default above).
        lissa_depth: LiSSA's terms at most.
        dtype: the compute dtype.
        indefinite: ``"raise"`` or ``"damp"``.
        solver: ``None`` (by ``memory``), ``"block"`` or ``"cg"``.
        memory: bytes block CG's search space may take (``None``: the free memory's share).

    Returns:
        `InfluenceResult` with ``scores [n_query, n_train]`` (float32) and ``meta``.

    Raises:
        ValueError: bad arguments, empty data, non-finite query gradients, or ``H + λI`` not
            positive definite under ``indefinite="raise"`` (the message names the damping that
            would do).

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(2, 2)
        >>> X, Y = torch.randn(8, 2), torch.randint(0, 2, (8,))
        >>> exact(m, torch.nn.functional.cross_entropy, (X, Y), (X, Y), 1.0).scores.shape
        torch.Size([8, 8])
    """
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    if method not in ("cg", "lissa"):
        raise ValueError(f"method must be 'cg' or 'lissa', got {method!r}")
    if indefinite not in INDEFINITE:
        raise ValueError(f"indefinite must be one of {list(INDEFINITE)}, got {indefinite!r}")
    if solver not in (None, "block", "cg"):
        raise ValueError(f"solver must be None, 'block' or 'cg', got {solver!r}")
    damping = check_damping(damping)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not names:
        raise ValueError("the model has no trainable parameters")
    loss = FunctionalLoss(model, loss_fn, names, dtype, loss_reduction)
    layout = ParamLayout(names, [loss.theta[n].shape for n in names])
    train = _batches(train_data, batch_size, dtype)
    query = _batches(query_data, batch_size, dtype)
    hvp = kept_curvature(loss, layout, train).product

    def example_grads(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return layout.from_dict(loss.example_grads(x, y), len(x))

    q_grads = torch.cat([example_grads(x, y) for x, y in query])
    if not torch.isfinite(q_grads).all():
        raise ValueError("query gradients contain NaN/Inf")
    n_q, dim = q_grads.shape
    meta: dict[str, Any] = {"mode": "dot", "preconditioner": f"exact-{method}"}
    if method == "lissa":
        solver, max_iter = "lissa", lissa_depth
    if solver is None:
        budget = available_memory(q_grads.device) if memory is None else memory
        space = 2 * dim * dim * torch.finfo(dtype).bits // 8
        solver = "block" if space <= budget else "cg"
    if max_iter is None:
        max_iter = -(-dim // n_q) + 2 if solver == "block" else min(2 * dim, 1000)
    op = DampedOperator(hvp, damping, adaptive=indefinite == "damp")
    try:
        solved, info = damped_solve(op, q_grads, solver, max_iter, tol=tol)
    except IndefiniteError as e:
        raise _indefinite_error(e) from None
    residual = float(info["residual"].max()) if "residual" in info else None
    if residual is not None and residual > max(tol, 1e-6):
        warnings.warn(
            f"conjugate gradient ({solver}) stopped after {info['passes']} passes at relative "
            f"residual {residual:.2e}; raise max_iter or the damping",
            stacklevel=2,
        )
    rule = "given"
    if op.found:
        rule = (
            f"raised from {damping:.3g} to {op.lam:.3g} to stay {DAMPING_RAISE} x "
            f"the Hessian's most negative curvature found ({min(op.found):.3g}), "
            "indefinite='damp'"
        )
        warnings.warn(
            f"nnstat: exact influence: H + damping·I is not positive definite enough: the "
            f"damping was {rule} (result.meta['damping_rule']); pass a larger damping, or "
            "indefinite='raise' to make this an error",
            stacklevel=2,
        )
    meta.update(damping=op.lam, damping_asked=damping, damping_rule=rule, passes=info["passes"])
    if method == "cg":
        meta.update(solver=solver, max_residual=residual)
    scores = torch.cat([solved @ example_grads(x, y).T for x, y in train], dim=1)
    n_train = scores.shape[1]
    return InfluenceResult(
        scores.to(torch.float32), list(range(len(q_grads))), list(range(n_train)), meta
    )
