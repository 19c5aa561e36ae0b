"""Lightning integration: statistics through the module's loggers, and influence helpers.

``NNStatCallback`` measures the Tracker's statistics and trust ratios on logging steps (right
around ``on_before_optimizer_step`` / ``on_train_batch_end``, so the update is that single step's)
and a streaming noise scale on every step, and writes them with ``logger.log_metrics`` to every
logger of the Trainer (TensorBoard, W&B, CSV...). ``extract_log`` / ``influence`` /
``self_influence`` run nnstat's plain logging API over a dataloader with the module's own
``training_step`` as the loss, so their results equal the plain API's.

Example:
    >>> import lightning as L  # doctest: +SKIP
    >>> from nnstat.integrations.lightning import NNStatCallback, extract_log, influence  # doctest: +SKIP
    >>> trainer = L.Trainer(max_epochs=3, callbacks=[NNStatCallback()])  # doctest: +SKIP
    >>> trainer.fit(module, train_loader)  # doctest: +SKIP
    >>> run = extract_log(trainer, module, ordered_train_loader, project="mnist")  # doctest: +SKIP
    >>> result = influence(trainer, module, test_loader, run)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch import Callback
from nnstat.integrations._callback_base import StatsCallbackBase
from nnstat.integrations._hooks import batch_size
from nnstat.integrations._logpass import (
    PassData,
    build_config,
    eval_mode,
    log_pass,
    open_run,
    probe_filter,
    query_log,
    refinement,
)
from torch.utils.data import RandomSampler

from nnstat.influence import Refinement

__all__ = ["NNStatCallback", "extract_log", "influence", "self_influence"]


class NNStatCallback(StatsCallbackBase, Callback):
    """Layer statistics, trust ratios and the noise scale, logged through the Trainer's loggers.

    Measures every ``every`` optimizer steps (default: ``trainer.log_every_n_steps``) and logs
    step ``t``'s statistics with ``logger.log_metrics(metrics, step=t)``, ``t`` being
    ``trainer.global_step`` after that step: the explicit step keeps them at their own step
    on every logger's x-axis even though they reach the loggers later. Nothing is read back
    inside the step: on a GPU they start for the host in one non-blocking copy and are logged
    at a later batch's ``on_before_optimizer_step`` once arrived (checked without waiting,
    while that batch's backward runs on the device), everything left at
    ``on_train_end``. ``history`` keeps every logged dict (with its ``step``) for
    :mod:`nnstat.plot`. The noise scale (the training loss must be a batch mean; set
    ``noise_scale=False`` to skip it) compares, with ``accumulate_grad_batches > 1``, each
    micro-batch's gradient with the accumulated one at every optimizer step (``B_small`` = the
    micro-batch's samples, the first tensor's leading dimension; one multi-tensor norm per
    micro-batch, no per-sample work: `nnstat.NoiseScale.watch_microbatches`), under DDP without
    accumulation each rank's gradient with the all-reduced one (a communication hook on
    ``trainer.strategy.model``: ``B_small`` = the rank's batch, ``B_big`` = that times the
    world size), and otherwise uses per-sample gradient norms (B_small = 1);
    ``noise_scale_method="per_sample"``, ``"micro_batch"`` or ``"ddp"`` forces one (refused
    at the first batch where it cannot work).

    Args:
        stats: statistics per tracked tensor (see ``nnstat.describe``).
        groups: Tracker groups (``weight``, ``grad``, ``optimizer``, ``update``).
        include: regex of parameter names to track; ``None``: all.
        exclude: regex of parameter names to leave out.
        every: log every this many optimizer steps; ``None``: ``trainer.log_every_n_steps``.
        noise_scale: also stream ``noise_scale/b_simple``.
        noise_scale_method: ``"auto"`` (micro-batches under gradient accumulation, else the
            DDP hook under DDP, else per-sample norms), ``"per_sample"``, ``"micro_batch"`` or
            ``"ddp"``.
        noise_scale_beta: EMA factor of the noise-scale averages.
        noise_scale_filter: regex of module names for the noise scale; ``None``: every
            supported module whose parameters are not shared with another module.
        noise_scale_every: measure the noise scale on one micro-batch in this many;
            ``None``: every micro-batch.

    Raises:
        ValueError: ``every`` or ``noise_scale_every`` not a positive int, ``noise_scale_beta``
            outside ``[0, 1)``, an unknown ``noise_scale_method`` or statistic.

    Example:
        >>> cb = NNStatCallback(stats=["l2"], every=10, noise_scale=False)
        >>> cb.options.every
        10
    """

    def _init_state(self) -> None:
        self.history: list[dict[str, Any]] = []
        self._stepped = True
        self._batch_stepped = False  # an optimizer stepped since this batch began
        self._scaler: Any = None  # the AMP GradScaler whose unscale_ is wrapped
        self._merged: Any = None  # the trainer's optimizers as one (several: manual optimization)

    # ---------------------------------------------------------------- loss scaling
    # Under 16-bit AMP Lightning unscales .grad (GradScaler.unscale_) before
    # on_before_optimizer_step, while the micro-batch estimator measured every micro-batch's
    # gradient scaled, in its backward: |.grad|^2 read after the unscale lacks their scale
    # squared (|G|^2 negative, b_simple inf on every step). The step is measured right before
    # the unscale instead, where .grad carries the same scale as its micro-batches.
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        plugin = getattr(trainer, "precision_plugin", None)
        scaler = getattr(plugin, "scaler", None)
        unscale = getattr(scaler, "unscale_", None)
        if not self.options.noise_scale or unscale is None or self._scaler is scaler:
            return
        self._unguard_unscale()
        self._measure_before(scaler, "unscale_")  # .grad as the backwards left it, scaled
        self._scaler = scaler

    def _unguard_unscale(self) -> None:
        scaler, self._scaler = self._scaler, None
        self._unmeasure(scaler, "unscale_")

    def _every(self, trainer: Any) -> int:
        return self.options.every or int(getattr(trainer, "log_every_n_steps", 50) or 50)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int):
        if self.options.noise_scale:
            self.hooks.configure(
                int(getattr(trainer, "accumulate_grad_batches", 1) or 1),
                batch_size(batch),
                int(getattr(trainer, "world_size", 1) or 1),
                wrapped=getattr(getattr(trainer, "strategy", None), "model", None),
                # Lightning divides every loss by accumulate_grad_batches, also in the shorter
                # last step of an epoch (measured on Lightning 2.6)
                fixed_divisor=True,
            )
        if self.options.noise_scale and self._stepped:
            # Lightning clears gradients inside its closure, after the forward pass; the
            # noise scale reads this batch's gradient as .grad after minus .grad before, so the
            # previous step's gradients (which Lightning is about to drop) are dropped now
            pl_module.zero_grad(set_to_none=True)
            self._stepped = False
        self._batch_stepped = False
        self.hooks.begin_batch(pl_module)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self.hooks.end_backward()

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        # earlier steps that have arrived: logged here, where this batch's forward and backward
        # keep the device busy (at the batch's start it idles after Lightning's own log read)
        self._log_ready(trainer)
        self._stepped = True
        if self._batch_stepped:
            # a second optimizer of this batch (manual optimization): the snapshot taken before
            # the batch's first step covers it, so the batch's update is every optimizer's
            # (a snapshot per optimizer made the others' parameters look unchanged)
            return
        self._batch_stepped = True
        optimizers = list(getattr(trainer, "optimizers", None) or [])
        if len(optimizers) > 1:
            if self._merged is None or self._merged.optimizers != optimizers:
                self._merged = Optimizers(optimizers)
            optimizer = self._merged
        log = (trainer.global_step + 1) % self._every(trainer) == 0
        # every backward was reported by on_after_backward: a capture still open saw none
        self.hooks.before_step(pl_module, optimizer, log, measure_open_batch=False)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int):
        self.hooks.after_step(int(trainer.global_step))  # queued, not read
        self._log_ready(trainer)

    def _log_ready(self, trainer: Any) -> None:
        """Log the steps whose statistics are on the host, at their own step (no wait)."""
        for step, metrics in self.hooks.collect():
            self.history.append({**metrics, "step": step})
            for logger in getattr(trainer, "loggers", []) or []:
                logger.log_metrics(metrics, step=step)

    # ---------------------------------------------------------------- checkpoints
    # The noise scale's state (JSON types only: averages, estimator, watched modules, cadence)
    # rides in Lightning's checkpoint as this callback's state, so `fit(ckpt_path=...)`
    # continues it instead of starting afresh.
    def state_dict(self) -> dict[str, Any]:
        state = self.hooks.noise_scale_state() if self.options.noise_scale else None
        return {} if state is None else {"noise_scale": state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.options.noise_scale and "noise_scale" in state_dict:
            self.hooks.restore_noise_scale(state_dict["noise_scale"])

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        try:
            self._unguard_unscale()
            self.hooks.close()  # delivers every step still on its way
        finally:
            self._log_ready(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.on_train_end(trainer, pl_module)


# ------------------------------------------------------------------ influence helpers
@contextmanager
def _quiet_logging(module: Any):
    """``self.log`` inside ``training_step`` outside a fit loop raises in Lightning; the
    logging passes only need the loss."""
    had = {k: k in vars(module) for k in ("log", "log_dict")}
    module.log = lambda *a, **k: None
    module.log_dict = lambda *a, **k: None
    try:
        yield
    finally:
        for k, present in had.items():
            if not present:
                delattr(module, k)


def _default_loss(module: Any) -> Callable[[Any, int], torch.Tensor]:
    def loss(batch: Any, batch_idx: int) -> torch.Tensor:
        out = module.training_step(batch, batch_idx)
        if isinstance(out, Mapping):
            out = out.get("loss")
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                "training_step must return the loss (or a dict with 'loss') for the logging "
                f"pass; got {type(out).__name__}. Pass loss_fn=... instead."
            )
        return out

    return loss


class _DeviceBatches:
    """Re-iterable view of a dataloader moving each batch to the module's device lazily (one
    batch in memory at a time) and remembering its index for ``training_step``."""

    def __init__(self, module: Any, dataloader: Any) -> None:
        self.module, self.dataloader, self.index = module, dataloader, 0

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self) -> Any:
        for i, batch in enumerate(self.dataloader):
            self.index = i
            yield self.module.transfer_batch_to_device(batch, self.module.device, 0)


def _prepared(
    module: Any,
    dataloader: Any,
    loss_fn: Callable[[Any, int], torch.Tensor] | None,
    ids_fn: Any,
) -> tuple[_DeviceBatches, Callable[[Any], torch.Tensor]]:
    if ids_fn is None and isinstance(getattr(dataloader, "sampler", None), RandomSampler):
        raise ValueError(
            "the dataloader shuffles, so batch positions do not name dataset rows: pass a "
            "non-shuffled dataloader (shuffle=False) or ids_fn=lambda batch, start: [...]"
        )
    fn = loss_fn or _default_loss(module)
    batches = _DeviceBatches(module, dataloader)

    def loss(batch: Any) -> torch.Tensor:
        return fn(batch, batches.index)

    return batches, loss


def extract_log(
    trainer: Any,
    module: Any,
    dataloader: Any,
    *,
    project: str = "nnstat",
    root_dir: str = "./nnstat_logs",
    config: Mapping[str, Any] | str | None = None,
    rank: int | None = 64,
    ekfac: bool | None = None,
    init: str = "random",
    seed: int = 0,
    name_filter: Any = None,
    type_filter: Any = None,
    loss_fn: Callable[[Any, int], torch.Tensor] | None = None,
    loss_reduction: str = "mean",
    ids_fn: Callable[[Any, int], Any] | None = None,
    progress: bool | None = None,
    overwrite: bool = False,
) -> Any:
    """Log projected per-sample gradients of ``dataloader`` (and the statistics the config
    asks for: EK-FAC by default) with ``module``; returns the :class:`nnstat.Run`.

    The loss is ``module.training_step(batch, batch_idx)`` (or ``loss_fn(batch, batch_idx)``),
    a batch **mean** by default (``loss_reduction="mean"``). Ids are dataset positions (the
    dataloader must not shuffle) unless ``ids_fn(batch, start)`` gives them. ``rank=None``
    stores full per-sample gradients. ``overwrite=True`` replaces a store logged from other
    weights (it is refused otherwise). ``trainer`` is accepted for symmetry with Lightning's
    API and may be ``None``.

    Args:
        trainer: the Lightning Trainer (or ``None``).
        module: the ``LightningModule``.
        dataloader: the training data, not shuffled (ids are positions unless ``ids_fn``).
        project: store directory name under ``root_dir``.
        root_dir: parent directory of stores.
        config: ``nnstat.setup`` dictionary or statistic preset name.
        rank: projection rank per side; ``None``: full per-sample gradients.
        ekfac: ``None``: EK-FAC unless ``config`` names a statistic; ``True`` forces it.
        init: ``"random"`` or ``"pca"`` projections.
        seed: seed of the random projections.
        name_filter: regex of module names to watch.
        type_filter: module classes to watch.
        loss_fn: ``loss_fn(batch, batch_idx)``; ``None``: ``module.training_step``.
        loss_reduction: ``"mean"`` or ``"sum"``, how the loss reduces the batch.
        ids_fn: ``ids_fn(batch, start)`` giving the batch's data ids.
        progress: tqdm bars (``None``: automatic).
        overwrite: replace a store logged from other weights.

    Returns:
        The :class:`nnstat.Run` that logged the store.

    Raises:
        ValueError: an invalid configuration, or a store of other weights without
            ``overwrite``.

    Example:
        >>> run = extract_log(trainer, module, train_loader, project="p")  # doctest: +SKIP
    """
    del trainer  # the passes run outside the fit loop; only the module is needed
    cfg = build_config(config, ekfac=ekfac, loss_reduction=loss_reduction)
    batches, loss = _prepared(module, dataloader, loss_fn, ids_fn)
    first = next(iter(batches), None)
    if first is None:
        raise ValueError("the dataloader is empty")
    with _quiet_logging(module):
        names = probe_filter(module, first, loss, name_filter, type_filter)
        run = open_run(
            module,
            project,
            root_dir,
            cfg,
            rank=rank,
            init=init,
            seed=seed,
            name_filter=names,
            type_filter=type_filter,
            overwrite=overwrite,
        )
        log_pass(run, PassData(module, batches, loss, ids_fn=ids_fn, progress=progress))
    return run


def _query(run: Any, module: Any, dataloader: Any, loss_fn: Any, ids_fn: Any, progress: Any):
    batches, loss = _prepared(module, dataloader, loss_fn, ids_fn)
    with _quiet_logging(module):
        return query_log(run, PassData(module, batches, loss, ids_fn=ids_fn, progress=progress))


def _refinement(refine, run, module, train_dataloader, query_dataloader, loss_fn, progress):
    if refine is None:
        return None
    if train_dataloader is None and not isinstance(refine, Refinement):
        raise ValueError("refine= needs train_dataloader=... (the data the store was logged from)")
    if isinstance(refine, Refinement):
        return refine
    train_batches, train_loss = _prepared(module, train_dataloader, loss_fn, None)
    train = PassData(module, train_batches, train_loss, progress=progress)
    query = None
    if query_dataloader is not None:
        q_batches, q_loss = _prepared(module, query_dataloader, loss_fn, None)
        query = PassData(module, q_batches, q_loss, progress=progress)
    return refinement(refine, train, query, run.config.loss_reduction)


def influence(
    trainer: Any,
    module: Any,
    query_dataloader: Any,
    run: Any,
    *,
    mode: str = "dot",
    preconditioner: str | None = None,
    damping: float | None = None,
    top_k: int | None = None,
    loss_fn: Callable[[Any, int], torch.Tensor] | None = None,
    ids_fn: Callable[[Any, int], Any] | None = None,
    progress: bool | None = None,
    refine: int | Refinement | None = None,
    train_dataloader: Any = None,
) -> Any:
    """Influence of every logged training example on every query of ``query_dataloader``
    (``InfluenceResult``, or ``TopKInfluence`` with ``top_k``); ``run`` is what
    :func:`extract_log` returned. ``refine=5`` refines the scores with 5 conjugate-gradient
    steps on the Gauss-Newton curvature of the module's loss over ``train_dataloader`` (the
    unshuffled data the store was logged from), or pass a `nnstat.influence.Refinement`.

    Args:
        trainer: the Lightning Trainer (or ``None``).
        module: the ``LightningModule`` at the weights the store was logged with.
        query_dataloader: the query data.
        run: the :class:`nnstat.Run` :func:`extract_log` returned.
        mode: score mode (``"dot"``, ``"cosine"``, ``"l2"``, ``"relatif"``).
        preconditioner: ``None`` (the store's default), ``"identity"``, ``"raw"``,
            ``"kfac"`` or ``"ekfac"``.
        damping: preconditioner damping; ``None``: its default rule.
        top_k: keep the ``top_k`` best training examples per query.
        loss_fn: ``loss_fn(batch, batch_idx)``; ``None``: ``module.training_step``.
        ids_fn: ``ids_fn(batch, start)`` giving the queries' ids.
        progress: tqdm bars (``None``: automatic).
        refine: refinement steps, or a `nnstat.influence.Refinement`.
        train_dataloader: the training data, for ``refine``.

    Returns:
        An ``InfluenceResult`` (``TopKInfluence`` with ``top_k``).

    Raises:
        ValueError: queries from other weights than the store's, or invalid options.

    Example:
        >>> result = influence(trainer, module, test_loader, run, top_k=5)  # doctest: +SKIP
    """
    from nnstat.influence import compute_influence_all

    del trainer
    log = _query(run, module, query_dataloader, loss_fn, ids_fn, progress)
    with _quiet_logging(module), eval_mode(module):
        refined = _refinement(
            refine, run, module, train_dataloader, query_dataloader, loss_fn, progress
        )
        return compute_influence_all(
            log,
            run.path,
            mode=mode,
            preconditioner=preconditioner,
            damping=damping,
            top_k=top_k,
            progress=progress,
            refine=refined,
        )


def self_influence(
    trainer: Any,
    module: Any,
    run: Any,
    dataloader: Any = None,
    *,
    preconditioner: str | None = None,
    damping: float | None = None,
    loss_fn: Callable[[Any, int], torch.Tensor] | None = None,
    ids_fn: Callable[[Any, int], Any] | None = None,
    progress: bool | None = None,
    refine: int | Refinement | None = None,
    train_dataloader: Any = None,
) -> Any:
    """Self-influence of each logged training example (``dataloader=None``) or of each example
    of ``dataloader`` (``SelfInfluenceResult``); ``refine`` as in :func:`influence`.

    Args:
        trainer: the Lightning Trainer (or ``None``).
        module: the ``LightningModule``.
        run: the :class:`nnstat.Run` :func:`extract_log` returned.
        dataloader: examples to score; ``None``: the logged training examples.
        preconditioner: as in :func:`influence`.
        damping: as in :func:`influence`.
        loss_fn: ``loss_fn(batch, batch_idx)``; ``None``: ``module.training_step``.
        ids_fn: ``ids_fn(batch, start)`` giving the examples' ids.
        progress: tqdm bars (``None``: automatic).
        refine: refinement steps, or a `nnstat.influence.Refinement`.
        train_dataloader: the training data, for ``refine``.

    Returns:
        A ``SelfInfluenceResult``.

    Raises:
        ValueError: invalid options, or data from other weights than the store's.

    Example:
        >>> self_influence(trainer, module, run).scores.shape  # doctest: +SKIP
    """
    from nnstat.influence import compute_self_influence

    del trainer
    options = {"preconditioner": preconditioner, "damping": damping, "progress": progress}
    with _quiet_logging(module), eval_mode(module):
        queries = train_dataloader if dataloader is None else dataloader
        refined = _refinement(refine, run, module, train_dataloader, queries, loss_fn, progress)
        if dataloader is None:
            return compute_self_influence(run.path, refine=refined, **options)
    log = _query(run, module, dataloader, loss_fn, ids_fn, progress)
    with _quiet_logging(module), eval_mode(module):
        return compute_self_influence(log, run.path, refine=refined, **options)


class Optimizers:
    """Several optimizers as one for the Tracker (a GAN's generator and discriminator under
    manual optimization): their per-parameter states and parameter groups together, so one
    Tracker logs every optimizer's states and the batch's update of every parameter.

    Example:
        >>> a, b = torch.nn.Linear(2, 1), torch.nn.Linear(1, 1)
        >>> both = Optimizers([torch.optim.SGD(a.parameters()), torch.optim.Adam(b.parameters())])
        >>> len(both.param_groups)
        2
    """

    def __init__(self, optimizers: list[Any]) -> None:
        self.optimizers = optimizers

    @property
    def state(self) -> Mapping[Any, Any]:
        """Every optimizer's ``state`` as one read-only mapping (parameter -> its state)."""
        return _States([opt.state for opt in self.optimizers])

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every optimizer's parameter groups, in order."""
        return [g for opt in self.optimizers for g in opt.param_groups]


class _States(Mapping):
    """Read-only view of several ``optimizer.state`` dicts. Looked up with ``in`` first: a
    torch optimizer's state is a ``defaultdict``, which a plain ``[]`` (a ``ChainMap``'s
    lookup) would fill with an empty state for the other optimizers' parameters."""

    def __init__(self, states: list[Mapping[Any, Any]]) -> None:
        self._states = states

    def __getitem__(self, key: Any) -> Any:
        for state in self._states:
            if key in state:
                return state[key]
        raise KeyError(key)

    def __iter__(self) -> Iterator[Any]:
        for state in self._states:
            yield from state

    def __len__(self) -> int:
        return sum(len(state) for state in self._states)
