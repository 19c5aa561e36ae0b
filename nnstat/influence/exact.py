"""Influence through exact inverse-Hessian-vector products (Koh & Liang 2017), for small models.

``score(q, i) = g_qᵀ (H + λI)⁻¹ g_i`` where ``H`` is the true Hessian of the **mean** training loss,
obtained matrix-free: Hessian-vector products by double backward on the real training loss
(``nnstat.curvature.products``, the gradient graph of the data built once), solved by conjugate
gradient (default) or LiSSA (``krylov.py``). Per-example gradients come from
``torch.func.vmap(grad(...))``. Everything runs in float64 by default: this is the reference the
approximations are measured against.

Conjugate gradient solves all queries as one block (`krylov.block_cg`, ``solver="block"``, when
its search space, at most two ``P × P`` matrices, fits ``memory``): it ends within ``⌈P / k⌉``
passes for ``k`` queries, and the Ritz values of its whole space find negative curvature of
``H + λI`` that each query's own recurrence can miss for hundreds of steps. Otherwise one
recurrence per query (``solver="cg"``), stopped at ``max_iter``; the Lanczos tridiagonal of its
coefficients gives the curvature it reports. Where ``H + λI`` is not positive definite the
reference is undefined: ``indefinite="raise"`` (default) stops with the damping that would do,
``indefinite="damp"`` raises ``λ`` by refinement's rule (`refine_system.raised_damping`: at
least 1.5 x the Hessian's most negative curvature found), with a warning and
``result.meta["damping_rule"]`` saying so.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(3, 2)
    >>> X, Y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    >>> res = exact(model, torch.nn.functional.cross_entropy, (X, Y), (X[:2], Y[:2]), damping=0.1)
    >>> res.scores.shape
    torch.Size([2, 20])
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from nnstat.curvature.products import Batch, FunctionalLoss, ParamLayout, iter_batches
from nnstat.curvature.streamed import kept_curvature

from .krylov import (
    block_cg,
    conjugate_gradient,
    lissa,
    preconditioned_cg,
    top_eigenvalue,
)
from .refine_plan import available_memory
from .refine_system import DAMPING_RAISE, MAX_DAMPING_RAISES, raised_damping
from .result import InfluenceResult

__all__ = ["conjugate_gradient", "exact", "iter_batches", "lissa"]


def _batches(data: Any, batch_size: int, dtype: torch.dtype) -> list[Batch]:
    """All of `iter_batches` in memory (the exact path holds its data: small models only)."""
    out = list(iter_batches(data, batch_size, dtype))
    if not out:
        raise ValueError("empty data")
    return out


INDEFINITE = ("raise", "damp")


def _indefinite_error(lam: float, curvature: float, solver: str) -> ValueError:
    """The error of an indefinite ``H + λI`` found with Ritz value ``curvature``."""
    theta = curvature - lam
    need = DAMPING_RAISE * -theta
    return ValueError(
        f"exact influence: H + damping·I is not positive definite (damping {lam:.3g}): "
        f"conjugate gradient ({solver}) found a Ritz value {curvature:.3g} of it, i.e. the "
        f"Hessian has curvature {theta:.3g} < -damping there, so (H + λI)⁻¹ is no influence "
        f"reference. Pass damping >= {need:.3g} ({DAMPING_RAISE} x that curvature, the rule "
        "Refinement uses), or indefinite='damp' to raise it so (result.meta['damping_rule'] "
        "says to what)"
    )


def _solve(
    hvp: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    lam: float,
    solver: str,
    tol: float,
    max_iter: int,
    damp: bool,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(H + λI)⁻¹ rhs`` by ``solver``, λ raised by `raised_damping` where ``damp``; ``info``
    with the final ``"damping"`` and the Hessian curvatures raised past (``"found"``)."""
    state: dict[str, Any] = {"lam": lam, "found": []}

    def matvec(v: torch.Tensor) -> torch.Tensor:
        return hvp(v) + state["lam"] * v

    def shift(mu: float) -> float:  # the block solver raises λ in place, no product repeated
        new = raised_damping(mu - state["lam"], state["lam"])
        if new is None:
            return 0.0
        state["found"].append(mu - state["lam"])
        delta, state["lam"] = new - state["lam"], new
        return delta

    for _ in range(MAX_DAMPING_RAISES + 1):
        try:
            if solver == "block":
                x, info = block_cg(
                    matvec, lambda r: r, rhs, max_iter, tol=tol, shift=shift if damp else None
                )
            else:
                x, info = preconditioned_cg(matvec, None, rhs, max_iter, tol=tol)
        except ValueError as e:
            curv = getattr(e, "curvature", None)
            if not curv:
                raise
            if not damp or solver == "block":
                raise _indefinite_error(state["lam"], min(curv), solver) from None
            theta = min(curv) - state["lam"]  # per query: solve again at the raised λ
            state["found"].append(theta)
            state["lam"] = raised_damping(theta, state["lam"]) or state["lam"]
            continue
        return x, {**info, "damping": state["lam"], "found": state["found"]}
    raise _indefinite_error(state["lam"], min(curv), solver)


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
    `refine_plan.available_memory`; ``"cg"``: one recurrence per query, at most ``max_iter``
    steps, default ``min(2P, 1000)``); ``method="lissa"`` uses the Neumann series with a
    power-iteration scale. ``indefinite``: where ``H + λI`` turns out not positive definite,
    ``"raise"`` stops with the damping that would do, ``"damp"`` raises ``λ`` to 1.5 x the
    Hessian's most negative curvature found (as `Refinement` does), with a warning;
    ``result.meta["damping"]`` is the ``λ`` used, ``["damping_rule"]`` how it was chosen. Ids
    are positions in the data. Put the model in ``eval()`` mode if it has dropout or batch norm.

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
    damping = float(damping)
    if not math.isfinite(damping) or damping < 0:
        raise ValueError(f"damping must be a finite number >= 0, got {damping}")
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
    if method == "cg":
        if solver is None:
            budget = available_memory(q_grads.device) if memory is None else memory
            space = 2 * dim * dim * torch.finfo(dtype).bits // 8
            solver = "block" if space <= budget else "cg"
        if max_iter is None:
            max_iter = -(-dim // n_q) + 2 if solver == "block" else min(2 * dim, 1000)
        solved, info = _solve(hvp, q_grads, damping, solver, tol, max_iter, indefinite == "damp")
        residual = float(info["residual"].max())
        if residual > max(tol, 1e-6):
            warnings.warn(
                f"conjugate gradient ({solver}) stopped after {info['passes']} passes at relative "
                f"residual {residual:.2e}; raise max_iter or the damping",
                stacklevel=2,
            )
        rule = "given"
        if info["found"]:
            rule = (
                f"raised from {damping:.3g} to {info['damping']:.3g} to stay {DAMPING_RAISE} x "
                f"the Hessian's most negative curvature found ({min(info['found']):.3g}), "
                "indefinite='damp'"
            )
            warnings.warn(
                f"nnstat: exact influence: H + damping·I is not positive definite enough: the "
                f"damping was {rule} (result.meta['damping_rule']); pass a larger damping, or "
                "indefinite='raise' to make this an error",
                stacklevel=2,
            )
        meta.update(
            damping=info["damping"],
            damping_asked=damping,
            damping_rule=rule,
            solver=solver,
            passes=info["passes"],
            max_residual=residual,
        )
    else:
        matvec = _damped(hvp, damping)
        scale = 1.1 * top_eigenvalue(matvec, dim, dtype)
        solved = lissa(matvec, q_grads, scale, lissa_depth, tol)
        meta.update(damping=damping, damping_rule="given")
    scores = torch.cat([solved @ example_grads(x, y).T for x, y in train], dim=1)
    n_train = scores.shape[1]
    return InfluenceResult(
        scores.to(torch.float32), list(range(len(q_grads))), list(range(n_train)), meta
    )


def _damped(
    hvp: Callable[[torch.Tensor], torch.Tensor], lam: float
) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda v: hvp(v) + lam * v
