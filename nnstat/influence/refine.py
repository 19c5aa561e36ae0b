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
    >>> from nnstat.influence import TensorSource, compute_influence_all
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vjp, vmap
from tqdm.auto import tqdm

from nnstat.capture import rules
from nnstat.store.integrity import params_hash

from .cache import default_preconditioner, fitted
from .exact import iter_batches
from .krylov import block_cg, preconditioned_cg
from .layout import ModuleSpec
from .precondition import (
    Preconditioner,
    _fit_from_rows,
    kfac_factor,
    resolve_damping,
    stored_ekfac_factor,
)
from .sources import RowSource, all_rows

CURVATURES = ("hessian", "ggn")
FISHERS = ("store", "empirical", "true", "sampled")
SOLVERS = ("block", "cg")
# statistics that average output-gradient terms (scaled by the class count under fisher="true")
_BACKWARD_KEYS = (
    "/backward/covariance",
    "/backward/eigenvalues",
    "/ekfac/eigenvalues",
    "/grad/covariance",
)
REFINE_PRECONDITIONERS = ("ekfac", "kfac", "raw", "identity")
__all__ = [
    "CURVATURES",
    "FISHERS",
    "SOLVERS",
    "Refinement",
    "block_cg",
    "fit_fisher_statistics",
    "preconditioned_cg",
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
        query_batch: queries refined together (memory grows with it).
        solver: ``"block"`` (default): the queries of a block share one search space (block
            conjugate gradient: each pass over the data adds ``query_batch`` directions, not one,
            at the memory of ``2 · steps · query_batch`` logged-space vectors); ``"cg"``: one
            conjugate-gradient recurrence per query.
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


# ----------------------------------------------------------------------------- the model side
@dataclass
class _Slot:
    """One logged module: where its parameters sit in the flat vector and its store layout."""

    spec: ModuleSpec  # the store's layout entry (projected widths)
    module: nn.Module
    kind: str
    d_out: int | None
    d_in: int
    params: list[tuple[str, str, torch.Size, int, int]]  # (key, full name, shape, offset, numel)
    p_out: torch.Tensor | None = None
    p_in: torch.Tensor | None = None


def _find_module(model: nn.Module, name: str) -> nn.Module:
    modules = dict(model.named_modules())
    if name in modules and name:
        return modules[name]
    if name == "model":  # the engine's name for a watched root module
        return model
    raise ValueError(
        f"the store logged module {name!r}, which the refinement model does not have "
        f"(its modules: {[n for n in modules if n][:10]}...): pass the model the store was "
        "logged from"
    )


class _Flat:
    """The logged modules' parameters as one flat vector, and conversions to their layouts."""

    def __init__(self, model: nn.Module, source: RowSource, dtype: torch.dtype) -> None:
        meta_modules = {m["name"]: m for m in (source.meta or {}).get("modules", [])}
        projections = source.projections()
        names = {id(p): n for n, p in model.named_parameters()}
        self.slots: list[_Slot] = []
        offset = 0
        for spec in source.layout:
            module = _find_module(model, spec.name)
            kind = rules.detect_kind(module)
            if kind is None:
                raise ValueError(f"module {spec.name!r}: {rules.unsupported_reason(module)}")
            d_in, d_out = rules.dims(kind, module)
            if kind == "layernorm":
                d_in, d_out = d_in * (1 + rules.has_bias(module)), None
            info = meta_modules.get(spec.name)
            if info is not None and (info.get("d_in"), info.get("d_out")) != (d_in, d_out):
                raise ValueError(
                    f"module {spec.name!r}: the store logged a {info.get('d_out')}x"
                    f"{info.get('d_in')} gradient, the refinement model has {d_out}x{d_in}: "
                    "pass the model the store was logged from"
                )
            p_out = projections.get(f"{spec.name}/p_out")
            p_in = projections.get(f"{spec.name}/p_in")
            r_in = d_in if p_in is None else p_in.shape[0]
            r_out = (d_out or 1) if p_out is None else p_out.shape[0]
            if spec.width != r_in * r_out:
                raise ValueError(
                    f"module {spec.name!r} takes {spec.width} columns in the log, but its "
                    f"{d_out}x{d_in} gradient with the store's projections gives {r_out * r_in}: "
                    "a log without meta must hold unprojected rows"
                )
            params = []
            for key, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                params.append((key, names[id(p)], p.shape, offset, p.numel()))
                offset += p.numel()
            self.slots.append(
                _Slot(
                    spec,
                    module,
                    kind,
                    d_out,
                    d_in,
                    params,
                    None if p_out is None else p_out.to(dtype),
                    None if p_in is None else p_in.to(dtype),
                )
            )
        self.size = offset
        self.names = [full for s in self.slots for _, full, _, _, _ in s.params]
        self.projected = any(s.p_in is not None or s.p_out is not None for s in self.slots)

    # flat [k, P] <-> per-module matrix form [k, d_out, d_in(+1)] (layernorm [k, D(+D)])
    def matrix(self, flat: torch.Tensor, s: _Slot) -> torch.Tensor:
        k = flat.shape[0]
        params = {
            key: flat[:, off : off + n].reshape(k, *shape) for key, _, shape, off, n in s.params
        }
        return rules.matrix_from_params(s.kind, s.module, params)

    def write(self, out: torch.Tensor, s: _Slot, mat: torch.Tensor) -> None:
        for key, value in rules.grads_by_param(s.kind, s.module, mat).items():
            _, _, _, off, n = next(p for p in s.params if p[0] == key)
            out[:, off : off + n] = value.reshape(len(value), n)

    def to_dict(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        lead = flat.shape[:-1]
        return {
            full: flat[..., off : off + n].reshape(*lead, *shape)
            for s in self.slots
            for _, full, shape, off, n in s.params
        }

    def from_dict(self, tensors: Mapping[str, torch.Tensor], lead: int) -> torch.Tensor:
        return torch.cat([tensors[n].reshape(lead, -1) for n in self.names], dim=1)

    def project(self, flat: torch.Tensor) -> torch.Tensor:
        """``vec(P_out X P_inᵀ)`` of every module: flat parameters to the store's row layout."""
        parts = []
        for s in self.slots:
            x = self.matrix(flat, s)
            if s.kind == "layernorm":
                parts.append(x if s.p_in is None else x @ s.p_in.T)
                continue
            if s.p_out is not None:
                x = s.p_out @ x
            if s.p_in is not None:
                x = x @ s.p_in.T
            parts.append(x.reshape(len(x), -1))
        return torch.cat(parts, dim=1)

    def lift(self, y: torch.Tensor) -> torch.Tensor:
        """The adjoint of `project`: logged rows ``[k, width]`` to flat parameters,
        ``P_outᵀ Y P_in`` per module (the identity where a side is not projected)."""
        out = y.new_zeros(len(y), self.size)
        for s in self.slots:
            block = y[:, s.spec.offset : s.spec.stop]
            if s.kind == "layernorm":
                mat = block if s.p_in is None else block @ s.p_in
            else:
                r_out = s.d_out if s.p_out is None else s.p_out.shape[0]
                mat = block.reshape(len(y), r_out, -1)
                if s.p_out is not None:
                    mat = s.p_out.T @ mat
                if s.p_in is not None:
                    mat = mat @ s.p_in
            self.write(out, s, mat)
        return out


def _twice_differentiable() -> Any:
    """Attention through the math kernel: the fused CPU/flash kernels have no second derivative."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _sum_weight(batch_size: int, loss_reduction: str) -> float:
    """Weight of a batch loss in the *sum* of the examples' losses (the pass divides by the
    count once, so the data is read once per product, never once more to count it)."""
    return float(batch_size) if loss_reduction == "mean" else 1.0


def _finish_pass(curv: Any, total: torch.Tensor, seen: int) -> torch.Tensor:
    """``total / n``: a pass's summed products as those of the mean loss; every pass must see
    the same examples."""
    if seen == 0:
        raise ValueError("refinement needs training data: train_data is empty")
    if curv.n_train is not None and seen != curv.n_train:
        raise ValueError(
            f"train_data yielded {seen} examples in one pass and {curv.n_train} in another: "
            "refinement iterates it once per step, so it must not change (a DataLoader with a "
            "sampler that drops or repeats examples?)"
        )
    curv.n_train = seen
    curv.passes += 1
    return total / seen


class _Curvature:
    """Exact curvature-vector products of the mean training loss, streamed over the data."""

    def __init__(self, refine: Refinement, flat: _Flat) -> None:
        self.r = refine
        self.flat = flat
        dtype = refine.dtype
        model = refine.model
        self.theta = {
            n: p.detach().to(dtype) for n, p in model.named_parameters() if n in set(flat.names)
        }
        self.rest = {
            n: p.detach().to(dtype) for n, p in model.named_parameters() if n not in self.theta
        }
        self.rest.update(
            {n: (b.to(dtype) if b.is_floating_point() else b) for n, b in model.named_buffers()}
        )
        self.n_train: int | None = None
        self.passes = 0

    def _outputs(self, params: Mapping[str, torch.Tensor], x: Any) -> Any:
        return functional_call(self.r.model, {**params, **self.rest}, (x,))

    def _loss(self, params: Mapping[str, torch.Tensor], x: Any, y: Any) -> torch.Tensor:
        loss = self.r.loss_fn(self._outputs(params, x), y)
        if loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar batch loss (reduced as loss_reduction="
                f"{self.r.loss_reduction!r}), got shape {tuple(loss.shape)}"
            )
        return loss

    def batches(self, data: Any) -> Iterator[tuple[Any, Any]]:
        return iter_batches(data, self.r.batch_size, self.r.dtype)

    def example_grads(self, data: Any) -> torch.Tensor:
        """``[n, P]`` gradients of each example's own loss (flat, logged modules only)."""

        def one(params, xi, yi):
            return self._loss(params, xi.unsqueeze(0), yi.unsqueeze(0))

        per = vmap(grad(one), in_dims=(None, 0, 0))
        parts = [self.flat.from_dict(per(self.theta, x, y), len(x)) for x, y in self.batches(data)]
        if not parts:
            raise ValueError("empty query data")
        return torch.cat(parts)

    def _batch_product(self, vs: dict[str, torch.Tensor], x: Any, y: Any, w: float):
        theta = self.theta
        if self.r.curvature == "hessian":
            g = grad(lambda p: w * self._loss(p, x, y))

            def one(v):
                return jvp(g, (theta,), (v,))[1]

        else:
            out, pullback = vjp(lambda p: self._outputs(p, x), theta)
            out = out.detach()
            lgrad = grad(lambda o: w * self.r.loss_fn(o, y))

            def one(v):
                ju = jvp(lambda p: self._outputs(p, x), (theta,), (v,))[1]
                hju = jvp(lgrad, (out,), (ju,))[1]
                return pullback(hju)[0]

        try:
            with _twice_differentiable():
                return vmap(one)(vs)
        except RuntimeError:
            # an operator without a batching rule: one vector at a time is the same product
            k = len(next(iter(vs.values())))
            with _twice_differentiable():
                res = [one({n: t[i] for n, t in vs.items()}) for i in range(k)]
            return {n: torch.stack([r[n] for r in res]) for n in res[0]}

    def product(self, v: torch.Tensor) -> torch.Tensor:
        """``H v`` for a block of flat vectors ``[k, P]`` (one pass over the training data)."""
        vs = self.flat.to_dict(v)
        out = torch.zeros_like(v)
        seen = 0
        for x, y in self.batches(self.r.train_data):
            w = _sum_weight(len(x), self.r.loss_reduction)
            out += self.flat.from_dict(self._batch_product(vs, x, y, w), len(v))
            seen += len(x)
        return _finish_pass(self, out, seen)


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (dicts, tuples, nested).

    Example:
        >>> batch_len({"input_ids": torch.zeros(3, 5), "labels": torch.zeros(3, 5)})
        3
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"cannot find a batch dimension in {type(batch).__name__}")
    for v in values:
        try:
            return batch_len(v)
        except TypeError:
            continue
    raise TypeError(f"cannot find a batch dimension in {type(batch).__name__}")


