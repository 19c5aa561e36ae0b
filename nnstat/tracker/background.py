"""Background statistics of the Tracker: scheduling, the safety checks, delivery in order.

`BackgroundSteps` is the part of `nnstat.tracker.Tracker` that hands a logged step's
reductions to the worker thread (`nnstat.background`) and collects them later:

* weights and optimizer states change only inside ``optimizer.step()``: the worker reduces them
  first and a step pre-hook waits for that part before the optimizer touches them (registered
  while a step is pending); step t's gradients (new tensors after ``set_to_none``) come last and
  may be reduced during the next ``optimizer.step()``;
* gradients that share storage with the previous logged step's (``zero_grad(set_to_none=False)``,
  DDP bucket views, accumulation into the same tensor) are reduced synchronously, as on the first
  logged step (no history yet);
* every tensor the worker reads has its ``_version`` recorded; if one changed before the join,
  its numbers may be torn: they are dropped with a warning naming the tensor and the Tracker
  stays synchronous from then on (``p.data`` writes bypass version counters and cannot be seen);
* a worker exception is re-raised in the training thread at the next ``step``/``flush``/
  ``close`` or when the step's metrics are read; a sink's exception too, after every other sink
  got the step (and, at ``step``, after that step is scheduled, so no sink loses it);
* pending steps are flushed at exit (a forked child forgets its parent's); if that fails, the
  errors are printed and the process exits with status 120 (CPython's status for a failed
  finalization) instead of 0.

Example:
    >>> import torch, nnstat
    >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> seen = []
    >>> tracker = nnstat.Tracker(model, opt, background=True, sinks=[lambda m, s: seen.append(s)])
    >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> metrics = tracker.step()      # returns at once; the worker reduces step 0
    >>> tracker.flush(); seen
    [0]
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nnstat.background import Job, submit
from nnstat.describe.fused import share_blocks
from nnstat.distributed import any_dtensor, is_distributed
from nnstat.tracker.compute import StepPlan, assemble

__all__ = ["BackgroundSteps", "StepMetrics"]


class BackgroundSteps:
    """Mixin of `nnstat.tracker.Tracker`: the background path (see the module docstring)."""

    # set by Tracker.__init__
    background: bool | None
    optimizer: Any
    names: list[str]
    params: list[torch.Tensor]
    _prev: list[torch.Tensor] | None
    _fsdp1: bool
    _sync_only: bool
    _pending: _Pending | None
    _hook: Any
    _grad_storages: list[weakref.ref] | None

    def _background_ok(self, on_cpu: bool) -> bool:
        wanted = self.background
        if wanted is None:
            # auto: single-process CPU training on one torch thread with an optimizer to hook.
            # With more torch threads the worker competes with OpenMP's threads for the cores
            # (measured slower than synchronous statistics, README "Statistics overhead")
            wanted = (
                self.optimizer is not None and torch.get_num_threads() == 1 and not is_distributed()
            )
        return (
            wanted
            and on_cpu
            and (self.optimizer is None or _hook_target(self.optimizer) is not None)
            and not self._sync_only
            and not self._fsdp1
            and not any_dtensor(self.params)
        )

    def _split_ok(self, on_cpu: bool) -> bool:
        """Whether the synchronous CPU statistics run on two threads at once (this one and the
        worker): with two or more torch threads training keeps both cores busy, so background
        statistics have no idle core to hide on; split, the step waits less for them
        (docs/benchmarks.md, "Statistics overhead")."""
        # sharded parameters reduce with collectives, which must keep one order on every rank
        return (
            on_cpu
            and torch.get_num_threads() >= 2
            and not self._fsdp1
            and not any_dtensor(self.params)
        )

    def _grads_reused(self, plan: StepPlan) -> bool:
        """Whether a gradient shares storage with the previous logged step's (written in place:
        ``zero_grad(set_to_none=False)``, DDP bucket views, accumulation), or no history yet."""
        grads = next((t for g, _, t in plan.groups if g == "grad"), [])
        before, self._grad_storages = self._grad_storages, [
            weakref.ref(g.untyped_storage()) for g in grads
        ]
        if not before:  # no gradients seen yet: nothing to compare with
            return True
        alive = {id(s) for s in (r() for r in before) if s is not None}
        return any(id(g.untyped_storage()) in alive for g in grads)

    def _schedule(self, step: int, plan: StepPlan, todo: list[Any]) -> StepMetrics:
        # gradients written in place must be read now; everything else waits in place for the
        # worker (weights and optimizer states change only in optimizer.step: pre-hook)
        inline = {"group:grad"} if self._grads_reused(plan) else set()
        remote = [(k, fn) for k, fn in todo if k not in inline]
        watched, grad_watch = [], []
        for group, names, tensors in plan.groups:
            if f"group:{group}" not in inline:
                rows = [(group, n, t, t._version) for n, t in zip(names, tensors, strict=True)]
                (grad_watch if group == "grad" else watched).extend(rows)
        if plan.fused and plan.weights is not None:
            watched += [
                ("weight", n, t, t._version) for n, t in zip(plan.names, plan.weights, strict=True)
            ]
        # first: a failure here must not leave a step pending
        if self.optimizer is not None and self._hook is None:
            ref = weakref.ref(self)

            def wait_for_statistics(optimizer: Any, args: Any, kwargs: Any) -> None:
                tracker = ref()
                if tracker is not None and tracker._pending is not None:
                    tracker._join(tracker._pending, whole=False)

            self._hook = _hook_target(self.optimizer).register_step_pre_hook(wait_for_statistics)
        guard = threading.Event()
        late_conflicts: list[tuple[str, str]] = []
        # what the optimizer changes first, so its pre-hook waits only for that part; step t's
        # gradients are not touched by step t + 1 (set_to_none gave those new tensors), so their
        # reduction may run on during optimizer.step()
        guarded = [(k, fn) for k, fn in remote if k != "group:grad"]
        late = [(k, fn) for k, fn in remote if k == "group:grad"]

        def run() -> dict[str, Any]:
            out = {}
            try:
                for k, fn in guarded:
                    out[k] = fn()
            finally:
                guard.set()
            for k, fn in late:
                out[k] = fn()
            # checked here, then let go: nobody but the worker still holds these gradients
            late_conflicts.extend((g, n) for g, n, t, v in grad_watch if t._version != v)
            grad_watch.clear()
            return out

        job = submit(run)
        # the tasks hold what they read; keep only names here so step t's gradients are freed
        # as soon as the worker and the version check are done with them
        plan.groups = [(g, names, []) for g, names, _ in plan.groups]
        pending = _Pending(step, plan, job, watched, StepMetrics(self, step))
        pending.guard, pending.late_conflicts = guard, late_conflicts
        self._pending = pending
        _PENDING.add(self)
        _register_atexit()
        # overlap: tasks that must run now do so while the worker reads the rest
        try:
            pending.local = {k: fn() for k, fn in todo if k in inline}
        except BaseException:
            pending.job.wait()  # this step cannot be completed: nothing of it is delivered
            self._pending = None
            _PENDING.discard(self)
            raise
        return pending.handle

    def _join(self, pending: _Pending, whole: bool = True) -> None:
        """Wait for the worker (only for what the optimizer changes unless `whole`) and check
        nothing it read changed meanwhile (safe inside the optimizer's pre-hook)."""
        if not pending.joined:
            pending.guard.wait()
            pending.joined = True
            self._conflicts(pending, [(g, n) for g, n, t, v in pending.watched if t._version != v])
            pending.watched = []
        if whole and not pending.job.done():
            pending.job.wait()
        if whole and pending.late_conflicts:
            self._conflicts(pending, pending.late_conflicts)
            pending.late_conflicts = []

    def _conflicts(self, pending: _Pending, found: list[tuple[str, str]]) -> None:
        if not found:
            return
        pending.conflicts += found
        self._sync_only = True
        torn = {n for g, n in found if g == "weight"}
        if self._prev is not None and torn:
            # the snapshot of these layers was copied from weights being modified
            for n, prev, p in zip(self.names, self._prev, self.params, strict=True):
                if n in torn:
                    prev.copy_(p.detach())

    def _finish_pending(self) -> None:
        pending = self._pending
        if pending is None:
            return
        self._join(pending)
        self._pending = None
        _PENDING.discard(self)
        if self._hook is not None:
            self._hook.remove()  # re-registered with the next background step
            self._hook = None
        job = pending.job
        if job.error is not None:
            err = job.error
            if hasattr(err, "add_note"):
                err.add_note(f"(raised in nnstat's background statistics of step {pending.step})")
            raise err
        metrics = assemble(pending.plan, {**pending.local, **job.result()})
        if pending.conflicts:
            self._drop_torn(metrics, pending)
        metrics.update(pending.extra)
        pending.handle._data = metrics
        self._deliver(metrics, pending.step, pending.handle)

    def _drop_torn(self, metrics: dict[str, Any], pending: _Pending) -> None:
        labels = drop_keys(metrics, pending.conflicts)
        warnings.warn(
            f"Tracker: {labels[:5]}{' ...' if len(labels) > 5 else ''} changed in place while "
            f"the background thread read them (after tracker.step()); their statistics of step {pending.step} are skipped (those "
            f"values no longer exist), the update of the next logged step is measured from the "
            f"weights as they are now, and statistics are computed synchronously from now on",
            stacklevel=4,
        )


def drop_keys(metrics: dict[str, Any], torn: list[tuple[str, str]]) -> list[str]:
    """Delete the metrics of each torn ``(group, layer)`` (a torn weight or update takes the
    layer's ratios along, a weight its update too); returns their ``"group/layer"`` labels."""
    prefixes = []
    for group, name in torn:
        prefixes.append(f"{group}/{name}/")
        if group in ("weight", "update"):
            prefixes += [f"trust_ratio/{name}", f"update_ratio/{name}"]
        if group == "weight":
            prefixes.append(f"update/{name}/")
    for key in [k for k in metrics if k.startswith(tuple(prefixes))]:
        del metrics[key]
    return [f"{g}/{n}" for g, n in torn]


def task_costs(plan: StepPlan, todo: list[tuple[str, Any]]) -> list[float]:
    """Relative cost of each task of `todo`: the elements it reads (a weight/update task reads
    the weights and their snapshot)."""
    numel = {f"group:{g}": float(sum(t.numel() for t in ts)) for g, _, ts in plan.groups}
    weights = float(sum(t.numel() for t in plan.weights or ()))
    return [numel[k] if k in numel else 2.0 * weights for k, _ in todo]


def split_run(
    todo: list[tuple[str, Any]], costs: list[float], blocks: bool = False
) -> dict[str, Any]:
    """Run independent tasks on this thread and on the statistics worker at once; returns
    ``{key: fn()}`` once both are done (the same numbers as running them in order).

    `blocks`: every task is a blocked numpy pass of `nnstat.describe.fused` (the default
    statistics, `nnstat.tracker.compute.shares_blocks`): the tasks run in order and both
    threads share each one block by block, so they finish together (a split by tasks would
    leave this thread alone with the weight/update pass, the longest). Otherwise each task runs whole on one thread, split by
    `costs` (longest first onto the less loaded side); the worker's share is submitted first,
    so both sides start at once.

    Example:
        >>> split_run([("a", lambda: 1), ("b", lambda: 2)], [1.0, 1.0])
        {'a': 1, 'b': 2}
    """
    if blocks:
        with share_blocks(submit):
            return {k: fn() for k, fn in todo}
    order = sorted(range(len(todo)), key=lambda i: -costs[i])
    mine: list[int] = []
    theirs: list[int] = []
    load = [0.0, 0.0]
    for i in order:
        side = 0 if load[0] <= load[1] else 1
        (mine if side == 0 else theirs).append(i)
        load[side] += costs[i]
    job = submit(lambda: {todo[i][0]: todo[i][1]() for i in theirs}) if theirs else None
    out: dict[str, Any] = {}
    try:
        for i in mine:
            out[todo[i][0]] = todo[i][1]()
    finally:
        if job is not None:
            job.wait()  # never leave the worker reading tensors the caller goes on to change
    if job is not None:
        out.update(job.result())
    return {k: out[k] for k, _ in todo}


class StepMetrics(Mapping[str, Any]):
    """The metrics of a step whose statistics are still on their way: reduced by the background
    worker (CPU), or copied from the accelerator without waiting (`nnstat.tracker.delivery`).

    A read-only mapping: the first read waits for them (and hands the step to the sinks if
    that has not happened yet), so reading it every step gives up the overlap (on a GPU: makes
    the host wait for the device every step): log through sinks to keep it. ``dict(m)`` or
    ``m.copy()`` gives a plain dict, e.g. for ``json.dump``.

    Args:
        tracker: the `nnstat.Tracker` that made it (`Tracker.step` builds it).
        step: the step number.

    Raises:
        Exception: (on first read) the error of that step's statistics or of a sink.

    Example:
        >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> import nnstat
        >>> m = nnstat.Tracker(model, opt, background=True, stats=["l2"], groups=["weight"]).step()
        >>> sorted(m)
        ['weight/bias/l2', 'weight/weight/l2']
    """

    def __init__(self, tracker: Any, step: int) -> None:
        self._tracker = tracker
        self.step = step
        self._data: dict[str, Any] | None = None
        self._missing = f"the statistics of step {step} failed (raised before)"

    def _resolve(self) -> dict[str, Any]:
        if self._data is None:
            self._tracker._settle(self)  # waits for this step, hands it to the sinks
            if self._data is None:
                raise RuntimeError(self._missing)
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._resolve()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolve())

    def __len__(self) -> int:
        return len(self._resolve())

    def __repr__(self) -> str:
        return f"StepMetrics(step={self.step}, {self._resolve()!r})"

    def copy(self) -> dict[str, Any]:
        """A plain dict of the metrics (``wandb.log(tracker.step())`` copies what it gets)."""
        return dict(self._resolve())


