"""`Recorder`: named tensors and their gradients at chosen steps, with comgra's vocabulary.

Per-step cost model: a batch that is neither scheduled, retroactive nor watched by anomaly rules
costs one attribute check per `register_tensor`. An active batch keeps references to the
registered tensors, hooks their gradients, and at `finish_batch` reduces everything in one fused
device pass (`reduce.segment_stats`) with one host transfer.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nnstat.background.signals import CommitOnSignal
from nnstat.describe import as_float
from nnstat.distributed import clean_name, fsdp1_shards
from nnstat.recorder.anomalies import NonFiniteError, Rule, evaluate_rules
from nnstat.recorder.batch import Batch, GradHook, Iteration
from nnstat.recorder.graph import ROLES
from nnstat.recorder.reduce import COL, STAT_NAMES, device_stats, fix_nonfinite, light_stats
from nnstat.recorder.schedule import Schedule, make_schedule, schedule_json
from nnstat.recorder.stepdata import (
    RowSet,
    Selection,
    check_kpi,
    finalize_step,
    kpi_records,
    split_raw,
)
from nnstat.recorder.storage import TrialWriter

log = logging.getLogger("nnstat.recorder")


class Recorder:
    """Record registered tensors, parameters and their gradients at chosen steps.

    Call `finish_batch` after ``loss.backward()`` and before ``optimizer.zero_grad()`` so that
    parameter gradients are still in ``.grad``.

    Args:
        root: folder of recordings (``root/group/trial``).
        group: folder of comparable trials (a plain folder name).
        trial: this run's folder name.
        every: the default schedule: steps between recordings, a `Schedule`, its dict form,
            or ``None`` (record only when a rule fires or a step is decided).
        schedules: a schedule per ``type_of_execution`` (e.g. ``"eval"``).
        rules: anomaly rules checked on every step (`nnstat.recorder.Rule`).
        sample_k: also describe each of the first ``sample_k`` samples.
        raw_max_numel: keep the raw values of tensors with at most this many elements.
        on_nonfinite: NaN/Inf in a recorded step: ``"warn"`` or ``"raise"``.
        overwrite: replace an existing trial folder.

    Raises:
        ValueError: an invalid ``on_nonfinite``, ``sample_k``, ``raw_max_numel``, schedule, or
            a group/trial that is not a plain folder name.
        TypeError: a rule that is not a `Rule`.
        FileExistsError: the trial folder exists and ``overwrite`` is False.

    Example:
        >>> import torch, nnstat
        >>> model = torch.nn.Linear(3, 1)
        >>> rec = nnstat.Recorder("/tmp/nnstat-rec", group="doc", every=1, overwrite=True)
        >>> rec.track_module(model)
        >>> rec.start_batch(0)
        >>> x = rec.register_tensor("x", torch.randn(4, 3), role="input")
        >>> loss = rec.register_tensor("loss", model(x).pow(2).mean(), role="loss")
        >>> loss.backward()
        >>> rec.finish_batch()["reason"]
        'schedule'
    """

    def __init__(
        self,
        root: str | Path,
        group: str = "default",
        trial: str = "baseline",
        every: Schedule | dict | int | None = 100,
        *,
        schedules: dict[str, Schedule | dict | int | None] | None = None,
        rules: Sequence[Rule] = (),
        sample_k: int = 4,
        raw_max_numel: int = 0,
        on_nonfinite: str = "warn",
        overwrite: bool = False,
    ) -> None:
        if on_nonfinite not in ("warn", "raise"):
            raise ValueError(f"on_nonfinite must be 'warn' or 'raise', got {on_nonfinite!r}")
        if sample_k < 0 or raw_max_numel < 0:
            raise ValueError("sample_k and raw_max_numel must be >= 0")
        bad = [r for r in rules if not isinstance(r, Rule)]
        if bad:
            raise TypeError(f"rules must be nnstat.recorder.Rule objects, got {bad!r}")
        self.default_schedule = make_schedule(every)
        self.schedules = {k: make_schedule(v) for k, v in (schedules or {}).items()}
        self.rules = tuple(rules)
        self.sample_k, self.raw_max_numel, self.on_nonfinite = sample_k, raw_max_numel, on_nonfinite
        self.writer = TrialWriter(root, group, trial, overwrite)
        self.path = self.writer.path
        self.group, self.trial = group, trial
        self._params: dict[str, torch.nn.Parameter] = {}
        self._fsdp1: dict[int, tuple] = {}
        self._modules: list[dict[str, Any]] = []
        self._batch: Batch | None = None
        self._kpi_log: list[tuple[str, int, dict[str, Any]]] = []
        # KPIs are buffered (one host transfer per flush, not per step): a script ended by an
        # exception, by SIGTERM/SIGINT/SIGHUP (a scheduler, Ctrl-C), or a recorder dropped
        # without close() still writes them, at exit, on the signal or when collected. Both
        # hold the writer and the buffer (one list, emptied in place), never the recorder.
        flush = functools.partial(_write_kpis, self.writer, self._kpi_log)
        self._flush_at_exit = weakref.finalize(self, flush)
        self._on_signal = CommitOnSignal(flush)
        self._on_signal.install()
        self._prev: tuple[tuple, torch.Tensor] | None = None
        self._mask_cache: dict[tuple, Selection] = {}
        self.last_record: dict[str, Any] | None = None
        self._engine: Any = None
        self._engine_ctx: Any = None
        self._engine_kwargs: dict[str, Any] = {}
        self._write_trial()

    # ---- setup -------------------------------------------------------------------------
    def track_module(self, module: torch.nn.Module, prefix: str = "") -> None:
        """Record ``module``'s parameters (values and ``.grad``) and its parameter counts.

        Raises:
            TypeError: ``module`` is not an ``nn.Module`` (e.g. the optimizer).
        """
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"track_module expects an nn.Module, got {type(module).__name__}")
        for name, p in module.named_parameters():
            self._params[f"{prefix}{clean_name(name)}"] = p
        # FSDP1 wrapper: its parameters are flat per-rank slices, described as whole tensors
        self._fsdp1.update(fsdp1_shards(module))
        for name, m in module.named_modules():
            own = sum(p.numel() for p in m.parameters(recurse=False))
            total = sum(p.numel() for p in m.parameters())
            label = f"{prefix}{name}" if name else (prefix.rstrip(".") or "(root)")
            self._modules.append(
                {"name": label, "type": type(m).__name__, "params_own": own, "params_total": total}
            )
        self._write_trial()

    def track_activations(
        self,
        model: torch.nn.Module,
        name_filter: str | None = None,
        type_filter: Any = None,
        prefix: str = "",
        loss_reduction: str = "sum",
        batch_size: int | None = None,
    ) -> list[str]:
        """Record module inputs and output gradients through the capture engine.

        Adds ``"<module>:input"`` / ``"<module>:output"`` nodes to the last iteration of each
        recorded batch (the engine captures per backward, not per iteration). ``prefix`` must
        match the one given to `track_module` so parameters connect to their module. The engine
        hooks only run during recorded (or rule-watched) batches.

        Example:
            >>> rec.track_activations(model, loss_reduction="mean")  # doctest: +SKIP
            ['fc1', 'fc2']
        """
        from nnstat.recorder.activations import attach_engine

        if self._engine is not None:
            raise RuntimeError("track_activations was already called on this recorder")
        self._engine, names = attach_engine(
            self, model, name_filter, type_filter, prefix, loss_reduction, batch_size
        )
        # "input": a shared module (a position embedding) is expanded to the model input's batch,
        # so its output gradient is recorded per sample rather than summed over the batch
        self._engine_kwargs = {
            "loss_reduction": loss_reduction,
            "batch_size": batch_size,
            "samples": "input",
        }
        return names

    def close(self) -> None:
        """Write buffered KPIs, remove the capture engine's hooks (`track_activations`) and the
        signal handlers that write the KPIs on SIGTERM/SIGINT/SIGHUP."""
        self.flush_kpis()
        self._on_signal.restore()
        if self._engine is not None:
            self._engine.unwatch()
            self._engine = None

    def schedule_for(self, type_of_execution: str) -> Schedule:
        return self.schedules.get(type_of_execution, self.default_schedule)

    def _write_trial(self) -> None:
        self.writer.write_trial(
            {
                "group": self.group,
                "trial": self.trial,
                "stat_names": list(STAT_NAMES),
                "sample_k": self.sample_k,
                "modules": self._modules,
                "parameters": {n: list(p.shape) for n, p in self._params.items()},
                "rules": [r.__dict__ | {"label": r.label} for r in self.rules],
                "schedules": {k: schedule_json(v) for k, v in self.schedules.items()},
                "default_schedule": schedule_json(self.default_schedule),
            }
        )

    # ---- step structure ----------------------------------------------------------------
    def start_batch(self, step: int, type_of_execution: str = "train") -> None:
        """Begin a training step; decides (cheaply) whether its tensors are captured.

        Args:
            step: the training step.
            type_of_execution: ``"train"``, ``"eval"``, ... (selects the schedule).

        Raises:
            RuntimeError: called twice without `finish_batch`.
        """
        if self._batch is not None:
            raise RuntimeError("start_batch called twice without finish_batch")
        sched = self.schedule_for(type_of_execution)
        scheduled = sched.is_scheduled(int(step))
        active = scheduled or bool(self.rules) or sched.retroactive
        self._batch = Batch(int(step), str(type_of_execution), scheduled, active)
        if active and self._engine is not None:
            self._engine_ctx = self._engine.batch(**self._engine_kwargs)
            self._engine_ctx.__enter__()

    def start_iteration(self) -> None:
        """Begin one forward pass inside the batch (several per batch for multi-pass models)."""
        b = self._require_batch("start_iteration")
        b.current = Iteration(len(b.iterations))
        b.iterations.append(b.current)

    def finish_iteration(self) -> None:
        b = self._require_batch("finish_iteration")
        if b.current is None:
            raise RuntimeError("finish_iteration called without start_iteration")
        b.current = None

    def register_tensor(
        self, name: str, tensor: torch.Tensor, role: str = "intermediate"
    ) -> torch.Tensor:
        """Register a tensor of the current (or, after `finish_iteration`, the last) iteration.

        Its gradient is captured with a tensor hook when it requires grad. Works under
        ``torch.no_grad()`` (forward values only); ``requires_grad`` is never changed.

        Args:
            name: the tensor's name (unique in the iteration).
            tensor: the tensor.
            role: ``"input"``, ``"target"``, ``"output"``, ``"loss"`` or ``"intermediate"``.

        Returns:
            ``tensor``, unchanged.

        Raises:
            RuntimeError: called outside `start_batch`/`finish_batch`.
            ValueError: an unknown role, or a name registered twice.
            TypeError: ``tensor`` is not a tensor, or is complex.
        """
        b = self._batch
        if b is None:
            raise RuntimeError("register_tensor called outside start_batch/finish_batch")
        if not b.active:
            return tensor
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; valid roles are {list(ROLES)}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"register_tensor({name!r}) needs a torch.Tensor, got {type(tensor)}")
        if tensor.is_complex():
            raise TypeError(
                f"register_tensor({name!r}): complex tensors ({tensor.dtype}) have no real "
                "statistics; register tensor.abs() or torch.view_as_real(tensor)"
            )
        if b.current is None and not b.iterations:
            self.start_iteration()
        # after finish_iteration (e.g. the loss of a multi-pass model) the last pass owns it
        it = b.current or b.iterations[-1]
        if name in it.tensors or name in self._params:
            raise ValueError(f"tensor name {name!r} registered twice in iteration {it.index}")
        it.names.append(name)
        it.tensors[name] = tensor
        it.roles[name] = role
        if tensor.requires_grad:
            tensor.register_hook(GradHook(b, it, name))
        return tensor

    def add_tensor_connection(self, src: str, dst: str) -> None:
        """Add a manual dependency edge ``src -> dst`` to the current iteration's graph."""
        b = self._require_batch("add_tensor_connection")
        if not b.active:
            return
        if b.current is None and not b.iterations:
            self.start_iteration()
        (b.current or b.iterations[-1]).edges.append((str(src), str(dst)))

    def decide_recording_of_batch(self, record: bool) -> None:
        """Retroactively keep (True) or drop (False) the current batch; anomalies still force it."""
        b = self._require_batch("decide_recording_of_batch")
        if record and not b.active:
            raise ValueError(
                f"batch {b.step} ({b.type_of_execution}) was not captured; use a schedule with "
                "retroactive=True for this type_of_execution to decide after the fact"
            )
        b.decision = bool(record)

    def record_kpi(self, name: str, value: float | torch.Tensor) -> None:
        """Record a scalar KPI of the current batch, on every step (recorded or not).

        Tensors are kept on device and converted in one transfer when the buffer is written
        (at recorded steps, every 256 steps and at `close`), so no step waits on a sync.

        Args:
            name: the KPI's name.
            value: a real number or a one-element real tensor.

        Raises:
            RuntimeError: called outside `start_batch`/`finish_batch`.
            TypeError: ``value`` is not a real number or tensor.
            ValueError: a tensor with more than one element.

        Example:
            >>> rec.record_kpi("loss", loss.detach())  # doctest: +SKIP
        """
        b = self._require_batch("record_kpi")
        check_kpi(str(name), value)
        b.kpis[str(name)] = value

    def add_note(self, text: str) -> None:
        """Append a free-text note to the trial (shown in the viewer)."""
        step = None if self._batch is None else self._batch.step
        self.writer.append_note({"step": step, "time": time.time(), "text": str(text)})

    def _require_batch(self, what: str) -> Batch:
        if self._batch is None:
            raise RuntimeError(f"{what} called outside start_batch/finish_batch")
        return self._batch

    # ---- the per-step reduction ----------------------------------------------------------
    def finish_batch(self) -> dict[str, Any] | None:
        """Reduce, evaluate rules, and write the step if it is recorded.

        Returns:
            The step's record (``"reason"``: ``"schedule"``, ``"decision"`` or a rule), or
            ``None`` when it is not recorded.

        Raises:
            RuntimeError: called without `start_batch`.
            NonFiniteError: NaN/Inf in a recorded step with ``on_nonfinite="raise"``.
        """
        b = self._require_batch("finish_batch")
        if self._engine_ctx is not None:
            ctx, self._engine_ctx = self._engine_ctx, None
            ctx.__exit__(None, None, None)  # flushes pending captures into this batch
        self._batch = None
        if b.kpis:
            self._kpi_log.append((b.type_of_execution, b.step, b.kpis))
            if len(self._kpi_log) >= 256:
                self.flush_kpis()
        if not b.active:
            return None
        keep = b.decision if b.decision is not None else b.scheduled
        if keep:
            reason = "decision" if b.decision else "schedule"
            return self._record(
                b, RowSet.collect(b.iterations, self._params, self.sample_k, self._fsdp1), reason
            )
        if not self.rules:
            return None
        # unrecorded step: only the batch-level rows the rules look at, only what they need
        rows = RowSet.collect(b.iterations, self._params, 0, self._fsdp1)
        sel = self._selection(rows)
        need_abs_max = any(r.kind == "abs_max_above" for r in self.rules)
        light = light_stats([rows.segments[i] for i in sel.rows], abs_max=need_abs_max)
        prev = self._prev_norm(sel.keys, light[:, COL["norm"]])
        hits = evaluate_rules(self.rules, sel.masks, light, prev)
        if not bool(hits.any()):  # the one host transfer of an unrecorded step
            return None
        rows = RowSet.collect(b.iterations, self._params, self.sample_k, self._fsdp1)
        return self._record(b, rows, "anomaly", prev=prev)

    def _record(
        self, b: Batch, rows: RowSet, reason: str, prev: torch.Tensor | None = None
    ) -> dict[str, Any] | None:
        if not rows.segments:
            return None
        sel = self._selection(rows) if self.rules else None
        stats = device_stats(rows.segments)
        payload, hits = [stats.reshape(-1)], None
        if sel is not None:
            picked = stats[sel.index(stats.device)]
            if prev is None:
                prev = self._prev_norm(sel.keys, picked[:, COL["norm"]])
            hits = evaluate_rules(self.rules, sel.masks, picked, prev)
            payload.append(hits.reshape(-1).to(stats.dtype))
        raw = rows.raw_values(self.raw_max_numel)
        payload += [v.reshape(-1).to(device=stats.device, dtype=stats.dtype) for v in raw.values()]
        host = torch.cat(payload).cpu().numpy()  # the one device -> host transfer of the step
        n_stat = stats.numel()
        stats_np = host[:n_stat].reshape(stats.shape).copy()
        n_hit = 0 if hits is None else hits.numel()
        hits_np = np.zeros((0, len(self.rules)))
        if sel is not None:
            hits_np = host[n_stat : n_stat + n_hit].reshape(len(self.rules), len(sel.rows)).T
            if fix_nonfinite(stats_np, rows.segments):
                # NaN/Inf rows now hold exact finite-only statistics: re-evaluate on them
                exact = torch.from_numpy(stats_np[sel.rows])
                p = None if prev is None else prev.cpu()
                hits_np = evaluate_rules(self.rules, sel.masks.cpu(), exact, p).T.numpy()
        else:
            fix_nonfinite(stats_np, rows.segments)
        record = finalize_step(b, rows, stats_np, hits_np, self.rules, sel.rows if sel else [])
        if reason == "anomaly" and not record["anomalies"]:
            return None  # the cheap probe overflowed float32; the exact statistics show no hit
        record["reason"] = reason
        record["kpis"] = {k: as_float(v) for k, v in b.kpis.items()}
        graphs = rows.graphs(b.iterations)
        for digest, doc in graphs.values():
            self.writer.write_graph(digest, doc)
        record["graphs"] = {str(i): d for i, (d, _) in graphs.items()}
        values = split_raw(host[n_stat + n_hit :], raw)
        self.writer.write_step(f"{b.type_of_execution}-{b.step:09d}", stats_np, record, values)
        self.last_record = record
        self.flush_kpis()
        off = record.get("first_offender")
        if off is not None:
            msg = (
                f"non-finite values at step {b.step} ({b.type_of_execution}); first offender: "
                f"{off['tensor']} ({off['stream']}, iteration {off['iteration']})"
            )
            if self.on_nonfinite == "raise":
                raise NonFiniteError(msg)
            log.warning(msg)
        return record

    def flush_kpis(self) -> None:
        """Append buffered KPIs to ``kpis.jsonl`` (tensor values: one transfer per device)."""
        with self._on_signal.hold():  # a signal waits for the lines being written
            _write_kpis(self.writer, self._kpi_log)

    def _selection(self, rows: RowSet) -> Selection:
        """Batch-level rows some rule applies to, with the rule x row mask (cached by layout)."""
        sel = self._mask_cache.get(rows.rule_keys)
        if sel is None:
            applies = [[r.applies(n, s) for (n, _, s) in rows.rule_keys] for r in self.rules]
            pos = [j for j in range(len(rows.rule_keys)) if any(a[j] for a in applies)]
            masks = torch.tensor([[a[j] for j in pos] for a in applies], dtype=torch.bool)
            sel = Selection(pos, masks.reshape(len(self.rules), len(pos)), rows.rule_keys)
            if len(self._mask_cache) > 64:
                self._mask_cache.clear()
            self._mask_cache[rows.rule_keys] = sel
        return sel.bind(rows)

    def _prev_norm(self, keys: tuple, now: torch.Tensor) -> torch.Tensor | None:
        """Each row's norm at the previous evaluated step (NaN if unknown); stores ``now``."""
        if not any(r.kind == "norm_ratio_above" for r in self.rules):
            return None
        prev = None
        if self._prev is not None:
            old_keys, old = self._prev
            if old_keys == keys:
                prev = old
            else:
                pos = {k: i for i, k in enumerate(old_keys)}
                idx = torch.tensor([pos.get(k, -1) for k in keys], device=now.device)
                prev = torch.cat([old, old.new_full((1,), float("nan"))])[idx]
        self._prev = (keys, now)
        return prev


def _write_kpis(writer: TrialWriter, kpi_log: list[tuple[str, int, dict[str, Any]]]) -> None:
    # empties the buffer in place first: a failed write is raised, never written twice
    if not kpi_log:
        return
    log_ = kpi_log[:]
    kpi_log.clear()
    writer.append_kpis(kpi_records(log_))
