"""Influence refined by preconditioned conjugate gradient on exact curvature products.

K-FAC-family curvature (``ekfac``, ``kfac``) gives an approximate ``(H + λI)⁻¹``. Refinement uses
it not as the answer but as the preconditioner of a few conjugate-gradient steps on the *exact*
curvature of the mean training loss (the idea of ASTRA, Wang et al. 2025). For every query it
solves ``(P H Pᵀ + λI) y = P g_q`` in the space the store logs (``P``: the store's projections,
the identity for an unprojected store; ``P g_q`` is the query's row) and scores ``yᵀ P g_i``
against the stored rows, like the unrefined preconditioners, which approximate the same matrix.
(Solving in the full parameter space and projecting the solution was measured far worse: the
projection's error is amplified along the low-curvature directions the solution grows in.)

* ``H``: the Hessian (``curvature="hessian"``) or the Gauss-Newton matrix (``"ggn"``, positive
  semi-definite, for non-convex models whose Hessian is indefinite) of the mean loss over
  ``train_data``; a product lifts ``y`` to the parameters (``Pᵀ y``), applies ``H`` (batched over
  a block of queries, ``torch.func``) and projects back; one conjugate-gradient step is one
  streamed pass over ``train_data``.
* Preconditioner: the unrefined path's own (default EK-FAC, else K-FAC, else raw), with the
  same ``λ`` as the system.
* ``λ``: ``damping``, or by default the mean eigenvalue of ``H`` over the logged parameters,
  ``tr(P H Pᵀ) / n_params`` (Hutchinson's estimator in the logged space, 8 probes). The
  empirical-Fisher scale of the unrefined default is 10-250x smaller on confident models, and
  conjugate gradient then diverges from useful rankings in few steps. The block solver adds the
  probes to its first product, which needs no ``λ``: ``A = H + λI`` is formed after it, every
  block's first directions are the unrefined default's ``M(λ₀)⁻¹ row_q``, and its second pass
  adds ``M(λ)⁻¹ row_q`` next to the residuals' directions. So the default costs no pass (per-query
  CG spends one on it), and one step already holds the unrefined solution in its space.
* Block conjugate gradient (``solver="block"``, default): the queries of a block share one
  search space, each pass adding every query's preconditioned residual to it, so a block of 32
  explores 32 directions per pass (`krylov.block_cg`); ``solver="cg"``: one recurrence each.
* Start at ``y₀ = 0``: ``steps`` steps cost ``steps`` passes per block of queries; ``steps=0``
  returns the unrefined scores exactly. (Starting at the preconditioned gradient was worse at
  equal cost in 131 of 135 measured settings, so it is not offered.)

A conjugate-gradient step never increases the ``(P H Pᵀ + λI)``-norm error while that matrix is
positive definite. An indefinite direction under ``curvature="hessian"`` raises, naming the
queries and the fix. Under the defaults (``curvature=None``, ``damping=None``) ``λ`` is kept at
least ``DAMPING_RAISE`` x the Hessian's most negative curvature found along the search space:
the block solver raises it in place (`krylov.block_cg`'s ``shift``; blocks solved before are
solved again at the final ``λ``), per-query CG solves again (at most ``MAX_DAMPING_RAISES``
times). With a given damping an indefinite Hessian makes every query use the Gauss-Newton
matrix instead. Each with a warning, every pass counted, and the report saying so.

Example:
    >>> import torch
    >>> from nnstat.influence import ModuleSpec, TensorSource, compute_influence_all
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(3, 2)
    >>> X, Y = torch.randn(40, 3), torch.randint(0, 2, (40,))
    >>> loss = torch.nn.functional.cross_entropy
    >>> def rows(x, y):  # unprojected per-sample gradients as a store would hold them
    ...     g = torch.func.vmap(torch.func.grad(lambda p, a, b: loss(
    ...         torch.func.functional_call(model, p, (a[None],)), b[None])), (None, 0, 0))(
    ...         dict(model.named_parameters()), x, y)
    ...     return torch.cat([g["weight"], g["bias"][..., None]], -1).flatten(1)
    >>> lay = [ModuleSpec("model", 0, 2, 4)]
    >>> train = TensorSource(rows(X, Y), layout=lay)
    >>> query = TensorSource(rows(X[:2], Y[:2]), layout=lay)
    >>> refine = Refinement(model, loss, (X, Y), query_data=(X[:2], Y[:2]), steps=3,
    ...                     damping=0.01, preconditioner="identity")
    >>> res = compute_influence_all(query, train, refine=refine, damping=0.01)
    >>> res.scores.shape, res.meta["refine"]["passes"]
    (torch.Size([2, 40]), 3)
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from nnstat.curvature.fisher import fisher_statistics
from nnstat.curvature.products import FunctionalLoss, batch_len
from nnstat.curvature.streamed import BatchLossCurvature, LossFnCurvature, StreamedCurvature

from .krylov import block_cg, preconditioned_cg
from .logged_space import (
    LoggedSpace,
    captured_rows,
    check_against_rows,
    check_weights,
    logged_preconditioner,
)
from .precondition import Preconditioner, resolve_damping
from .refine_plan import Footprint, Plan, available_memory, choose_plan, product_cost, warn_changed
from .refine_system import DAMPING_RAISE, MAX_DAMPING_RAISES, DampedSystem, set_damping
from .sources import RowSource, all_rows

CURVATURES = ("hessian", "ggn")
FISHERS = ("store", "empirical", "true", "sampled")
SOLVERS = ("block", "cg")
REFINE_PRECONDITIONERS = ("ekfac", "kfac", "raw", "identity")
__all__ = [
    "CURVATURES",
    "FISHERS",
    "SOLVERS",
    "Refinement",
    "batch_len",
    "block_cg",
    "fit_fisher_statistics",
    "preconditioned_cg",
    "refinement_plan",
]


@dataclass
class Refinement:
    """How to refine influence scores with exact curvature (pass as ``refine=`` to
    `compute_influence_all` / `compute_self_influence`).

    Attributes:
        model: the trained model, with the weights the gradient store was logged from (put it in
            ``eval()`` mode if it has dropout or batch norm).
        loss_fn: ``loss_fn(outputs, targets)`` -> the batch loss reduced as ``loss_reduction``.
        train_data: the training data of the store, an ``(inputs, targets)`` tuple of tensors, a
            Dataset or a DataLoader (iterated once per conjugate-gradient step; keep it unshuffled).
        batch_loss: instead of ``loss_fn``, for framework batches (dicts, ...): ``batch_loss(batch)``
            -> the batch loss reduced as ``loss_reduction``, computed by calling ``model``; the
            data are then iterables of such batches. Curvature products then use autograd double
            backward (``"ggn"`` takes the model's output, or its ``.logits``, as the point where
            the loss starts) and the queries' gradients come from the capture engine.
        query_data: optionally the queries' data, in the query log's order: their gradients,
            projected, must reproduce the log's rows (a check of weights, loss and order; the
            solve itself uses the rows). Without it, the model's weights are checked against the
            store's ``params_sha256``.
        steps: conjugate-gradient steps; 0 gives the unrefined scores exactly.
        curvature: ``None`` (default): the Hessian; a default ``λ`` is kept at least
            ``DAMPING_RAISE`` x its most negative curvature found along the search space, and
            where the Hessian plus a given ``λ`` turns out indefinite the Gauss-Newton matrix is
            used for every query (a warning; ``result.meta["refine"]`` says which curvature and
            damping, and every pass spent is counted); ``"hessian"``: the Hessian, an indefinite
            direction raises; ``"ggn"``: the Gauss-Newton matrix (positive semi-definite).
        damping: ``λ`` of system and preconditioner; ``None`` = the mean eigenvalue of the
            curvature per logged parameter (``compute_influence_all``'s ``damping`` is used
            when this is ``None`` and that is given).
        preconditioner: ``None`` (the unrefined default: EK-FAC when the run has K-FAC
            statistics, else raw), or one of ``"ekfac"``, ``"kfac"``, ``"raw"``, ``"identity"``
            (plain CG).
        batch_size: training examples per curvature product.
        query_batch: queries refined together, at most (memory grows with it; see ``memory``).
        solver: ``"block"`` (default): the queries of a block share one search space (block
            conjugate gradient: each pass over the data adds ``query_batch`` directions, not one,
            at the memory of ``2 · steps · query_batch`` logged-space vectors); ``"cg"``: one
            conjugate-gradient recurrence per query.
        memory: bytes refinement may use on the model's device beyond the model, its data and
            the logs' rows (``None``: `refine_plan.available_memory`, 80% of the free GPU
            memory, or 50% of the available RAM on the CPU). It sets the plan
            (`refine_plan.choose_plan`, reported in ``result.meta["refine"]["memory"]`` with its
            estimate): the vectors per curvature product (``chunk``: the same results), on a
            GPU where the search space lives (device or host: the same results), then smaller
            blocks and per-query CG (a warning: the same solution once converged); where one
            query with one vector per product does not fit, a ``ValueError`` names the bytes
            needed. The product's share is measured on the first training batch.
        loss_reduction: how ``loss_fn`` reduces a batch, ``"mean"`` or ``"sum"``.
        fisher: where the K-FAC/EK-FAC preconditioner's factors come from: ``"store"`` (the run's
            statistics), or refit from ``train_data`` (two more passes) with the real targets
            (``"empirical"``), with the expectation over the model's predicted classes
            (``"true"``: the true Fisher = Gauss-Newton matrix of softmax cross-entropy, one
            backward per class) or with ``fisher_samples`` targets drawn from it (``"sampled"``).
            ``"true"``/``"sampled"`` need logits ``[..., C]`` and class-index targets.
        fisher_samples: draws per example for ``fisher="sampled"``.
        dtype: compute dtype (``torch.float64`` for small models and tests).
        progress: show a progress bar (``None``: when interactive).

    Example:
        >>> import torch
        >>> r = Refinement(torch.nn.Linear(2, 2), torch.nn.functional.cross_entropy,
        ...                (torch.randn(4, 2), torch.tensor([0, 1, 0, 1])), steps=5)
        >>> r.curvature, r.steps  # None: the Hessian, the GGN where that is indefinite
        (None, 5)
    """

    model: nn.Module
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    train_data: Any
    query_data: Any = None
    batch_loss: Callable[[Any], torch.Tensor] | None = None
    steps: int = 5
    curvature: str | None = None
    damping: float | None = None
    preconditioner: str | None = None
    batch_size: int = 256
    query_batch: int = 32
    solver: str = "block"
    memory: int | None = None
    loss_reduction: str = "mean"
    fisher: str = "store"
    fisher_samples: int = 1
    dtype: torch.dtype = torch.float32
    progress: bool | None = None
    _owner: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(self.model).__name__}")
        if (self.loss_fn is None) == (self.batch_loss is None):
            raise TypeError(
                "give exactly one of loss_fn(outputs, targets) and batch_loss(batch) -> scalar"
            )
        if not callable(self.loss_fn or self.batch_loss):
            raise TypeError("loss_fn / batch_loss must be callable")
        if self.batch_loss is not None and self.fisher in ("true", "sampled"):
            raise ValueError(f"fisher={self.fisher!r} needs loss_fn(outputs, targets) logits")
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise ValueError(f"steps must be an int >= 0, got {self.steps!r}")
        if self.curvature is not None and self.curvature not in CURVATURES:
            raise ValueError(f"curvature must be one of {list(CURVATURES)}, got {self.curvature!r}")
        if self.preconditioner is not None and self.preconditioner not in REFINE_PRECONDITIONERS:
            raise ValueError(
                f"preconditioner must be None or one of {list(REFINE_PRECONDITIONERS)}, "
                f"got {self.preconditioner!r}"
            )
        if self.solver not in SOLVERS:
            raise ValueError(f"solver must be one of {list(SOLVERS)}, got {self.solver!r}")
        if self.fisher not in FISHERS:
            raise ValueError(f"fisher must be one of {list(FISHERS)}, got {self.fisher!r}")
        if not isinstance(self.fisher_samples, int) or self.fisher_samples < 1:
            raise ValueError(f"fisher_samples must be a positive int, got {self.fisher_samples!r}")
        if self.loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        for name in ("batch_size", "query_batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.damping is not None:
            resolve_damping(self.damping, torch.zeros(0))  # validates
        if self.memory is not None and (
            not isinstance(self.memory, int) or isinstance(self.memory, bool) or self.memory < 1
        ):
            raise ValueError(f"memory must be None or a positive int (bytes), got {self.memory!r}")


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


def _curvature(refine: Refinement, flat: LoggedSpace, kind: str) -> StreamedCurvature:
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


def _query_grads(
    refine: Refinement, flat: LoggedSpace, curv: StreamedCurvature, data: Any
) -> Iterator[torch.Tensor]:
    """``[b, P]`` gradients of the queries' own losses in the logged space, batch by batch."""
    if isinstance(curv, LossFnCurvature):
        return curv.example_grads(data)
    assert refine.batch_loss is not None
    return captured_rows(
        flat, refine.model, refine.batch_loss, data, refine.loss_reduction, refine.dtype
    )