def _logits(out: Any) -> torch.Tensor:
    """The tensor of a model's output the loss is computed from (``.logits`` of HF outputs)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"curvature='ggn' needs the model to return a tensor or an output with .logits, got "
            f"{type(out).__name__}"
        )
    return logits


def _batched_grad(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``[∂(Σ outputs·v_k)/∂inputs for every k]`` stacked: ``vs`` carry a leading ``[k]``."""
    try:
        return list(
            torch.autograd.grad(
                outputs, inputs, grad_outputs=vs, is_grads_batched=True, retain_graph=True,
                allow_unused=True, materialize_grads=True,
            )
        )  # fmt: skip
    except RuntimeError:  # an operator without a batching rule: one vector at a time
        k = len(vs[0])
        rows = [
            torch.autograd.grad(
                outputs, inputs, [t[i] for t in vs], retain_graph=True, allow_unused=True,
                materialize_grads=True,
            )
            for i in range(k)
        ]  # fmt: skip
        return [torch.stack([r[j] for r in rows]) for j in range(len(inputs))]


def _watch_logged(engine: Any, model: nn.Module, names: list[str]) -> None:
    """Watch exactly the modules a store logged (``"model"`` is the engine's name for a watched
    root module)."""
    import re

    if names == ["model"]:
        engine.watch(model)
    else:
        engine.watch(model, name_filter="^(" + "|".join(map(re.escape, names)) + ")$")


