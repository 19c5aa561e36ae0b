"""Refinement's solve: every block of queries through the damped solve at one final ``λ``.

Each block of ``plan.block`` queries is one `damped_solve.damped_solve` on the logged system's
``A + λI``. Under ``curvature=None`` and the default damping ``λ`` is kept at least
``DAMPING_RAISE`` x the Hessian's most negative curvature found (the block solver raises it in
place, per-query CG solves the block again), and blocks solved before a raise are solved again
at the final ``λ``; with a given damping an indefinite Hessian makes every query use the GGN
(`recover`). Each with a warning, every pass counted, and the report saying so.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch

from ..damped_solve import DAMPING_RAISE, MAX_DAMPING_RAISES, IndefiniteError, damped_solve
from .config import Refinement
from .plan import Plan
from .system import LoggedSystem, curvature_of


@dataclass
class Solved:
    """Every block's solution, final relative residuals, passes and the λ it was solved at."""

    rows: list[torch.Tensor] = field(default_factory=list)
    residual: list[torch.Tensor] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)
    lams: list[float] = field(default_factory=list)


def solve_blocks(
    refine: Refinement,
    system: LoggedSystem,
    rhs: torch.Tensor,
    plan: Plan,
    deferred: bool,
) -> Solved:
    """One solve of every block of ``plan.block`` queries; an `IndefiniteError`'s ``rows``
    are made positions in ``rhs``."""
    size = plan.block
    out = Solved()
    op = system.op
    for lo in range(0, len(rhs), size):
        b = rhs[lo : lo + size]
        # every block starts from the same directions, the unrefined default's M(λ₀)⁻¹ row_q
        # (λ is not known before the first product)
        start = system.pre.apply(b, None).to(system.dtype) if deferred else None
        try:
            y, info = damped_solve(
                op,
                b,
                plan.solver,
                refine.steps,
                tol=1e-12,
                precondition=system.precondition,
                start=start,
            )
        except IndefiniteError as e:
            e.rows = [lo + i for i in e.rows]
            raise
        out.rows.append(y.to(torch.float32))
        out.passes.append(info["passes"])
        out.residual.append(info["residual"])
        out.lams.append(op.lam)  # type: ignore[arg-type]
    return out


def recover(refine: Refinement, system: LoggedSystem, e: IndefiniteError, ids: list) -> None:
    """Recover from a direction where ``H + λI`` is not positive definite (``e``, ``λ`` no
    longer raised) by solving with the GGN instead of the Hessian, or raise the user's error."""
    bad = [ids[i] for i in e.rows]
    name = system.curv.kind
    what = (
        f"curvature='{name}' plus damping {e.lam:.3g} is not positive definite "
        f"along a conjugate-gradient direction of queries {bad[:5]} (curvature along it, "
        f"vᵀ(H+λI)v / vᵀv = {min(e.curvature):.3g})"
    )
    hessian = name == "hessian"
    if refine.curvature is not None:
        fix = (
            "the Hessian of this loss is indefinite there. Use Refinement(curvature="
            "'ggn') (positive semi-definite) or a larger damping"
            if hessian
            else "the loss is not convex in the model's outputs: pass a larger damping"
        )
        raise ValueError(f"{what}: {fix}") from None
    if not hessian:
        raise ValueError(
            f"{what}, and so is the Gauss-Newton matrix (the loss is not convex in the "
            "model's outputs): pass a larger damping"
        ) from None
    warnings.warn(
        f"nnstat: {what}: the Hessian of this loss is indefinite there; every query is "
        "refined with curvature='ggn' (the Gauss-Newton matrix, positive semi-definite) "
        "instead (result.meta['refine']['curvature']). Pass curvature='hessian' to make "
        "this an error, or a larger damping",
        stacklevel=5,
    )
    system.use(curvature_of(refine, system.flat, "ggn"))


def solve(
    refine: Refinement,
    system: LoggedSystem,
    rhs: torch.Tensor,
    ids: list,
    plan: Plan,
) -> Solved:
    """Every block solved at one final ``λ`` and curvature (the module docstring)."""
    deferred = system.op.lam is None  # λ comes with the first product (the block solver only)
    resolves = 0
    while True:
        try:
            solved = solve_blocks(refine, system, rhs, plan, deferred)
        except IndefiniteError as e:
            recover(refine, system, e, ids)
            continue
        if all(u == system.op.lam for u in solved.lams):
            return solved
        # λ was raised after earlier blocks were solved: all of them again at the final λ (the
        # last time without further raises, so that every query ends at one λ)
        resolves += 1
        system.op.adaptive = system.op.adaptive and resolves < MAX_DAMPING_RAISES


def raised_rule(system: LoggedSystem, rule: str) -> str:
    """``rule``, saying (and warning) how far ``λ`` was raised past negative curvature."""
    op = system.op
    if not op.found:
        return rule
    warnings.warn(
        f"nnstat: the Hessian has curvature down to {min(op.found):.3g} along the "
        f"refinement's search directions, beyond the default damping: it was raised from "
        f"{op.raised_from:.3g} to {op.lam:.3g} (result.meta['refine']['damping_rule']). "
        "Pass damping= to choose it, or curvature='ggn'",
        stacklevel=4,
    )
    return rule + (
        f"; raised from {op.raised_from:.3g} to {op.lam:.3g} ({len(op.found)} x) "
        f"to stay {DAMPING_RAISE} x the Hessian's most negative curvature found"
    )
