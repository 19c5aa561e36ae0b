"""Deferred delivery of device statistics: no host synchronisation inside ``Tracker.step()``.

On an accelerator a logged step's reductions are queued on the device (`compute.stage`) and
their tables start for the host in ONE non-blocking copy into pinned memory, followed by a CUDA
event (`nnstat.background.transfer`). Later calls of ``step()`` poll the event (no wait) and
hand the steps that have arrived to the sinks, in order; ``flush()``, ``close()``, reading a
returned `StepMetrics` and ``tracker.latest`` wait for them (reading is the caller's choice to
wait). Values and step numbers are those of the synchronous path.

A step's host tables are exact except for tensors holding NaN/Inf (or overflowing in float32):
`compute.finish` recomputes those rows over the finite elements from the tensors themselves.
The tensors stay referenced until the step is delivered; one that changed in place before then
(``_version``: the next optimizer step, ``zero_grad(set_to_none=False)``, the snapshot refresh)
can no longer give step t's values: its statistics of that step are dropped with a warning and
the Tracker reads every later step back inside ``step()`` (one transfer per step, as before).

Example:
    >>> import torch, nnstat
    >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> seen = []
    >>> tracker = nnstat.Tracker(model, opt, sinks=[lambda m, s: seen.append(s)])
    >>> for _ in range(2):
    ...     model(torch.ones(1, 2)).sum().backward(); opt.step()
    ...     _ = tracker.step()   # on a GPU: returns before the numbers reach the host
    >>> tracker.flush(); seen
    [0, 1]
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from nnstat.background.deferred import InFlight, InOrder
from nnstat.background.transfer import HostBuffers, LocalCopy, start_copy
from nnstat.tracker.compute import Staged, StepPlan, assemble, finish, stage
from nnstat.tracker.pending import StepMetrics, drop_keys

__all__ = ["DeviceSteps", "rereads"]


def rereads(plan: StepPlan, st: Staged, host: list[torch.Tensor]) -> list[tuple[str, str, Any]]:
    """``(group, layer, tensor)`` that `compute.finish` reads again from the device for these
    host tables: the rows flagged by a non-finite probe (a table's last column, `repair_table`;
    histograms are binned again for the same rows) and the paired weight/update rows with a
    non-finite sum of squares (`repair_update_rows`, which reads the weights and the snapshot).

    Keep in step with `finish` (``tests/tracker/test_tracker_deferred.py`` checks that `finish`
    reads nothing else). Empty tensors are flagged too; they hold nothing that could change.
    """
    names = {f"group:{g}": n for g, n, _ in plan.groups}
    names["update"] = plan.names
    out: list[tuple[str, str, Any]] = []
    for key, (tensors, at, *_) in st.groups.items():
        group = "update" if key == "update" else key.removeprefix("group:")
        for i in (~torch.isfinite(host[at][:, -1])).nonzero().flatten().tolist():
            out.append((group, names[key][i], tensors[i]))
    if st.paired is not None:  # the paired pass' weight and update tables (`repair_table` both)
        assert plan.weights is not None and plan.prev is not None
        views = plan.update_views if plan.update_views is not None else plan.prev
        for group, at, tensors in (
            ("weight", st.paired[0], plan.weights),
            ("update", st.paired[1], views),
        ):
            for i in (~torch.isfinite(host[at][:, -1])).nonzero().flatten().tolist():
                out.append((group, plan.names[i], tensors[i]))
    return out


@dataclass(eq=False)
class _Step:
    """What a logged step in flight needs at delivery (`InFlight.work`)."""

    plan: StepPlan
    staged: Staged
    versions: dict[int, int]  # id(tensor) -> its _version when staged
    extra: list[Mapping[str, Any]] = field(default_factory=list)


class DeviceSteps:
    """The Tracker's device-deferred executor (see the module docstring).

    It owns the steps on their way to the host (`inflight`) and the pinned buffers their copies
    land in; the Tracker queues a step with `defer` and hands `arrived` the function that
    delivers finished steps to the sinks. `torn` turns True once a step's NaN/Inf rows could not
    be recomputed (the Tracker then reads every step back inside ``step()``).

    Example:
        >>> DeviceSteps().torn
        False
    """

    def __init__(self) -> None:
        self.inflight = InOrder()
        self.torn = False
        self._buffers = HostBuffers(pin=True, minimum=256)
        self._warned_meta = False

    def holds(self, handle: StepMetrics) -> bool:
        """Whether `handle`'s step is on its way."""
        return self.inflight.holds(handle)

    def defer(
        self,
        step: int,
        plan: StepPlan,
        workspaces: dict[str, Any],
        extra: list[Any],
        settle: Callable[[StepMetrics], None],
    ) -> StepMetrics:
        """Queue step `step`'s reductions and its one copy to the host; nothing is read back.
        Returns its `StepMetrics` (`settle` fills it in when first read)."""
        st = stage(plan, workspaces)
        # what finish may read again, as it is now (the snapshot refresh below changes prev)
        held = [t for tensors, *_ in st.groups.values() for t in tensors]
        held += [*(plan.weights or ()), *(plan.prev or ())]
        versions = {id(t): t._version for t in held}
        if plan.refresh and plan.prev is not None and plan.weights is not None:
            # queued after the reductions that read the snapshot, before the next optimizer
            # step changes the weights; finish must not refresh it again, later
            torch._foreach_copy_(plan.prev, plan.weights)
            plan.refresh = False
        copy = start_copy(st.parts, self._buffers)
        handle = StepMetrics(settle, step)
        if isinstance(copy, LocalCopy) and copy.meta:
            # no values exist: nothing is queued for the sinks (nor for the flush at exit)
            handle.missing = f"step {step}: {LocalCopy.META}"
            if not self._warned_meta:
                self._warned_meta = True
                warnings.warn(
                    f"Tracker: the model is on the meta device: {LocalCopy.META}; its sinks "
                    "receive nothing (warned once)",
                    stacklevel=4,
                )
            return handle
        work = _Step(plan, st, versions, extra)
        self.inflight.append(InFlight(copy, work, [handle], step))
        return handle

    def arrived(
        self,
        deliver: Callable[[dict[str, Any], int, StepMetrics], None],
        wait: bool,
        upto: StepMetrics | None = None,
    ) -> None:
        """``deliver(metrics, step, handle)`` the steps whose copies have arrived, oldest first;
        with `wait` every queued step (up to `upto`'s when given), waiting for its copy."""
        self.inflight.drain(
            lambda entry: deliver(*self._complete(entry)),
            wait,
            upto,
            note=lambda f: f"(raised completing nnstat's device statistics of step {f.number})",
        )

    def _complete(self, entry: InFlight) -> tuple[dict[str, Any], int, StepMetrics]:
        f: _Step = entry.work
        host = entry.copy.wait()
        torn = [
            (group, name)
            for group, name, t in rereads(f.plan, f.staged, host)
            if t.numel()
            and t._version != f.versions.get(id(t))
            and not (group == "update" and f.plan.skip_update)  # left out of this step anyway
        ]
        metrics = assemble(f.plan, finish(f.plan, f.staged, host))
        if torn:
            labels = drop_keys(metrics, torn)
            self.torn = True
            warnings.warn(
                f"Tracker: {labels[:5]}{' ...' if len(labels) > 5 else ''} held NaN/Inf at step "
                f"{entry.number} and changed in place before that step reached the host, so their "
                "statistics over the finite elements could not be computed: they are left out "
                f"of step {entry.number}, and from now on each step is read back inside tracker.step() "
                "(one device-to-host transfer per step) so that NaN/Inf rows stay exact",
                stacklevel=5,
            )
        for extra in f.extra:
            metrics.update(extra)
        entry.handles[0].set(metrics)
        return metrics, entry.number, entry.handles[0]
