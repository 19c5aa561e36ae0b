"""Krylov solvers for ``A X = B`` with many right-hand sides (pure maths on ``[k, P]`` rows).

The one home of the influence code's solvers. ``preconditioned_cg`` runs one conjugate-gradient
recurrence per row (the rows only share the batched ``matvec``). `lissa` is the Neumann series, scaled by `top_eigenvalue` (power
iteration). ``block_cg`` shares one search space between all rows: each step adds every row's
preconditioned residual to it, and every row takes the best iterate in the whole space.
Refinement solves one system per query against the same curvature, so a block of 32 queries
explores 32 directions per pass over the training data instead of one; exact influence solves
all its queries as one block, so it ends once the space is the whole parameter space.

Both run on the device of ``rhs`` and read the host once per step (one small tensor of flags:
on a GPU nothing else waits for the queue to drain): what a step found (a direction of
non-positive curvature, NaN) is acted on at the next step's read, before its iterate is used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "block_cg",
    "block_directions",
    "lanczos_ritz",
    "lissa",
    "preconditioned_cg",
    "top_eigenvalue",
]


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


#: LiSSA stops a row whose series term grew this many times its smallest (it never grows where
#: A is positive definite: the row's iterate diverges along negative curvature)
DIVERGED = 100.0


def _read(*values: torch.Tensor) -> list[float]:
    """The step's one host read: scalars (and small vectors) of the device, flattened."""
    return torch.cat([v.reshape(-1).to(torch.float64) for v in values]).tolist()