class _BatchLossCurvature:
    """Curvature products by double backward through ``batch_loss`` (any batch format), and the
    queries' gradients from the capture engine (the same per-sample gradients the store holds)."""

    def __init__(self, refine: Refinement, flat: _Flat) -> None:
        self.r = refine
        self.flat = flat
        by_name = dict(refine.model.named_parameters())
        self.params = [by_name[n] for n in flat.names]
        self.n_train: int | None = None
        self.passes = 0
        self._checked = False

    def example_grads(self, data: Any) -> torch.Tensor:
        from nnstat.capture import CaptureEngine

        engine = CaptureEngine()
        slots = {s.spec.name: s for s in self.flat.slots}
        caps: list[Any] = []
        _watch_logged(engine, self.r.model, list(slots))
        engine.add_consumer(lambda cap: caps.append((cap.name, cap.per_sample_grad().detach())))
        saved = {p: p.grad for p in self.params}
        parts = []
        try:
            for batch in data:
                caps.clear()
                n = batch_len(batch)
                # samples=n: a shared module (a position embedding) is expanded to the batch, so
                # its rows are each example's own gradient rather than the batch's sum
                with engine.batch(loss_reduction=self.r.loss_reduction, samples=n):
                    self.r.batch_loss(batch).backward()
                out = torch.zeros(n, self.flat.size, dtype=self.r.dtype)
                for name, mat in caps:
                    self.flat.write(out, slots[name], mat.to(self.r.dtype))
                parts.append(out)
        finally:
            engine.unwatch()
            for p, g in saved.items():
                p.grad = g
        if not parts:
            raise ValueError("empty query data")
        return torch.cat(parts)

    def product(self, v: torch.Tensor) -> torch.Tensor:
        """``H v`` (or ``G v``) for flat vectors ``[k, P]``: one pass, double backward per batch."""
        k = len(v)
        entries = [e for s in self.flat.slots for e in s.params]  # the order of self.params
        vs = [
            v[:, off : off + size].reshape(k, *shape).to(p.dtype)
            for (_, _, shape, off, size), p in zip(entries, self.params, strict=True)
        ]
        out = torch.zeros_like(v)
        seen = 0
        for batch in self.r.train_data:
            n_batch = batch_len(batch)
            w = _sum_weight(n_batch, self.r.loss_reduction)
            with torch.enable_grad(), _twice_differentiable():
                if self.r.curvature == "hessian":
                    loss = w * self.r.batch_loss(batch)
                    grads = torch.autograd.grad(loss, self.params, create_graph=True)
                    hv = _batched_grad(grads, self.params, vs)
                else:
                    hv = self._ggn(batch, w, vs)
            out += torch.cat([h.reshape(k, -1) for h in hv], 1).to(v.dtype)
            seen += n_batch
        return _finish_pass(self, out, seen)

    def _ggn(self, batch: Any, w: float, vs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``Jᵀ H_L J v`` with ``z`` the model's output logits, all by reverse mode: ``J v`` is
        the derivative of ``u ↦ Jᵀu`` (linear in ``u``) in direction ``v``.

        ``z`` is the output of the last module call to finish inside ``batch_loss`` (the model
        itself, or e.g. ``self.net`` in a Lightning ``training_step``); on the first batch the
        loss gradient is checked to flow through ``z`` alone, else the split would be wrong.
        """
        seen: list[Any] = []
        handles = [
            m.register_forward_hook(lambda m, a, out: seen.append(out))
            for m in self.r.model.modules()
        ]
        try:
            loss = w * self.r.batch_loss(batch)
        finally:
            for h in handles:
                h.remove()
        if not seen:
            raise ValueError("curvature='ggn': batch_loss never called the model")
        z = _logits(seen[-1])
        gz = torch.autograd.grad(loss, z, create_graph=True)[0]
        if not self._checked:
            direct = torch.autograd.grad(loss, self.params, retain_graph=True, allow_unused=True)
            via = torch.autograd.grad(
                z, self.params, gz.detach(), retain_graph=True, allow_unused=True
            )
            for a, b in zip(direct, via, strict=True):
                a = torch.zeros(()) if a is None else a
                b = torch.zeros(()) if b is None else b
                if not torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(a.abs().max()) + 1e-12):
                    raise ValueError(
                        "curvature='ggn': the loss depends on the parameters other than through "
                        "the model's last output (several model calls, or a regulariser?); use "
                        "curvature='hessian', or loss_fn(outputs, targets) with (inputs, targets)"
                    )
            self._checked = True
        u = torch.zeros_like(z, requires_grad=True)
        jtu = torch.autograd.grad(z, self.params, grad_outputs=u, create_graph=True)
        jv = _batched_grad(jtu, [u], vs)[0]  # [k, *z.shape]
        hjv = _batched_grad([gz], [z], [jv])[0]
        return _batched_grad([z], self.params, [hjv])


def _class_logits(outputs: Any, targets: Any) -> torch.Tensor:
    if (
        not isinstance(outputs, torch.Tensor)
        or not outputs.is_floating_point()
        or not isinstance(targets, torch.Tensor)
        or targets.is_floating_point()
        or tuple(targets.shape) != tuple(outputs.shape[:-1])
    ):
        raise ValueError(
            "fisher='true'/'sampled' needs class logits [..., C] and integer targets [...] "
            "(softmax cross-entropy); use fisher='empirical' or 'store' for other losses"
        )
    return outputs


def fit_fisher_statistics(
    refine: Refinement, module_names: list[str], preset: str = "ekfac"
) -> dict[str, torch.Tensor]:
    """K-FAC/EK-FAC statistics of the logged modules refit from ``refine.train_data``.

    ``refine.fisher`` says with which output gradients: ``"empirical"`` the real targets'
    loss, ``"true"`` every class ``c`` weighted by ``p_c`` (``g = √p_c (p − e_c)`` on the
    logits, an exact expectation: the true Fisher of softmax cross-entropy), ``"sampled"``
    ``fisher_samples`` targets drawn from ``p``. Keys as in a run's ``statistics.safetensors``.
    The model's ``.grad`` is restored afterwards.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(3, 4)
        >>> r = Refinement(m, torch.nn.functional.cross_entropy,
        ...                (torch.randn(16, 3), torch.randint(0, 4, (16,))), fisher="true")
        >>> sorted(fit_fisher_statistics(r, ["model"], "kfac"))
        ['model/backward/covariance', 'model/forward/covariance']
    """
    from nnstat.capture import CaptureEngine
    from nnstat.curvature import StatisticsCollector

    model = refine.model
    engine = CaptureEngine()
    _watch_logged(engine, model, module_names)
    collector = StatisticsCollector(preset)
    engine.add_consumer(collector)
    saved = {p: p.grad for p in model.parameters()}
    gen = torch.Generator().manual_seed(0)
    n_classes = 1
    try:
        for _ in collector.passes:
            for x, y in iter_batches(refine.train_data, refine.batch_size, torch.float32):
                if refine.fisher == "empirical":
                    with engine.batch(loss_reduction=refine.loss_reduction):
                        refine.loss_fn(model(x), y).backward()
                    continue
                draws = refine.fisher_samples if refine.fisher == "sampled" else None
                c = 0
                while c < (draws or n_classes):
                    with engine.batch(loss_reduction="sum"):
                        logits = _class_logits(model(x), y)
                        p = torch.softmax(logits.detach().float(), -1)
                        n_classes = p.shape[-1]
                        if draws is None:  # class c, weighted by √p_c
                            onehot = torch.zeros_like(p)
                            onehot[..., c] = 1
                            g = p[..., c : c + 1].sqrt() * (p - onehot)
                        else:
                            drawn = torch.multinomial(p.reshape(-1, n_classes), 1, generator=gen)
                            onehot = torch.zeros_like(p).reshape(-1, n_classes)
                            onehot.scatter_(1, drawn, 1.0)
                            g = p - onehot.reshape(p.shape)
                        logits.backward(g.to(logits.dtype))
                    c += 1
            collector.finalize()
    finally:
        engine.unwatch()
        for p, g in saved.items():
            p.grad = g
    state = collector.state_dict()
    if refine.fisher == "true":
        # C backward passes per batch were averaged as C·N samples: the expectation is a sum
        for key in state:
            if key.endswith(_BACKWARD_KEYS):
                state[key] = state[key] * n_classes
    return state


def _check_against_rows(
    flat: _Flat, grads: torch.Tensor, rows: torch.Tensor, ids: list, meta: Mapping
) -> None:
    """Refuse query data whose gradients are not the log's rows (other weights, loss or order)."""
    if len(grads) != len(rows):
        raise ValueError(
            f"the refinement's query data has {len(grads)} examples but the log has "
            f"{len(rows)} rows: pass the data the log was captured from, in the same order"
        )
    proj = flat.project(grads).to(torch.float32)
    rows = rows.to(torch.float32)
    err = (proj - rows).norm(dim=1) / rows.norm(dim=1).clamp_min(1e-30)
    tol = 1e-2 if str(meta.get("dtype", "float32")) in ("float16", "bfloat16") else 1e-3
    bad = (err > tol).nonzero().flatten()
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"the gradients of the refinement's query data do not match the logged rows for "
            f"{len(bad)} of {len(rows)} examples (first: id {ids[i]!r}, relative difference "
            f"{float(err[i]):.3g}): the model's weights, the loss function or the order of the "
            "data differ from when the log was captured"
        )