@dataclass(eq=False)
class _Pending:
    step: int
    plan: StepPlan
    job: Job
    watched: list[tuple[str, str, torch.Tensor, int]]
    handle: StepMetrics
    local: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    joined: bool = False
    conflicts: list[tuple[str, str]] = field(default_factory=list)
    guard: threading.Event = field(default_factory=threading.Event)
    late_conflicts: list[tuple[str, str]] = field(default_factory=list)


def _hook_target(optimizer: Any) -> torch.optim.Optimizer | None:
    """The optimizer whose ``step()`` runs step pre-hooks: wrappers that never ran
    ``Optimizer.__init__`` (accelerate's ``AcceleratedOptimizer``) delegate to ``.optimizer``."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, torch.optim.Optimizer) and hasattr(
            optimizer, "_optimizer_step_pre_hooks"
        ):
            return optimizer
        optimizer, seen = getattr(optimizer, "optimizer", None), seen + 1
    return None


# trackers with background statistics not yet handed to their sinks (kept alive until then)
_PENDING: set[BackgroundSteps] = set()
_ATEXIT = [False]


def _forget_pending() -> None:
    # a forked child has no worker thread: its copies of pending steps would never complete,
    # and they belong to the parent, which delivers them (the child's sinks must not repeat them)
    for tracker in list(_PENDING):
        tracker._pending = None
        tracker._inflight.clear()  # device copies: the child has no CUDA context of its own
    _PENDING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pending)


def _register_atexit() -> None:
    # registered at first use, i.e. after the sinks' own libraries (atexit runs last-in
    # first-out, so the statistics reach W&B/TensorBoard before those shut down)
    if not _ATEXIT[0]:
        atexit.register(_flush_all)
        _ATEXIT[0] = True


def _flush_all() -> None:
    errors = []
    for tracker in list(_PENDING):
        try:
            tracker.flush()
        except BaseException as e:  # flush every tracker, then report every failure
            errors.append(e)
    if not errors:
        return
    # an exception leaving an atexit callback is printed as "ignored" and the exit status stays
    # 0: print them here and make the exit status say the run's last statistics were lost
    print(
        f"nnstat: {len(errors)} error(s) while delivering background statistics at interpreter "
        "exit (the last steps may be missing from some sinks); the process exits with status "
        "120. Call tracker.close() at the end of training to get this error there instead.",
        file=sys.stderr,
    )
    for e in errors:
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    _fail_exit_status()


class _FailingFinalFlush:
    """Stands in for ``sys.stdout``/``sys.stderr``; its flush fails once the interpreter is
    finalizing.

    No API sets the exit status from an atexit callback; ``os._exit`` would skip the callbacks
    still to run (e.g. W&B's own teardown) and the flushing of open files. CPython flushes the
    standard streams after every atexit callback and, if that fails, exits with status 120
    (``Py_RunMain``), so the failure is reported without cutting anything short.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __repr__(self) -> str:
        return f"<{self._stream!r}, failing its final flush for nnstat>"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()
        # only the interpreter's final flush fails (later atexit callbacks still flush freely)
        if sys.is_finalizing():
            raise RuntimeError(
                "nnstat: background statistics could not be delivered at exit (errors above): "
                "exit status 120"
            )


def _fail_exit_status() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        if stream is not None and not getattr(stream, "closed", True):
            setattr(sys, name, _FailingFinalFlush(stream))
            return
    os._exit(120)  # no open standard stream to fail with: end now rather than exit with 0