def lanczos_ritz(alphas: torch.Tensor, betas: torch.Tensor) -> torch.Tensor:
    """Ritz values of the Lanczos tridiagonal that ``j`` CG steps' coefficients define.

    ``alphas`` ``[j]`` (step lengths ``rᵀz / pᵀAp``) and ``betas`` ``[j - 1]``
    (``r_{i+1}ᵀz_{i+1} / r_iᵀz_i``) give ``T`` with diagonal ``1/α_i + β_{i-1}/α_{i-1}`` and
    off-diagonal ``√β_i / α_i`` (Saad, *Iterative Methods*, §6.7.3): its eigenvalues are Ritz
    values of ``A`` (of ``M^½ A M^½`` with a preconditioner ``M``, which has the inertia of
    ``A``), inside ``[λ_min, λ_max]``, the smallest an upper bound on ``λ_min``.

    Example:
        >>> import torch
        >>> A = torch.diag(torch.tensor([1.0, 3.0], dtype=torch.float64))
        >>> x, info = preconditioned_cg(lambda v: v @ A, None, torch.ones(1, 2, dtype=A.dtype), 2)
        >>> [round(v, 6) for v in lanczos_ritz(info["alphas"][:, 0], info["betas"][:, 0]).tolist()]
        [1.0, 3.0]
    """
    j = len(alphas)
    inv = 1 / alphas
    diag = inv.clone()
    diag[1:] += betas[: j - 1] * inv[:-1]
    off = betas[: j - 1].clamp_min(0).sqrt() * inv[:-1]
    t = torch.diag(diag) + torch.diag(off, 1) + torch.diag(off, -1)
    return torch.linalg.eigvalsh(t)


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
    under ``tol`` stop; ``matvec`` then sees only the active rows. Returns ``(x, info)``:
    ``info["products"]`` counts single-vector products, ``info["passes"]`` calls of ``matvec``,
    ``info["residual"]`` the final relative residuals, ``info["alphas"]``/``info["betas"]`` the
    coefficients ``[steps, k]`` (NaN once a row stopped; `lanczos_ritz` makes Ritz values of
    them). Raises ``ValueError`` when ``pᵀAp <= 0`` for an active row (``A`` is not positive
    definite along that direction: the Lanczos tridiagonal of the coefficients so far, whose
    ``LDLᵀ`` pivots are ``1/α``, is not positive definite), with ``err.rows`` the offending row
    indices, ``err.pap`` their ``pᵀAp`` and ``err.curvature`` the smallest Ritz value of each
    (plain CG; with a preconditioner, whose Ritz values are of ``M^½AM^½``, ``pᵀAp / pᵀp``).

    Example:
        >>> import torch
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> b = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
        >>> x, info = preconditioned_cg(lambda v: v @ A, lambda r: r / 4, b, steps=2)
        >>> torch.allclose(x @ A, b), info["passes"]
        (True, 2)
    """
    plain = precondition is None
    precondition = precondition or _identity
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
    nan = torch.full((k,), float("nan"), dtype=rhs.dtype, device=rhs.device)
    alphas: list[torch.Tensor] = []
    betas: list[torch.Tensor] = []
    bad = pap_all = rayleigh = None  # the previous step's, checked at this step's read
    for step in range(steps + 1):
        flags = _read(active, bad if bad is not None else active.new_zeros(k))
        live, was_bad = flags[:k], flags[k:]
        if any(was_bad):
            rows = [i for i, v in enumerate(was_bad) if v]
            assert pap_all is not None and rayleigh is not None
            if plain:  # the smallest Ritz value of each row's tridiagonal (≤ pᵀAp / pᵀp)
                a, b = torch.stack(alphas), torch.stack(betas)
                curv = [float(lanczos_ritz(a[:, i], b[:, i]).min()) for i in rows]
            else:
                curv = rayleigh[rows].tolist()
            raise _not_positive_definite(rows, curv, pap_all[rows].tolist())
        idx_list = [i for i, v in enumerate(live) if v]
        if step == steps or not idx_list:
            break
        if on_step is not None:
            on_step(x)
        idx = torch.tensor(idx_list, device=rhs.device) if len(idx_list) < k else slice(None)
        ap = matvec(p[idx])
        products += len(idx_list)
        passes += 1
        pap = (p[idx] * ap).sum(1)
        bad, pap_all, rayleigh = nan.new_zeros(k, dtype=torch.bool), nan.clone(), nan.clone()
        bad[idx] = pap <= 0
        pap_all[idx] = pap
        rayleigh[idx] = pap / (p[idx] * p[idx]).sum(1)  # pᵀAp / pᵀp, comparable across rows
        alpha = rz[idx] / pap
        x[idx] += alpha[:, None] * p[idx]
        r[idx] -= alpha[:, None] * ap
        z_new = precondition(r[idx])
        rz_new = (r[idx] * z_new).sum(1)
        beta = rz_new / rz[idx]
        p[idx] = z_new + beta[:, None] * p[idx]
        rz[idx] = rz_new
        active[idx] = r[idx].norm(dim=1) / b_norm[idx] > tol
        alphas.append(nan.index_put((idx,), alpha) if len(idx_list) < k else alpha)
        betas.append(nan.index_put((idx,), beta) if len(idx_list) < k else beta)
    if on_step is not None:
        on_step(x)
    info = {
        "products": products,
        "passes": passes,
        "residual": r.norm(dim=1) / b_norm,
        "alphas": torch.stack(alphas) if alphas else nan[:0, None].expand(0, k),
        "betas": torch.stack(betas) if betas else nan[:0, None].expand(0, k),
    }
    return x, info


def _identity(r: torch.Tensor) -> torch.Tensor:
    return r


def lissa(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    scale: float,
    depth: int = 1000,
    tol: float = 1e-8,
) -> torch.Tensor:
    """LiSSA / Neumann series ``A⁻¹ b ≈ (1/scale) Σ_j (I − A/scale)^j b`` (``scale > λ_max(A)``).

    The series converges only where ``A`` is positive definite with ``λ_max(A) < 2 · scale``:
    its terms ``d_j = (I − A/scale)^j (I − A/scale) b`` then never grow. A row whose term grows
    to ``DIVERGED`` x its smallest so far (or is not finite; or, after ``depth`` steps, ends
    above twice its smallest), above rounding's level of its iterate, is refused like conjugate gradient's non-positive curvature: a ``ValueError`` with
    ``err.rows`` and ``err.curvature``, the Rayleigh quotient of ``A`` along the growing term
    (``A d_j = scale · (d_j − d_{j+1})``, no product spent), clamped at 0. One host read per
    step.

    Args:
        matvec: ``A`` on rows ``[k, P]``.
        rhs: ``b``, ``[k, P]``.
        scale: above ``λ_max(A)`` (e.g. 1.1 x `top_eigenvalue`).
        depth: terms at most.
        tol: the relative change of the iterate (all rows together) to stop at.

    Returns:
        ``A⁻¹ rhs`` as far as the series got, ``[k, P]``.

    Raises:
        ValueError: a row's series diverges (``err.rows``, ``err.curvature``).

    Example:
        >>> import torch
        >>> A = torch.tensor([[2.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
        >>> x = lissa(lambda v: v @ A, torch.ones(1, 2, dtype=torch.float64), scale=3.0)
        >>> [round(v, 6) for v in x[0].tolist()]
        [0.5, 1.0]
        >>> B = torch.tensor([[2.0, 0.0], [0.0, -0.5]], dtype=torch.float64)
        >>> lissa(lambda v: v @ B, torch.ones(1, 2, dtype=torch.float64), scale=3.0)
        Traceback (most recent call last):
        ...
        ValueError: not positive definite
    """
    k = rhs.shape[0]
    tiny = torch.finfo(rhs.dtype).tiny
    est = rhs.clone()
    prev: torch.Tensor | None = None
    low = [math.inf] * k  # each row's smallest term so far
    norms = ritzes = floors = [0.0] * k
    # terms at rounding's level of the iterate (a series converged as far as the dtype allows)
    # may wobble: never read as growth
    floor = 1000 * torch.finfo(rhs.dtype).eps
    for _ in range(depth):
        new = rhs + est - matvec(est) / scale
        term = new - est
        ritz = torch.zeros_like(term[:, 0])
        if prev is not None:  # the Rayleigh quotient of A along the previous term
            ritz = scale * (1 - (term * prev).sum(1) / (prev * prev).sum(1).clamp_min(tiny))
        change = term.norm() / new.norm().clamp_min(tiny)
        values = _read(term.norm(dim=1), ritz, floor * new.norm(dim=1), change)
        norms, ritzes, floors = values[:k], values[k : 2 * k], values[2 * k : 3 * k]
        bad = [
            i
            for i, n in enumerate(norms)
            if not math.isfinite(n) or (n > DIVERGED * low[i] and n > floors[i])
        ]
        if bad:
            raise _not_positive_definite(bad, [_curvature(ritzes[i]) for i in bad])
        low = [min(a, b) for a, b in zip(low, norms, strict=True)]
        est, prev = new, term
        if values[-1] < tol:
            return est / scale
    # depth spent: a row whose term ended above twice its smallest diverges, slowly
    bad = [i for i in range(k) if norms[i] > 2 * low[i] and norms[i] > floors[i]]
    if bad:
        raise _not_positive_definite(bad, [_curvature(ritzes[i]) for i in bad])
    return est / scale


def _curvature(ritz: float) -> float:
    """A growing LiSSA term's curvature for the error: its Rayleigh quotient, at most 0 (a
    mixture of directions can read positive before the growing one dominates)."""
    return min(ritz, 0.0) if math.isfinite(ritz) else 0.0


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


def block_directions(rows: int, steps: int, start: bool, width: int) -> int:
    """The most directions `block_cg`'s search space holds: ``rows`` per step, ``rows`` more at
    the second step when it starts from other directions (``start``), at most ``width``.

    Example:
        >>> block_directions(4, steps=3, start=True, width=100)
        16
    """
    return min(width, (steps + (start and steps > 1)) * rows)


def _candidates(
    z: torch.Tensor, mask: torch.Tensor, basis: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Orthonormal rows ``vh`` spanning what the rows of ``z`` (those ``mask`` keeps) add to the
    row space of ``basis`` (orthonormal rows), with their singular values ``s`` (descending):
    rows scaled to unit norm (a query's direction counts whatever its gradient's size),
    projected out twice (classical Gram-Schmidt loses orthogonality once), then an SVD. NaN
    and Inf are zeroed here (the caller reads whether there were any)."""
    z = torch.nan_to_num(z, nan=0.0, posinf=0.0, neginf=0.0) * mask[:, None]
    z = z / z.norm(dim=1, keepdim=True).clamp_min(torch.finfo(z.dtype).tiny)
    for _ in range(2 if len(basis) else 0):
        z = z - (z @ basis.T) @ basis
    _, s, vh = torch.linalg.svd(z, full_matrices=False)
    return vh, s


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
    ``A V``, `block_directions` vectors each, allocated once. Same ``info`` as
    `preconditioned_cg` (``info["ritz"]``: the smallest Ritz value of ``A`` in the final
    space); raises ``ValueError`` (``err.rows``: the active rows, ``err.curvature``: the
    non-positive Ritz values) when ``Vᵀ A V`` is not positive definite.

    ``start`` replaces the first step's directions ``precondition(rhs)`` (for a first ``matvec``
    that must run before ``precondition`` is final); the second step then adds
    ``precondition(rhs)`` next to the residuals' directions, so the space still holds them.

    ``shift(μ) -> δ``, called each step with the smallest Ritz value ``μ`` of ``A`` in the space,
    may return ``δ > 0``: the system becomes ``A + δI`` from there on (``matvec`` must follow
    it; the space and its products are updated in place, no product is repeated).

    One host read per step (the number of new directions, whether a row is still active, NaN,
    and the previous step's ``μ``), two in a step after a shift. On a GPU the small ``m × m``
    eigendecomposition and the candidates' SVD also wait for the device (``torch.linalg``
    checks their convergence); they follow the step's product, which the step needs anyway.

    Example:
        >>> import torch
        >>> A = torch.diag(torch.arange(1.0, 5.0, dtype=torch.float64))
        >>> B = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, -1.0, 2.0, 0.0]], dtype=torch.float64)
        >>> X, info = block_cg(lambda v: v @ A, lambda r: r, B, steps=2)  # 4 = 2 steps x 2 rows
        >>> torch.allclose(X @ A, B), info["passes"]
        (True, 2)
    """
    k, width = rhs.shape
    b_norm = rhs.norm(dim=1).clamp_min(torch.finfo(rhs.dtype).tiny)
    drop = 10 * torch.finfo(rhs.dtype).eps ** 0.5
    cap = block_directions(k, steps, start is not None, width)
    basis, a_basis = rhs.new_empty(cap, width), rhs.new_empty(cap, width)
    m = 0
    gram = rhs.new_zeros(0, 0)  # Vᵀ A V
    x, r = torch.zeros_like(rhs), rhs.clone()
    active = r.norm(dim=1) / b_norm > tol
    products = passes = 0
    ritz = float("nan")
    pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # evals, evecs, rows

    def directions(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if step == 0 and start is not None:
            z, mask = start, active
        elif step == 1 and start is not None:
            z = torch.cat([precondition(r), precondition(rhs)])
            mask = torch.cat([active, active])
        else:
            z, mask = precondition(r), active
        vh, s = _candidates(z, mask, basis[:m])
        return vh, (s > drop).sum(), torch.isfinite(z).all()

    def galerkin(evals: torch.Tensor, evecs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # a non-positive eigenvalue is refused at the next read: divide by 1 until then
        safe = torch.where(evals > 0, evals, torch.ones_like(evals))
        coef = ((rhs @ basis[:m].T) @ evecs / safe) @ evecs.T
        res = rhs - coef @ a_basis[:m]
        return coef @ basis[:m], res, res.norm(dim=1) / b_norm > tol

    for step in range(steps + 1):
        last = step == steps
        if last and pending is None:
            break
        if not last:
            vh, n_new, finite = directions(step)
        mu = pending[0][0] if pending is not None else b_norm.new_zeros(())
        flags = _read(mu) if last else _read(mu, n_new, active.any(), finite)
        if pending is not None:
            evals, evecs, rows = pending
            pending = None
            ritz = flags[0]
            delta = 0.0 if shift is None else shift(ritz)
            if delta > 0:  # A + δI on the space: Vᵀ(A + δI)V = VᵀAV + δI (orthonormal V)
                gram = gram + delta * torch.eye(m, dtype=gram.dtype, device=gram.device)
                a_basis[:m] += delta * basis[:m]
                evals, ritz = evals + delta, ritz + delta
            if ritz <= 0:
                bad = evals[evals <= 0].tolist()
                raise _not_positive_definite(rows.nonzero().flatten().tolist(), bad)
            if delta > 0:
                x, r, active = galerkin(evals, evecs)
                if not last:
                    vh, n_new, finite = directions(step)
                    flags = [ritz, *_read(n_new, active.any(), finite)]
        if last:
            break
        n, any_active, ok = int(flags[1]), flags[2], flags[3]
        if not ok:
            raise ValueError(
                "the preconditioned residuals contain NaN/Inf: check the data, the statistics "
                "and the damping"
            )
        if not any_active or n == 0:
            break
        if on_step is not None:
            on_step(x)
        w = vh[:n]
        aw = matvec(w)
        products += n
        passes += 1
        cross = basis[:m] @ aw.T
        corner = w @ aw.T
        gram = torch.cat(
            [torch.cat([gram, cross], 1), torch.cat([cross.T, (corner + corner.T) / 2], 1)], 0
        )
        basis[m : m + n], a_basis[m : m + n] = w, aw
        m += n
        evals, evecs = torch.linalg.eigh(gram)
        pending = (evals, evecs, active)
        x, r, active = galerkin(evals, evecs)
    if on_step is not None:
        on_step(x)
    info = {"products": products, "passes": passes, "residual": r.norm(dim=1) / b_norm}
    info["ritz"] = ritz
    return x, info