def _logged_preconditioner(
    source: RowSource,
    kind: str | None,
    stats: Mapping[str, torch.Tensor] | None,
    batch_size: int,
) -> Preconditioner:
    """The preconditioner of the logged space: the unrefined path's own (``fitted``), or, with
    refit statistics (``fisher=``), K-FAC/EK-FAC factors from them through the store's
    projections (EK-FAC eigenvalues apply where a module is logged unprojected)."""
    kind = kind or default_preconditioner(source)
    if stats is None or kind in ("identity", "raw"):
        return fitted(source, kind, batch_size)
    projections = source.projections()
    factors: dict[str, Any] = {}
    for m in source.layout:
        if m.kronecker:
            f = stored_ekfac_factor(m, stats, projections) if kind == "ekfac" else None
            factors[m.name] = f if f is not None else kfac_factor(m, stats, projections)
    dense = [m for m in source.layout if not m.kronecker]
    if dense:
        factors.update(_fit_from_rows(source, dense, {}, batch_size))
    return Preconditioner(kind, list(source.layout), factors)


def _check_weights(flat: _Flat, meta: Mapping[str, Any], path: str) -> None:
    """The refinement model must carry the weights the store was logged with."""
    recorded = meta.get("params_sha256")
    if not recorded:
        return
    with torch.no_grad():
        mine = params_hash(
            (f"{s.spec.name}.{k}", p)
            for s in flat.slots
            for k, p in s.module.named_parameters(recurse=False)
        )
    if mine != recorded:
        raise ValueError(
            f"the refinement model's weights are not those the store {path} was logged with "
            f"(params_sha256 {mine[:12]}... vs {recorded[:12]}...): pass the model as it was "
            "when the store was written, or log a new store"
        )


