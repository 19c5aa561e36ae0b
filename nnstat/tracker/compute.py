"""The statistics of one Tracker step as independent tasks, and the metric dict built from them.

A `StepPlan` lists what one logged step reads: the weights with their snapshot (for updates)
and every other group (gradients, optimizer states...). `tasks` turns it into a few
independent tasks (one per group; weights and updates together when the fused pass applies).
The Tracker runs them inline or on the background worker; a task computes the same numbers
wherever it runs, so both give bit-identical metrics. `assemble` then builds the flat ``"<group>/<layer>/<stat>"`` dict.

Example:
    >>> import torch
    >>> w, prev = [torch.tensor([3.0, 4.0])], [torch.tensor([3.0, 3.0])]
    >>> plan = StepPlan(["w"], ("l2",), fused=True, weights=w, prev=prev, refresh=True)
    >>> results = {key: fn() for key, fn in tasks(plan)}
    >>> metrics = assemble(plan, results)
    >>> metrics["weight/w/l2"], metrics["update/w/l2"], metrics["trust_ratio/w"]
    (5.0, 1.0, 5.0)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nnstat.describe import Workspace, summarize
from nnstat.describe.fused import light_columns, weight_update_norms
from nnstat.describe.histogram import HIST_SUMMARY, histograms
from nnstat.describe.ratios import ratio_from_norms
from nnstat.distributed import local_tensor

__all__ = ["StepPlan", "tasks", "assemble"]

Task = tuple[str, Callable[[], Any]]


@dataclass
class StepPlan:
    """What one logged step reduces.

    `groups` holds ``(group, layer names, tensors)`` for every group but updates (and but the
    weights when `fused`). `weights`/`prev` are the current weights and their snapshot when
    updates are tracked; `update_views` what to summarize after the in-place difference
    (FSDP1 wrappers of `prev`; `prev` itself otherwise). `refresh`: leave ``prev == weights``.
    `skip_update`: no optimizer step since the snapshot, so the update is still computed (the
    snapshot refresh rides on it) but its keys and the ratios are left out of the metrics.
    """

    names: list[str]
    stats: tuple[str, ...]
    fused: bool = False
    weights: list[torch.Tensor] | None = None
    prev: list[torch.Tensor] | None = None
    refresh: bool = False
    update_views: list[torch.Tensor] | None = None
    groups: list[tuple[str, list[str], list[torch.Tensor]]] = field(default_factory=list)
    histograms: bool = False
    bins: int = 64
    hist_max_elements: int | None = None
    weight_in_groups: bool = True
    skip_update: bool = False

    @property
    def computed(self) -> tuple[str, ...]:
        """Columns computed per tensor: the requested statistics, l2 (trust ratios) and what
        histograms need."""
        extra = HIST_SUMMARY if self.histograms else ()
        return tuple(dict.fromkeys([*self.stats, "l2", *extra]))


def tasks(plan: StepPlan, workspaces: dict[str, Workspace] | None = None) -> list[Task]:
    """``(key, fn)`` per independent task; ``fn()`` returns what `assemble` needs.

    `workspaces` maps a task key to its scratch buffers (tasks may run concurrently, so each
    gets its own); missing keys get a fresh `Workspace`.
    """
    ws = workspaces if workspaces is not None else {}
    out: list[Task] = []
    computed = plan.computed

    def group_task(tensors: list[torch.Tensor], key: str) -> Callable[[], Any]:
        def run() -> Any:
            table = summarize(tensors, computed, workspace=ws.setdefault(key, Workspace()))
            return table, _hists(plan, tensors, table)

        return run

    for group, _names, tensors in plan.groups:
        out.append((f"group:{group}", group_task(tensors, f"group:{group}")))
    if plan.prev is not None and plan.weights is not None:
        w, prev = plan.weights, plan.prev
        if plan.fused:

            def fused() -> Any:
                return weight_update_norms(
                    w, prev, plan.refresh, ws.setdefault("update", Workspace())
                )

            out.append(("update", fused))
        else:
            views = plan.update_views if plan.update_views is not None else prev

            def update() -> Any:
                # in place and in one pass: prev becomes W_t - W_prev (out= may alias an input)
                for p, cur in zip(prev, w, strict=True):
                    torch.sub(local_tensor(cur), local_tensor(p), out=local_tensor(p))
                table = summarize(views, computed, workspace=ws.setdefault("update", Workspace()))
                hists = _hists(plan, views, table)
                if plan.refresh:
                    torch._foreach_copy_(
                        [local_tensor(p) for p in prev], [local_tensor(c) for c in w]
                    )
                return table, hists

            out.append(("update", update))
    return out


def _hists(plan: StepPlan, tensors: list[torch.Tensor], table: torch.Tensor) -> list[Any] | None:
    if not plan.histograms:
        return None
    computed = plan.computed
    summary = table[:, [computed.index(c) for c in HIST_SUMMARY]]
    return histograms(tensors, plan.bins, plan.hist_max_elements, summary=summary)


def assemble(plan: StepPlan, results: dict[str, Any]) -> dict[str, Any]:
    """The flat metrics dict of a step from the results of its `tasks` (by task key)."""
    computed = plan.computed
    metrics: dict[str, Any] = {}
    w_l2 = u_l2 = None
    l2 = computed.index("l2")

    def put(group: str, names: list[str], table: torch.Tensor, hists: list[Any] | None) -> None:
        for name, row in zip(names, table.tolist(), strict=True):
            for s, v in zip(computed, row, strict=True):
                if s in plan.stats:
                    metrics[f"{group}/{name}/{s}"] = v
        if hists is not None:
            for name, h in zip(names, hists, strict=True):
                metrics[f"{group}/{name}/hist"] = h

    fused_tables = None
    if plan.fused and "update" in results:
        norms = results["update"]
        numel = torch.tensor([t.numel() for t in plan.weights], dtype=torch.float64)
        fused_tables = []
        for lo in (0, 4):
            cols = light_columns(numel, *(norms[:, lo + k] for k in range(4)))
            fused_tables.append(torch.stack([cols[s] for s in computed], dim=1))
        put("weight", plan.names, fused_tables[0], None)
        w_l2 = fused_tables[0][:, l2]
    for group, names, _tensors in plan.groups:
        table, hists = results[f"group:{group}"]
        put(group, names, table, hists)
        if group == "weight":
            w_l2 = table[:, l2]
    if "update" in results and not plan.skip_update:
        if fused_tables is not None:
            put("update", plan.names, fused_tables[1], None)
            u_l2 = fused_tables[1][:, l2]
        else:
            table, hists = results["update"]
            put("update", plan.names, table, hists)
            u_l2 = table[:, l2]
    if w_l2 is not None and u_l2 is not None and plan.weight_in_groups:
        tr = ratio_from_norms(w_l2, u_l2).tolist()
        ur = ratio_from_norms(u_l2, w_l2).tolist()
        for name, r, u in zip(plan.names, tr, ur, strict=True):
            metrics[f"trust_ratio/{name}"] = r
            metrics[f"update_ratio/{name}"] = u
    return metrics
