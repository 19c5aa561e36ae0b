"""Logging and query passes shared by the HuggingFace and Lightning influence helpers.

Both frameworks reduce to the same plain-API calls: a :class:`nnstat.Run` watching the model,
``for _ in run.schedule(): with run(data_id=ids): loss.backward()`` over the training data, then
``run.eval()`` + a query pass + ``nnstat.influence.compute_influence_all``. The helpers here only
add what frameworks need: eval mode during the passes, ids from dataset positions, progress bars.

Example:
    >>> import torch, tempfile
    >>> model = torch.nn.Linear(3, 2)
    >>> run = open_run(model, "doc", tempfile.mkdtemp(), {"statistic": "none"}, rank=None)
    >>> batches = [(torch.randn(4, 3), torch.randint(0, 2, (4,)))]
    >>> loss = lambda b: torch.nn.functional.cross_entropy(model(b[0]), b[1], reduction="sum")
    >>> log_pass(run, PassData(model, batches, loss, progress=False))
    >>> len(__import__("nnstat").GradientStore(run.path))
    4
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nnstat.curvature.products import batch_len

__all__ = [
    "PassData",
    "build_config",
    "open_run",
    "log_pass",
    "query_log",
    "probe_filter",
    "refinement",
    "eval_mode",
]

IdsFn = Callable[[Any, int], Any]


def build_config(
    config: Mapping[str, Any] | str | None,
    *,
    ekfac: bool | None,
    loss_reduction: str,
    param_grads: bool = False,
) -> dict[str, Any]:
    """The run configuration of an integration: the user's, completed with what it needs.

    ``ekfac=None``: EK-FAC statistics unless ``config`` names a statistic; ``True`` forces
    EK-FAC (an error if ``config`` names another); ``False``: ``config``'s statistic or ``raw``.

    Example:
        >>> build_config(None, ekfac=None, loss_reduction="sum")["statistic"]
        'ekfac'
    """
    base: dict[str, Any] = {"statistic": config} if isinstance(config, str) else dict(config or {})
    named = base.get("statistic")
    if ekfac is True and named not in (None, "ekfac"):
        raise ValueError(f"ekfac=True but config names statistic={named!r}; set ekfac=False")
    if named is None:
        base["statistic"] = "ekfac" if ekfac in (None, True) else "raw"
    base.setdefault("log", "grad")
    base.setdefault("save", "grad")
    if base.setdefault("loss_reduction", loss_reduction) != loss_reduction:
        raise ValueError(
            f"this integration computes losses reduced by {loss_reduction!r}; config says "
            f"loss_reduction={base['loss_reduction']!r}"
        )
    # a dedicated logging pass never needs the weights' own gradients
    base.setdefault("param_grads", param_grads)
    return base


def open_run(
    model: nn.Module,
    project: str,
    root_dir: str | Path,
    config: dict[str, Any],
    *,
    rank: int | None = 64,
    init: str = "random",
    seed: int = 0,
    name_filter: Any = None,
    type_filter: Any = None,
    overwrite: bool = False,
) -> Any:
    """A :class:`nnstat.Run` watching ``model`` with its projection set (``overwrite``: its
    first logging pass replaces the store, see :class:`nnstat.run.Run`).

    Example:
        >>> import tempfile
        >>> run = open_run(nn.Linear(2, 2), "p", tempfile.mkdtemp(), {}, rank=None)
        >>> run.project
        'p'
    """
    from nnstat.run import Run

    run = Run(project, root_dir=root_dir, config=config, overwrite=overwrite)
    run.watch(model, name_filter=name_filter, type_filter=type_filter)
    run.add_projection(rank=rank, init=init, seed=seed)
    return run


class _EvalMode:
    """Eval mode (no dropout: influence assumes a deterministic model) and no stale gradients,
    restored afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __enter__(self) -> None:
        self.was_training = self.model.training
        self.model.eval()
        self.model.zero_grad(set_to_none=True)

    def __exit__(self, *exc: object) -> None:
        self.model.zero_grad(set_to_none=True)
        self.model.train(self.was_training)


def _scalar(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"the loss must be a scalar tensor, got {type(loss).__name__}: {loss!r}")
    return loss


