"""Rows of one step (which tensor, iteration, stream, sample) and the JSON record built from them."""

from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from nnstat.distributed import fsdp1_grad, fsdp1_whole
from nnstat.recorder.anomalies import Rule, first_offender, indicator_name
from nnstat.recorder.graph import autograd_edges, graph_document, graph_hash
from nnstat.recorder.reduce import COL

PARAM_ITERATION = -1  # parameters belong to the batch, not to one iteration


class RowSet:
    """Flattened view of a batch: one segment per (tensor, iteration, stream, sample) row.

    ``sample == -1`` is the whole-batch row; ``0..k-1`` are the first samples along dim 0.
    """

    def __init__(self) -> None:
        self.tensor: list[str] = []
        self.iteration: list[int] = []
        self.stream: list[str] = []
        self.sample: list[int] = []
        self.segments: list[torch.Tensor] = []
        self.batch_index: list[int] = []
        self.roles: dict[str, str] = {}
        self.params: dict[str, torch.Tensor] = {}
        #: (tensor, iteration, stream) of each batch-level row: the layout rules are cached by
        self.rule_keys: tuple[tuple[str, int, str], ...] = ()
        self._graphs: dict[int, tuple[str, dict[str, Any]]] | None = None

    @classmethod
    def collect(
        cls,
        iterations: Sequence[Any],
        params: dict[str, torch.Tensor],
        k: int,
        shards: dict | None = None,
    ) -> RowSet:
        rs = cls()
        rs.params = params
        shards = shards or {}  # FSDP1 slices (nnstat.distributed.fsdp1_shards): whole-tensor views
        for name, p in params.items():
            rs.roles[name] = "parameter"
            rs._add(name, PARAM_ITERATION, "forward", fsdp1_whole(p.detach(), p, shards), 0)
            g = fsdp1_grad(p, shards)
            if g is not None:
                rs._add(name, PARAM_ITERATION, "gradient", g.detach(), 0)
        for it in iterations:
            for name in it.names:
                t = it.tensors[name]
                rs.roles[name] = it.roles[name]
                kk = 0 if it.roles[name] == "parameter" else k
                if t is not None:  # capture-engine output nodes carry only a gradient
                    rs._add(name, it.index, "forward", t.detach(), kk)
                g = it.grads.get(name)
                if g is not None:
                    rs._add(name, it.index, "gradient", g, kk)
        rs.rule_keys = tuple((rs.tensor[i], rs.iteration[i], rs.stream[i]) for i in rs.batch_index)
        return rs

    def _add(self, name: str, iteration: int, stream: str, t: torch.Tensor, k: int) -> None:
        self.batch_index.append(len(self.tensor))
        self._row(name, iteration, stream, -1, t)
        if t.dim() >= 1:
            for i in range(min(k, t.shape[0])):
                self._row(name, iteration, stream, i, t[i])

    def _row(self, name: str, iteration: int, stream: str, sample: int, t: torch.Tensor) -> None:
        self.tensor.append(name)
        self.iteration.append(iteration)
        self.stream.append(stream)
        self.sample.append(sample)
        self.segments.append(t)

    def raw_values(self, max_numel: int) -> dict[str, torch.Tensor]:
        out = {}
        for i in self.batch_index:
            t = self.segments[i]
            if 0 < t.numel() <= max_numel:
                out[f"{self.iteration[i]}/{self.stream[i]}/{self.tensor[i]}"] = t.detach()
        return out

    def graphs(self, iterations: Sequence[Any]) -> dict[int, tuple[str, dict[str, Any]]]:
        """Per iteration: (sha256, document) of its dependency graph, parameters included."""
        if self._graphs is None:
            self._graphs = {}
            for it in iterations:
                named = list(self.params.items())
                named += [(n, it.tensors[n]) for n in it.names if it.tensors[n] is not None]
                edges = autograd_edges(named) | set(it.edges)
                nodes = [(n, "parameter") for n in self.params]
                nodes += [(n, it.roles[n]) for n in it.names]
                doc = graph_document(nodes, edges)
                self._graphs[it.index] = (graph_hash(doc), doc)
        return self._graphs


def anomaly_hits(
    rows: RowSet, stats: np.ndarray, hits: np.ndarray, rules: Sequence[Rule], rule_rows: list[int]
) -> list[dict[str, Any]]:
    out = []
    for j, r in zip(*np.nonzero(hits), strict=True):
        i = rule_rows[j]
        rule = rules[r]
        col = {"nonfinite": "nonfinite", "abs_max_above": "abs_max"}.get(rule.kind, "norm")
        out.append(
            {
                "rule": rule.label,
                "indicator": indicator_name(rule, rows.tensor[i], rows.stream[i]),
                "tensor": rows.tensor[i],
                "iteration": rows.iteration[i],
                "stream": rows.stream[i],
                "value": float(stats[i, COL[col]]),
            }
        )
    return out


