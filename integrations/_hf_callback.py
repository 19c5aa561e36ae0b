"""The HuggingFace Trainer callback (re-exported by :mod:`nnstat.integrations.huggingface`).

Example:
    >>> from nnstat.integrations.huggingface import NNStatCallback  # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from nnstat.integrations._callback_base import StatsCallbackBase
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler

__all__ = ["NNStatCallback", "watch_trainer", "NOISE_SCALE_EVERY"]

#: Default cadence of the callback's noise scale: per-sample norms on one micro-batch in this
#: many. Measured every step they cost most of the callback's overhead on GPT-2 (the capture
#: runs inside backward: 1.12-1.14x a plain Trainer); every 8th keeps the callback within 1.05x
#: (docs/benchmarks.md, "HuggingFace callback overhead") while the EMA still sees an unbiased
#: observation every 8 steps. ``noise_scale_every=1`` measures every micro-batch.
NOISE_SCALE_EVERY = 8


def _printer_classes() -> tuple[type, ...]:
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    classes: list[type] = [PrinterCallback, ProgressCallback]
    try:
        from transformers.utils.notebook import NotebookProgressCallback

        classes.append(NotebookProgressCallback)
    except ImportError:  # pragma: no cover - notebook extras missing
        pass
    return tuple(classes)


class _HideFromConsole(TrainerCallback):
    """Placed around the console printer (``ProgressCallback``/``PrinterCallback``): the one
    before it takes nnstat's keys out of the log dict, so the console does not print hundreds
    of layer statistics, and the one after it puts them back, so every later callback (a
    user's ``on_log``) sees them."""

    def __init__(self, owner: NNStatCallback, restore: bool) -> None:
        self.owner, self.restore = owner, restore

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any):
        if logs is None:
            return
        if self.restore:
            logs.update(self.owner._hidden)
            self.owner._hidden = {}
        else:
            self.owner._hidden = {k: logs.pop(k) for k in self.owner._injected if k in logs}


