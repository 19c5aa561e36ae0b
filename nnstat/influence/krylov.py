"""Krylov solvers for ``A X = B`` with many right-hand sides (pure maths on ``[k, P]`` rows).

The one home of the influence code's solvers. ``preconditioned_cg`` runs one conjugate-gradient
recurrence per row (the rows only share the batched ``matvec``); `conjugate_gradient` is it
without a preconditioner (exact influence). `lissa` is the Neumann series, scaled by
`top_eigenvalue` (power iteration). ``block_cg`` shares one search space between all rows: each step adds every
row's preconditioned residual to it, and every row takes the best iterate in the whole space.
Refinement solves one system per query against the same curvature, so a block of 32 queries
explores 32 directions per pass over the training data instead of one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["block_cg", "conjugate_gradient", "lissa", "preconditioned_cg", "top_eigenvalue"]


def _not_positive_definite(
    rows: list[int], curvature: list[float], pap: list[float] | None = None
) -> ValueError:
    """The error of a search space where ``A`` is not positive definite: ``rows`` the active
    rows, ``curvature`` the Rayleigh quotients ``vᵀAv / vᵀv <= 0`` found (Ritz values), ``pap``
    the search directions' ``pᵀAp`` (CG)."""
    err = ValueError("not positive definite")
    err.rows = rows  # type: ignore[attr-defined]
    err.curvature = curvature  # type: ignore[attr-defined]
    err.pap = pap  # type: ignore[attr-defined]
    return err


def _next_rows(
    active: torch.Tensor, on_step: Callable[[torch.Tensor], None] | None, x: torch.Tensor
) -> torch.Tensor | None:
    """The start of a step: report the iterate, then the rows still to solve (``None``: all
    converged)."""
    if on_step is not None:
        on_step(x)
    idx = active.nonzero().flatten()
    return idx if len(idx) else None


