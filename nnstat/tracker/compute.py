"""The statistics of one Tracker step as independent tasks, and the metric dict built from them.

A `StepPlan` lists what one logged step reads: the weights with their snapshot (for updates)
and every other group (gradients, optimizer states...). `tasks` turns it into a few
independent tasks (one per group; weights and updates together when the paired pass applies).
The Tracker runs them inline or on the background worker; a task computes the same numbers
wherever it runs, so both give bit-identical metrics. `assemble` then builds the flat ``"<group>/<layer>/<stat>"`` dict.

Example:
    >>> import torch
    >>> w, prev = [torch.tensor([3.0, 4.0])], [torch.tensor([3.0, 3.0])]
    >>> plan = StepPlan(["w"], ("l2",), paired=True, weights=w, prev=prev, refresh=True)
    >>> results = {key: fn() for key, fn in tasks(plan)}
    >>> metrics = assemble(plan, results)
    >>> metrics["weight/w/l2"], metrics["update/w/l2"], metrics["trust_ratio/w"]
    (5.0, 1.0, 5.0)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from nnstat.background.transfer import flatten_parts, split_parts
from nnstat.describe import Workspace, partials, summarize
from nnstat.describe.block_passes import run_passes
from nnstat.describe.histogram import (
    HIST_SUMMARY,
    bin_counts,
    build_histograms,
    hist_ranges,
    histograms,
    sample_for_histogram,
)
from nnstat.describe.moments import pair_ok
from nnstat.describe.numpy_blocks import (
    LIGHT_STATS,
    light_rows,
    weight_update_norms,
    weight_update_pass,
)
from nnstat.describe.ratios import ratio_from_norms
from nnstat.describe.summary import pair_tables, repair_table, summarize_pass
from nnstat.describe.torch_segments import HistSpec, segment_tables
from nnstat.distributed import local_tensor

__all__ = [
    "StepPlan",
    "tasks",
    "shares_blocks",
    "one_pass",
    "assemble",
    "device_results",
    "stage",
    "finish",
    "snapshot_of",
    "to_host",
]

Task = tuple[str, Callable[[], Any]]


@dataclass
class StepPlan:
    """What one logged step reduces.

    `groups` holds ``(group, layer names, tensors)`` for every group but updates (and but the
    weights when `paired`). `weights`/`prev` are the current weights and their snapshot when
    updates are tracked; `update_views` what to summarize after the in-place difference
    (FSDP1 wrappers of `prev`; `prev` itself otherwise). `refresh`: leave ``prev == weights``.
    `skip_update`: no optimizer step since the snapshot, so the update is still computed (the
    snapshot refresh rides on it) but its keys and the ratios are left out of the metrics.
    """

    names: list[str]
    stats: tuple[str, ...]
    paired: bool = False
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

    paired = _paired_weights(plan)
    for group, _names, tensors in plan.groups:
        if paired is not None and group == "weight":
            continue  # reduced with the update, below
        out.append((f"group:{group}", group_task(tensors, f"group:{group}")))
    if plan.prev is not None and plan.weights is not None:
        w, prev = plan.weights, plan.prev
        if paired is not None:

            def weight_and_update() -> Any:
                # weights and W - prev in one read of both; prev is refreshed afterwards
                tw, td = pair_tables(w, prev, computed, ws.setdefault("update", Workspace()))
                out = {
                    "group:weight": (tw, _hists(plan, paired, tw)),
                    "update": (td, _difference_hists(plan, w, prev, td)),
                }
                if plan.refresh:
                    torch._foreach_copy_(prev, w)
                return out

            out.append((PAIRED, weight_and_update))
        elif plan.paired:

            def paired() -> Any:
                return weight_update_norms(
                    w, prev, plan.refresh, ws.setdefault("update", Workspace())
                )

            out.append(("update", paired))
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


def shares_blocks(plan: StepPlan) -> bool:
    """Whether every task of `plan` is one of `nnstat.describe.numpy_blocks`'s blocked passes on CPU
    tensors (the default statistics: weights paired with their update, the other groups'
    norms with ``abs_max``), so that two threads can share each task's blocks
    (`nnstat.describe.block_passes.share_blocks`) rather than split the tasks."""
    return plan.paired and not plan.histograms and "abs_max" in plan.computed


def one_pass(plan: StepPlan, workspaces: dict[str, Workspace] | None = None) -> dict[str, Any]:
    """The results of every task of a `shares_blocks` plan (``{key: fn() for key, fn in
    tasks(plan)}``, bit for bit) from ONE blocked pass over the blocks of every group and of
    the weights with their update (`nnstat.describe.block_passes.run_passes`).

    Inside `nnstat.describe.block_passes.share_blocks` this thread and the second one share
    that pass: the step hands the second thread one job and waits for it once, where the tasks
    run in turn would hand over and wait once per task. A group the blocked passes do not take
    (not on the CPU, say) is summarized on its own first.
    """
    assert plan.weights is not None and plan.prev is not None, "shares_blocks plans pair them"
    ws = workspaces if workspaces is not None else {}
    computed = plan.computed
    out: dict[str, Any] = {}
    keys, passes = [], []
    for group, _names, tensors in plan.groups:
        key = f"group:{group}"
        blocked = summarize_pass(tensors, computed)
        if blocked is None:
            out[key] = (
                summarize(tensors, computed, workspace=ws.setdefault(key, Workspace())),
                None,
            )
        else:
            keys.append(key)
            passes.append(blocked.then(lambda table: (table, None)))
    keys.append("update")
    update_ws = ws.setdefault("update", Workspace())
    passes.append(weight_update_pass(plan.weights, plan.prev, plan.refresh, update_ws))
    out.update(zip(keys, run_passes(passes), strict=True))
    return {f"group:{group}": out[f"group:{group}"] for group, _, _ in plan.groups} | {
        "update": out["update"]
    }


#: Task key of the weights reduced together with their update (`pair_tables`).
PAIRED = "weight+update"


def _paired_weights(plan: StepPlan) -> list[torch.Tensor] | None:
    """The weight group's tensors when weights and update can be reduced in one read (CPU,
    moment statistics, plain tensors of equal shapes), else None."""
    if plan.paired or plan.prev is None or plan.weights is None or plan.update_views is not None:
        return None
    if not set(plan.computed) - LIGHT_STATS:
        return None  # norms only: the per-group norm kernels are cheaper than the moment pass
    weights = next((t for g, _, t in plan.groups if g == "weight"), None)
    if weights is None or len(weights) != len(plan.weights):
        return None
    if not all(pair_ok(w, p) for w, p in zip(plan.weights, plan.prev, strict=True)):
        return None
    return weights


def _difference_hists(
    plan: StepPlan, w: list[torch.Tensor], prev: list[torch.Tensor], table: torch.Tensor
) -> list[Any] | None:
    """Histograms of ``w - prev`` from the difference of the two samples (same positions), so
    the difference is formed only where it is binned."""
    if not plan.histograms:
        return None
    computed = plan.computed
    summary = table[:, [computed.index(c) for c in HIST_SUMMARY]]
    lo, hi = hist_ranges(summary[:, 0], summary[:, 1])
    samples, sampled = [], []
    for a, b in zip(w, prev, strict=True):
        sa, was = sample_for_histogram(a, plan.hist_max_elements)
        sb, _ = sample_for_histogram(b, plan.hist_max_elements)
        samples.append(sa - sb)
        sampled.append(was)
    counts = bin_counts(samples, lo, hi, plan.bins).numpy()
    return build_histograms(counts, lo.tolist(), hi.tolist(), summary.tolist(), sampled, plan.bins)


@dataclass
class Staged:
    """A step's reductions left on the device (`stage`), to be moved to the host at once.

    `parts` are the device tensors to transfer, in order; `groups` maps a result key to
    ``(tensors, index of its table in parts, index of its histogram rows or None, which
    histograms were subsampled)``; `paired`: the indices of the weight and update tables of the
    norm-only pass.
    """

    parts: list[torch.Tensor] = field(default_factory=list)
    groups: dict[str, tuple[list[torch.Tensor], int, int | None, list[bool]]] = field(
        default_factory=dict
    )
    paired: tuple[int, int] | None = None


def snapshot_of(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The copy of the weights the Tracker measures updates from: contiguous whatever the
    parameters' layout (a transposed or strided parameter), because the blocked passes refresh
    it through flat views, and the flat view of a non-contiguous copy is a new tensor: the
    refresh would be lost and every later update measured from stale weights.

    Example:
        >>> w = torch.nn.Parameter(torch.randn(3, 2).t())
        >>> snap = snapshot_of([w])[0]
        >>> snap.is_contiguous(), torch.equal(snap, w.detach())
        (True, True)
    """
    out = []
    for p in params:
        t = p.detach()
        out.append(t.clone() if t.is_contiguous() else t.contiguous())
    return out


