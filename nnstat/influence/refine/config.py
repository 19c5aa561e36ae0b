"""What a refinement is asked to do: `Refinement`, the options and their validation."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nnstat.curvature.passes import keyword_checked

from ..precondition import resolve_damping

CURVATURES = ("hessian", "ggn")
FISHERS = ("store", "empirical", "true", "sampled")
SOLVERS = ("block", "cg")
REFINE_PRECONDITIONERS = ("ekfac", "kfac", "raw", "identity")


@keyword_checked("refinement")
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
            the logs' rows (``None``: `memory.available_memory`, 80% of the free GPU
            memory, or 50% of the available RAM on the CPU). It sets the plan
            (`plan.choose_plan`, reported in ``result.meta["refine"]["memory"]`` with its
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
