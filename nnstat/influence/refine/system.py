"""The linear system refinement solves, ``(P H Pᵀ + λI) y = row_q`` in the logged space, and
what it is built from: the exact curvature of the training loss (`curvature_of`), the queries'
own gradients (`query_grads`), the preconditioner (`preconditioner_of`, refit statistics by
`fit_fisher_statistics`).

`LoggedSystem` is ``P H Pᵀ`` (products on the model's device, ``chunk`` vectors at a time, the
vectors lifted to the parameters and projected back within each training batch) with its
preconditioner, and ``A + λI`` as the damped solve's `DampedOperator` (``system.op``). ``λ``
is given, the mean eigenvalue of the curvature (Hutchinson's estimator, `set_damping`), or
raised past negative Hessian curvature found along the search space
(`nnstat.influence.damped_solve.raised_damping`, the rule exact influence uses too).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import InitVar, dataclass, field
from typing import Any

import torch

from nnstat.curvature.fisher import fisher_statistics
from nnstat.curvature.products import FunctionalLoss
from nnstat.curvature.streamed import BatchLossCurvature, LossFnCurvature, StreamedCurvature

from ..damped_solve import DampedOperator
from ..logged_space import LoggedSpace, captured_rows, logged_preconditioner
from ..precondition import Preconditioner, resolve_damping
from ..sources import RowSource
from .config import Refinement


def fit_fisher_statistics(
    refine: Refinement, module_names: list[str], preset: str = "ekfac"
) -> dict[str, torch.Tensor]:
    """K-FAC/EK-FAC statistics of the logged modules refit from ``refine.train_data``, with the
    output gradients ``refine.fisher`` names (`nnstat.curvature.fisher.fisher_statistics`).

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(3, 4)
        >>> r = Refinement(m, torch.nn.functional.cross_entropy,
        ...                (torch.randn(16, 3), torch.randint(0, 4, (16,))), fisher="true")
        >>> sorted(fit_fisher_statistics(r, ["model"], "kfac"))
        ['model/backward/covariance', 'model/forward/covariance']
    """
    assert refine.loss_fn is not None  # checked by Refinement for fisher != "store"
    return fisher_statistics(
        refine.model,
        refine.loss_fn,
        refine.train_data,
        module_names,
        preset,
        fisher=refine.fisher,
        samples=refine.fisher_samples,
        batch_size=refine.batch_size,
        loss_reduction=refine.loss_reduction,
    )


def curvature_of(refine: Refinement, flat: LoggedSpace, kind: str) -> StreamedCurvature:
    """The exact curvature ``kind`` of the mean loss over ``refine.train_data``: by torch.func
    for ``loss_fn(outputs, targets)`` data, by double backward for ``batch_loss(batch)``."""
    if refine.batch_loss is not None:
        return BatchLossCurvature(
            refine.model,
            flat.layout,
            refine.batch_loss,
            refine.train_data,
            kind,
            refine.loss_reduction,
        )
    assert refine.loss_fn is not None
    loss = FunctionalLoss(
        refine.model, refine.loss_fn, flat.names, refine.dtype, refine.loss_reduction
    )
    return LossFnCurvature(loss, flat.layout, refine.train_data, kind, refine.batch_size)


def query_grads(
    refine: Refinement, flat: LoggedSpace, curv: StreamedCurvature, data: Any
) -> Iterator[torch.Tensor]:
    """``[b, P]`` gradients of the queries' own losses in the logged space, batch by batch."""
    if isinstance(curv, LossFnCurvature):
        return curv.example_grads(data)
    assert refine.batch_loss is not None
    return captured_rows(
        flat, refine.model, refine.batch_loss, data, refine.loss_reduction, refine.dtype
    )


def preconditioner_of(
    refine: Refinement, train: RowSource, flat: LoggedSpace, kind: str | None, batch_size: int
) -> tuple[Preconditioner, bool]:
    """The logged space's preconditioner, and whether its statistics were refit (two passes)."""
    kind = refine.preconditioner or kind
    if refine.fisher != "store" and kind is None:
        kind = "ekfac"  # the refit is K-FAC statistics, whatever the run collected
    stats = None
    if refine.fisher != "store" and kind not in ("identity", "raw"):
        preset = "kfac" if kind in ("kfac", "raw") else "ekfac"
        stats = fit_fisher_statistics(refine, [sl.spec.name for sl in flat.slots], preset)
    return logged_preconditioner(train, kind, stats, batch_size), stats is not None


