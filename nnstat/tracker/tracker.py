"""Tracker: one line in a training loop logs weight/grad/optimizer-state/update statistics.

Each logged step reduces every tracked tensor (fused blocked passes, one host transfer per
group, `nnstat.tracker.compute`), derives trust ratios from the same norms, adds the metrics of
registered providers, and hands one flat dict to every sink. On CPU the reductions of step ``t``
run by default on a background thread (`nnstat.background`) while step ``t + 1`` trains; the
optimizer's step pre-hook waits for them before the weights change.

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
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from nnstat.describe import DEFAULT_STATS, Workspace, cpu_single_thread, validate_stats
from nnstat.describe.fused import FUSED_STATS
from nnstat.describe.histogram import DEFAULT_MAX_ELEMENTS
from nnstat.distributed import (
    any_dtensor,
    clean_name,
    fsdp1_grad,
    fsdp1_shards,
    fsdp1_whole,
    local_tensor,
)
from nnstat.netdict import select_names
from nnstat.tracker.background import BackgroundSteps, StepMetrics, _Pending
from nnstat.tracker.compute import StepPlan, assemble, tasks

__all__ = ["Tracker", "Sink", "GROUPS", "StepMetrics"]

#: What a Tracker can watch; ``"optimizer"`` expands to the optimizer's per-parameter states.
GROUPS: tuple[str, ...] = ("weight", "grad", "optimizer", "update")


@runtime_checkable
class Sink(Protocol):
    """Anything with ``log(metrics, step)``; plain callables ``f(metrics, step)`` work too."""

    def log(self, metrics: dict[str, Any], step: int) -> None: ...


def _as_log(sink: Any) -> Callable[[dict[str, Any], int], None]:
    if hasattr(sink, "log") and callable(sink.log):
        return sink.log
    if callable(sink):
        return sink
    raise TypeError(f"a sink needs a log(metrics, step) method or must be callable, got {sink!r}")


class Tracker(BackgroundSteps):
    """Log statistics of a model (and its optimizer) every `every` calls of `step`.

    Call `step()` once per training iteration, after ``optimizer.step()``. Metric keys:
    ``"<group>/<layer>/<stat>"`` with groups ``weight``, ``grad``, each optimizer state key
    (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...) and ``update`` (the change made by the
    last optimizer step), plus ``"trust_ratio/<layer>"`` and ``"update_ratio/<layer>"``. With
    ``histograms=True`` keys ``"<group>/<layer>/hist"`` hold `nnstat.describe.Histogram` objects
    (counts from at most `hist_max_elements` elements per tensor, see `nnstat.describe.histogram`).

    Updates need a snapshot of the weights before the step: the Tracker keeps one copy of the
    tracked parameters, refreshed only on the call before a logged step (with the default
    statistics the fused pass rewrites it block by block while it reads the weights).
    On CPU the statistic passes run on one intra-op thread (`nnstat.describe.cpu_single_thread`).

    ``background`` (CPU only): ``True`` reduces step ``t`` on a worker thread while step
    ``t + 1`` trains (`nnstat.tracker.background`: the optimizer's step pre-hook waits for it,
    in-place gradients are read synchronously, a version check guards the rest); ``False`` is
    synchronous; ``None`` (default) picks background when training runs on one torch thread,
    with an optimizer, outside ``torch.distributed`` (with more torch threads the worker competes
    with OpenMP for the cores, measured slower). The numbers are bit-identical either way. In
    background mode `step` returns a `StepMetrics` mapping that waits on first read, sinks get
    step ``t`` at the next `step`/`flush`/`close` (or exit), and step ``t``'s gradients stay
    referenced until the next optimizer step.

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
        self._sync_only = False
        self._pending: _Pending | None = None
        self._hook: Any = None
        self._grad_storages: list[weakref.ref] | None = None
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
        self._fsdp1 = bool(fsdp1_shards(model))
        self._sinks: list[Callable[[dict[str, Any], int], None]] = []
        self._sink_objects: list[Any] = []
        for s in sinks:
            self.add_sink(s)
        self._providers: list[Callable[[], Mapping[str, Any]]] = []
        self._calls = 0
        self._warned_grad = False
        self._latest: Mapping[str, Any] = {}
        # the update of the first logged step is measured from the weights at construction
        self._prev: list[torch.Tensor] | None = None
        if "update" in self.groups:
            self._prev = [p.detach().clone() for p in self.params]

    # -- wiring ---------------------------------------------------------------------------
    def add_sink(self, sink: Any) -> None:
        """Send every logged dict to `sink` (``sink.log(metrics, step)`` or ``sink(metrics, step)``)."""
        self._sinks.append(_as_log(sink))
        self._sink_objects.append(sink)
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
    def _state_keys(self) -> tuple[str, ...]:
        if self.state_keys is not None:
            return self.state_keys
        keys: dict[str, None] = {}
        for p in self.params:
            for k, v in self.optimizer.state.get(p, {}).items():
                # per-parameter states only (Adam's scalar "step" is not a layer statistic)
                if isinstance(v, torch.Tensor) and v.shape == p.shape:
                    keys[k] = None
        return tuple(keys)

    def _collect(self, weights: bool = True) -> list[tuple[str, list[str], list[torch.Tensor]]]:
        """``(group, names, tensors)`` of every group but updates."""
        out: list[tuple[str, list[str], list[torch.Tensor]]] = []
        # FSDP1: flat per-rank slices become DTensors of the whole (reduced, never gathered)
        shards = fsdp1_shards(self.model) if self._fsdp1 else {}
        if weights and "weight" in self.groups:
            out.append(
                (
                    "weight",
                    list(self.names),
                    [fsdp1_whole(p.detach(), p, shards) for p in self.params],
                )
            )
        if "grad" in self.groups:
            grads = [fsdp1_grad(p, shards) for p in self.params]
            missing = [n for n, g in zip(self.names, grads, strict=True) if g is None]
            if missing and not self._warned_grad:
                warnings.warn(
                    f"Tracker: {len(missing)} parameter(s) have no gradient at this step and are "
                    f"left out of grad/ (warned once): {missing[:5]}",
                    stacklevel=4,
                )
                self._warned_grad = True
            kept = [
                (n, g.detach()) for n, g in zip(self.names, grads, strict=True) if g is not None
            ]
            if kept:
                out.append(("grad", [n for n, _ in kept], [g for _, g in kept]))
        if "optimizer" in self.groups:
            for key in self._state_keys():
                names, tensors = [], []
                for n, p in zip(self.names, self.params, strict=True):
                    v = self.optimizer.state.get(p, {}).get(key)
                    if v is None and id(p) in shards and p.numel() == 0:
                        v = p.detach()  # FSDP1: no slice of this parameter on this rank
                    if isinstance(v, torch.Tensor):
                        names.append(n)
                        tensors.append(fsdp1_whole(v.detach(), p, shards))
                if names:
                    out.append((key, names, tensors))
        return out

    def _plan(self, refresh: bool) -> StepPlan:
        fused = (
            self._prev is not None
            and "weight" in self.groups
            and not self.histograms
            and set(self.stats) <= FUSED_STATS
            and not any_dtensor(self.params)
            and not self._fsdp1
        )
        plan = StepPlan(
            names=list(self.names),
            stats=self.stats,
            fused=fused,
            refresh=refresh,
            groups=self._collect(weights=not fused),
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

        `step` defaults to the number of previous calls. With background statistics the
        returned `StepMetrics` fills in when first read (or at the next `step`, `flush`,
        `close`); sinks receive every step's plain dict, in order.
        """
        call = self._calls
        self._calls += 1
        step = call if step is None else step
        self._finish_pending()
        refresh = self._prev is not None and (call + 1) % self.every == 0
        if call % self.every:
            if refresh:
                # snapshot the weights the next (logged) step's update is measured from
                # on local shards: DTensor (FSDP fully_shard) has no foreach sharding rules
                torch._foreach_copy_(
                    [local_tensor(t) for t in self._prev],
                    [local_tensor(p.detach()) for p in self.params],
                )
            return None
        on_cpu = all(p.device.type == "cpu" for p in self.params)
        plan = self._plan(refresh)
        todo = tasks(plan, self._workspaces)
        background = self._background_ok(on_cpu)  # outside cpu_single_thread: reads threads
        with cpu_single_thread() if on_cpu else contextlib.nullcontext():
            if background:
                handle = self._schedule(step, plan, todo)
            else:
                results = {k: fn() for k, fn in todo}
        if background:
            # providers run while the worker reduces this step (their values are step t's)
            self._pending.extra = self._provided()
            return handle
        metrics = assemble(plan, results)
        metrics.update(self._provided())
        self._deliver(metrics, step)
        return metrics

    def _provided(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for provider in self._providers:
            extra = provider()
            if not isinstance(extra, Mapping):
                raise TypeError(
                    f"provider {provider!r} returned {type(extra).__name__}, not a dict"
                )
            out.update(extra)
        return out

    def _deliver(
        self, metrics: dict[str, Any], step: int, handle: StepMetrics | None = None
    ) -> None:
        for log in self._sinks:
            log(metrics, step)
        self._latest = metrics if handle is None else handle

    @property
    def latest(self) -> Mapping[str, Any]:
        """The metrics of the last logged step (waits for background statistics)."""
        self._finish_pending()
        return self._latest

    # -- lifecycle ------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait for background statistics and hand them to the sinks (re-raises their errors)."""
        self._finish_pending()

    def close(self) -> None:
        """Flush, remove the optimizer hook and close every sink that has a ``close()``."""
        try:
            self.flush()
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            for s in self._sink_objects:
                close = getattr(s, "close", None)
                if callable(close):
                    close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