def probe_filter(
    model: nn.Module,
    batch: Any,
    loss_fn: Callable[[Any], torch.Tensor],
    name_filter: Any = None,
    type_filter: Any = None,
    stacklevel: int = 3,
) -> Any:
    """The ``name_filter`` to watch: every supported module (within the user's filters) whose
    per-sample gradients are defined, found with one forward/backward on ``batch``. Modules left
    out are named in a warning. With ``type_filter`` the user's filters are returned as they are.

    Example:
        >>> m = nn.Linear(3, 1)
        >>> probe_filter(m, torch.randn(2, 3), lambda b: m(b).sum())
        '^(?:model)$'
    """
    from nnstat.integrations._probe import ModuleProbe

    if type_filter is not None:
        return name_filter
    with _EvalMode(model):
        probe = ModuleProbe(model, name_filter=name_filter)
        with probe:
            _scalar(loss_fn(batch)).backward()
    keep = probe.regex()
    if probe.excluded:
        reasons = "; ".join(f"{n}: {why}" for n, why in probe.excluded.items())
        warnings.warn(f"not watched (no per-sample gradient): {reasons}", stacklevel=stacklevel)
    return keep


@dataclass
class PassData:
    """What a logging or query pass runs over.

    ``loss_fn(batch)`` returns the batch loss reduced as the run's ``loss_reduction`` says;
    ``ids_fn(batch, start)`` the batch's ids (default: positions ``start, start+1, ...``, which
    name dataset rows only when ``batches`` does not shuffle); ``mask_fn(batch)`` an optional
    ``[N]`` / ``[N, positions]`` mask; ``progress=False`` hides the progress bar.

    Example:
        >>> m = nn.Linear(3, 1)
        >>> PassData(m, [torch.randn(2, 3)], lambda b: m(b).sum()).progress is None
        True
    """

    model: nn.Module
    batches: Iterable[Any]
    loss_fn: Callable[[Any], torch.Tensor]
    ids_fn: IdsFn | None = None
    mask_fn: Callable[[Any], torch.Tensor | None] | None = None
    progress: bool | None = None

    def run_pass(self, run: Any, desc: str) -> None:
        """One pass of ``run(data_id=..., mask=...)`` + backward over every batch."""
        from tqdm.auto import tqdm

        batches = self.batches
        start = 0
        total = len(batches) if hasattr(batches, "__len__") else None  # type: ignore[arg-type]
        # None: tqdm's own rule, no bar when the output is not a terminal (CI logs, files)
        off = None if self.progress is None else not self.progress
        for batch in tqdm(batches, desc=desc, total=total, disable=off, leave=False):
            n = batch_len(batch)
            ids = (
                list(range(start, start + n)) if self.ids_fn is None else self.ids_fn(batch, start)
            )
            mask = None if self.mask_fn is None else self.mask_fn(batch)
            with run(data_id=ids, mask=mask):
                _scalar(self.loss_fn(batch)).backward()
            self.model.zero_grad(set_to_none=True)
            start += n


def log_pass(run: Any, data: PassData) -> None:
    """Every pass the run's configuration needs over ``data`` (EK-FAC: two), then finalize."""
    with _EvalMode(data.model):
        for i, spec in enumerate(run.schedule()):
            data.run_pass(run, f"nnstat log pass {i + 1} ({getattr(spec, 'name', 'grad')})")


def query_log(run: Any, data: PassData) -> Any:
    """Projected gradients of ``data`` with the run's projection (a ``GradientLog``); the run
    is back in logging mode afterwards."""
    run.eval()
    try:
        with _EvalMode(data.model):
            data.run_pass(run, "nnstat query")
        return run.get_log()
    finally:
        run.train()


def eval_mode(model: nn.Module) -> _EvalMode:
    """The context the passes run in (eval mode, no stale gradients), for refined scoring too."""
    return _EvalMode(model)


def refinement(refine: Any, train: PassData, query: PassData | None, loss_reduction: str) -> Any:
    """``refine=`` of an integration's influence call as a `nnstat.influence.Refinement`: an
    int is the number of steps, on the integration's own loss and data, with the Gauss-Newton
    curvature (framework models are non-convex: their Hessian is indefinite in general); a
    Refinement is used as given; ``None`` stays ``None``.

    Example:
        >>> m = nn.Linear(3, 2)
        >>> data = PassData(m, [(torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))],
        ...                 lambda b: nn.functional.cross_entropy(m(b[0]), b[1], reduction="sum"))
        >>> refinement(5, data, None, "sum").steps
        5
    """
    from nnstat.influence import Refinement

    if refine is None or isinstance(refine, Refinement):
        return refine
    if isinstance(refine, bool) or not isinstance(refine, int):
        raise TypeError(f"refine must be a number of steps or a Refinement, got {refine!r}")
    if train is None:
        raise ValueError(f"refine={refine} needs the training data the store was logged from")
    return Refinement(
        train.model,
        None,
        train.batches,
        query_data=None if query is None else query.batches,
        batch_loss=train.loss_fn,
        loss_reduction=loss_reduction,
        steps=refine,
        curvature="ggn",
        progress=train.progress,
    )
