"""Running a refinement: what it builds before it solves (`Setup`), its plan, its report."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from nnstat.curvature.streamed import StreamedCurvature

from ..logged_space import LoggedSpace, check_against_rows, check_weights
from ..precondition import Preconditioner
from ..sources import RowSource, all_rows
from .config import Refinement
from .cost import estimate_cost, product_time
from .memory import available_memory
from .plan import Footprint, Plan, choose_plan, product_cost, warn_changed
from .solve import raised_rule, solve
from .system import LoggedSystem, curvature_of, preconditioner_of, query_grads, set_damping


def plan_for(
    refine: Refinement,
    curv: StreamedCurvature,
    flat: LoggedSpace,
    pre: Preconditioner,
    n: int,
    width: int,
    deferred: bool,
    refit: bool,
) -> Plan:
    """The plan of this refinement (`plan.choose_plan`) with its cost (`cost.estimate_cost`),
    the product's memory and time measured on the first training batch."""
    device = curv.device or torch.device("cpu")
    fixed, per_vector, measured = product_cost(
        curv, flat.lift, flat.project, width, refine.dtype, device
    )
    fp = Footprint(
        n=n,
        width=width,
        params=flat.size,
        itemsize=torch.finfo(refine.dtype).bits // 8,
        steps=refine.steps,
        start=deferred and refine.solver == "block",
        probes=8 if deferred else 0,
        fixed=fixed,
        per_vector=per_vector,
        measured=measured,
        preconditioner=2 * pre.damped_bytes(),
    )
    memory = refine.memory if refine.memory is not None else available_memory(device)
    plan = choose_plan(fp, memory, refine.solver, refine.query_batch, device.type == "cuda")
    times = product_time(curv, flat.lift, flat.project, width, refine.dtype, device)
    plan.cost = estimate_cost(plan, refine.query_batch, curv.batch_count(), times, refit)
    warn_changed(plan)
    return plan


@dataclass
class Setup:
    """What a refinement builds before it solves: the model's ``device``, the logged space
    ``flat``, the query log's ``ids`` and rows ``q_rows``, the exact curvature ``curv``, the
    preconditioner ``pre`` (``refit``: its statistics refit from the data, two passes), the
    damping ``lam`` (``None``: found with the first product) and the memory ``plan``."""

    device: torch.device
    flat: LoggedSpace
    ids: list
    q_rows: torch.Tensor
    curv: StreamedCurvature
    pre: Preconditioner
    refit: bool
    lam: float | None
    plan: Plan


def refined_damping(refine: Refinement, damping: float | None) -> float | None:
    """The one ``λ`` of a refined solve: ``Refinement(damping=)`` or the scoring call's.

    Both name the same damping (of the system and of its preconditioner), so two different
    values are refused rather than one silently ignored.

    Raises:
        ValueError: both are given and differ.
    """
    if refine.damping is None:
        return damping
    if damping is not None and float(damping) != float(refine.damping):
        raise ValueError(
            f"damping={damping} was passed with Refinement(damping={refine.damping}): both "
            "are the damping of the refined solve; pass one of them (or the same value)"
        )
    return refine.damping


def setup(
    refine: Refinement,
    query: RowSource,
    train: RowSource,
    damping: float | None,
    kind: str | None,
    batch_size: int,
    query_data: Any,
) -> Setup:
    """Build what `refine_queries` solves with (`Setup`); the checks of weights and queries."""
    lam = refined_damping(refine, damping)
    device = next((p.device for p in refine.model.parameters()), torch.device("cpu"))
    flat = LoggedSpace(refine.model, train, refine.dtype, device)
    ids, q_rows = all_rows(query, batch_size)
    check_weights(flat, train.meta or {}, str(getattr(train, "path", "") or "(in memory)"))
    curv = curvature_of(refine, flat, refine.curvature or "hessian")
    curv.check_reduction(refine.loss_reduction, "loss_fn" if refine.loss_fn else "batch_loss")
    if query_data is not None:  # the queries' own data: its gradients must be the log's rows
        grads = query_grads(refine, flat, curv, query_data)
        check_against_rows(flat, grads, q_rows, ids, query.meta or {})
    pre, refit = preconditioner_of(refine, train, flat, kind, batch_size)
    plan = plan_for(refine, curv, flat, pre, len(q_rows), q_rows.shape[1], lam is None, refit)
    return Setup(device, flat, ids, q_rows, curv, pre, refit, lam, plan)