def probes(width: int, dtype: torch.dtype) -> torch.Tensor:
    """8 Rademacher vectors of the logged space for Hutchinson's trace estimator (seeded)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 2, (8, width), generator=gen).to(dtype) * 2 - 1


def mean_curvature(z: torch.Tensor, hz: torch.Tensor, flat: LoggedSpace, name: str) -> float:
    """The mean eigenvalue of ``H`` over the logged modules' parameters, ``tr(P H Pᵀ) / n_params``
    (``E[PᵀP] = I`` for the store's projections, so the trace survives projection), by
    Hutchinson's estimator from `probes` ``z`` and their products ``hz = (P H Pᵀ) z``; refused
    when it is not positive (then it gives the damping no scale)."""
    gamma = float((z * hz).sum(1).mean()) / flat.size
    if not gamma > 0:
        raise ValueError(
            f"the {name} curvature has a mean eigenvalue of {gamma:.3g} <= 0, "
            "so damping=None has no scale: pass a damping > 0 (or curvature='ggn')"
        )
    return gamma


@dataclass
class LoggedSystem:
    """``(P H Pᵀ + λI) y = row_q`` in the logged space: the curvature ``curv`` over ``flat``,
    the preconditioner ``pre``, and ``op``, ``A + λI`` with ``λ`` as it evolves (given,
    ``None`` until `set_damping`)."""

    curv: StreamedCurvature
    flat: LoggedSpace
    pre: Preconditioner
    dtype: torch.dtype
    lam: InitVar[float | None]  # the damping to start from (``op.lam`` as it evolves)
    chunk: int | None = None  # vectors per curvature product (None: all at once)
    device: torch.device | None = None  # the products' (the model's); y may live elsewhere
    op: DampedOperator = field(init=False)

    def __post_init__(self, lam: float | None) -> None:
        self.op = DampedOperator(self.curvature, lam, mean_curvature=self.mean_curvature)

    def curvature(self, y: torch.Tensor) -> torch.Tensor:
        """``P H Pᵀ y``: each chunk of ``y`` lifted, multiplied and projected batch by batch."""
        here = y if self.device is None else y.to(self.device)
        out = self.curv.product(here, self.flat.lift, self.flat.project, self.chunk)
        return out.to(y.device)

    def mean_curvature(self, z: torch.Tensor, hz: torch.Tensor) -> float:
        """The default ``λ`` from the probes ``z`` and their products (`mean_curvature`)."""
        return mean_curvature(z, hz, self.flat, self.curv.kind)

    def precondition(self, r: torch.Tensor) -> torch.Tensor:
        return self.pre.apply(r, self.op.lam).to(self.dtype)

    def use(self, curv: StreamedCurvature) -> None:
        """Solve with ``curv`` from now on (the GGN where the Hessian was indefinite), its
        passes counted on top of those spent so far; ``λ`` is no longer raised."""
        curv.passes += self.curv.passes
        self.curv = curv
        self.op.adaptive = False


def set_damping(
    system: LoggedSystem, solver: str, width: int, device: torch.device | None = None
) -> str:
    """Resolve ``system.op.lam`` where it is not given (the probes on ``device``, the solve's);
    returns the rule that chose it."""
    op = system.op
    if op.lam is not None:
        op.lam = resolve_damping(op.lam, torch.zeros(0))
        return "given"
    if solver == "block":
        # the trace probes ride along the first block's first product (it does not need λ: the
        # first directions are preconditioned at the unrefined default damping, and A = H + λI
        # is formed after the product), so the default damping costs no pass of its own
        op.probes = probes(width, system.dtype).to(device)
        return "mean eigenvalue of the curvature per parameter (Hutchinson, 8 probes, first pass)"
    # per-query CG's recurrence needs one M from its first step: one pass to find λ
    z = probes(width, system.dtype).to(device)
    op.lam = system.mean_curvature(z, system.curvature(z))
    return "mean eigenvalue of the curvature per parameter (Hutchinson, 8 probes, one pass)"
