"""Influence through exact inverse-Hessian-vector products (Koh & Liang 2017), for small models.

``score(q, i) = g_qᵀ (H + λI)⁻¹ g_i`` where ``H`` is the true Hessian of the **mean** training loss,
obtained matrix-free: Hessian-vector products by forward-over-reverse ``torch.func`` on the real
training loss, solved by conjugate gradient (default) or LiSSA. Per-example gradients come from
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
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.func import functional_call, grad, vmap

from .result import InfluenceResult

Batch = tuple[torch.Tensor, torch.Tensor]


def iter_batches(data: Any, batch_size: int, dtype: torch.dtype) -> Iterator[Batch]:
    """Yield ``(inputs, targets)`` batches of ``data`` (a tuple of tensors, Dataset or DataLoader),
    floating tensors cast to ``dtype``; a DataLoader is iterated afresh on every call.

    Example:
        >>> import torch
        >>> X, Y = torch.zeros(5, 2), torch.zeros(5, dtype=torch.long)
        >>> [len(x) for x, _ in iter_batches((X, Y), 2, torch.float64)]
        [2, 2, 1]
    """
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        x, y = data
        if len(x) != len(y):
            raise ValueError(f"inputs have {len(x)} rows but targets {len(y)}")
        loader: Any = (
            (x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)
        )
    elif isinstance(data, torch.utils.data.DataLoader):
        loader = data
    elif isinstance(data, torch.utils.data.Dataset):
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)
    else:
        raise TypeError(
            f"data must be an (inputs, targets) tuple of tensors, a Dataset or a DataLoader, "
            f"got {type(data).__name__}"
        )
    for batch in loader:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("each batch must be an (inputs, targets) pair")
        bx, by = batch  # not x, y: the generator above reads those lazily
        yield (
            bx.to(dtype) if bx.is_floating_point() else bx,
            by.to(dtype) if by.is_floating_point() else by,
        )


def _batches(data: Any, batch_size: int, dtype: torch.dtype) -> list[Batch]:
    """All of `iter_batches` in memory (the exact path holds its data: small models only)."""
    out = list(iter_batches(data, batch_size, dtype))
    if not out:
        raise ValueError("empty data")
    return out


class _Problem:
    """The model as a function of one flat parameter vector."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable, reduction: str, dtype):
        self.model = model
        self.loss_fn = loss_fn
        self.reduction = reduction
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.names = [n for n, _ in named]
        self.shapes = [p.shape for _, p in named]
        self.sizes = [p.numel() for _, p in named]
        self.theta = torch.cat([p.detach().reshape(-1) for _, p in named]).to(dtype)
        self.buffers = {n: b.detach() for n, b in model.named_buffers()}
        self.frozen = {
            n: p.detach().to(dtype) for n, p in model.named_parameters() if not p.requires_grad
        }
        # float buffers follow the compute dtype so functional_call does not mix precisions
        self.buffers = {
            n: (b.to(dtype) if b.is_floating_point() else b) for n, b in self.buffers.items()
        }

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        parts = torch.split(flat, self.sizes)
        return {n: t.view(s) for n, t, s in zip(self.names, parts, self.shapes, strict=True)}

    def batch_loss(self, flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        state = {**self.unflatten(flat), **self.frozen, **self.buffers}
        loss = self.loss_fn(functional_call(self.model, state, (x,)), y)
        if loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar batch loss (reduced as loss_reduction="
                f"{self.reduction!r}), got shape {tuple(loss.shape)}"
            )
        return loss

    def example_grads(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``[b, P]`` gradients of each example's own loss."""

        def one(flat, xi, yi):
            return self.batch_loss(flat, xi.unsqueeze(0), yi.unsqueeze(0))

        return vmap(grad(one), in_dims=(None, 0, 0))(self.theta, x, y)

    def mean_loss_weight(self, batch_len: int, n: int) -> float:
        # contribution of a batch loss to the MEAN training loss
        return batch_len / n if self.reduction == "mean" else 1.0 / n


def _hvp_fn(problem: _Problem, batches: list[Batch]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Hessian-vector products of the mean training loss for a stack of vectors ``[k, P]``.

    The gradient graph of every batch is built once (``create_graph``) and reused: each product is
    then a single reverse pass per batch (reverse-over-reverse), batched over the ``k`` vectors.
    """
    n = sum(len(x) for x, _ in batches)
    theta = problem.theta.detach().requires_grad_(True)
    grads = []
    with torch.enable_grad():
        for x, y in batches:
            w = problem.mean_loss_weight(len(x), n)
            loss = w * problem.batch_loss(theta, x, y)
            (g,) = torch.autograd.grad(loss, theta, create_graph=True)
            grads.append(g)

    def many(vs: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(vs)
        for g in grads:
            try:
                (h,) = torch.autograd.grad(
                    g, theta, grad_outputs=vs, retain_graph=True, is_grads_batched=True
                )
            except RuntimeError:
                # some operators have no batching rule: one vector at a time is equivalent
                h = torch.stack(
                    [
                        torch.autograd.grad(g, theta, grad_outputs=v, retain_graph=True)[0]
                        for v in vs
                    ]
                )
            out += h
        return out

    return many


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    tol: float = 1e-10,
    max_iter: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve ``A x_k = rhs_k`` for every row ``k`` of ``rhs`` (A symmetric positive definite).

    Returns ``(x, relative residuals)``. Raises when ``A`` is not positive definite along a search
    direction (a non-convex loss with too little damping).

    Example:
        >>> import torch
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> x, _ = conjugate_gradient(lambda v: v @ A, torch.tensor([[1.0, 2.0]], dtype=torch.float64))
        >>> torch.allclose(x @ A, torch.tensor([[1.0, 2.0]], dtype=torch.float64))
        True
    """
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    p = r.clone()
    rs = (r * r).sum(1)
    b_norm = rhs.norm(dim=1).clamp_min(torch.finfo(rhs.dtype).tiny)
    active = torch.ones(len(rhs), dtype=torch.bool)
    for _ in range(max_iter):
        active = rs.sqrt() / b_norm > tol
        if not active.any():
            break
        ap = matvec(p)
        pap = (p * ap).sum(1)
        if (pap[active] <= 0).any():
            raise ValueError(
                "H + damping·I is not positive definite along a conjugate-gradient direction "
                f"(pᵀAp = {pap[active].min().item():.3g}); increase the damping"
            )
        alpha = torch.where(active, rs / pap.where(active, torch.ones_like(pap)), 0.0)
        x = x + alpha[:, None] * p
        r = r - alpha[:, None] * ap
        rs_new = (r * r).sum(1)
        beta = torch.where(active, rs_new / rs.where(active, torch.ones_like(rs)), 0.0)
        p = r + beta[:, None] * p
        rs = rs_new
    return x, rs.sqrt() / b_norm


def lissa(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    scale: float,
    depth: int = 1000,
    tol: float = 1e-8,
) -> torch.Tensor:
    """LiSSA / Neumann series ``A⁻¹ b ≈ (1/scale) Σ_j (I − A/scale)^j b`` (``scale > λ_max(A)``).

    Example:
        >>> import torch
        >>> A = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
        >>> x = lissa(lambda v: v @ A, torch.ones(1, 2, dtype=torch.float64), scale=3.0)
        >>> [round(v, 6) for v in x[0].tolist()]
        [0.5, 1.0]
    """
    est = rhs.clone()
    for _ in range(depth):
        new = rhs + est - matvec(est) / scale
        change = (new - est).norm() / new.norm().clamp_min(torch.finfo(rhs.dtype).tiny)
        est = new
        if change < tol:
            break
    return est / scale


def _top_eigenvalue(matvec, dim: int, dtype, iters: int = 30) -> float:
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(1, dim, generator=gen, dtype=torch.float64).to(dtype)
    v = v / v.norm()
    value = 0.0
    for _ in range(iters):
        w = matvec(v)
        value = float(w.norm())
        if value == 0:
            return 0.0
        v = w / value
    return value


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
    problem = _Problem(model, loss_fn, loss_reduction, dtype)
    train = _batches(train_data, batch_size, dtype)
    query = _batches(query_data, batch_size, dtype)
    hvp = _hvp_fn(problem, train)

    def matvec(v: torch.Tensor) -> torch.Tensor:
        return hvp(v) + damping * v

    q_grads = torch.cat([problem.example_grads(x, y) for x, y in query])
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
        scale = 1.1 * _top_eigenvalue(matvec, dim, dtype)
        solved = lissa(matvec, q_grads, scale, lissa_depth, tol)
    scores = torch.cat([solved @ problem.example_grads(x, y).T for x, y in train], dim=1)
    n_train = scores.shape[1]
    meta = {"mode": "dot", "preconditioner": f"exact-{method}", "damping": damping}
    return InfluenceResult(
        scores.to(torch.float32), list(range(len(q_grads))), list(range(n_train)), meta
    )
