"""The linear system refinement solves, ``(P H Pᵀ + λI) y = row_q`` in the logged space.

`DampedSystem` holds its curvature, preconditioner and ``λ`` as it evolves: given, the mean
eigenvalue of the curvature (Hutchinson's estimator, `set_damping`), or raised past negative
Hessian curvature found along the search space. `choose_solver` falls back from the block
solver when its search space would not fit `BLOCK_MEMORY_LIMIT`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from nnstat.curvature.products import StreamedCurvature

from .logged_space import LoggedSpace
from .precondition import Preconditioner, resolve_damping


def _probes(width: int, dtype: torch.dtype) -> torch.Tensor:
    """8 Rademacher vectors of the logged space for Hutchinson's trace estimator (seeded)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 2, (8, width), generator=gen).to(dtype) * 2 - 1


def _resolve_mean_curvature(
    z: torch.Tensor, hz: torch.Tensor, flat: LoggedSpace, name: str
) -> float:
    """The mean eigenvalue of ``H`` over the logged modules' parameters, ``tr(P H Pᵀ) / n_params``
    (``E[PᵀP] = I`` for the store's projections, so the trace survives projection), by
    Hutchinson's estimator from `_probes` ``z`` and their products ``hz = (P H Pᵀ) z``; refused
    when it is not positive (then it gives the damping no scale)."""
    gamma = float((z * hz).sum(1).mean()) / flat.size
    if not gamma > 0:
        raise ValueError(
            f"the {name} curvature has a mean eigenvalue of {gamma:.3g} <= 0, "
            "so damping=None has no scale: pass a damping > 0 (or curvature='ggn')"
        )
    return gamma


BLOCK_MEMORY_LIMIT = 2 * 1024**3  # bytes of search space the block solver may hold
# curvature=None with the default damping: λ stays >= DAMPING_RAISE x the Hessian's most negative
# curvature found (per-query CG: at most MAX_DAMPING_RAISES new solves, then the GGN)
DAMPING_RAISE = 1.5
MAX_DAMPING_RAISES = 3


def choose_solver(
    solver: str, steps: int, query_batch: int, width: int, dtype: torch.dtype, start: bool
) -> str:
    """``solver``, or ``"cg"`` with a warning when the block solver's search space
    (``2 · min(directions, width)`` vectors of ``width``; ``directions = steps · query_batch``,
    one ``query_batch`` more from the second step when the block starts from other directions,
    ``start``) would exceed `BLOCK_MEMORY_LIMIT`."""
    if solver != "block":
        return solver
    directions = (steps + (start and steps > 1)) * query_batch
    vectors = 2 * min(directions, width)
    need = vectors * width * torch.finfo(dtype).bits // 8
    if need <= BLOCK_MEMORY_LIMIT:
        return "block"
    warnings.warn(
        f"nnstat: the block solver's search space would take {need / 1024**3:.1f} GiB "
        f"({vectors} vectors of width {width}); refining with solver='cg' (one recurrence per "
        "query: the same solution, reached in more steps). Lower query_batch or project the "
        "store to use the block solver",
        stacklevel=3,
    )
    return "cg"


@dataclass
class DampedSystem:
    """``(P H Pᵀ + λI) y = row_q`` in the logged space, with ``λ`` as it evolves: given, found
    by Hutchinson's estimator with the first product (``probes``), or raised past negative
    Hessian curvature (``found``: the curvatures raised past, ``raised_from``: ``λ`` before)."""

    curv: StreamedCurvature
    flat: LoggedSpace
    pre: Preconditioner
    dtype: torch.dtype
    lam: float | None
    probes: torch.Tensor | None = None
    adaptive: bool = False
    found: list[float] = field(default_factory=list)
    raised_from: float | None = None
    products: int = 0  # every curvature-vector product, abandoned solves' too

    def curvature(self, y: torch.Tensor) -> torch.Tensor:
        return self.flat.project(self.curv.product(self.flat.lift(y)))

    def matvec(self, v: torch.Tensor) -> torch.Tensor:
        self.products += len(v) + (0 if self.probes is None else len(self.probes))
        if self.probes is None:
            return self.curvature(v) + self.lam * v
        both = self.curvature(torch.cat([v, self.probes]))
        self.lam = _resolve_mean_curvature(self.probes, both[len(v) :], self.flat, self.curv.kind)
        self.probes = None
        return both[: len(v)] + self.lam * v

    def precondition(self, r: torch.Tensor) -> torch.Tensor:
        return self.pre.apply(r, self.lam).to(self.dtype)

    def raise_damping(self, theta: float) -> float:
        """Raise λ to ``DAMPING_RAISE x |θ|`` (θ < 0, a Ritz value of the Hessian, so an upper
        bound on λ_min(H)); returns the increase."""
        if not self.found:
            self.raised_from = self.lam
        new = DAMPING_RAISE * -theta
        delta, self.lam = new - self.lam, new
        self.found.append(theta)
        return delta

    def shift(self, mu: float) -> float:
        """The block solver's ``shift``: μ, the smallest Ritz value of ``H + λI`` in its space."""
        theta = mu - self.lam
        hessian = self.curv.kind == "hessian"
        if not (self.adaptive and hessian) or DAMPING_RAISE * -theta <= self.lam:
            return 0.0
        return self.raise_damping(theta)


def set_damping(system: DampedSystem, solver: str, width: int) -> str:
    """Resolve ``system.lam`` where it is not given; returns the rule that chose it."""
    if system.lam is not None:
        system.lam = resolve_damping(system.lam, torch.zeros(0))
        return "given"
    if solver == "block":
        # the trace probes ride along the first block's first product (it does not need λ: the
        # first directions are preconditioned at the unrefined default damping, and A = H + λI
        # is formed after the product), so the default damping costs no pass of its own
        system.probes = _probes(width, system.dtype)
        return "mean eigenvalue of the curvature per parameter (Hutchinson, 8 probes, first pass)"
    # per-query CG's recurrence needs one M from its first step: one pass to find λ
    z = _probes(width, system.dtype)
    system.lam = _resolve_mean_curvature(z, system.curvature(z), system.flat, system.curv.kind)
    return "mean eigenvalue of the curvature per parameter (Hutchinson, 8 probes, one pass)"
