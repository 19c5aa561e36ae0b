"""The damped solve ``(A + λI) X = B`` that exact influence and refinement share.

``A`` is a curvature operator (the Hessian or the Gauss-Newton matrix, of the full or the logged
parameter space: `nnstat.curvature.streamed.StreamedCurvature`), ``B`` one row per query.
`DampedOperator` is ``A + λI`` with ``λ`` as it evolves: given, resolved by the first product
(trace probes riding along it), or raised past negative curvature found along the search
space by the rule below. `damped_solve` runs one solver on it (``"block"``: `krylov.block_cg`,
``"cg"``: `krylov.preconditioned_cg`, ``"lissa"``: `krylov.lissa` scaled by power iteration)
and detects where ``A + λI`` is not positive definite: a non-positive Ritz value (conjugate
gradient) or a growing iterate (LiSSA). With ``adaptive`` it raises ``λ`` and solves again
(the block solver raises it in place, no product repeated); otherwise, or after
``MAX_DAMPING_RAISES`` raises, it stops with an `IndefiniteError` that carries the curvature
found and the damping that would do.

The rule: ``λ`` is kept at least ``DAMPING_RAISE`` x the most negative curvature ``θ`` of ``A``
found (a Ritz value, so an upper bound on ``λ_min(A)``).

Example:
    >>> import torch
    >>> A = torch.diag(torch.tensor([2.0, -1.0], dtype=torch.float64))
    >>> op = DampedOperator(lambda v: v @ A, lam=0.5, adaptive=True)
    >>> x, info = damped_solve(op, torch.ones(1, 2, dtype=torch.float64), "cg", steps=10)
    >>> round(op.lam, 6), torch.allclose(x @ (A + op.lam * torch.eye(2, dtype=A.dtype)), 1.0 + 0 * x)
    (1.5, True)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .krylov import block_cg, lissa, preconditioned_cg, top_eigenvalue

DAMPING_RAISE = 1.5
MAX_DAMPING_RAISES = 3
SOLVERS = ("block", "cg", "lissa")
#: LiSSA's scale: this much above the largest eigenvalue magnitude power iteration finds
LISSA_SCALE = 1.1


def raised_damping(theta: float, lam: float) -> float | None:
    """The damping rule: ``λ`` is kept at least ``DAMPING_RAISE`` x the most negative curvature
    ``θ`` found (a Ritz value of ``A``, so an upper bound on ``λ_min(A)``). Returns the raised
    ``λ``, ``None`` when ``λ`` already satisfies it.

    Example:
        >>> raised_damping(-0.2, 0.1), raised_damping(-0.05, 0.1)
        (0.30000000000000004, None)
    """
    new = DAMPING_RAISE * -theta
    return new if new > lam else None


class IndefiniteError(ValueError):
    """``A + λI`` is not positive definite along a direction the solver explored.

    Attributes: ``lam`` (the damping it was found at), ``curvature`` (the Rayleigh quotients
    ``vᵀ(A + λI)v / vᵀv <= 0`` found, Ritz values of ``A + λI``), ``rows`` (the rows, i.e.
    queries, it was found for), ``solver``; ``theta`` is ``A``'s own curvature there and
    ``need`` the damping the rule asks for.
    """

    def __init__(self, lam: float, curvature: list[float], rows: list[int], solver: str) -> None:
        self.lam, self.curvature, self.rows, self.solver = lam, list(curvature), rows, solver
        self.theta = min(self.curvature) - lam
        self.need = DAMPING_RAISE * -self.theta
        how = "LiSSA's iterate grew" if solver == "lissa" else f"conjugate gradient ({solver})"
        super().__init__(
            f"A + damping·I is not positive definite (damping {lam:.3g}): {how} along a "
            f"direction of curvature {self.theta:.3g} < -damping; pass damping >= {self.need:.3g}"
        )


@dataclass
class DampedOperator:
    """``A + λI`` for the curvature product ``product`` (rows ``[k, W] -> [k, W]``).

    ``lam=None`` with ``probes``: ``λ`` is ``mean_curvature(probes, A probes)``, the probes
    riding along the first product. ``adaptive``: ``λ`` may be raised past negative curvature
    found (`raise_damping`; ``found``: the curvatures raised past, ``raised_from``: ``λ``
    before). ``products`` counts every single-vector product, abandoned solves' too;
    ``on_product`` is called after each call.
    """

    product: Callable[[torch.Tensor], torch.Tensor]
    lam: float | None
    adaptive: bool = False
    probes: torch.Tensor | None = None
    mean_curvature: Callable[[torch.Tensor, torch.Tensor], float] | None = None
    found: list[float] = field(default_factory=list)
    raised_from: float | None = None
    products: int = 0
    on_product: Callable[[], None] | None = None  # after every product (a progress bar)

    def __call__(self, v: torch.Tensor) -> torch.Tensor:
        out = self._apply(v)
        if self.on_product is not None:
            self.on_product()
        return out

    def _apply(self, v: torch.Tensor) -> torch.Tensor:
        self.products += len(v) + (0 if self.probes is None else len(self.probes))
        if self.probes is None:
            return self.product(v) + self.lam * v
        assert self.mean_curvature is not None
        both = self.product(torch.cat([v, self.probes]))
        self.lam = self.mean_curvature(self.probes, both[len(v) :])
        self.probes = None
        return both[: len(v)] + self.lam * v

    def raise_damping(self, theta: float) -> float:
        """Raise ``λ`` by `raised_damping` past ``A``'s curvature ``θ < 0``; returns the increase
        (0 when ``λ`` already satisfies the rule)."""
        assert self.lam is not None
        new = raised_damping(theta, self.lam)
        if new is None:
            return 0.0
        if not self.found:
            self.raised_from = self.lam
        delta, self.lam = new - self.lam, new
        self.found.append(theta)
        return delta

    def shift(self, mu: float) -> float:
        """The block solver's ``shift``: ``μ``, the smallest Ritz value of ``A + λI`` in its
        space; ``λ`` raised past it where ``adaptive``."""
        assert self.lam is not None
        return self.raise_damping(mu - self.lam) if self.adaptive else 0.0


def _lissa(
    op: DampedOperator, rhs: torch.Tensor, steps: int, tol: float
) -> tuple[torch.Tensor, dict[str, Any]]:
    """`krylov.lissa` scaled by `LISSA_SCALE` x power iteration's largest eigenvalue magnitude;
    ``info``: the passes and products of both."""
    passes, products = 0, op.products

    def counted(v: torch.Tensor) -> torch.Tensor:
        nonlocal passes
        passes += 1
        return op(v)

    scale = LISSA_SCALE * top_eigenvalue(counted, rhs.shape[1], rhs.dtype)
    x = lissa(counted, rhs, scale, steps, tol)
    return x, {"passes": passes, "products": op.products - products}


def damped_solve(
    op: DampedOperator,
    rhs: torch.Tensor,
    solver: str,
    steps: int,
    *,
    tol: float = 1e-12,
    precondition: Callable[[torch.Tensor], torch.Tensor] | None = None,
    start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(A + λI)⁻¹ rhs`` by ``solver`` in at most ``steps`` steps (passes of ``op``).

    Args:
        op: ``A + λI``; its ``λ`` is raised in place where ``op.adaptive``.
        rhs: ``[k, W]`` right-hand sides.
        solver: ``"block"``, ``"cg"`` or ``"lissa"`` (see the module docstring).
        steps: the most steps (LiSSA: its depth).
        tol: relative residual (conjugate gradient) or relative change (LiSSA) to stop at.
        precondition: ``M ≈ (A + λI)⁻¹`` for conjugate gradient (``None``: none).
        start: the block solver's first directions (`krylov.block_cg`).

    Returns:
        ``(x, info)``: the solver's ``info`` (``passes``, ``products``, ``residual``).

    Raises:
        IndefiniteError: ``A + λI`` is not positive definite and ``λ`` may not be raised (not
            ``op.adaptive``, or ``MAX_DAMPING_RAISES`` raises spent; the block solver raises
            in place only).

    Example:
        >>> import torch
        >>> op = DampedOperator(lambda v: -v, lam=0.5)
        >>> damped_solve(op, torch.ones(1, 3), "cg", 5)
        Traceback (most recent call last):
        ...
        nnstat.influence.damped_solve.IndefiniteError: A + damping·I is not positive definite (damping 0.5): conjugate gradient (cg) along a direction of curvature -1 < -damping; pass damping >= 1.5
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {list(SOLVERS)}, got {solver!r}")
    while True:
        try:
            if solver == "block":
                shift = op.shift if op.adaptive else None
                pre = precondition or (lambda r: r)
                return block_cg(op, pre, rhs, steps, tol=tol, start=start, shift=shift)
            if solver == "cg":
                return preconditioned_cg(op, precondition, rhs, steps, tol=tol)
            return _lissa(op, rhs, steps, tol)
        except ValueError as e:
            curvature = getattr(e, "curvature", None)
            if not curvature:
                raise
            err = IndefiniteError(op.lam or 0.0, curvature, e.rows, solver)  # type: ignore
            retry = op.adaptive and solver != "block" and len(op.found) < MAX_DAMPING_RAISES
            if not retry or op.raise_damping(err.theta) == 0:
                raise err from None


def conjugate_gradient(
    matvec: Callable[[torch.Tensor], torch.Tensor],
    rhs: torch.Tensor,
    tol: float = 1e-10,
    max_iter: int = 1000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve ``A x_k = rhs_k`` for every row ``k`` of ``rhs`` (A symmetric positive definite) to
    relative residual ``tol``: `damped_solve` by per-query CG without a preconditioner.

    Args:
        matvec: ``A`` on rows ``[k, P]``.
        rhs: ``[k, P]``.
        tol: the relative residual to stop at.
        max_iter: steps at most.

    Returns:
        ``(x, relative residuals)``.

    Raises:
        IndefiniteError: ``A`` is not positive definite along a search direction (a
            non-convex loss with too little damping).

    Example:
        >>> import torch
        >>> A = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
        >>> b = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
        >>> x, _ = conjugate_gradient(lambda v: v @ A, b)
        >>> torch.allclose(x @ A, b)
        True
    """
    x, info = damped_solve(DampedOperator(matvec, 0.0), rhs, "cg", max_iter, tol=tol)
    return x, info["residual"]
