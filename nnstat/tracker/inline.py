"""The Tracker's inline executor: a logged step's statistics computed inside ``step()``.

On CPU the tasks run on the training thread; with two or more torch threads they are shared
with the statistics worker (training keeps both cores busy, so there is no idle core to hide
background statistics on, and the step waits less): the default statistics as ONE blocked pass
over every task's blocks (`nnstat.tracker.compute.one_pass`), other statistics task by task
(`split_run`). Sharded parameters (FSDP1,
DTensor) run their tasks in order (their collectives keep one order on every rank); a
synchronous accelerator step queues every reduction on the device and reads them in ONE
transfer (`nnstat.tracker.compute.device_results`).

Example:
    >>> import torch
    >>> from nnstat.tracker.compute import StepPlan
    >>> w = torch.ones(3)
    >>> plan = StepPlan(names=["w"], stats=["l2"], paired=False, refresh=False,
    ...                 groups=[("weight", ["w"], [w])])
    >>> InlineSteps([w], fsdp1=False).run(plan, [("group:weight", lambda: 1.0)], {}, True)
    {'group:weight': 1.0}
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from nnstat.background import submit
from nnstat.describe import cpu_single_thread
from nnstat.describe.block_passes import share_blocks
from nnstat.distributed import any_dtensor
from nnstat.tracker.compute import StepPlan, device_results, one_pass, shares_blocks

__all__ = ["InlineSteps", "split_run", "task_costs"]


class InlineSteps:
    """The synchronous executor (see the module docstring).

    Args:
        params: the tracked parameters.
        fsdp1: the model is wrapped by FSDP1.
    """

    def __init__(self, params: list[torch.Tensor], fsdp1: bool) -> None:
        self.params, self.fsdp1 = params, fsdp1

    def split_ok(self, on_cpu: bool) -> bool:
        """Whether the synchronous CPU statistics run on two threads at once (this one and the
        worker): with two or more torch threads training keeps both cores busy, so background
        statistics have no idle core to hide on; split, the step waits less for them
        (docs/benchmarks.md, "Statistics overhead")."""
        # sharded parameters reduce with collectives, which must keep one order on every rank
        return (
            on_cpu
            and torch.get_num_threads() >= 2
            and not self.fsdp1
            and not any_dtensor(self.params)
        )

    def run(
        self, plan: StepPlan, todo: list[tuple[str, Any]], workspaces: dict[str, Any], on_cpu: bool
    ) -> dict[str, Any]:
        """The results ``{task key: value}`` of `plan`'s tasks `todo`, computed now."""
        # two threads share one task's blocks, or take whole tasks when there are several;
        # decided outside cpu_single_thread: both read the thread count
        blocks = shares_blocks(plan)
        split = (blocks or len(todo) > 1) and self.split_ok(on_cpu)
        with cpu_single_thread() if on_cpu else contextlib.nullcontext():
            if split and blocks:
                # the blocks of every task in one pass shared with the worker: one hand-over
                # and one wait per step (`one_pass`), not one per task
                with share_blocks(submit):
                    return one_pass(plan, workspaces)
            if split:
                return split_run(todo, task_costs(plan, todo))
            if on_cpu or self.fsdp1 or any_dtensor(self.params):
                return {k: fn() for k, fn in todo}
            # accelerators, synchronous: every reduction queued on the device, one transfer
            return device_results(plan, workspaces)


def task_costs(plan: StepPlan, todo: list[tuple[str, Any]]) -> list[float]:
    """Relative cost of each task of `todo`: the elements it reads (a weight/update task reads
    the weights and their snapshot)."""
    numel = {f"group:{g}": float(sum(t.numel() for t in ts)) for g, _, ts in plan.groups}
    weights = float(sum(t.numel() for t in plan.weights or ()))
    return [numel[k] if k in numel else 2.0 * weights for k, _ in todo]


def split_run(todo: list[tuple[str, Any]], costs: list[float]) -> dict[str, Any]:
    """Run independent tasks on this thread and on the statistics worker at once; returns
    ``{key: fn()}`` once both are done (the same numbers as running them in order).

    Each task runs whole on one thread, split by `costs` (longest first onto the less loaded
    side); the worker's share is submitted first, so both sides start at once. (The default
    statistics' blocked passes are shared block by block instead: `one_pass`.)

    Example:
        >>> split_run([("a", lambda: 1), ("b", lambda: 2)], [1.0, 1.0])
        {'a': 1, 'b': 2}
    """
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