def _preconditioner(
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


@dataclass
class _Solved:
    """Every block's solution, final relative residuals, passes and the λ it was solved at."""

    rows: list[torch.Tensor] = field(default_factory=list)
    residual: list[torch.Tensor] = field(default_factory=list)
    passes: list[int] = field(default_factory=list)
    lams: list[float] = field(default_factory=list)


def _solve_blocks(
    refine: Refinement,
    system: DampedSystem,
    rhs: torch.Tensor,
    ids: list,
    plan: Plan,
    deferred: bool,
) -> _Solved:
    """One solve of every block of ``plan.block`` queries; a not positive definite error
    carries the ``queries`` (ids) it was found for."""
    solver, size = plan.solver, plan.block
    blocks = range(0, len(rhs), size)
    bar = tqdm(
        total=len(blocks) * refine.steps,
        desc=f"refine ({system.curv.kind})",
        unit="pass",
        disable=None if refine.progress is None else not refine.progress,
    )
    solve = block_cg if solver == "block" else preconditioned_cg
    out = _Solved()

    def counted(v: torch.Tensor) -> torch.Tensor:
        res = system.matvec(v)
        bar.update(1)
        return res

    with bar:
        for lo in blocks:
            b = rhs[lo : lo + size]
            kw: dict[str, Any] = {"shift": system.shift} if solver == "block" else {}
            if deferred:
                # every block starts from the same directions, the unrefined default's
                # M(λ₀)⁻¹ row_q (λ is not known before the first product)
                kw["start"] = system.pre.apply(b, None).to(system.dtype)
            try:
                y, info = solve(counted, system.precondition, b, refine.steps, **kw)
            except ValueError as e:
                if getattr(e, "rows", None):
                    e.queries = [ids[lo + i] for i in e.rows]  # type: ignore[attr-defined]
                raise
            out.rows.append(y.to(torch.float32))
            out.passes.append(info["passes"])
            out.residual.append(info["residual"])
            out.lams.append(system.lam)  # type: ignore[arg-type]
    return out


def _not_positive_definite(refine: Refinement, system: DampedSystem, e: ValueError) -> None:
    """Recover from a direction where ``H + λI`` is not positive definite (``e``), changing
    ``system`` (a raised ``λ``, or the GGN instead of the Hessian), or raise the user's error."""
    bad = e.queries  # type: ignore[attr-defined]
    rho = min(e.curvature)  # type: ignore[attr-defined]
    name = system.curv.kind
    what = (
        f"curvature='{name}' plus damping {system.lam:.3g} is not positive definite "
        f"along a conjugate-gradient direction of queries {bad[:5]} (curvature along it, "
        f"vᵀ(H+λI)v / vᵀv = {rho:.3g})"
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
    if hessian and system.adaptive and len(system.found) < MAX_DAMPING_RAISES:
        system.raise_damping(rho - system.lam)  # θ = ρ − λ: the Hessian's curvature there
        return
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
    spent = system.curv.passes
    system.curv = _curvature(refine, system.flat, "ggn")
    system.curv.passes += spent


def _solve(
    refine: Refinement, system: DampedSystem, rhs: torch.Tensor, ids: list, plan: Plan
) -> _Solved:
    """Every block solved at one final ``λ`` and curvature: under ``curvature=None`` and the
    default damping ``λ`` is kept at least ``DAMPING_RAISE`` x the Hessian's most negative
    curvature found (the block solver raises it in place; per-query CG solves again where
    ``H + λI`` turns out indefinite), with a given damping an indefinite Hessian makes every
    query use the GGN."""
    deferred = system.lam is None  # λ comes with the first product (the block solver only)
    resolves = 0
    while True:
        try:
            solved = _solve_blocks(refine, system, rhs, ids, plan, deferred)
        except ValueError as e:
            if not getattr(e, "queries", None):
                raise
            _not_positive_definite(refine, system, e)
            continue
        if all(u == system.lam for u in solved.lams):
            return solved
        # λ was raised after earlier blocks were solved: all of them again at the final λ (the
        # last time without further raises, so that every query ends at one λ)
        resolves += 1
        system.adaptive = system.adaptive and resolves < MAX_DAMPING_RAISES


def _raised_rule(system: DampedSystem, rule: str) -> str:
    """``rule``, saying (and warning) how far ``λ`` was raised past negative curvature."""
    if not system.found:
        return rule
    warnings.warn(
        f"nnstat: the Hessian has curvature down to {min(system.found):.3g} along the "
        f"refinement's search directions, beyond the default damping: it was raised from "
        f"{system.raised_from:.3g} to {system.lam:.3g} (result.meta['refine']['damping_rule']). "
        "Pass damping= to choose it, or curvature='ggn'",
        stacklevel=4,
    )
    return rule + (
        f"; raised from {system.raised_from:.3g} to {system.lam:.3g} ({len(system.found)} x) "
        f"to stay {DAMPING_RAISE} x the Hessian's most negative curvature found"
    )


def _plan(
    refine: Refinement,
    curv: StreamedCurvature,
    flat: LoggedSpace,
    pre: Preconditioner,
    n: int,
    width: int,
    deferred: bool,
) -> Plan:
    """The memory plan of this refinement (`refine_plan.choose_plan`), the product's share
    measured on the first training batch."""
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
    warn_changed(plan)
    return plan


def _setup(
    refine: Refinement,
    query: RowSource,
    train: RowSource,
    damping: float | None,
    kind: str | None,
    batch_size: int,
    query_data: Any,
) -> tuple[Any, ...]:
    """What a refinement builds before it solves: ``(device, flat, ids, q_rows, curv, pre,
    refit, lam, plan)``."""
    device = next((p.device for p in refine.model.parameters()), torch.device("cpu"))
    flat = LoggedSpace(refine.model, train, refine.dtype, device)
    ids, q_rows = all_rows(query, batch_size)
    check_weights(flat, train.meta or {}, str(getattr(train, "path", "") or "(in memory)"))
    curv = _curvature(refine, flat, refine.curvature or "hessian")
    if query_data is not None:  # the queries' own data: its gradients must be the log's rows
        grads = _query_grads(refine, flat, curv, query_data)
        check_against_rows(flat, grads, q_rows, ids, query.meta or {})
    pre, refit = _preconditioner(refine, train, flat, kind, batch_size)
    lam = refine.damping if refine.damping is not None else damping
    plan = _plan(refine, curv, flat, pre, len(q_rows), q_rows.shape[1], lam is None)
    return device, flat, ids, q_rows, curv, pre, refit, lam, plan


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
    product's share measured on the first training batch, the rest counted.

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
    """
    from .sources import as_source

    q, t = as_source(query), as_source(train)
    return _setup(refine, q, t, damping, preconditioner, batch_size, None)[-1]


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
    device, flat, ids, q_rows, curv, pre, refit, lam, plan = _setup(
        refine, query, train, damping, kind, batch_size, query_data
    )
    width = q_rows.shape[1]
    here = device if plan.directions == "device" else torch.device("cpu")
    rhs = q_rows.to(device=here, dtype=refine.dtype)
    system = DampedSystem(curv, flat, pre, refine.dtype, lam, chunk=plan.chunk, device=device)
    rule = set_damping(system, plan.solver, width, here)
    system.adaptive = refine.curvature is None and rule != "given"
    solved = _solve(refine, system, rhs, ids, plan)
    rule = _raised_rule(system, rule)
    name = system.curv.kind
    if name == "ggn" and refine.curvature is None:
        name = "ggn (the Hessian was indefinite)"
    report = {
        "steps": refine.steps,
        "curvature": name,
        "fisher": refine.fisher,
        "solver": plan.solver,
        "products": system.products,
        "passes": system.curv.passes + (2 if refit else 0),
        "passes_per_block": max(solved.passes, default=0),
        "n_train": system.curv.n_train,
        "seconds": time.perf_counter() - start,
        "preconditioner": pre.kind,
        "damping": system.lam,
        "damping_rule": rule,
        "max_residual": float(torch.cat(solved.residual).max()),
        "device": str(device),
        "memory": plan.meta(),
    }
    if not math.isfinite(report["max_residual"]):
        raise ValueError("refinement produced NaN/Inf: check the data and the damping")
    return ids, q_rows, torch.cat(solved.rows).cpu(), report
