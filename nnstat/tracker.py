"""Tracker: one line in a training loop logs weight/grad/optimizer-state/update statistics.

Each logged step reduces every tracked tensor with one fused `nnstat.stats.summarize` call (one
host transfer), derives trust ratios from the same norms, adds the metrics of registered
providers, and hands one flat dict to every sink.

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
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from nnstat.distributed import (
    any_dtensor,
    clean_name,
    fsdp1_grad,
    fsdp1_shards,
    fsdp1_whole,
    local_tensor,
)
from nnstat.dynamics import ratio_from_norms
from nnstat.histogram import DEFAULT_MAX_ELEMENTS, HIST_SUMMARY, histograms
from nnstat.netdict import select_names
from nnstat.stats import (
    DEFAULT_STATS,
    Workspace,
    cpu_single_thread,
    summarize,
    validate_stats,
)
from nnstat.stats_fused import FUSED_STATS, light_columns, weight_update_norms

__all__ = ["Tracker", "Sink", "GROUPS"]

#: What a Tracker can watch; ``"optimizer"`` expands to the optimizer's per-parameter states.
GROUPS: tuple[str, ...] = ("weight", "grad", "optimizer", "update")


@runtime_checkable
class Sink(Protocol):
    """Anything with ``log(metrics, step)``; plain callables ``f(metrics, step)`` work too."""

    def log(self, metrics: dict[str, Any], step: int) -> None: ...


def _local(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [local_tensor(t) for t in tensors]


def _as_log(sink: Any) -> Callable[[dict[str, Any], int], None]:
    if hasattr(sink, "log") and callable(sink.log):
        return sink.log
    if callable(sink):
        return sink
    raise TypeError(f"a sink needs a log(metrics, step) method or must be callable, got {sink!r}")


class Tracker:
    """Log statistics of a model (and its optimizer) every `every` calls of `step`.

    Call `step()` once per training iteration, after ``optimizer.step()``. Metric keys:
    ``"<group>/<layer>/<stat>"`` with groups ``weight``, ``grad``, each optimizer state key
    (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``...) and ``update`` (the change made by the
    last optimizer step), plus ``"trust_ratio/<layer>"`` and ``"update_ratio/<layer>"``. With
    ``histograms=True`` keys ``"<group>/<layer>/hist"`` hold `nnstat.stats.Histogram` objects
    (counts from at most `hist_max_elements` elements per tensor, see `nnstat.histogram`).

    Updates need a snapshot of the weights before the step: the Tracker keeps one copy of the
    tracked parameters, refreshed only on the call before a logged step (with the default
    statistics the fused pass rewrites it block by block while it reads the weights).
    On CPU the statistic passes run on one intra-op thread (`nnstat.stats.cpu_single_thread`).

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
        self._workspace = Workspace()
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
        self.latest: dict[str, Any] = {}
        # the update of the first logged step is measured from the weights at construction
        self._prev: list[torch.Tensor] | None = None
        if "update" in self.groups:
            self._prev = [p.detach().clone() for p in self.params]

    # -- wiring ---------------------------------------------------------------------------
    def add_sink(self, sink: Any) -> None:
        """Send every logged dict to `sink` (``sink.log(metrics, step)`` or ``sink(metrics, step)``)."""
        self._sinks.append(_as_log(sink))
        self._sink_objects.append(sink)

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

    def _collect(self, weights: bool = True) -> list[tuple[str, str, torch.Tensor]]:
        entries: list[tuple[str, str, torch.Tensor]] = []
        # FSDP1: flat per-rank slices become DTensors of the whole (reduced, never gathered)
        shards = fsdp1_shards(self.model) if self._fsdp1 else {}
        if weights and "weight" in self.groups:
            entries += [
                ("weight", n, fsdp1_whole(p.detach(), p, shards))
                for n, p in zip(self.names, self.params, strict=True)
            ]
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
            entries += [
                ("grad", n, g.detach())
                for n, g in zip(self.names, grads, strict=True)
                if g is not None
            ]
        if "optimizer" in self.groups:
            for key in self._state_keys():
                for n, p in zip(self.names, self.params, strict=True):
                    v = self.optimizer.state.get(p, {}).get(key)
                    if v is None and id(p) in shards and p.numel() == 0:
                        v = p.detach()  # FSDP1: no slice of this parameter on this rank
                    if isinstance(v, torch.Tensor):
                        entries.append((key, n, fsdp1_whole(v.detach(), p, shards)))
        return entries

    def step(self, step: int | None = None) -> dict[str, Any] | None:
        """Record statistics if this call is a logging step; returns the metrics (else None).

        `step` defaults to the number of previous calls.
        """
        call = self._calls
        self._calls += 1
        step = call if step is None else step
        refresh = self._prev is not None and (call + 1) % self.every == 0
        on_cpu = all(p.device.type == "cpu" for p in self.params)
        with cpu_single_thread() if on_cpu else contextlib.nullcontext():
            metrics, refresh = self._record(call, refresh)
        if refresh:
            # snapshot the weights the next (logged) step's update is measured from
            # on local shards: DTensor (FSDP fully_shard) has no foreach sharding rules
            torch._foreach_copy_(_local(self._prev), _local([p.detach() for p in self.params]))
        if metrics is None:
            return None
        for provider in self._providers:
            extra = provider()
            if not isinstance(extra, Mapping):
                raise TypeError(
                    f"provider {provider!r} returned {type(extra).__name__}, not a dict"
                )
            metrics.update(extra)
        for log in self._sinks:
            log(metrics, step)
        self.latest = metrics
        return metrics

    def _record(self, call: int, refresh: bool) -> tuple[dict[str, Any] | None, bool]:
        if call % self.every:
            return None, refresh
        if self._fused_ok():
            return self._measure_fused(refresh), False  # the fused pass refreshed the snapshot
        return self._measure(), refresh

    def _fused_ok(self) -> bool:
        return (
            self._prev is not None
            and "weight" in self.groups
            and not self.histograms
            and set(self.stats) <= FUSED_STATS
            and not any_dtensor(self.params)
            and not self._fsdp1
        )

    def _measure_fused(self, refresh: bool) -> dict[str, Any]:
        """Default statistics with weights and updates from one blocked pass (`stats_fused`)."""
        computed = tuple(dict.fromkeys([*self.stats, "l2"]))
        entries = self._collect(weights=False)
        current = [p.detach() for p in self.params]
        # exact over the finite part by itself (non-finite blocks are redone in float64 before
        # the snapshot block is overwritten), so no second pass and no spare snapshot
        norms = weight_update_norms(current, self._prev, refresh, self._workspace)
        numel = torch.tensor([t.numel() for t in current], dtype=torch.float64)
        tables = []
        for lo in (0, 4):
            cols = light_columns(numel, *(norms[:, lo + k] for k in range(4)))
            tables.append(torch.stack([cols[s] for s in computed], dim=1))
        w_table, u_table = tables
        others = summarize([t for _, _, t in entries], computed, workspace=self._workspace)
        metrics: dict[str, Any] = {}
        rows = [("weight", n, r) for n, r in zip(self.names, w_table.tolist(), strict=True)]
        rows += [(g, n, r) for (g, n, _), r in zip(entries, others.tolist(), strict=True)]
        rows += [("update", n, r) for n, r in zip(self.names, u_table.tolist(), strict=True)]
        for group, name, row in rows:
            for s, v in zip(computed, row, strict=True):
                if s in self.stats:
                    metrics[f"{group}/{name}/{s}"] = v
        l2 = computed.index("l2")
        tr = ratio_from_norms(w_table[:, l2], u_table[:, l2]).tolist()
        ur = ratio_from_norms(u_table[:, l2], w_table[:, l2]).tolist()
        for name, r, u in zip(self.names, tr, ur, strict=True):
            metrics[f"trust_ratio/{name}"] = r
            metrics[f"update_ratio/{name}"] = u
        return metrics

    def _measure(self) -> dict[str, Any]:
        entries = self._collect()
        has_update = self._prev is not None
        if has_update:
            current = [p.detach() for p in self.params]
            # in place and in one pass: _prev becomes W_curr - W_prev (out= may alias an input;
            # a foreach sub_ would give W_prev - W_curr and need a second, negating pass)
            for prev, cur in zip(_local(self._prev), _local(current), strict=True):
                torch.sub(cur, prev, out=prev)
            shards = fsdp1_shards(self.model) if self._fsdp1 else {}
            entries += [
                ("update", n, fsdp1_whole(d, p, shards))
                for n, d, p in zip(self.names, self._prev, self.params, strict=True)
            ]
        extra = HIST_SUMMARY if self.histograms else ()
        computed = tuple(dict.fromkeys([*self.stats, "l2", *extra]))
        tensors = [t for _, _, t in entries]
        table = summarize(tensors, computed, workspace=self._workspace)
        metrics: dict[str, Any] = {}
        values = table.tolist()
        for (group, name, _), row in zip(entries, values, strict=True):
            for s, v in zip(computed, row, strict=True):
                if s in self.stats:
                    metrics[f"{group}/{name}/{s}"] = v
        if has_update and "weight" in self.groups:
            l2 = table[:, computed.index("l2")]
            w_rows = [i for i, e in enumerate(entries) if e[0] == "weight"]
            u_rows = [i for i, e in enumerate(entries) if e[0] == "update"]
            tr = ratio_from_norms(l2[w_rows], l2[u_rows]).tolist()
            ur = ratio_from_norms(l2[u_rows], l2[w_rows]).tolist()
            for name, r, u in zip(self.names, tr, ur, strict=True):
                metrics[f"trust_ratio/{name}"] = r
                metrics[f"update_ratio/{name}"] = u
        if self.histograms:
            summary = table[:, [computed.index(c) for c in HIST_SUMMARY]]
            hists = histograms(tensors, self.bins, self.hist_max_elements, summary=summary)
            for (group, name, _), h in zip(entries, hists, strict=True):
                metrics[f"{group}/{name}/hist"] = h
        return metrics

    # -- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Close every sink that has a ``close()`` method."""
        for s in self._sink_objects:
            close = getattr(s, "close", None)
            if callable(close):
                close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
