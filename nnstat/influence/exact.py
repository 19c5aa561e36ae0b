"""Influence through exact inverse-Hessian-vector products (Koh & Liang 2017), for small models.

``score(q, i) = g_qᵀ (H + λI)⁻¹ g_i`` where ``H`` is the true Hessian of the **mean** training loss,
obtained matrix-free: Hessian-vector products by double backward on the real training loss
(``nnstat.curvature.products``, the gradient graph of the data built once), solved by conjugate
gradient (default) or LiSSA (``krylov.py``). Per-example gradients come from
``torch.func.vmap(grad(...))``. Everything runs in float64 by default: this is the reference the
approximations are measured against.

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

from nnstat.curvature.products import (
    Batch,
    FunctionalLoss,
    ParamLayout,
    graph_hvp,
    iter_batches,
    mean_loss_weight,
)

from .krylov import conjugate_gradient, lissa, top_eigenvalue
from .result import InfluenceResult

__all__ = ["conjugate_gradient", "exact", "iter_batches", "lissa"]


def _batches(data: Any, batch_size: int, dtype: torch.dtype) -> list[Batch]:
    """All of `iter_batches` in memory (the exact path holds its data: small models only)."""
    out = list(iter_batches(data, batch_size, dtype))
    if not out:
        raise ValueError("empty data")
    return out


def _hvp_fn(
    loss: FunctionalLoss, layout: ParamLayout, batches: list[Batch]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Hessian-vector products of the mean training loss for a stack of flat vectors ``[k, P]``.

    The gradient graph of every batch is built once (``create_graph``) and reused: each product is
    then a single reverse pass per batch (`graph_hvp`), batched over the ``k`` vectors.
    """
    n = sum(len(x) for x, _ in batches)
    theta = layout.from_dict(loss.theta, 1)[0].requires_grad_(True)
    grads = []
    with torch.enable_grad():
        for x, y in batches:
            w = mean_loss_weight(len(x), n, loss.reduction or "mean")
            batch_loss = w * loss.loss(layout.to_dict(theta), x, y)
            (g,) = torch.autograd.grad(batch_loss, theta, create_graph=True)
            grads.append(g)

    def many(vs: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(vs)
        for g in grads:
            out += graph_hvp([g], [theta], [vs])[0]
        return out

    return many


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
) -> InfluenceResult:
    """Exact influence ``g_qᵀ (H + λI)⁻¹ g_i`` with ``H`` the Hessian of the mean training loss.

    ``loss_fn(outputs, targets)`` returns the batch loss reduced as ``loss_reduction`` declares
    (``"mean"`` or ``"sum"``); per-example losses are that function on single-example batches.
    Data may be an ``(inputs, targets)`` tuple of tensors, a Dataset or a DataLoader (held in memory:
    this is for small models). ``method="cg"`` solves by conjugate gradient to relative residual
    ``tol``; ``method="lissa"`` uses the Neumann series with a power-iteration scale. Ids are
    positions in the data. Put the model in ``eval()`` mode if it has dropout or batch norm.

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
    hvp = _hvp_fn(loss, layout, train)

    def example_grads(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return layout.from_dict(loss.example_grads(x, y), len(x))

    def matvec(v: torch.Tensor) -> torch.Tensor:
        return hvp(v) + damping * v

    q_grads = torch.cat([example_grads(x, y) for x, y in query])
    if not torch.isfinite(q_grads).all():
        raise ValueError("query gradients contain NaN/Inf")
    dim = q_grads.shape[1]
    if method == "cg":
        solved, residual = conjugate_gradient(matvec, q_grads, tol, max_iter or min(dim, 2000))
        if (residual > max(tol, 1e-6)).any():
            warnings.warn(
                f"conjugate gradient stopped at relative residual {residual.max().item():.2e}; "
                "raise max_iter or the damping",
                stacklevel=2,
            )
    else:
        scale = 1.1 * top_eigenvalue(matvec, dim, dtype)
        solved = lissa(matvec, q_grads, scale, lissa_depth, tol)
    scores = torch.cat([solved @ example_grads(x, y).T for x, y in train], dim=1)
    n_train = scores.shape[1]
    meta = {"mode": "dot", "preconditioner": f"exact-{method}", "damping": damping}
    return InfluenceResult(
        scores.to(torch.float32), list(range(len(q_grads))), list(range(n_train)), meta
    )