def _probes(width: int, dtype: torch.dtype) -> torch.Tensor:
    """8 Rademacher vectors of the logged space for Hutchinson's trace estimator (seeded)."""
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, 2, (8, width), generator=gen).to(dtype) * 2 - 1


def _resolve_mean_curvature(z: torch.Tensor, hz: torch.Tensor, flat: _Flat, name: str) -> float:
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


def _choose_solver(refine: Refinement, width: int, dtype: torch.dtype, start: bool) -> str:
    """``refine.solver``, or ``"cg"`` with a warning when the block solver's search space
    (``2 · min(directions, width)`` vectors of ``width``; ``directions = steps · query_batch``,
    one ``query_batch`` more from the second step when the block starts from other directions,
    ``start``) would exceed `BLOCK_MEMORY_LIMIT`."""
    if refine.solver != "block":
        return refine.solver
    directions = (refine.steps + (start and refine.steps > 1)) * refine.query_batch
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
    ``y = (P H Pᵀ + λI)⁻¹ row_q`` ``[n, width]`` that scores are dotted with, and the cost
    report for ``result.meta["refine"]``.

    The system lives in the logged (possibly projected) space, where the rows are: its
    curvature products lift ``y`` to the parameters (``Pᵀ y``), apply the exact curvature and
    project back. Solving in the full space and projecting the solution instead amplifies the
    projection's error along low-curvature directions.
    """
    start = time.perf_counter()
    dtype = refine.dtype
    flat = _Flat(refine.model, train, dtype)
    ids, q_rows = all_rows(query, batch_size)
    _check_weights(flat, train.meta or {}, str(getattr(train, "path", "") or "(in memory)"))
    auto = refine.curvature is None  # the Hessian, the GGN where the Hessian is indefinite

    def make_curvature(name: str) -> _Curvature | _BatchLossCurvature:
        r = replace(refine, curvature=name)
        return _Curvature(r, flat) if refine.batch_loss is None else _BatchLossCurvature(r, flat)

    curv = make_curvature(refine.curvature or "hessian")
    if query_data is not None:  # the queries' own data: its gradients must be the log's rows
        _check_against_rows(flat, curv.example_grads(query_data), q_rows, ids, query.meta or {})
    b_all = q_rows.to(dtype)
    kind = refine.preconditioner or kind
    if refine.fisher != "store" and kind is None:
        kind = "ekfac"  # the refit is K-FAC statistics, whatever the run collected
    stats = None
    if refine.fisher != "store" and kind not in ("identity", "raw"):
        preset = "kfac" if kind in ("kfac", "raw") else "ekfac"
        stats = fit_fisher_statistics(refine, [sl.spec.name for sl in flat.slots], preset)
    pre = _logged_preconditioner(train, kind, stats, batch_size)

    def curvature(y: torch.Tensor) -> torch.Tensor:
        return flat.project(curv.product(flat.lift(y)))

    lam = refine.damping if refine.damping is not None else damping
    solver = _choose_solver(refine, b_all.shape[1], dtype, start=lam is None)
    rule = "given"
    probes = None
    if lam is not None:
        lam = resolve_damping(lam, torch.zeros(0))
    elif solver == "block":
        # the trace probes ride along the first block's first product (it does not need λ: the
        # first directions are preconditioned at the unrefined default damping, and A = H + λI
        # is formed after the product), so the default damping costs no pass of its own
        probes = _probes(b_all.shape[1], dtype)
        rule = "mean eigenvalue of the curvature per parameter (Hutchinson, 8 probes, first pass)"
    else:  # per-query CG's recurrence needs one M from its first step: one pass to find λ
        z = _probes(b_all.shape[1], dtype)
        lam = _resolve_mean_curvature(z, curvature(z), flat, curv.r.curvature)
        rule = "mean eigenvalue of the curvature per parameter (Hutchinson, 8 probes, one pass)"
    deferred = lam is None  # λ comes with the first product (the block solver only)

    def matvec(v: torch.Tensor) -> torch.Tensor:
        nonlocal lam, probes
        if probes is None:
            return curvature(v) + lam * v
        both = curvature(torch.cat([v, probes]))
        lam = _resolve_mean_curvature(probes, both[len(v) :], flat, curv.r.curvature)
        probes = None
        return both[: len(v)] + lam * v

    def precondition(r: torch.Tensor) -> torch.Tensor:
        return pre.apply(r, lam).to(dtype)

    solve = block_cg if solver == "block" else preconditioned_cg
    blocks = range(0, len(b_all), refine.query_batch)
    # curvature=None and the default damping: λ is only a scale, so it is kept at least
    # DAMPING_RAISE x the Hessian's most negative curvature found (the block solver raises it in
    # place; per-query CG solves again where H + λI turns out indefinite)
    adaptive = auto and rule != "given"
    raised_from, found = lam, []  # λ before the first raise; the Hessian curvatures raised past

    def raise_damping(theta: float) -> float:
        """Raise λ to ``DAMPING_RAISE x |θ|`` (θ < 0, a Ritz value of the Hessian, so an upper
        bound on λ_min(H)); returns the increase."""
        nonlocal lam, raised_from
        if not found:
            raised_from = lam
        new = DAMPING_RAISE * -theta
        delta, lam = new - lam, new
        found.append(theta)
        return delta

    def shift(mu: float) -> float:  # μ: the smallest Ritz value of H + λI in the block space
        theta = mu - lam
        if not (adaptive and curv.r.curvature == "hessian") or DAMPING_RAISE * -theta <= lam:
            return 0.0
        return raise_damping(theta)

    products = resolves = 0  # every curvature-vector product, abandoned solves' too

    def solve_all() -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
        bar = tqdm(
            total=len(blocks) * refine.steps,
            desc=f"refine ({curv.r.curvature})",
            unit="pass",
            disable=None if refine.progress is None else not refine.progress,
        )
        solved, residual, per_block, used = [], [], [], []
        with bar:
            for lo in blocks:
                rhs = b_all[lo : lo + refine.query_batch]
                kw: dict[str, Any] = {"shift": shift} if solver == "block" else {}
                if deferred:
                    # every block starts from the same directions, the unrefined default's
                    # M(λ₀)⁻¹ row_q (λ is not known before the first product)
                    kw["start"] = pre.apply(rhs, None).to(dtype)

                def counted(v: torch.Tensor) -> torch.Tensor:
                    nonlocal products
                    products += len(v) + (0 if probes is None else len(probes))
                    out = matvec(v)
                    bar.update(1)
                    return out

                try:
                    y, info = solve(counted, precondition, rhs, refine.steps, **kw)
                except ValueError as e:
                    if getattr(e, "rows", None):
                        e.queries = [ids[lo + i] for i in e.rows]  # type: ignore[attr-defined]
                    raise
                solved.append(y.to(torch.float32))
                per_block.append(info["passes"])
                residual.append(info["residual"])
                used.append(lam)
        return solved, residual, per_block, used

    while True:
        try:
            solved, residual, per_block, used = solve_all()
        except ValueError as e:
            bad = getattr(e, "queries", None)
            if not bad:
                raise
            rho = min(e.curvature)  # type: ignore[attr-defined]
            what = (
                f"curvature='{curv.r.curvature}' plus damping {lam:.3g} is not positive definite "
                f"along a conjugate-gradient direction of queries {bad[:5]} (curvature along it, "
                f"vᵀ(H+λI)v / vᵀv = {rho:.3g})"
            )
            hessian = curv.r.curvature == "hessian"
            if not auto:
                fix = (
                    "the Hessian of this loss is indefinite there. Use Refinement(curvature="
                    "'ggn') (positive semi-definite) or a larger damping"
                    if hessian
                    else "the loss is not convex in the model's outputs: pass a larger damping"
                )
                raise ValueError(f"{what}: {fix}") from None
            if hessian and adaptive and len(found) < MAX_DAMPING_RAISES:
                raise_damping(rho - lam)  # θ = ρ − λ: the Hessian's curvature there
                continue
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
                stacklevel=3,
            )
            spent = curv.passes
            curv = make_curvature("ggn")
            curv.passes += spent
            continue
        if all(u == lam for u in used):
            break
        # λ was raised after earlier blocks were solved: all of them again at the final λ (the
        # last time without further raises, so that every query ends at one λ)
        resolves += 1
        adaptive = adaptive and resolves < MAX_DAMPING_RAISES
    if found:
        rule += (
            f"; raised from {raised_from:.3g} to {lam:.3g} ({len(found)} x) to stay "
            f"{DAMPING_RAISE} x the Hessian's most negative curvature found"
        )
        warnings.warn(
            f"nnstat: the Hessian has curvature down to {min(found):.3g} along the refinement's "
            f"search directions, beyond the default damping: it was raised from "
            f"{raised_from:.3g} to {lam:.3g} (result.meta['refine']['damping_rule']). Pass "
            "damping= to choose it, or curvature='ggn'",
            stacklevel=3,
        )
    name = curv.r.curvature
    if name == "ggn" and auto:
        name = "ggn (the Hessian was indefinite)"
    report = {
        "steps": refine.steps,
        "curvature": name,
        "fisher": refine.fisher,
        "solver": solver,
        "products": products,
        "passes": curv.passes + (2 if stats is not None else 0),
        "passes_per_block": max(per_block, default=0),
        "n_train": curv.n_train,
        "seconds": time.perf_counter() - start,
        "preconditioner": pre.kind,
        "damping": lam,
        "damping_rule": rule,
        "max_residual": float(torch.cat(residual).max()),
    }
    if not math.isfinite(report["max_residual"]):
        raise ValueError("refinement produced NaN/Inf: check the data and the damping")
    return ids, q_rows, torch.cat(solved), report