def preconditioned_cg(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    precondition: Callable[[torch.Tensor], torch.Tensor] | None,
    rhs: torch.Tensor,
    steps: int,
    x0: torch.Tensor | None = None,
    tol: float = 1e-12,
    on_step: Callable[[torch.Tensor], None] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``steps`` iterations of preconditioned CG on ``A x_k = rhs_k`` for every row ``k``.

    ``matvec`` and ``precondition`` map ``[k, P]`` to ``[k, P]`` (``A`` and ``M ≈ A⁻¹``
    symmetric; ``precondition=None``: ``M = I``, plain CG). Rows whose relative residual falls
    under ``tol`` stop; ``matvec`` then sees only the active rows. Returns ``(x, info)``: ``info["products"]`` counts single-vector products,
    ``info["passes"]`` calls of ``matvec``, ``info["residual"]`` the final relative residuals.
    Raises ``ValueError`` when ``pᵀAp <= 0`` for an active row (``A`` is not positive definite
    along that direction), with ``err.rows`` the offending row indices, ``err.pap`` their ``pᵀAp``.

    Example:
        >>> import torch
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> b = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
        >>> x, info = preconditioned_cg(lambda v: v @ A, lambda r: r / 4, b, steps=2)
        >>> torch.allclose(x @ A, b), info["passes"]
        (True, 2)
    """
    if precondition is None:
        precondition = _identity
    k = rhs.shape[0]
    b_norm = rhs.norm(dim=1).clamp_min(torch.finfo(rhs.dtype).tiny)
    products = passes = 0
    if x0 is None:
        x = torch.zeros_like(rhs)
        r = rhs.clone()
    else:
        x = x0.clone()
        r = rhs - matvec(x)
        products, passes = k, 1
    z = precondition(r)
    p = z.clone()
    rz = (r * z).sum(1)
    active = r.norm(dim=1) / b_norm > tol
    for _ in range(steps):
        idx = _next_rows(active, on_step, x)
        if idx is None:
            break
        ap = matvec(p[idx])
        products += len(idx)
        passes += 1
        pap = (p[idx] * ap).sum(1)
        bad = pap <= 0
        if bad.any():
            rayleigh = pap / (p[idx] * p[idx]).sum(1)  # pᵀAp / pᵀp, comparable across rows
            raise _not_positive_definite(
                idx[bad].tolist(), rayleigh[bad].tolist(), pap[bad].tolist()
            )
        alpha = rz[idx] / pap
        x[idx] += alpha[:, None] * p[idx]
        r[idx] -= alpha[:, None] * ap
        z_new = precondition(r[idx])
        rz_new = (r[idx] * z_new).sum(1)
        beta = rz_new / rz[idx]
        p[idx] = z_new + beta[:, None] * p[idx]
        rz[idx] = rz_new
        active[idx] = r[idx].norm(dim=1) / b_norm[idx] > tol
    if on_step is not None:
        on_step(x)
    info = {"products": products, "passes": passes, "residual": r.norm(dim=1) / b_norm}
    return x, info


def _identity(r: torch.Tensor) -> torch.Tensor:
    return r


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    tol: float = 1e-10,
    max_iter: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve ``A x_k = rhs_k`` for every row ``k`` of ``rhs`` (A symmetric positive definite) to
    relative residual ``tol``: `preconditioned_cg` without a preconditioner.

    Returns ``(x, relative residuals)``. Raises when ``A`` is not positive definite along a search
    direction (a non-convex loss with too little damping).

    Example:
        >>> import torch
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> x, _ = conjugate_gradient(lambda v: v @ A, torch.tensor([[1.0, 2.0]], dtype=torch.float64))
        >>> torch.allclose(x @ A, torch.tensor([[1.0, 2.0]], dtype=torch.float64))
        True
    """
    try:
        x, info = preconditioned_cg(matvec, None, rhs, max_iter, tol=tol)
    except ValueError as e:
        pap = getattr(e, "pap", None)
        if not pap:
            raise
        raise ValueError(
            "H + damping·I is not positive definite along a conjugate-gradient direction "
            f"(pᵀAp = {min(pap):.3g}); increase the damping"
        ) from None
    return x, info["residual"]


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


def top_eigenvalue(
    matvec: Callable[[torch.Tensor], torch.Tensor], dim: int, dtype: torch.dtype, iters: int = 30
) -> float:
    """``λ_max(A)`` by ``iters`` steps of power iteration from a seeded random start.

    Example:
        >>> import torch
        >>> A = torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64))
        >>> round(top_eigenvalue(lambda v: v @ A, 2, torch.float64), 6)
        3.0
    """
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


def _new_directions(z: torch.Tensor, basis: torch.Tensor, drop: float) -> torch.Tensor:
    """An orthonormal basis ``[m, P]`` of what ``z`` adds to the row space of ``basis``
    (orthonormal rows): rows scaled to unit norm (a query's direction counts whatever its
    gradient's size), projected out twice (classical Gram-Schmidt loses orthogonality once),
    then an SVD keeps the directions above ``drop``."""
    if not torch.isfinite(z).all():
        raise ValueError(
            "the preconditioned residuals contain NaN/Inf: check the data, the statistics and "
            "the damping"
        )
    z = z / z.norm(dim=1, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny)
    for _ in range(2 if len(basis) else 0):
        z = z - (z @ basis.T) @ basis
    _, s, vh = torch.linalg.svd(z, full_matrices=False)
    return vh[s > drop]


def block_cg(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    precondition: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    steps: int,
    tol: float = 1e-12,
    on_step: Callable[[torch.Tensor], None] | None = None,
    start: torch.Tensor | None = None,
    shift: Callable[[float], float] | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``steps`` iterations of preconditioned block conjugate gradient on ``A X = rhs``.

    All rows share one search space ``V``: step ``j`` adds the preconditioned residuals of every
    unconverged row (orthonormalised against ``V``, dependent ones dropped), applies ``A`` to
    them in one ``matvec`` call, and gives every row the Galerkin solution in ``V``, i.e. the
    iterate of least ``A``-norm error in the block Krylov space ``K_j(MA, M·rhs)``. That space
    holds each row's own preconditioned-CG space, so no row is worse than under
    `preconditioned_cg` at the same number of ``matvec`` calls, and each row's ``A``-norm error
    never increases. One row is exactly `preconditioned_cg` (up to rounding). Memory: ``V`` and
    ``A V``, up to ``2 · steps · k`` vectors. Same ``info`` as `preconditioned_cg`; raises
    ``ValueError`` (``err.rows``: the active rows) when ``Vᵀ A V`` is not positive definite.

    ``start`` replaces the first step's directions ``precondition(rhs)`` (for a first ``matvec``
    that must run before ``precondition`` is final); the second step then adds
    ``precondition(rhs)`` next to the residuals' directions, so the space still holds them.

    ``shift(μ) -> δ``, called each step with the smallest Ritz value ``μ`` of ``A`` in the space,
    may return ``δ > 0``: the system becomes ``A + δI`` from there on (``matvec`` must follow
    it; the space and its products are updated in place, no product is repeated).

    Example:
        >>> import torch
        >>> A = torch.diag(torch.arange(1.0, 5.0, dtype=torch.float64))
        >>> B = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 2.0, 0.0]], dtype=torch.float64)
        >>> X, info = block_cg(lambda v: v @ A, lambda r: r, B, steps=2)  # 4 = 2 steps x 2 rows
        >>> torch.allclose(X @ A, B), info["passes"]
        (True, 2)
    """
    b_norm = rhs.norm(dim=1).clamp_min(torch.finfo(rhs.dtype).tiny)
    drop = 10 * torch.finfo(rhs.dtype).eps ** 0.5
    x = torch.zeros_like(rhs)
    r = rhs.clone()
    basis = rhs.new_zeros(0, rhs.shape[1])
    a_basis = basis.clone()
    gram = rhs.new_zeros(0, 0)  # Vᵀ A V
    products = passes = 0
    active = r.norm(dim=1) / b_norm > tol
    for step in range(steps):
        idx = _next_rows(active, on_step, x)
        if idx is None:
            break
        if step == 0 and start is not None:
            z = start
        elif step == 1 and start is not None:
            z = torch.cat([precondition(r[idx]), precondition(rhs[idx])])
        else:
            z = precondition(r[idx])
        w = _new_directions(z, basis, drop)
        if len(w) == 0:
            break
        aw = matvec(w)
        products += len(w)
        passes += 1
        cross = basis @ aw.T
        corner = w @ aw.T
        gram = torch.cat(
            [torch.cat([gram, cross], 1), torch.cat([cross.T, (corner + corner.T) / 2], 1)], 0
        )
        basis = torch.cat([basis, w])
        a_basis = torch.cat([a_basis, aw])
        evals, evecs = torch.linalg.eigh(gram)
        delta = 0.0 if shift is None else shift(float(evals[0]))
        if delta > 0:  # A + δI on the space: Vᵀ(A + δI)V = VᵀAV + δI (orthonormal V)
            gram = gram + delta * torch.eye(len(gram), dtype=gram.dtype)
            a_basis = a_basis + delta * basis
            evals = evals + delta
        if evals[0] <= 0:
            raise _not_positive_definite(idx.tolist(), evals[evals <= 0].tolist())
        coef = ((rhs @ basis.T) @ evecs / evals) @ evecs.T
        x = coef @ basis
        r = rhs - coef @ a_basis
        active = r.norm(dim=1) / b_norm > tol
    if on_step is not None:
        on_step(x)
    info = {"products": products, "passes": passes, "residual": r.norm(dim=1) / b_norm}
    return x, info
