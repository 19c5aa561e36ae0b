"""The Tracker's steps on the CPU worker thread: scheduling, the safety checks, delivery in order.

`WorkerSteps` is the executor of `nnstat.tracker.Tracker` that hands a logged step's
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
  stays synchronous from then on. ``p.data`` writes bypass version counters: each weight's L2
  norm is taken when the step is scheduled (one pass over the weights, ``torch._foreach_norm``
  summing in float64)
  and again by the worker once it has read them; a weight whose norm differs was edited after
  ``tracker.step()`` and is dropped the same way (an edit that keeps every norm, a sign flip or
  a permutation, or one that moves a norm by less than 1e-9 relative, is not seen);
* a worker exception is re-raised in the training thread at the next ``step``/``flush``/
  ``close`` or when the step's metrics are read; a sink's exception too, after every other sink
  got the step (and, at ``step``, after that step is scheduled, so no sink loses it);
* pending steps are flushed at exit (`nnstat.tracker.pending`).

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

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch

from nnstat.background import Job, submit
from nnstat.distributed import any_dtensor, is_distributed
from nnstat.tracker.compute import StepPlan, assemble
from nnstat.tracker.pending import StepMetrics, drop_keys

__all__ = ["Pending", "WorkerSteps", "hook_target"]


class WorkerSteps:
    """The Tracker's CPU worker executor (see the module docstring).

    It owns the step in flight (`pending`) and the optimizer's step pre-hook that waits for it;
    the Tracker hands it a step with `schedule` and takes the finished metrics back with
    `finish`, to deliver them. `torn` turns True once a tensor changed while the worker read it
    (the Tracker then stays synchronous).

    Args:
        background: the Tracker's ``background`` argument (``None``: auto).
        optimizer: the Tracker's optimizer (``None``: none).
        names: the tracked parameters' names.
        params: the tracked parameters.
        prev: the Tracker's weight snapshot (``None``: updates not tracked); torn layers of it
            are copied again from the weights.
        fsdp1: the model is wrapped by FSDP1 (never background).
    """

    def __init__(
        self,
        background: bool | None,
        optimizer: Any,
        names: list[str],
        params: list[torch.Tensor],
        prev: list[torch.Tensor] | None,
        fsdp1: bool,
    ) -> None:
        self.background, self.optimizer, self.fsdp1 = background, optimizer, fsdp1
        self.names, self.params, self.prev = names, params, prev
        self.pending: Pending | None = None
        self.torn = False
        self._hook: Any = None
        # the Tracker's signal guard (`CommitOnSignal.hold`): a flush on SIGTERM must not cut
        # into the pre-hook's check of what the worker read
        self.hold: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext
        self._grad_storages: list[weakref.ref] | None = None

    def usable(self, on_cpu: bool) -> bool:
        """Whether this step may go to the worker (the Tracker checks it is not synchronous)."""
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
            and (self.optimizer is None or hook_target(self.optimizer) is not None)
            and not self.fsdp1
            and not any_dtensor(self.params)
        )

    def holds(self, handle: StepMetrics) -> bool:
        """Whether `handle` is the step in flight."""
        return self.pending is not None and self.pending.handle is handle

    def ready(self) -> bool:
        """Whether a step is in flight and the worker is done with it (`finish` waits not)."""
        return self.pending is not None and self.pending.job.done()

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

    def schedule(
        self, step: int, plan: StepPlan, todo: list[Any], settle: Callable[[StepMetrics], None]
    ) -> StepMetrics:
        """Hand step `step`'s tasks `todo` to the worker (gradients written in place are read
        here, now); returns its `StepMetrics`, which `settle` fills in when first read."""
        # gradients written in place must be read now; everything else waits in place for the
        # worker (weights and optimizer states change only in optimizer.step: pre-hook)
        inline = {"group:grad"} if self._grads_reused(plan) else set()
        remote = [(k, fn) for k, fn in todo if k not in inline]
        watched, grad_watch = [], []
        for group, names, tensors in plan.groups:
            if f"group:{group}" not in inline:
                rows = [(group, n, t, t._version) for n, t in zip(names, tensors, strict=True)]
                (grad_watch if group == "grad" else watched).extend(rows)
        if plan.paired and plan.weights is not None:
            watched += [
                ("weight", n, t, t._version) for n, t in zip(plan.names, plan.weights, strict=True)
            ]
        edits = NormCheck([(n, t) for g, n, t, _ in watched if g == "weight"])
        # first: a failure here must not leave a step pending
        if self.optimizer is not None and self._hook is None:
            ref = weakref.ref(self)

            def wait_for_statistics(optimizer: Any, args: Any, kwargs: Any) -> None:
                steps = ref()
                if steps is not None and steps.pending is not None:
                    with steps.hold():
                        steps.join(steps.pending, whole=False)

            self._hook = hook_target(self.optimizer).register_step_pre_hook(wait_for_statistics)
        guard = threading.Event()
        late_conflicts: list[tuple[str, str]] = []
        edited: list[tuple[str, str]] = []  # weights the worker found edited (.data)
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
                # before the optimizer may change the weights (its pre-hook waits for guard)
                edited.extend(("weight", n) for n in edits.changed())
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
        pending = Pending(step, plan, job, watched, StepMetrics(settle, step))
        pending.guard, pending.late_conflicts, pending.edited = guard, late_conflicts, edited
        self.pending = pending
        # overlap: tasks that must run now do so while the worker reads the rest
        try:
            pending.local = {k: fn() for k, fn in todo if k in inline}
        except BaseException:
            pending.job.wait()  # this step cannot be completed: nothing of it is delivered
            self.pending = None
            raise
        return pending.handle

    def join(self, pending: Pending, whole: bool = True) -> None:
        """Wait for the worker (only for what the optimizer changes unless `whole`) and check
        nothing it read changed meanwhile (safe inside the optimizer's pre-hook)."""
        if not pending.joined:
            pending.guard.wait()
            pending.joined = True
            found = [(g, n) for g, n, t, v in pending.watched if t._version != v]
            self._conflicts(pending, found + [e for e in pending.edited if e not in found])
            pending.watched = []
        if whole and not pending.job.done():
            pending.job.wait()
        if whole and pending.late_conflicts:
            self._conflicts(pending, pending.late_conflicts)
            pending.late_conflicts = []

    def _conflicts(self, pending: Pending, found: list[tuple[str, str]]) -> None:
        if not found:
            return
        pending.conflicts += found
        self.torn = True
        torn = {n for g, n in found if g == "weight"}
        if self.prev is not None and torn:
            # the snapshot of these layers was copied from weights being modified
            for n, prev, p in zip(self.names, self.prev, self.params, strict=True):
                if n in torn:
                    prev.copy_(p.detach())

    def finish(self) -> tuple[dict[str, Any], int, StepMetrics] | None:
        """Wait for the step in flight and return ``(metrics, step, handle)`` to deliver
        (``None``: none in flight).

        Raises:
            BaseException: what the worker raised reducing the step (the step is dropped).
        """
        pending = self.pending
        if pending is None:
            return None
        self.join(pending)
        self.pending = None
        self.close()  # the hook is registered again with the next background step
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
        pending.handle.set(metrics)
        return metrics, pending.step, pending.handle

    def close(self) -> None:
        """Remove the optimizer's step pre-hook."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _drop_torn(self, metrics: dict[str, Any], pending: Pending) -> None:
        labels = drop_keys(metrics, pending.conflicts)
        warnings.warn(
            f"Tracker: {labels[:5]}{' ...' if len(labels) > 5 else ''} changed in place while "
            f"the background thread read them (after tracker.step(), e.g. a p.data edit); their "
            f"statistics of step {pending.step} are skipped (those values no longer exist), the "
            f"update of the next logged step is measured from the weights as they are now, and "
            f"statistics are computed synchronously from now on. Call tracker.flush() before "
            f"editing weights after tracker.step(), or use background=False",
            stacklevel=4,
        )


class NormCheck:
    """The L2 norm of each weight when a step is scheduled (``torch._foreach_norm``: one pass,
    in the training thread), and which differ when :meth:`changed` takes them again.

    Example:
        >>> w = torch.ones(3); check = NormCheck([("w", w)])
        >>> w.data[1] = 5.0; check.changed()
        ['w']
    """

    def __init__(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.names = [n for n, _ in named]
        self.tensors = [t.detach() for _, t in named if t.is_floating_point()]
        if len(self.tensors) != len(self.names):  # integer weights: nothing to compare
            self.names, self.tensors = [], []
        self.norms = self._norms()

    def _norms(self) -> list[torch.Tensor]:
        # float64 sums: the worker's thread count may order them differently (see changed)
        return torch._foreach_norm(self.tensors, 2, dtype=torch.float64) if self.tensors else []

    def changed(self) -> list[str]:
        """The names whose weight's norm is not what it was, beyond the 1e-9 relative that a
        float64 sum taken in another order may differ by (NaN == NaN); the tensors are let go."""
        if not self.tensors:
            return []
        now, self.tensors = self._norms(), []
        a, b = torch.stack(self.norms), torch.stack(now)
        # equal first: an infinite norm stays infinite (inf - inf is NaN, never <= a bound)
        same = (a == b) | ((a - b).abs() <= 1e-9 * a.abs()) | (a.isnan() & b.isnan())
        return [n for n, kept in zip(self.names, same.tolist(), strict=True) if not kept]


@dataclass(eq=False)
class Pending:
    """A logged step whose statistics the worker thread reduces (`WorkerSteps`)."""

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
    edited: list[tuple[str, str]] = field(default_factory=list)


def hook_target(optimizer: Any) -> torch.optim.Optimizer | None:
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