def refinement_plan(
    refine: Refinement,
    query: Any,
    train: Any,
    damping: float | None = None,
    preconditioner: str | None = None,
    batch_size: int = 4096,
) -> Plan:
    """The memory plan `compute_influence_all(query, train, refine=refine)` would solve with
    (its ``result.meta["refine"]["memory"]`` is ``plan.meta()``), without solving: the
    product's share measured on the first training batch, the rest counted; ``plan.cost``:
    its passes, products and estimated time.

    Args:
        refine: the refinement.
        query: the query log (any source `compute_influence_all` takes).
        train: the gradient store.
        damping: `compute_influence_all`'s ``damping``.
        preconditioner: `compute_influence_all`'s ``preconditioner``.
        batch_size: rows read at once.

    Returns:
        The `plan.Plan`.

    Raises:
        ValueError: the budget cannot hold one query (the bytes needed named), a loss
            reduced otherwise than declared, or weights other than the store's.

    Example:
        >>> import torch
        >>> from nnstat.influence import ModuleSpec, TensorSource
        >>> model = torch.nn.Linear(3, 2)
        >>> X, Y = torch.randn(8, 3), torch.randint(0, 2, (8,))
        >>> rows = TensorSource(torch.randn(8, 8), layout=[ModuleSpec("model", 0, 2, 4)])
        >>> r = Refinement(model, torch.nn.functional.cross_entropy, (X, Y), damping=0.1)
        >>> plan = refinement_plan(r, rows, rows)
        >>> plan.solver, plan.block, plan.estimate > 0
        ('block', 8, True)
        >>> plan.cost.passes, plan.cost.products  # 5 steps of one block of 8 queries
        (5, 40)
    """
    from ..sources import as_source

    q, t = as_source(query), as_source(train)
    return setup(refine, q, t, damping, preconditioner, batch_size, None).plan


def refine_queries(
    refine: Refinement,
    query: RowSource,
    train: RowSource,
    damping: float | None,
    kind: str | None,
    batch_size: int,
    query_data: Any,
) -> tuple[list, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """``(ids, rows, refined, report)``: the query log's ids and rows, the refined rows
    ``y = (P H Pᵀ + λI)⁻¹ row_q`` ``[n, width]`` (on the CPU) that scores are dotted with, and
    the cost report for ``result.meta["refine"]``.

    The system lives in the logged (possibly projected) space, where the rows are: its
    curvature products lift ``y`` to the parameters (``Pᵀ y``), apply the exact curvature and
    project back, on the model's device, batch by batch of the training data. Solving in the
    full space and projecting the solution instead amplifies the projection's error along
    low-curvature directions.
    """
    start = time.perf_counter()
    s = setup(refine, query, train, damping, kind, batch_size, query_data)
    plan = s.plan
    width = s.q_rows.shape[1]
    here = s.device if plan.directions == "device" else torch.device("cpu")
    rhs = s.q_rows.to(device=here, dtype=refine.dtype)
    system = LoggedSystem(s.curv, s.flat, s.pre, refine.dtype, s.lam, plan.chunk, s.device)
    rule = set_damping(system, plan.solver, width, here)
    system.op.adaptive = refine.curvature is None and rule != "given"
    assert plan.cost is not None
    show = sys.stderr.isatty() if refine.progress is None else refine.progress
    if show:  # the cost, before the first pass
        print(f"nnstat: refining {len(rhs)} queries: {plan.cost.describe()}", file=sys.stderr)
    bar = tqdm(
        total=-(-len(rhs) // plan.block) * refine.steps,
        desc=f"refine ({system.curv.kind})",
        unit="pass",
        disable=not show,
        file=sys.stderr,
    )
    system.op.on_product = lambda: bar.update(1)
    with bar:
        solved = solve(refine, system, rhs, s.ids, plan)
    rule = raised_rule(system, rule)
    name = system.curv.kind
    if name == "ggn" and refine.curvature is None:
        name = "ggn (the Hessian was indefinite)"
    report = {
        "steps": refine.steps,
        "curvature": name,
        "fisher": refine.fisher,
        "solver": plan.solver,
        "products": system.op.products,
        "passes": system.curv.passes + (2 if s.refit else 0),
        "passes_per_block": max(solved.passes, default=0),
        "n_train": system.curv.n_train,
        "seconds": time.perf_counter() - start,
        "preconditioner": s.pre.kind,
        "damping": system.op.lam,
        "damping_rule": rule,
        "max_residual": float(torch.cat(solved.residual).max()),
        "device": str(s.device),
        "memory": plan.meta(),
        "cost": plan.cost.meta(),
    }
    if not math.isfinite(report["max_residual"]):
        raise ValueError("refinement produced NaN/Inf: check the data and the damping")
    return s.ids, s.q_rows, torch.cat(solved.rows).cpu(), report
