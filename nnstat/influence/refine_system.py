"""The linear system refinement solves, ``(P H Pᵀ + λI) y = row_q`` in the logged space.

`DampedSystem` holds its curvature, preconditioner and ``λ`` as it evolves: given, the mean
eigenvalue of the curvature (Hutchinson's estimator, `set_damping`), or raised past negative
Hessian curvature found along the search space (`raised_damping`, the rule exact influence uses
too). Its products run on the model's device, ``chunk`` vectors at a time (`refine_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nnstat.curvature.streamed import StreamedCurvature

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


# curvature=None with the default damping: λ stays >= DAMPING_RAISE x the Hessian's most negative
# curvature found (per-query CG: at most MAX_DAMPING_RAISES new solves, then the GGN)
DAMPING_RAISE = 1.5
MAX_DAMPING_RAISES = 3


def raised_damping(theta: float, lam: float) -> float | None:
    """The damping rule refinement and exact influence share: ``λ`` is kept at least
    ``DAMPING_RAISE`` x the Hessian's most negative curvature found, ``θ`` (a Ritz value of
    ``H``, so an upper bound on ``λ_min(H)``). Returns the raised ``λ``, ``None`` when ``λ``
    already satisfies it.

    Example:
        >>> raised_damping(-0.2, 0.1), raised_damping(-0.05, 0.1)
        (0.30000000000000004, None)
    """
    new = DAMPING_RAISE * -theta
    return new if new > lam else None


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

    chunk: int | None = None  # vectors per curvature product (None: all at once)
    device: torch.device | None = None  # the products' (the model's); y may live elsewhere

    def curvature(self, y: torch.Tensor) -> torch.Tensor:
        """``P H Pᵀ y``: each chunk of ``y`` lifted, multiplied and projected batch by batch."""
        here = y if self.device is None else y.to(self.device)
        out = self.curv.product(here, self.flat.lift, self.flat.project, self.chunk)
        return out.to(y.device)

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
        """Raise λ by `raised_damping` (θ < 0, a Ritz value of the Hessian, so an upper bound on
        λ_min(H)); returns the increase (0 when λ already satisfies the rule)."""
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
        """The block solver's ``shift``: μ, the smallest Ritz value of ``H + λI`` in its space."""
        assert self.lam is not None
        if not (self.adaptive and self.curv.kind == "hessian"):
            return 0.0
        return self.raise_damping(mu - self.lam)


def set_damping(
    system: DampedSystem, solver: str, width: int, device: torch.device | None = None
) -> str:
    """Resolve ``system.lam`` where it is not given (the probes on ``device``, the solve's);
    returns the rule that chose it."""
    if system.lam is not None:
        system.lam = resolve_damping(system.lam, torch.zeros(0))
        return "given"
    if solver == "block":
        # the trace probes ride along the first block's first product (it does not need λ: the
        # first directions are preconditioned at the unrefined default damping, and A = H + λI
        # is formed after the product), so the default damping costs no pass of its own
        system.probes = _probes(width, system.dtype).to(device)
        return "mean eigenvalue of the curvature per parameter (Hutchinson, 8 probes, first pass)"
    # per-query CG's recurrence needs one M from its first step: one pass to find λ
    z = _probes(width, system.dtype).to(device)
    system.lam = _resolve_mean_curvature(z, system.curvature(z), system.flat, system.curv.kind)
    return "mean eigenvalue of the curvature per parameter (Hutchinson, 8 probes, one pass)"
