"""Framework-neutral driver behind the HuggingFace and Lightning callbacks.

A training framework calls, per optimizer step: ``begin_batch`` (before forward), ``end_backward``
(after each backward), ``before_step`` (gradients final, weights not yet updated) and
``after_step`` (weights updated, gradients still there). Statistics are measured only on the
steps the framework logs, by ONE `nnstat.Tracker` kept for the whole run: ``before_step`` of a
logging step takes its update snapshot (`Tracker.snapshot`, one multi-tensor copy), so the
update and trust ratio describe that one step, not the whole logging interval. Nothing is read
back inside the step: ``after_step`` queues the statistics (on a GPU they reach the host in one
non-blocking copy) and `StepStats.collect` hands over the steps that have arrived, each with its
own step number; non-logging steps launch no kernel and read nothing.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> hooks = StepStats(StatsOptions(noise_scale=False))
    >>> hooks.before_step(model, opt, log=True)
    >>> model(torch.ones(2, 3)).sum().backward(); opt.step()
    >>> _ = hooks.after_step(step=1)
    >>> [(step, "trust_ratio/0.weight" in m) for step, m in hooks.collect(wait=True)]
    [(1, True)]
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from nnstat.integrations._noise_checkpoint import restore_into
from nnstat.integrations._noise_method import check_method, choose_method
from nnstat.integrations._probe import ModuleProbe
from torch import nn

__all__ = ["StatsOptions", "StepStats", "batch_size"]


@dataclass
class StatsOptions:
    """What the training callbacks measure.

    Attributes:
        stats: statistics per tracked tensor (see ``nnstat.describe``; default ``l2, rms, abs_max,
            nonfinite``).
        groups: Tracker groups (``weight``, ``grad``, ``optimizer``, ``update``).
        include / exclude: regexes on parameter names.
        every: log every this many optimizer steps; ``None`` follows the framework's own
            logging interval.
        noise_scale: stream ``noise_scale/b_simple``, reported on logging steps. The training
            loss must be a mean over the batch.
        noise_scale_method: how: ``"per_sample"`` (per-sample gradient norms, B_small = 1, on
            one micro-batch in ``noise_scale_every``), ``"micro_batch"`` (gradient
            accumulation's micro-batches against their sum, every step: one multi-tensor norm
            per micro-batch, no per-sample work; needs 2 or more micro-batches per step),
            ``"ddp"`` (each rank's gradient against the all-reduced one, from a DDP
            communication hook: one norm per bucket, no per-sample work; needs DDP on 2 or
            more processes) or ``"auto"`` (the default): ``"micro_batch"`` where the framework
            accumulates gradients, else ``"ddp"`` under DDP, else ``"per_sample"`` (see
            ``nnstat.integrations._noise_method``).
        noise_scale_beta: EMA factor of the noise-scale averages.
        noise_scale_window: average the last this many observations instead (a sliding mean,
            in place of the EMA), which also logs a 95% bootstrap interval of ``b_simple`` as
            ``noise_scale/low`` and ``noise_scale/high`` from the second observation on.
        noise_scale_every: measure the noise scale on one micro-batch in this many (per-sample
            norms cost a few forward-backward fractions on sequence models; the EMA just sees
            fewer, equally unbiased observations).
        noise_scale_filter: regex of module names for the noise scale (default: every
            supported module whose parameters are not shared with another module).
    """

    stats: Sequence[str] | str | None = ("l2", "rms", "abs_max", "nonfinite")
    groups: Sequence[str] = ("weight", "grad", "optimizer", "update")
    include: str | None = None
    exclude: str | None = None
    every: int | None = None
    noise_scale: bool = True
    noise_scale_method: str = "auto"
    noise_scale_beta: float = 0.9
    noise_scale_filter: str | None = None
    noise_scale_every: int = 1
    noise_scale_window: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.noise_scale_every, int) or self.noise_scale_every < 1:
            raise ValueError(
                f"noise_scale_every must be a positive int, got {self.noise_scale_every!r}"
            )
        if self.every is not None and (not isinstance(self.every, int) or self.every < 1):
            raise ValueError(f"every must be a positive int or None, got {self.every!r}")
        window = self.noise_scale_window
        if window is not None and (not isinstance(window, int) or window < 2):
            raise ValueError(f"noise_scale_window must be an int >= 2 or None, got {window!r}")
        if not 0.0 <= self.noise_scale_beta < 1.0:
            raise ValueError(f"noise_scale_beta must be in [0, 1), got {self.noise_scale_beta}")
        check_method(self.noise_scale_method)


class _Abandoned(Exception):
    """Unwinds a capture block that is closed without being measured."""


class StepStats:
    """Tracker statistics and a streaming noise scale driven by framework hooks.

    One Tracker serves the whole run (rebuilt only when the model or optimizer object changes);
    the noise scale reaches it as a provider, so a logged step carries its value as of that
    step without waiting for the noise scale's own copy. Delivered steps wait in `collect`.

    Example:
        >>> hooks = StepStats(StatsOptions(noise_scale=False, groups=["weight"]))
        >>> hooks.before_step(torch.nn.Linear(2, 1), None, log=True)
        >>> hooks.after_step()["weight/bias/l2"] >= 0
        True
    """

    def __init__(self, options: StatsOptions | None = None) -> None:
        self.options = options or StatsOptions()
        self.gns: Any = None
        self._gns_model: nn.Module | None = None
        self._gns_ctx: Any = None
        #: modules left out of the noise scale, with the reason
        self.excluded: dict[str, str] = {}
        self._micro = 0
        #: the noise scale's estimator: "per_sample", "micro_batch" or "ddp" (`configure`
        #: resolves "auto")
        self.method = {"auto": "per_sample"}.get(method := self.options.noise_scale_method, method)
        self._micro_feed: Any = None  # MicroBatchNorms of the micro_batch method
        self._ddp: Any = None  # the DistributedDataParallel model, for the ddp method
        self._ddp_feed: Any = None  # its DDPStepNorms
        self._micro_batch_size: int | None = None
        self._sizes: list[int | None] = []  # each micro-batch's size since the last step
        self._accumulation = "mean"  # how the framework adds the micro-batch losses up
        self._divisor: int | None = None  # what it divides them by, if not the step's number
        self._ranks = 1
        self._gns_filter: str | None = None  # the modules the per-sample capture watches
        self._restored: dict[str, Any] | None = None  # `restore_noise_scale`, not yet applied
        self._tracker: Any = None
        self._built_for: tuple[Any, Any] = (None, None)  # (model, optimizer) of the Tracker
        self._log = False  # before_step saw a logging step; after_step measures it
        self._delivered: list[tuple[int, dict[str, Any]]] = []

    # ------------------------------------------------------------------ noise scale
    def configure(
        self,
        accumulation_steps: int,
        micro_batch_size: int | None,
        ranks: int = 1,
        wrapped: Any = None,
        accumulation: str = "mean",
        fixed_divisor: bool = False,
        label_items: str | None = None,
    ) -> None:
        """What the framework runs: ``accumulation_steps`` micro-batches of
        ``micro_batch_size`` samples per optimizer step on each of ``ranks`` processes (whose
        gradients it averages at the step), ``wrapped`` being the model as the framework wraps
        it (a ``DistributedDataParallel`` under DDP). The estimator is chosen once, before the
        first batch: ``"auto"`` picks ``"micro_batch"`` when ``accumulation_steps > 1``, else
        ``"ddp"`` under DDP, else ``"per_sample"``. ``accumulation``: how the micro-batch
        losses add up to the step's (`nnstat.NoiseScale.watch_microbatches`: ``"mean"``, each
        divided by their number; ``"items"``, each summed loss divided by the step's samples).
        ``fixed_divisor``: each loss is divided by ``accumulation_steps`` even in a step of
        fewer micro-batches (Lightning's last step of an epoch), not by the step's number.
        ``label_items``: under DDP, each rank's loss is its label tokens' sum divided by the
        global count (HF's ``average_tokens_across_devices``): ``"all"`` counts the labels
        other than -100, ``"shifted"`` those after the first position (causal LMs), for
        `note_batch` (`nnstat.gradient_noise.ddp.DDPNoiseScaleState`'s ``local_items``).

        Raises:
            ValueError: a forced ``noise_scale_method`` that cannot work in this setting.
        """
        self._micro_batch_size, self._ranks = micro_batch_size, int(ranks)
        self._accumulation = accumulation
        self._divisor = int(accumulation_steps) if fixed_divisor else None
        self._label_items = label_items
        if self._gns_model is None and self.options.noise_scale:  # not started yet
            from nnstat.gradient_noise.ddp import find_ddp

            self._ddp = find_ddp(wrapped)
            self.method = choose_method(
                self.options.noise_scale_method,
                int(accumulation_steps),
                self._ranks,
                self._ddp,
                micro_batch_size,
            )

    def begin_batch(self, model: nn.Module, training: bool | None = None) -> None:
        """Before the forward pass of a micro-batch: start capturing per-sample norms.

        The first micro-batch only probes which modules have per-sample gradients (see
        :class:`ModuleProbe`); the noise scale watches those from the next one on.
        ``training``: whether this batch trains (``None``: ``model.training``); a framework
        whose event comes before it switches the model back to train mode (HF's Trainer, after
        an evaluation between steps) says so, else that micro-batch would be left out (and
        under DDP its samples not counted).
        """
        if not self.options.noise_scale or not (model.training if training is None else training):
            return
        if self.method == "ddp" and self._start_ddp(model):
            self._ddp_feed.count(self._micro_batch_size)
            return
        if self.method == "micro_batch":
            if self._gns_model is not model:  # hooks on every parameter: no probe needed
                self._close_noise_scale()
                self._gns_model = model
                self.gns = self._new_gns()
                self._micro_feed = self.gns.watch_microbatches(
                    model, ranks=self._ranks, accumulation=self._accumulation
                )
            self._sizes.append(self._micro_batch_size)  # `configure` gave this batch's size
            return
        if self._gns_ctx is not None:  # a batch whose backward never came (e.g. skipped)
            self._abandon()
        if self._gns_model is not model:
            self._close_noise_scale()
            self._gns_model = model
            # a resumed run watches the modules its checkpoint's run probed (no probe batch)
            restored = self._restored or {}
            restored = restored if restored.get("method") == self.method else {}
            name_filter = self.options.noise_scale_filter or restored.get("filter")
            if name_filter is not None:
                self.excluded = dict(restored.get("excluded", self.excluded))
                self._start_gns(model, name_filter)
            else:
                self._gns_ctx = ModuleProbe(model, unshared=True)
                self._gns_ctx.__enter__()
                return
        self._micro += 1
        if self.gns is not None and self._micro % self.options.noise_scale_every == 0:
            self._gns_ctx = self.gns.batch()
            self._gns_ctx.__enter__()

    def _start_ddp(self, model: nn.Module) -> bool:
        """The DDP hook feeds the noise scale (registered on the first batch; re-pointed when
        the model carries it already); ``False`` when ``"auto"`` had to fall back to per-sample
        norms (the model has another communication hook)."""
        if self._gns_model is model:
            return True
        from nnstat.gradient_noise.ddp import DDPStepNorms

        self._close_noise_scale()
        gns = self._new_gns()
        try:
            self._ddp_feed = DDPStepNorms(self._ddp, gns.add_staged)
        except RuntimeError as e:
            if self.options.noise_scale_method == "ddp":
                raise
            warnings.warn(
                f"nnstat: {e}. The noise scale uses per-sample norms instead.", stacklevel=3
            )
            self.method = "per_sample"
            return False
        self.gns, self._gns_model = gns, model
        return True

    @property
    def capture_open(self) -> bool:
        """Whether a noise-scale capture is open (its backward not yet folded in), or, with the
        micro-batch method, micro-batches wait for the step's measurement (never with the
        DDP method: its hook measured the gradients before any clipping)."""
        if self._ddp_feed is not None:
            return False
        if self._micro_feed is not None:
            return self._micro_feed.pending > 0
        return self._gns_ctx is not None and not isinstance(self._gns_ctx, ModuleProbe)

    def _new_gns(self) -> Any:
        from nnstat.gradient_noise import NoiseScale

        window = self.options.noise_scale_window
        if window is None:
            gns = NoiseScale(beta=self.options.noise_scale_beta)
        else:
            gns = NoiseScale(window=window)
        restored, self._restored = self._restored, None
        if restored is not None and restore_into(gns, restored, self.method):
            self._micro = int(restored.get("micro", self._micro))  # the per-sample cadence
        return gns

    def noise_scale_state(self) -> dict[str, Any] | None:
        """The noise scale's state for a checkpoint (JSON-serialisable; waits for the steps
        on their way): its averages, estimator, watched modules and cadence; ``None`` before
        its estimator exists."""
        if self.gns is None:
            return None
        return {
            "method": self.method,
            "noise_scale": self.gns.state_dict(),
            "filter": self._gns_filter,
            "excluded": dict(self.excluded),
            "micro": self._micro,
        }

    def restore_noise_scale(self, state: Mapping[str, Any]) -> None:
        """Continue from `noise_scale_state` (a resumed run): the estimator built at the next
        batch starts from its averages, cadence and watched modules (`restore_into` says why
        it may not: another estimator or averaging)."""
        self._close_noise_scale()
        self._restored = dict(state)

    def _start_gns(self, model: nn.Module, name_filter: str) -> None:
        self._gns_filter = name_filter
        self.gns = self._new_gns()
        self.gns.watch(model, name_filter=name_filter)

    def before_clip(self) -> None:
        """The step's gradients are final and not yet clipped: measure what the noise scale
        reads from ``.grad`` (the open capture; the micro-batch method's step)."""
        if self._micro_feed is not None:
            sizes, self._sizes = self._sizes, []
            if self._micro_feed.pending:
                self._end_micro_step(sizes)
        elif self.capture_open:
            self.end_backward()

    def note_batch(self, batch: Any) -> None:
        """The size of the micro-batch whose forward runs now (its first tensor's leading
        dimension), for frameworks whose batch events carry no batch (HF's Trainer): the
        micro-batch method measures a smaller last batch at its own size, the DDP method
        counts it at its own size (ranks of unequal batches)."""
        size = batch_size(batch)
        if size is None:
            return
        if self._micro_feed is not None and self._sizes:
            self._sizes[-1] = size
        elif self._ddp_feed is not None and self._ddp_feed.counted:
            self._ddp_feed.recount(size, label_items(batch, self._label_items))

    def _end_micro_step(self, sizes: list[int | None]) -> None:
        """Measure the micro-batch method's step: with micro-batches of unequal sizes (a
        smaller last batch of the epoch) each one's size, else the one size (an observation
        with one size for unequal micro-batches would bias ``trace_sigma``)."""
        feed = self._micro_feed
        # a step of more backwards than the loop divides by (manual optimization) did not
        # divide by it: the step's own number then
        divisor = self._divisor if (self._divisor or 0) >= feed.pending else None
        if len(set(sizes)) <= 1 or None in sizes:
            feed.end_step(self._micro_batch_size, divisor)
        elif len(sizes) == feed.pending:
            feed.end_step(sizes, divisor)
        else:
            feed.discard()
            warnings.warn(
                f"nnstat: this step's micro-batches had unequal sizes {sizes}, but "
                f"{feed.pending} backward passes ran: the step is left out of the noise scale "
                "(its batch sizes are unknown). Use drop_last=True or one backward per batch.",
                RuntimeWarning,
                stacklevel=3,
            )

    def end_backward(self) -> None:
        """After the backward pass of a micro-batch: fold its norms into the estimate."""
        ctx, self._gns_ctx = self._gns_ctx, None
        if ctx is None:
            return
        ctx.__exit__(None, None, None)
        if isinstance(ctx, ModuleProbe):
            assert self._gns_model is not None
            regex = ctx.regex()
            self.excluded = dict(ctx.excluded)
            self._start_gns(self._gns_model, regex)

    def _abandon(self) -> None:
        """Close an open capture block without measuring it (a batch whose backward never came,
        or training stopped by an exception)."""
        ctx, self._gns_ctx = self._gns_ctx, None
        if ctx is None:
            return
        if isinstance(ctx, ModuleProbe):
            self._gns_model = None  # probe again on the next batch
        # thrown into the capture block, this exception unwinds it (hooks off, nothing
        # measured) and comes back out of __exit__ as "not handled"; any other error raises
        cancel = _Abandoned("capture block closed without a measurement")
        ctx.__exit__(_Abandoned, cancel, None)

    def _noise_scale(self) -> Mapping[str, float]:
        """The Tracker's provider: the noise scale as of this step, filled in when the step is
        delivered (no wait here); nothing before its first observation."""
        gns = self.gns
        if gns is None or not gns.n_observed:
            return {}
        return gns.as_provider()()

    # ------------------------------------------------------------------ statistics
    def before_step(
        self,
        model: nn.Module,
        optimizer: Any,
        log: bool,
        measure_open_batch: bool = True,
        clipped: bool = False,
    ) -> None:
        """Gradients are final and the weights not yet updated; ``log`` says whether this step
        is a logging step (its update is measured from the weights now).

        ``measure_open_batch``: a capture block still open holds the last micro-batch's backward
        (frameworks without an after-backward event); ``False`` when the framework reports every
        backward, so a block still open had none (a skipped batch) and is discarded.
        ``clipped``: ``.grad`` was clipped since the last backward; the micro-batch method's
        step is then discarded (else measured here, see `before_clip`). The DDP method's step
        is measured here whatever the clipping (its hook saw the gradients as all-reduced).
        """
        if self._ddp_feed is not None:
            self._ddp_feed.end_step()
        elif self._micro_feed is not None:
            if clipped:
                self._micro_feed.discard()
                self._sizes = []
            else:
                self.before_clip()
        elif measure_open_batch:
            self.end_backward()
        else:
            self._abandon()
        self._log = log
        if log:
            self._tracker_for(model, optimizer).snapshot()

    def _tracker_for(self, model: nn.Module, optimizer: Any) -> Any:
        """The run's Tracker; a new one when the model or optimizer object changed (the old
        one is flushed first: its steps stay in `collect`)."""
        if self._tracker is not None and self._built_for == (model, optimizer):
            return self._tracker
        self._close_tracker()
        from nnstat.tracker import Tracker

        # a torch optimizer, or a view of several with their `state` and `param_groups`
        # (Lightning's `Optimizers`)
        torch_like = isinstance(getattr(optimizer, "state", None), Mapping) and isinstance(
            getattr(optimizer, "param_groups", None), list
        )
        opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) or torch_like else None
        if opt is not None and not _holds_any(opt, model):
            # DeepSpeed ZeRO and master-weight optimizers step flat fp32 copies: the Tracker
            # would reject them, and their states cannot be matched to layers anyway
            opt = None
        self._tracker = Tracker(
            model,
            opt,
            stats=self.options.stats,
            include=self.options.include,
            exclude=self.options.exclude,
            groups=self.options.groups,
            sinks=[self._receive],
        )
        self._tracker.add_provider(self._noise_scale)
        self._built_for = (model, optimizer)
        return self._tracker

    def _receive(self, metrics: dict[str, Any], step: int) -> None:
        self._delivered.append((step, metrics))

    def after_step(self, step: int | None = None) -> Mapping[str, Any] | None:
        """Weights updated: on a logging step, queue its statistics as step ``step`` (default:
        the Tracker's count of logged steps) and return them as the Tracker did (on a GPU a
        `nnstat.tracker.StepMetrics` that waits when read: hand them over with `collect`
        instead); else None. Nothing is read back here."""
        if not self._log:
            return None
        self._log = False
        with warnings.catch_warnings():
            # frozen parameters have no gradient; they are simply absent from grad/
            warnings.filterwarnings("ignore", message="Tracker: .* have no gradient")
            # the framework calls this after its optimizer step, so "no optimizer.step() since"
            # means a skipped step (GradScaler after inf/NaN): its update is left out, as it should
            warnings.filterwarnings("ignore", message=r"Tracker\.step\(\) .*has not run since")
            return self._tracker.step(step)

    def collect(self, wait: bool = False) -> list[tuple[int, dict[str, Any]]]:
        """``(step, metrics)`` of the logged steps delivered since the last call, in order.

        Without ``wait`` only those already on the host (`nnstat.Tracker.poll`: no host
        synchronisation); with it every step measured so far (`nnstat.Tracker.flush`, which
        waits for copies still on their way).
        """
        if self._tracker is not None:
            if wait:
                self._tracker.flush()
            else:
                self._tracker.poll()
        out, self._delivered = self._delivered, []
        return out

    def _close_tracker(self) -> None:
        tracker, self._tracker = self._tracker, None
        self._built_for = (None, None)
        if tracker is not None:
            tracker.close()  # delivers what is left (into `collect`), removes its optimizer hook

    def _close_noise_scale(self) -> None:
        self._abandon()
        if self.gns is not None:
            self.gns.unwatch()  # the micro-batch hooks too
        if self._ddp_feed is not None:
            self._ddp_feed.close()  # DDP keeps the hook, which then only averages
        self.gns = None
        self._gns_model = None
        self._micro_feed = self._ddp_feed = None

    def close(self) -> None:
        """End of training: deliver every step still on its way (then in `collect`), remove
        the Tracker's optimizer hook and the noise-scale hooks (the model is left as before)."""
        try:
            self._close_tracker()
        finally:
            self._close_noise_scale()


def batch_size(batch: Any) -> int | None:
    """The leading dimension of the batch's first tensor (its samples), if any.

    Example:
        >>> batch_size({"input_ids": torch.zeros(4, 7)}), batch_size(["text"])
        (4, None)
    """
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def label_items(batch: Any, rule: str | None) -> torch.Tensor | None:
    """The label tokens the loss sums over (``shift_labels`` as given, else ``labels`` other
    than -100, after the first position for ``rule="shifted"``), counted on the device;
    ``None`` for ``rule=None`` or a batch without labels.

    Example:
        >>> labels = torch.tensor([[5, 6, -100], [7, -100, -100]])
        >>> batch = ((), {"labels": labels})  # a forward's (args, kwargs)
        >>> int(label_items(batch, "all")), int(label_items(batch, "shifted"))
        (3, 1)
    """
    kwargs = batch[1] if isinstance(batch, tuple) and len(batch) == 2 else None
    if rule is None or not isinstance(kwargs, dict):
        return None
    labels = kwargs.get("shift_labels")
    if labels is None and isinstance(kwargs.get("labels"), torch.Tensor):
        labels = kwargs["labels"][..., 1:] if rule == "shifted" else kwargs["labels"]
    return None if labels is None else labels.ne(-100).sum()


def _holds_any(optimizer: Any, model: nn.Module) -> bool:
    """Whether `optimizer`'s param_groups hold any trainable parameter of `model` (True when it
    has no torch-style param_groups to look at)."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, (list, tuple)):
        return True
    owned = {id(p) for g in groups if isinstance(g, dict) for p in g.get("params", ())}
    trainable = [p for p in model.parameters() if p.requires_grad]
    return not trainable or any(id(p) in owned for p in trainable)
