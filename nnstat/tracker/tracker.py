# size: one class, the Tracker's public surface (construction, snapshot, step, poll, flush,
# close) with each method's Args/Raises and example; the work lives in collect, compute, inline,
# worker, delivery and sinks beside it.
"""Tracker: one line in a training loop logs weight/grad/optimizer-state/update statistics.

Each logged step reduces every tracked tensor (blocked passes, `nnstat.tracker.compute`;
on accelerators everything stays queued on the device until ONE host transfer per step, on CPU
each group's table is read as it is done), derives trust ratios from the same norms, adds the
metrics of registered providers, and hands one flat dict to every sink. On CPU the reductions
of step ``t`` run by default on a background thread (`nnstat.background`) while step ``t + 1``
trains; the optimizer's step pre-hook waits for them before the weights change. On a GPU the
transfer does not wait (`nnstat.tracker.delivery`): sinks get step ``t`` once it has arrived,
one or more steps later; ``flush()``/``close()`` deliver everything.

Example:
    >>> import torch, nnstat
    >>> model = torch.nn.Linear(3, 1); opt = torch.optim.Adam(model.parameters())
    >>> seen = []
    >>> tracker = nnstat.Tracker(model, opt, sinks=[lambda m, step: seen.append(step)])
    >>> model(torch.ones(2, 3)).sum().backward(); opt.step()
    >>> metrics = tracker.step()
    >>> seen, "trust_ratio/weight" in metrics, "exp_avg/bias/l2" in metrics
    ([0], True, True)
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nnstat.describe import DEFAULT_STATS, Workspace, cpu_single_thread, validate_stats
from nnstat.describe.histogram import DEFAULT_MAX_ELEMENTS
from nnstat.describe.numpy_blocks import LIGHT_STATS
from nnstat.distributed import (
    any_dtensor,
    clean_name,
    fsdp1_shards,
    fsdp1_whole,
    local_tensor,
)
from nnstat.netdict import SameParams, select_names
from nnstat.tracker.collect import collect
from nnstat.tracker.compute import (
    StepPlan,
    assemble,
    by_dtype,
    snapshot_of,
    tasks,
)
from nnstat.tracker.delivery import DeviceSteps
from nnstat.tracker.guards import REPLACED_FIX, StepOrder, check_owned, first_error
from nnstat.tracker.inline import InlineSteps
from nnstat.tracker.pending import PENDING, StepMetrics, on_signal, register_atexit
from nnstat.tracker.sinks import Sink, Sinks, sink_list
from nnstat.tracker.worker import WorkerSteps, hook_target

__all__ = ["Tracker", "Sink", "GROUPS", "StepMetrics"]

#: What a Tracker can watch; ``"optimizer"`` expands to the optimizer's per-parameter states.
GROUPS: tuple[str, ...] = ("weight", "grad", "optimizer", "update")


class Tracker:
    """Log statistics of a model (and its optimizer) every `every` calls of `step`.

    Call `step()` once per training iteration, after ``optimizer.step()``. Metric keys:
    ``"<group>/<layer>/<stat>"`` with groups ``weight``, ``grad``, each optimizer state key
    (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...) and ``update`` (the change made by the
    last optimizer step), plus ``"trust_ratio/<layer>"`` and ``"update_ratio/<layer>"``. With
    ``histograms=True`` keys ``"<group>/<layer>/hist"`` hold `nnstat.describe.Histogram` objects
    (counts from at most `hist_max_elements` elements per tensor, see `nnstat.describe.histogram`).

    Updates need a snapshot: one copy of the tracked parameters, refreshed before a logged step.

    ``background`` on CPU: ``True`` reduces step ``t`` on a worker thread while step
    ``t + 1`` trains (`nnstat.tracker.worker`: the optimizer's step pre-hook waits for it,
    in-place gradients are read synchronously, a version check guards the rest); ``False`` is
    synchronous; ``None`` (default) picks background when training runs on one torch thread,
    with an optimizer, outside ``torch.distributed``; with more, the step's passes are shared
    by this thread and a worker (`nnstat.describe.block_passes.share_blocks`), bit-identically. In
    background mode `step` returns a `StepMetrics` mapping that waits on first read, sinks get
    step ``t`` at the next `step`/`flush`/`close` (or exit), and step ``t``'s gradients stay
    referenced until the next optimizer step. On a GPU ``None``/``True`` deliver without a
    host synchronisation inside `step` (a `StepMetrics` again; sinks get step ``t`` once its
    copy has arrived, polled at later steps; `nnstat.tracker.delivery`), ``False`` reads each
    step back inside `step`.

    Guards against silent misuse: an optimizer that holds none of the tracked trainable
    parameters raises (some of them: a warning naming the others); a `step` with no
    ``optimizer.step()`` since the previous one (or since construction) warns once and leaves
    ``update/``, ``trust_ratio/`` and ``update_ratio/`` out of that step instead of logging a zero
    update. A sink that raises does not stop the others: every sink gets the step, then the
    first error is raised (by `step`, `flush`, `close` or the read that delivered it).

    Args:
        model: the network whose parameters are tracked.
        optimizer: its optimizer (for the optimizer states and updates); ``None``: neither.
        every: log on one `step` call in ``every``.
        stats: statistic names (`nnstat.describe`); ``None``: all of them.
        histograms: also log a histogram per tensor (``bins`` bins, from at most
            ``hist_max_elements`` elements; ``None``: all).
        sinks: objects with ``log(metrics, step)`` (or callables) receiving each logged step.
        include: regex (``re.search``) of parameter names to track; ``exclude``: to leave out.
        groups: which of ``weight``, ``grad``, ``optimizer``, ``update`` to log.
        state_keys: optimizer state keys to log; ``None``: every per-parameter state tensor
            (`nnstat.netdict.layer_state_keys`: Adafactor's factored ``row_var``/``col_var``
            too; no scalar counter such as ``step``).
        background: ``True``, ``False`` or ``None`` (auto), as described above.

    Raises:
        TypeError: a wrong type of ``model``, ``optimizer``, a sink or ``background``.
        ValueError: ``every < 1``, an unknown group or statistic, no parameter to track, an
            optimizer holding none of them, or ``background=True`` without the optimizer.

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> t = Tracker(model, stats=["l2"], groups=["weight"])
        >>> sorted(t.step())
        ['weight/bias/l2', 'weight/weight/l2']
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        every: int = 1,
        stats: Sequence[str] | str | None = DEFAULT_STATS,
        histograms: bool = False,
        sinks: Sequence[Any] = (),
        include: str | None = None,
        exclude: str | None = None,
        groups: Sequence[str] = GROUPS,
        state_keys: Sequence[str] | None = None,
        bins: int = 64,
        hist_max_elements: int | None = DEFAULT_MAX_ELEMENTS,
        background: bool | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Tracker expects an nn.Module, got {type(model).__name__}")
        if not (
            optimizer is None
            or isinstance(optimizer, torch.optim.Optimizer)
            or isinstance(getattr(optimizer, "state", None), Mapping)
        ):
            # checked here: the first step() reads optimizer.state, and an AttributeError there
            # would not say which argument was wrong
            raise TypeError(
                "Tracker: optimizer must be a torch.optim.Optimizer (or wrap one: an object whose "
                f".state maps parameters to their states), got {type(optimizer).__name__}; pass "
                "the optimizer that steps the model, or optimizer=None to track no updates"
            )
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int, got {every!r}")
        unknown = [g for g in groups if g not in GROUPS]
        if unknown:
            raise ValueError(f"unknown group(s) {unknown}; valid groups are {list(GROUPS)}")
        self.model = model
        self.optimizer = optimizer
        self.every = every
        self.stats = validate_stats(stats)
        self.histograms = histograms
        self.bins = bins
        self.hist_max_elements = hist_max_elements
        self._workspaces: dict[str, Workspace] = {}
        if background not in (None, True, False):
            raise TypeError(f"background must be None (auto), True or False, got {background!r}")
        if background and optimizer is None and {"weight", "update"} & set(groups):
            raise ValueError(
                "background=True needs the optimizer when weights or updates are tracked: its "
                "step pre-hook keeps the weights unchanged while the background thread reads them"
            )
        self.background = background
        self.groups = (
            tuple(groups) if optimizer is not None else tuple(g for g in groups if g != "optimizer")
        )
        self.state_keys = None if state_keys is None else tuple(state_keys)
        # FSDP1 wrappers add a prefix: keys are the unwrapped model's names
        named = [(clean_name(n), p) for n, p in model.named_parameters()]
        names = select_names([n for n, _ in named], include, exclude)
        if not names:
            raise ValueError(
                f"Tracker: no parameter to track (include={include!r}, exclude={exclude!r}, "
                f"model parameters: {[n for n, _ in named][:10]})"
            )
        lookup = dict(named)
        self.names = names
        self.params = [lookup[n] for n in names]
        if optimizer is not None:
            check_owned(self.names, self.params, optimizer)
        self._fsdp1 = bool(fsdp1_shards(model))
        # a module replaced afterwards (model.fc = nn.Linear(...)) is refused at the next logged
        # step; FSDP1 wrappers name flat slices of their own, kept by fsdp1_shards
        self._same = None if self._fsdp1 else SameParams(model, names, self.params, *REPLACED_FIX)
        # the executors of a logged step: inline (synchronous), the device-deferred copy to the
        # host and (below, with the snapshot) the CPU worker thread
        self._inline = InlineSteps(self.params, self._fsdp1)
        self._device = DeviceSteps()
        self._sinks = Sinks()
        for s in sink_list(sinks):
            self.add_sink(s)
        self._providers: list[Callable[[], Mapping[str, Any]]] = []
        self._calls = 0
        self._warned_grad = False
        self._latest: Mapping[str, Any] = {}
        # the update of the first logged step is measured from the weights at construction
        self._prev: list[torch.Tensor] | None = None
        if "update" in self.groups:
            self._prev = snapshot_of(self.params)  # contiguous: refreshed in flat blocks
        self._worker = WorkerSteps(
            background, optimizer, self.names, self.params, self._prev, self._fsdp1
        )
        # a step() with no optimizer.step() since the last call was made before
        # optimizer.step() (or the step was skipped): there is no update
        self._order = StepOrder(self, hook_target(optimizer) if optimizer is not None else None)
        # `snapshot`: the caller took the next logged step's snapshot (that step does not
        # refresh it); `_stale`: a logged step formed its update in the snapshot and did not
        # refresh it, so it no longer holds weights
        self._snapped = False
        self._stale = False
        # SIGTERM/SIGINT/SIGHUP flush the steps on their way (`pending.on_signal`); a signal
        # arriving while a step is being built or delivered (the `hold` sections of step,
        # snapshot, poll, flush, a read, the pre-hook) waits for its end: no half-built step
        self._on_signal = on_signal(self)
        self._worker.hold = self._on_signal.hold

    # -- wiring ---------------------------------------------------------------------------
    def add_sink(self, sink: Any) -> None:
        """Send every logged dict to `sink` (``sink.log(metrics, step)`` or ``sink(metrics, step)``)."""
        self._sinks.add(sink)
        attach = getattr(sink, "attach", None)
        if callable(attach):  # e.g. W&B: flush pending background steps before wandb.finish()
            attach(self.flush)

    def add_provider(self, provider: Callable[[], Mapping[str, Any]]) -> None:
        """Merge ``provider()`` (a flat ``{key: value}`` dict) into every logged step.

        Example:
            >>> t = Tracker(torch.nn.Linear(1, 1), groups=["weight"], stats=["l2"])
            >>> t.add_provider(lambda: {"gns/b_simple": 32.0})
            >>> t.step()["gns/b_simple"]
            32.0
        """
        if not callable(provider):
            raise TypeError(f"a provider must be callable, got {provider!r}")
        self._providers.append(provider)

    # -- the step -------------------------------------------------------------------------
    def snapshot(self) -> None:
        """Take the weights the next logged step's update is measured from, now.

        For loops that choose the steps to log as they come (framework callbacks, which then
        call `step` only on those): call it right before that step's ``optimizer.step()`` and
        `step` after it; the update and ratios are that one optimizer step's (left out when
        none ran since, as `step` says). That step leaves the snapshot to the caller (it does
        not refresh it); a logged step with no ``snapshot()`` since the previous one leaves its
        update out, with a warning. One multi-tensor copy into the Tracker's own snapshot.

        Example:
            >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> t = Tracker(model, opt, stats=["l2"], groups=["update"])
            >>> model(torch.ones(1, 2)).sum().backward(); opt.step()  # not logged
            >>> t.snapshot(); opt.step()  # the step to log: one more step of 0.1 on the bias
            >>> round(t.step()["update/bias/l2"], 6)
            0.1
        """
        with self._on_signal.hold():
            self._finish_pending()  # a background step still reads (and rewrites) the snapshot
            self._order.mark()  # "no optimizer.step() since" counts from here
            if self._prev is not None:
                prev = [local_tensor(t) for t in self._prev]
                # per dtype: a multi-tensor kernel takes its fast path on one dtype only
                for dst, src in by_dtype(prev, [local_tensor(p.detach()) for p in self.params]):
                    torch._foreach_copy_(dst, src)
                self._snapped, self._stale = True, False

    def poll(self) -> None:
        """Hand the logged steps that are ready to the sinks without waiting for any: device
        copies that have arrived (their CUDA event is polled) and a background step whose worker
        is done. `step` polls too; a loop that calls `step` only on logged steps polls in
        between to deliver them sooner. Raises the errors of what it delivers, like `step`.

        Example:
            >>> seen = []
            >>> t = Tracker(torch.nn.Linear(2, 1), stats=["l2"], sinks=[lambda m, s: seen.append(s)])
            >>> _ = t.step(); t.poll(); seen
            [0]
        """
        with self._on_signal.hold():
            if self._worker.ready():
                self._finish_pending()
            self._arrived(wait=False)
            self._sinks.raise_errors()

    def _collect(self, weights: bool = True) -> list[tuple[str, list[str], list[torch.Tensor]]]:
        """``(group, names, tensors)`` of every group but updates (`nnstat.tracker.collect`)."""
        out, missing = collect(
            self.model,
            self.names,
            self.params,
            self.optimizer,
            self.groups,
            self.state_keys,
            self._fsdp1,
            weights,
        )
        if missing and not self._warned_grad:
            warnings.warn(
                f"Tracker: {len(missing)} parameter(s) have no gradient at this step (frozen, "
                f"or unused by the loss) and are left out of grad/ (warned once): {missing[:5]}",
                stacklevel=4,
            )
            self._warned_grad = True
        return out

    def _plan(self, refresh: bool) -> StepPlan:
        paired = (
            self._prev is not None
            and "weight" in self.groups
            and not self.histograms
            and set(self.stats) <= LIGHT_STATS
            and not any_dtensor(self.params)
            and not self._fsdp1
        )
        plan = StepPlan(
            names=list(self.names),
            stats=self.stats,
            paired=paired,
            refresh=refresh,
            groups=self._collect(weights=not paired),
            histograms=self.histograms,
            bins=self.bins,
            hist_max_elements=self.hist_max_elements,
            weight_in_groups="weight" in self.groups,
        )
        if self._prev is not None:
            plan.weights = [p.detach() for p in self.params]
            plan.prev = self._prev
            if self._fsdp1:
                shards = fsdp1_shards(self.model)
                plan.update_views = [
                    fsdp1_whole(d, p, shards) for d, p in zip(self._prev, self.params, strict=True)
                ]
        return plan

    def step(self, step: int | None = None) -> Mapping[str, Any] | None:
        """Record statistics if this call is a logging step; returns the metrics (else None).

        With background statistics the returned `StepMetrics` fills in when first read (or at
        the next `step`, `flush`, `close`); sinks receive every step's plain dict, in order.

        Args:
            step: the step the sinks get; defaults to the number of previous calls.

        Returns:
            The step's metrics (flat ``{key: value}``), or ``None`` between logged steps.

        Raises:
            TypeError: a provider returned something other than a dict.
            Exception: an error of a sink or of the background statistics of an earlier step,
                raised here once every sink has had that step.

        Example:
            >>> t = Tracker(torch.nn.Linear(2, 1), stats=["l2"], groups=["weight"], every=2)
            >>> sorted(t.step()), t.step()
            (['weight/bias/l2', 'weight/weight/l2'], None)
        """
        with self._on_signal.hold():
            call = self._calls
            self._calls += 1
            step = call if step is None else step
            stepped = self._order.stepped(call, has_update=self._prev is not None)
            self._finish_pending()
            self._arrived(wait=False)  # device steps whose copy has arrived (polled, no wait)
            try:
                return self._step(call, step, stepped)
            finally:
                # a sink that failed on the previous step (delivered just now) is raised after
                # this step was scheduled, so neither it nor the other sinks lose this one
                self._sinks.raise_errors()

    def _step(self, call: int, step: int, stepped: bool) -> Mapping[str, Any] | None:
        refresh = self._prev is not None and not self._snapped and (call + 1) % self.every == 0
        if call % self.every:
            if refresh:
                # snapshot the weights the next (logged) step's update is measured from
                # on local shards: DTensor (FSDP fully_shard) has no foreach sharding rules
                torch._foreach_copy_(
                    [local_tensor(t) for t in self._prev],
                    [local_tensor(p.detach()) for p in self.params],
                )
                self._stale = False
            return None
        if self._same is not None:
            self._same.check()
        on_cpu = _on_cpu(self.params)
        plan = self._plan(refresh)
        plan.skip_update = not stepped or self._stale
        if self._stale:
            warnings.warn(
                f"Tracker.step() (call {call}): no snapshot() since the previous logged step, "
                "whose update used the snapshot up: update/, trust_ratio/ and update_ratio/ are "
                "left out of this step. Call tracker.snapshot() before the optimizer.step() of "
                "every step you log.",
                stacklevel=3,
            )
        if self._prev is not None:
            self._snapped, self._stale = False, not refresh
        if self._deferred_ok(on_cpu):
            # providers first: their values are step t's (lazy ones resolve at delivery)
            extra = self._provided(merge=False)
            handle = self._device.defer(step, plan, self._workspaces, extra, self._settle)
            self._track_pending()
            return handle
        # anything still on its way is delivered first: sinks get the steps in order
        self._arrived(wait=True)
        todo = tasks(plan, self._workspaces)
        # outside cpu_single_thread: it reads the thread count
        background = not self._sync_only and self._worker.usable(on_cpu)
        if background:
            with cpu_single_thread() if on_cpu else contextlib.nullcontext():
                handle = self._worker.schedule(step, plan, todo, self._settle)
            self._track_pending()
        else:
            results = self._inline.run(plan, todo, self._workspaces, on_cpu)
        if background:
            # providers run while the worker reduces this step (their values are step t's)
            self._worker.pending.extra = self._provided()
            return handle
        metrics = assemble(plan, results)
        metrics.update(self._provided())
        self._deliver(metrics, step)
        return metrics

    def _deferred_ok(self, on_cpu: bool) -> bool:
        """Whether this step goes to the host without waiting (accelerators, unless
        ``background=False`` or a torn step made the Tracker synchronous)."""
        return (
            not on_cpu
            and self.background is not False
            and not self._sync_only
            and not self._fsdp1
            and not any_dtensor(self.params)
        )

    def _provided(self, merge: bool = True) -> Any:
        """The providers' values: one dict, or (``merge=False``) their mappings as returned."""
        out: list[Mapping[str, Any]] = []
        for provider in self._providers:
            extra = provider()
            if not isinstance(extra, Mapping):
                raise TypeError(
                    f"provider {provider!r} returned {type(extra).__name__}, not a dict"
                )
            out.append(extra)
        if not merge:
            return out
        merged: dict[str, Any] = {}
        for extra in out:
            merged.update(extra)
        return merged

    def _deliver(
        self, metrics: dict[str, Any], step: int, handle: StepMetrics | None = None
    ) -> None:
        self._latest = metrics if handle is None else handle
        self._sinks.log(metrics, step)

    @property
    def latest(self) -> Mapping[str, Any]:
        """The metrics of the last logged step (waits for background statistics and device
        copies)."""
        self.flush()
        return self._latest

    def _settle(self, handle: StepMetrics) -> None:
        """Wait for the step of `handle` (a read of it) and hand it to the sinks."""
        with self._on_signal.hold():
            if self._worker.holds(handle):
                self._finish_pending()
            elif self._device.holds(handle):
                self._arrived(wait=True, upto=handle)
            else:
                return
            self._sinks.raise_errors()  # the sinks just got this step: their errors

    @property
    def _sync_only(self) -> bool:
        """Whether every step is read synchronously now (a step was torn: changed in place while
        the worker read it, or NaN/Inf rows that could not be recomputed on the device)."""
        return self._worker.torn or self._device.torn

    def _finish_pending(self) -> None:
        """Wait for the worker's step in flight, if any, and hand it to the sinks."""
        try:
            done = self._worker.finish()
        finally:
            self._track_pending()
        if done is not None:
            self._deliver(*done)

    def _arrived(self, wait: bool, upto: StepMetrics | None = None) -> None:
        """Hand the device steps that have arrived to the sinks (`DeviceSteps.arrived`)."""
        try:
            self._device.arrived(self._deliver, wait, upto)
        finally:
            self._track_pending()

    def _track_pending(self) -> None:
        """Keep this Tracker in the flush at exit (and on a signal) while a step is on its way."""
        if self._worker.pending is not None or len(self._device.inflight):
            PENDING.add(self)
            register_atexit()
            self._on_signal.install()
        else:
            PENDING.discard(self)

    def forget_pending(self) -> None:
        """Drop the steps on their way without delivering them (a forked child: its worker
        thread and CUDA context are the parent's, which delivers them)."""
        self._worker.pending = None
        self._device.inflight.clear()

    # -- lifecycle ------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for background statistics and device copies and hand them to the sinks.

        Raises:
            Exception: an error of the statistics or of a sink, re-raised once every sink has
                had the step.

        Example:
            >>> seen = []
            >>> t = Tracker(torch.nn.Linear(2, 1), stats=["l2"], sinks=[lambda m, s: seen.append(s)])
            >>> _ = t.step(); t.flush(); seen
            [0]
        """
        with self._on_signal.hold():
            self._finish_pending()
            self._arrived(wait=True)
            self._sinks.raise_errors()

    def close(self) -> None:
        """Flush, remove the optimizer hooks and the signal handler, and close every sink that
        has a ``close()``.

        Raises:
            Exception: the first error of flushing or of a sink's ``close``, raised once every
                sink is closed (the others attached as notes).

        Example:
            >>> with Tracker(torch.nn.Linear(2, 1), stats=["l2"]) as t:  # close() at the end
            ...     _ = t.step()
        """
        errors: list[tuple[str, BaseException]] = []
        with self._on_signal.hold():  # a signal waits until every sink is closed
            try:
                self.flush()
            except BaseException as e:  # raised below, once every sink is closed
                errors.append(("flushing the Tracker failed", e))
            self._worker.close()
            self._order.close()
            self._sinks.close(errors)
            self._on_signal.restore()
        if errors:
            raise first_error(errors, "every sink was closed")

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _on_cpu(params: list[torch.Tensor]) -> bool:
    """Whether the CPU path applies (numpy passes, background worker); else the accelerator
    path (tests patch this to run the accelerator path on CPU tensors)."""
    return all(p.device.type == "cpu" for p in params)