def finalize_step(
    batch: Any,
    rows: RowSet,
    stats: np.ndarray,
    hits: np.ndarray,
    rules: Sequence[Rule],
    rule_rows: list[int],
) -> dict[str, Any]:
    """The JSON record of a step (anomalies, indicators, first non-finite offender, rows).

    ``hits[j, r]`` is rule ``r`` on row ``rule_rows[j]``.
    """
    record: dict[str, Any] = {
        "step": batch.step,
        "type_of_execution": batch.type_of_execution,
        "time": time.time(),
        "anomalies": anomaly_hits(rows, stats, hits, rules, rule_rows),
    }
    indicators: dict[str, int] = {}
    for r, rule in enumerate(rules):
        for j, i in enumerate(rule_rows):
            if rule.applies(rows.tensor[i], rows.stream[i]):
                key = indicator_name(rule, rows.tensor[i], rows.stream[i])
                indicators[key] = max(indicators.get(key, 0), int(hits[j, r] > 0))
    record["indicators"] = indicators
    record["rows"] = {
        "tensor": rows.tensor,
        "iteration": rows.iteration,
        "stream": rows.stream,
        "sample": rows.sample,
    }
    record["roles"] = rows.roles
    record["iterations"] = len(batch.iterations)
    record["first_offender"] = _offender(batch, rows, stats)
    return record


def _offender(batch: Any, rows: RowSet, stats: np.ndarray) -> dict[str, Any] | None:
    bad = {
        (rows.tensor[i], rows.iteration[i], rows.stream[i]): float(stats[i, COL["nonfinite"]])
        for i in rows.batch_index
    }
    if not any(v > 0 for v in bad.values()):
        return None
    # forward: parameters exist before the pass, then tensors in registration (= execution) order
    fwd = [((n, PARAM_ITERATION), bad[(n, PARAM_ITERATION, "forward")]) for n in rows.params]
    for it in batch.iterations:
        fwd += [((n, it.index), bad.get((n, it.index, "forward"), 0.0)) for n in it.names]
    # backward: gradient hooks fire in execution order; a parameter's gradient is produced right
    # after the gradient of the first registered tensor it feeds
    bwd = [((n, i), bad.get((n, i, "gradient"), 0.0)) for i, n in batch.grad_order]
    fired = {n: pos for pos, ((n, _), _) in enumerate(bwd)}
    children: dict[str, list[str]] = {}
    for _, doc in rows.graphs(batch.iterations).values():
        for a, b in doc["edges"]:
            children.setdefault(a, []).append(b)
    placed = []
    for n in rows.params:
        if (n, PARAM_ITERATION, "gradient") in bad:
            pos = min((fired[c] for c in children.get(n, []) if c in fired), default=len(bwd))
            placed.append(
                (pos, len(placed), ((n, PARAM_ITERATION), bad[(n, PARAM_ITERATION, "gradient")]))
            )
    for pos, _, item in sorted(placed, reverse=True):
        bwd.insert(pos + 1 if pos < len(bwd) else len(bwd), item)
    hit = first_offender(fwd, bwd)
    if hit is None:
        return None
    (name, iteration), stream = hit
    return {"tensor": name, "iteration": iteration, "stream": stream}


class Selection:
    """Rows (of one RowSet) that anomaly rules apply to."""

    def __init__(self, pos: list[int], masks: torch.Tensor, all_keys: tuple) -> None:
        self.pos, self.cpu_masks = pos, masks
        self.keys = tuple(all_keys[j] for j in pos)
        self.rows: list[int] = []
        self.masks = masks
        self._index: torch.Tensor | None = None

    def bind(self, rows: RowSet) -> Selection:
        self.rows = [rows.batch_index[j] for j in self.pos]
        self._index = None
        dev = rows.segments[0].device if rows.segments else torch.device("cpu")
        if self.masks.device != dev:
            self.masks = self.cpu_masks.to(dev)
        return self

    def index(self, device: torch.device) -> torch.Tensor:
        if self._index is None or self._index.device != device:
            self._index = torch.tensor(self.rows, dtype=torch.long, device=device)
        return self._index


def split_raw(flat: np.ndarray, raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, offset = {}, 0
    for key, v in raw.items():
        n = v.numel()
        out[key] = torch.from_numpy(flat[offset : offset + n].astype(np.float32)).reshape(v.shape)
        offset += n
    return out


def check_kpi(name: str, value: Any) -> None:
    """Refuse a KPI value `kpi_records` cannot write: it must be a real number or a one-element
    real tensor (checked from metadata only: no device sync).

    Args:
        name: the KPI's name, for the message.
        value: the value passed to `Recorder.record_kpi`.

    Raises:
        TypeError: not a real number or tensor.
        ValueError: a tensor with more than one element.

    Example:
        >>> check_kpi("loss", torch.ones(2))
        Traceback (most recent call last):
        ...
        ValueError: KPI 'loss' must be a scalar, got a tensor of shape (2,); pass a reduction such as loss.mean()
    """
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise TypeError(f"KPI {name!r} must be real, got a {value.dtype} tensor")
        if value.numel() != 1:
            raise ValueError(
                f"KPI {name!r} must be a scalar, got a tensor of shape {tuple(value.shape)}; "
                "pass a reduction such as loss.mean()"
            )
    elif isinstance(value, complex) or not isinstance(value, numbers.Real):
        raise TypeError(f"KPI {name!r} must be a real number or a scalar tensor, got {value!r}")


def kpi_records(log: list[tuple[str, int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """``[{"type", "step", "kpis"}]`` with tensor values moved to the host, one transfer per device."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, _, kpis in log:
        for v in kpis.values():
            if isinstance(v, torch.Tensor):
                by_device.setdefault(v.device, []).append(v.detach().reshape(()).double())
    host = {d: iter(torch.stack(ts).cpu().tolist()) for d, ts in by_device.items()}
    out = []
    for kind, step, kpis in log:
        vals = {
            k: next(host[v.device]) if isinstance(v, torch.Tensor) else float(v)
            for k, v in kpis.items()
        }
        out.append({"type": kind, "step": step, "kpis": vals})
    return out