class NNStatCallback(StatsCallbackBase, TrainerCallback):
    """Layer statistics, trust ratios and the noise scale on the Trainer's logging steps.

    Keys are the Tracker's (``weight/<param>/<stat>``, ``grad/...``, ``exp_avg/...``,
    ``update/...``, ``trust_ratio/<param>``) plus ``noise_scale/b_simple`` etc.; W&B and TensorBoard show them
    under ``train/`` as they do with every training log. The update and trust ratio of a logged step
    are those of that single optimizer step.

    **Which step they belong to.** The statistics of optimizer step ``t`` go into the Trainer's
    own log of step ``t`` (``on_log`` at ``state.global_step == t``), never a later one: HF's
    reporters write every key of that log at ``state.global_step`` (W&B's
    ``train/global_step``, TensorBoard's ``global_step``), so they line up with the loss and
    learning rate of the same step on the x-axis users already plot, with no extra step key.
    With ``every=k`` off the Trainer's ``logging_steps`` the callback asks the Trainer to log
    those steps too (``control.should_log``). A measured step that the Trainer still did not log
    (a Trainer subclass skipping it) goes into ``state.log_history`` at its own step, with a
    warning, rather than into a later log under the wrong step.

    **No host synchronisation of its own.** ``on_pre_optimizer_step`` takes the update snapshot
    (one multi-tensor copy) and ``on_optimizer_step`` queues the statistics (on a GPU they start
    for the host in one non-blocking copy); neither reads anything back. Before ``on_log`` the
    Trainer reads its loss back (``tr_loss.item()``), which waits for all work queued before it,
    that copy included, so ``on_log`` finds it on the host (it waits only where a framework
    logged without such a read). Non-logging steps launch no kernel and read nothing (the noise
    scale's capture runs on its own cadence, below).

    **The noise scale's estimator** (``noise_scale_method``). With gradient accumulation
    (``gradient_accumulation_steps > 1``) the default (``"auto"``) compares each micro-batch's
    gradient (``B_small = per_device_train_batch_size``) with the accumulated one (``B_big`` =
    that times the accumulation steps and the world size) at every optimizer step: one
    multi-tensor norm per micro-batch, nothing read back, no per-sample work
    (`nnstat.NoiseScale.watch_microbatches`). Under DDP without accumulation it compares each
    rank's gradient (``B_small = per_device_train_batch_size``, taken by a communication hook on
    ``trainer.model_wrapped`` before the all-reduce) with the all-reduced one (``B_big`` = that
    times the world size) at every optimizer step: one norm per bucket, nothing read back. On
    one process without accumulation it uses per-sample gradient
    norms (B_small = 1) of one micro-batch in ``noise_scale_every`` (default
    `NOISE_SCALE_EVERY` = 8: the per-sample capture runs inside backward and is the expensive
    part; ``1`` measures every micro-batch), starting with the first micro-batch after the one
    that probes which modules qualify. All estimate the same ``B_simple``; force one with
    ``noise_scale_method="per_sample"``, ``"micro_batch"`` or ``"ddp"`` (one that cannot work
    in the run's setting is refused at ``on_train_begin``). Each assumes the model's loss
    is a mean over the batch (the HF default). Set ``noise_scale=False`` to skip it.

    Args:
        stats: statistics per tracked tensor (see ``nnstat.describe``).
        groups: Tracker groups (``weight``, ``grad``, ``optimizer``, ``update``).
        include: regex of parameter names to track; ``None``: all.
        exclude: regex of parameter names to leave out.
        every: log every this many optimizer steps; ``None``: ``TrainingArguments.logging_steps``.
        noise_scale: also stream ``noise_scale/b_simple``.
        noise_scale_method: ``"auto"``, ``"per_sample"``, ``"micro_batch"`` or ``"ddp"``
            (above).
        noise_scale_beta: EMA factor of the noise-scale averages.
        noise_scale_filter: regex of module names for the noise scale; ``None``: every
            supported module whose parameters are not shared with another module.
        noise_scale_every: measure the noise scale on one micro-batch in this many;
            ``None``: `NOISE_SCALE_EVERY` (8).
        noise_scale_window: a sliding mean over this many noise-scale observations with a
            bootstrap interval (``noise_scale/low`` and ``/high``); ``None``: the EMA alone (window >= 2).

    Raises:
        ValueError: ``every`` or ``noise_scale_every`` not a positive int, ``noise_scale_beta``
            outside ``[0, 1)``, an unknown ``noise_scale_method`` or statistic.

    Example:
        >>> cb = NNStatCallback(stats=["l2", "rms"], noise_scale=False)
        >>> cb.options.stats, cb.options.noise_scale_every
        (['l2', 'rms'], 8)
        >>> NNStatCallback(noise_scale_every=1).options.noise_scale_every
        1
    """

    # the shared base defaults to every micro-batch (Lightning); HF models are sequence models,
    # where that costs ~12% of the step, hence this callback's own default
    default_noise_scale_every = NOISE_SCALE_EVERY

    def _init_state(self) -> None:
        # measure the first micro-batch after the probe, then one in k (micro-batches 1, 1 + k,
        # ... after it): the noise-scale keys are in the logs from the first logging step on
        # instead of appearing only after k steps (a short run would have none)
        self.hooks._micro = self.options.noise_scale_every - 1
        #: the metrics of the last logged step handed to the Trainer
        self.latest: dict[str, Any] = {}
        self._measured: int | None = None  # the step whose statistics are queued
        self._injected: list[str] = []  # the keys this callback put into the last log
        self._hidden: dict[str, Any] = {}  # ... taken out while the console printer runs
        self._placed = False
        self._warned_unlogged = False
        self._warned_clipped = False
        self._trainer: Any = None  # set by watch_trainer; else found on the stack
        self._guarded: Any = None  # the accelerator whose clip_grad_norm_ is wrapped
        self._sizer: Any = None  # the forward pre-hook noting each micro-batch's size

    # ---------------------------------------------------------------- placement
    def place(self, handler: CallbackHandler) -> None:
        """Put this callback right before the reporting callbacks, so the reporters see
        nnstat's keys in the very log dict they write, and hide them from the console printer
        only (every other callback, a user's ``on_log`` included, sees them)."""
        # a new list, not an in-place edit: this may run inside the handler's loop over the
        # old list, which must go on visiting every callback exactly once
        callbacks = [
            c for c in handler.callbacks if c is not self and not isinstance(c, _HideFromConsole)
        ]
        # first after the Trainer's flow control: before the reporters and every callback
        # that reads the logs (a user's, JsonlCallback), with or without reporters
        from transformers.trainer_callback import DefaultFlowCallback

        at = next(
            (i for i, c in enumerate(callbacks) if not isinstance(c, DefaultFlowCallback)),
            len(callbacks),
        )
        callbacks.insert(at, self)
        printers = _printer_classes()
        placed: list[Any] = []
        for c in callbacks:
            printer = isinstance(c, printers)
            if printer:
                placed.append(_HideFromConsole(self, restore=False))
            placed.append(c)
            if printer:
                placed.append(_HideFromConsole(self, restore=True))
        handler.callbacks = placed
        self._placed = True

    def _place_from_caller(self) -> None:
        # Callbacks given to Trainer(callbacks=[...]) come after the reporters, whose on_log
        # would then run before ours. The handler dispatching this event is our caller's
        # `self`; it is found on the stack (HF's CallbackHandler.call_event).
        handler = _on_stack(lambda o: isinstance(o, CallbackHandler) and self in o.callbacks)
        if handler is not None:
            self.place(handler)
            return
        warnings.warn(
            "NNStatCallback could not find the Trainer's callback handler; use "
            "watch_trainer(trainer) so the reporters receive nnstat's metrics "
            "(they stay available in trainer.state.log_history)",
            stacklevel=3,
        )

    # ---------------------------------------------------------------- clipping
    # The Trainer clips the gradients (max_grad_norm=1.0 by default) between the last backward
    # and on_pre_optimizer_step. The noise scale's batch gradient is read from .grad and its
    # per-sample norms were captured during backward: read after the clip, |G|^2 comes out
    # scaled by the clip factor squared (often negative, B_simple inf). The capture therefore
    # closes right before the Trainer's clip, inside `accelerator.clip_grad_norm_`.
    def _guard_clipping(self, trainer: Any) -> None:
        accelerator = getattr(trainer, "accelerator", None)
        if self._measure_before(accelerator, "clip_grad_norm_"):
            self._guarded = accelerator

    def _unguard_clipping(self) -> None:
        accelerator, self._guarded = self._guarded, None
        self._unmeasure(accelerator, "clip_grad_norm_")

    def _warn_clipped(self) -> None:
        if not self._warned_clipped:
            self._warned_clipped = True
            warnings.warn(
                "NNStatCallback: the Trainer clipped the gradients (max_grad_norm > 0) before "
                "the noise scale could read them (no accelerator.clip_grad_norm_ to close its "
                "capture first), so these micro-batches are left out of the noise scale; use "
                "watch_trainer(trainer), or TrainingArguments(max_grad_norm=0) (warned once)",
                stacklevel=3,
            )

    # ---------------------------------------------------------------- events
    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self._placed:
            self._place_from_caller()
        trainer = self._trainer or _on_stack(_is_trainer)
        self.hooks.configure(
            int(getattr(args, "gradient_accumulation_steps", 1) or 1),
            getattr(args, "per_device_train_batch_size", None),
            int(getattr(args, "world_size", 1) or 1),
            # the model as the Trainer wrapped it for training (DDP), before this event
            wrapped=getattr(trainer, "model_wrapped", None),
            accumulation="items" if _scales_for_accumulation(trainer) else "mean",
            label_items=_label_items(args, trainer),
        )
        if self.options.noise_scale and trainer is not None:
            self._guard_clipping(trainer)
        if self.options.noise_scale and state.global_step > 0:
            self._resume_noise_scale(args, state)
        model = kwargs.get("model")
        measured_per_batch = self.hooks.method in ("micro_batch", "ddp")
        if measured_per_batch and model is not None and self._sizer is None:
            # the Trainer's events carry no batch: each training forward says its size (a
            # smaller last micro-batch, or a rank's smaller last batch, is measured at its size)
            self._sizer = model.register_forward_pre_hook(self._note_batch, with_kwargs=True)

    # ---------------------------------------------------------------- checkpoints
    # The noise scale's averages go into each checkpoint the Trainer saves (a JSON file per
    # process, `_noise_checkpoint`), and come back when training resumes from one, so that a
    # resumed run's estimate is the uninterrupted run's.
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        saved = self.hooks.noise_scale_state() if self.options.noise_scale else None
        if saved is None:
            return
        from nnstat.integrations._noise_checkpoint import save_state
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        world = int(getattr(args, "world_size", 1) or 1)
        save_state(folder, saved, state.global_step, int(args.process_index), world)

    def _resume_noise_scale(self, args: Any, state: Any) -> None:
        from nnstat.integrations._noise_checkpoint import load_state
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        # the folder the Trainer resumes from: its training loop's argument, else the
        # output folder's checkpoint of the restored step
        folder = _on_stack_local("resume_from_checkpoint") or os.path.join(
            args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        )
        world = int(getattr(args, "world_size", 1) or 1)
        saved = load_state(folder, state.global_step, int(args.process_index), world)
        if saved is not None:
            self.hooks.restore_noise_scale(saved)

    def _note_batch(self, module: Any, args: tuple, kwargs: dict) -> None:
        if module.training and torch.is_grad_enabled():
            self.hooks.note_batch((args, kwargs))

    # The Trainer calls model.train() inside training_step, after these events: after an
    # evaluation between steps the model is still in eval mode here, yet the batch trains
    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        if model is not None:
            self.hooks.begin_batch(model, training=True)

    def on_substep_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
        # gradient accumulation: one noise-scale observation per micro-batch
        self.hooks.end_backward()
        if model is not None:
            self.hooks.begin_batch(model, training=True)

    def _logs_step(self, args: Any, state: Any, step: int) -> bool:
        if self.options.every is not None:
            return step % self.options.every == 0
        strategy = str(getattr(args.logging_strategy, "value", args.logging_strategy))
        if strategy != "steps":
            return False
        every = state.logging_steps or args.logging_steps
        return step % int(every) == 0 or (step == 1 and bool(args.logging_first_step))

    def on_pre_optimizer_step(
        self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kw
    ) -> None:
        log = model is not None and self._logs_step(args, state, state.global_step + 1)
        # a capture still open here missed the Trainer's clip (.grad is clipped now, the
        # per-sample norms are not): left out; the module probe reads no .grad and closes
        after_clip = float(getattr(args, "max_grad_norm", 0) or 0) > 0 and self.hooks.capture_open
        if after_clip:
            self._warn_clipped()
        self.hooks.before_step(
            model, optimizer, log, measure_open_batch=not after_clip, clipped=after_clip
        )

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        # queued, not read: the Trainer increments global_step right after this event
        if self.hooks.after_step(state.global_step + 1) is not None:
            self._measured = state.global_step + 1

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> Any:
        if self._measured == state.global_step:
            control.should_log = True  # `every` off logging_steps: the Trainer logs it too
            return control
        return None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kw: Any):
        if logs is None or "loss" not in logs:
            return  # only training logs carry the statistics (not eval/final summaries)
        # the Trainer has just read its loss back: a step measured now is on the host
        self._hand_over(state, logs, wait=self._measured == state.global_step)

    def _hand_over(self, state: Any, logs: dict | None, wait: bool) -> None:
        """Put the delivered steps' metrics into the log of their own step (``logs`` when it is
        that step's), else into ``state.log_history`` at their step."""
        for step, metrics in self.hooks.collect(wait=wait):
            self.latest = metrics
            if step == self._measured:
                self._measured = None
            if logs is None or step != state.global_step:
                self._unlogged(state, step, metrics)
                continue
            fresh = [k for k in metrics if k not in logs]
            logs.update({k: metrics[k] for k in fresh})
            self._injected = fresh
            if state.log_history and state.log_history[-1].get("step") == step:
                state.log_history[-1].update({k: metrics[k] for k in fresh})

    def _unlogged(self, state: Any, step: int, metrics: dict[str, Any]) -> None:
        history = state.log_history
        at = len(history)
        while at and history[at - 1].get("step", -1) > step:
            at -= 1
        history.insert(at, {**metrics, "step": step})
        if not self._warned_unlogged:
            self._warned_unlogged = True
            warnings.warn(
                f"NNStatCallback: the Trainer did not log step {step}, whose statistics were "
                "measured: they are in trainer.state.log_history at that step but not sent to "
                "the reporters, which log at the Trainer's own logging steps (warned once)",
                stacklevel=2,
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._unguard_clipping()
        if self._sizer is not None:
            self._sizer.remove()
            self._sizer = None
        try:
            self.hooks.close()  # delivers every step still on its way
        finally:
            self._hand_over(state, None, wait=True)


def _scales_for_accumulation(trainer: Any) -> bool:
    """Whether the Trainer divides each micro-batch's summed loss by the step's items
    (``num_items_in_batch``: a model that takes loss kwargs, or a ``compute_loss_func``)
    rather than its mean loss by the accumulation steps; the two differ for unequal
    micro-batches (`nnstat.NoiseScale.watch_microbatches`'s ``"items"`` and ``"mean"``)."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is not None:
        return bool(scaled)
    return bool(getattr(trainer, "model_accepts_loss_kwargs", False)) or (
        getattr(trainer, "compute_loss_func", None) is not None
    )


def _label_items(args: Any, trainer: Any) -> str | None:
    """How the Trainer counts the label tokens when each rank's loss is their sum divided by
    the global count times the world size (``average_tokens_across_devices`` with
    ``num_items_in_batch``): the DDP noise scale then weighs each rank by its count."""
    if not (
        getattr(args, "average_tokens_across_devices", False) and _scales_for_accumulation(trainer)
    ):
        return None
    return "shifted" if _shifts_labels(trainer) else "all"


def _shifts_labels(trainer: Any) -> bool:
    """Whether the model's loss sums the labels after the first position (a causal LM): the
    items it sums, whatever the Trainer divides by (a GPT-2 whose ``loss_type`` is unset is
    counted over every label by some Trainer versions; that only scales every rank alike)."""
    if getattr(trainer, "_loss_shifts_labels", False):
        return True
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # an older transformers: no loss mapping to look at
        return False
    model = getattr(trainer, "model", None)
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):  # its labels are not shifted
        return False
    return getattr(type(model), "loss_function", None) is not None and (
        getattr(model, "loss_function", None) is ForCausalLMLoss
    )


def watch_trainer(
    trainer: Any, callback: NNStatCallback | None = None, **kwargs: Any
) -> NNStatCallback:
    """Add an :class:`NNStatCallback` to ``trainer`` in the right place (before the reporters).

    Args:
        trainer: a ``transformers.Trainer``.
        callback: the callback to add; ``None``: a new one built from ``kwargs``.
        **kwargs: the options of a new :class:`NNStatCallback`.

    Returns:
        The callback added.

    Raises:
        ValueError: both ``callback`` and ``kwargs``.

    Example:
        >>> cb = watch_trainer(trainer, stats=["l2"])  # doctest: +SKIP
    """
    if callback is None:
        callback = NNStatCallback(**kwargs)
    elif kwargs:
        raise ValueError(f"pass either a callback or its options, not both: {list(kwargs)}")
    callback.place(trainer.callback_handler)
    callback._trainer = trainer
    return callback


def _is_trainer(obj: Any) -> bool:
    from transformers import Trainer

    return isinstance(obj, Trainer)


def _on_stack_local(name: str, depth: int = 8) -> str | None:
    """The first callers' local variable ``name`` that is a path to a folder (the Trainer's
    training loop's ``resume_from_checkpoint``, resolved from ``True`` to the last one)."""
    return _first_on_stack(
        lambda f: v if isinstance(v := f.f_locals.get(name), str) and os.path.isdir(v) else None,
        depth,
    )


def _on_stack(match: Any, depth: int = 8) -> Any:
    """The first ``self`` of the callers' frames (above this callback's own) that ``match``
    accepts: HF's CallbackHandler dispatching the event, the Trainer running the loop."""
    return _first_on_stack(
        lambda f: o if (o := f.f_locals.get("self")) is not None and match(o) else None, depth
    )


def _first_on_stack(pick: Any, depth: int) -> Any:
    """The first value ``pick(frame)`` gives that is not ``None``, over the ``depth`` frames
    above the callback method that called `_on_stack` or `_on_stack_local`."""
    frame = sys._getframe(3)  # 0: here, 1: _on_stack*, 2: the callback's method, 3: its caller
    for _ in range(depth):
        if frame is None:
            return None
        found = pick(frame)
        if found is not None:
            return found
        frame = frame.f_back
    return None