def by_dtype(*lists: list[torch.Tensor]) -> list[tuple[list[torch.Tensor], ...]]:
    """Parallel lists split by (device, dtype) of the first: a multi-tensor kernel takes its
    fast path (one launch per chunk of tensors) only on lists of one dtype and device."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(lists[0]):
        groups.setdefault((t.device, t.dtype), []).append(i)
    if len(groups) == 1:
        return [lists]
    return [tuple([lst[i] for i in idx] for lst in lists) for idx in groups.values()]


def stage(plan: StepPlan, workspaces: dict[str, Workspace] | None = None) -> Staged:
    """Every reduction of `plan` on the tensors' device, with no host synchronisation.

    For accelerators: every group's statistics table and histogram rows come from one
    `nnstat.describe.torch_segments.segment_tables` call (a fixed number of kernels per group and
    dtype, not per tensor) and stay queued on the device; `finish` moves them in one transfer. The update is
    formed in place in the snapshot by multi-tensor kernels (``prev`` becomes ``W_t - W_prev``,
    or its negative when only norm statistics are taken, which the sign does not change); the
    snapshot is refreshed in `finish`, after the rare exact recomputation of non-finite rows
    (which reads that difference).
    """
    ws = workspaces if workspaces is not None else {}
    # one flat buffer for all groups: the device queue orders its uses
    work = ws.setdefault("device", Workspace())
    st = Staged()
    keys = [f"group:{group}" for group, _, _ in plan.groups]
    lists = [tensors for _, _, tensors in plan.groups]
    if plan.prev is not None and plan.weights is not None:
        for prev, cur in by_dtype(plan.prev, plan.weights):
            torch._foreach_sub_(prev, cur)  # prev - W, exact
            if not plan.paired:  # norm statistics alone do not see the sign (one pass less)
                torch._foreach_neg_(prev)
        views = list(plan.update_views if plan.update_views is not None else plan.prev)
        if plan.paired:
            lists += [list(plan.weights), views]
        else:
            keys.append("update")
            lists.append(views)
    spec = HistSpec(plan.bins, plan.hist_max_elements) if plan.histograms else None
    # one call: each list reduced on its own, the statistics of all derived at once
    results = segment_tables(lists, plan.computed, work, spec)
    n = len(keys)
    for key, tensors, (table, hist, sampled) in zip(keys, lists[:n], results[:n], strict=True):
        st.parts.append(table)
        at, h = len(st.parts) - 1, None
        if hist is not None:
            st.parts.append(hist)
            h = len(st.parts) - 1
        st.groups[key] = (tensors, at, h, sampled)
    if len(results) == n + 2:  # the paired pass' weights and update
        st.parts += [results[n][0], results[n + 1][0]]
        st.paired = (len(st.parts) - 2, len(st.parts) - 1)
    return st


def to_host(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """`parts` on the host with ONE device-to-host transfer (float64, shapes kept); it waits
    for the device (`nnstat.tracker.delivery` starts the same copy without waiting)."""
    if not parts:
        return []
    return split_parts(flatten_parts(parts).cpu(), [t.shape for t in parts])


def finish(plan: StepPlan, st: Staged, host: list[torch.Tensor]) -> dict[str, Any]:
    """The results `assemble` takes (as `tasks` would give them) from `stage`'s host copies;
    then refreshes the update snapshot."""
    computed = plan.computed
    results: dict[str, Any] = {}
    for key, (tensors, at, h, sampled) in st.groups.items():
        table = repair_table(host[at], tensors, computed)
        hists = None
        if h is not None:
            summary = table[:, [computed.index(c) for c in HIST_SUMMARY]]
            rows = host[h]
            lo, hi, counts = rows[:, 0].tolist(), rows[:, 1].tolist(), rows[:, 2:].numpy()
            hists = build_histograms(counts, lo, hi, summary.tolist(), sampled, plan.bins)
            probe = host[at][:, -1]
            for i in (~torch.isfinite(probe)).nonzero().flatten().tolist():
                # the device ranges came from non-finite min/max: bin again over the finite range
                hists[i] = histograms(
                    [tensors[i]], plan.bins, plan.hist_max_elements, summary=summary[i : i + 1]
                )[0]
        results[key] = (table, hists)
    if st.paired is not None:
        assert plan.weights is not None and plan.prev is not None
        views = plan.update_views if plan.update_views is not None else plan.prev
        tw = repair_table(host[st.paired[0]], plan.weights, computed)
        results["update"] = (tw, repair_table(host[st.paired[1]], list(views), computed))
    if plan.refresh and plan.prev is not None and plan.weights is not None:
        for prev, cur in by_dtype(plan.prev, plan.weights):
            torch._foreach_copy_(prev, cur)
    return results


def device_results(
    plan: StepPlan, workspaces: dict[str, Workspace] | None = None
) -> dict[str, Any]:
    """The results of every task of `plan` with one host transfer (the accelerator path:
    `stage`, `to_host`, `finish`). Equal to running `tasks` (tested on CPU)."""
    st = stage(plan, workspaces)
    return finish(plan, st, to_host(st.parts))


def _hists(plan: StepPlan, tensors: list[torch.Tensor], table: torch.Tensor) -> list[Any] | None:
    if not plan.histograms:
        return None
    computed = plan.computed
    summary = table[:, [computed.index(c) for c in HIST_SUMMARY]]
    return histograms(tensors, plan.bins, plan.hist_max_elements, summary=summary)


@functools.lru_cache(maxsize=64)
def _metric_keys(
    group: str, names: tuple[str, ...], computed: tuple[str, ...], stats: tuple[str, ...]
) -> tuple[list[str], list[int]]:
    """``"<group>/<name>/<stat>"`` for every name (rows) and asked statistic (columns, in the
    order computed), and those columns: the same names every step, so built once."""
    cols = [i for i, s in enumerate(computed) if s in stats]
    return [f"{group}/{n}/{computed[i]}" for n in names for i in cols], cols


def assemble(plan: StepPlan, results: dict[str, Any]) -> dict[str, Any]:
    """The flat metrics dict of a step from the results of its `tasks` (by task key)."""
    if PAIRED in results:
        results = {k: v for k, v in results.items() if k != PAIRED} | results[PAIRED]
    computed = plan.computed
    metrics: dict[str, Any] = {}
    w_l2 = u_l2 = None
    l2 = computed.index("l2")

    def put(group: str, names: list[str], table: torch.Tensor, hists: list[Any] | None) -> None:
        keys, cols = _metric_keys(group, tuple(names), computed, tuple(plan.stats))
        values = table[:, cols] if len(cols) != table.shape[1] else table
        metrics.update(zip(keys, values.reshape(-1).tolist(), strict=True))
        if hists is not None:
            for name, h in zip(names, hists, strict=True):
                metrics[f"{group}/{name}/hist"] = h

    fused_tables = None
    if plan.paired and "update" in results:
        norms = results["update"]
        if isinstance(norms, tuple):  # the device path's weight and update tables (`finish`)
            fused_tables = list(norms)
        else:  # the CPU pass' rows [sumsq, min, max, nonfinite] of W, then of W - prev
            numel = torch.tensor([t.numel() for t in plan.weights], dtype=torch.float64)
            fused_tables = []
            for lo in (0, 4):
                rows = light_rows(numel, norms[:, lo : lo + 4])
                fused_tables.append(partials.finish(rows, computed, partials.eps_of(torch.float32)))
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
