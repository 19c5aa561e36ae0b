"""The :class:`Run` class behind :mod:`nnstat.run` (re-exported there; import it from there).

The module-level functions that act on the current run live in :mod:`nnstat.run`; this module
holds the stateful class: configuration, capture hooks, passes, eval-mode queries.

Example:
    >>> from nnstat.run import Run
    >>> run = Run("demo", root_dir=__import__("tempfile").mkdtemp())
    >>> run.mode
    'log'
"""

from __future__ import annotations

import atexit
import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nnstat.background.signals import CommitOnSignal
from nnstat.curvature import StatisticsCollector
from nnstat.distributed import rank_world
from nnstat.run import store_io
from nnstat.run.config import RunConfig, configured
from nnstat.run.lifecycle import PassEnd
from nnstat.run.params import (
    check_store_weights,
    freeze_params,
    params_fingerprint,
    weights_changed_error,
)
from nnstat.run.reduction import reduction_probe, warn_mean_loss
from nnstat.run.rows import (
    BatchRows,
    Block,
    input_ids,
    module_blocks,
    refuse_left_out,
)
from nnstat.run.weights import BlockGuard, Models, enclosing, model_fingerprint
from nnstat.store.errors import StoreWriteError
from nnstat.store.factored import EnergyTally, dense_layout
from nnstat.store.files import META_FILE
from nnstat.store.ids import duplicate_ids, ids_count_error, normalize_ids
from nnstat.store.logger import StoreLogger, filter_nonfinite
from nnstat.store.meta import build_meta, prepare_store
from nnstat.store.projection import (
    ModuleProjection,
    build_projections,
    module_shape,
    projection_tensors,
)
from nnstat.store.reader import GradientLog, make_log_dataloader


class Run(PassEnd):
    """One logging project: configuration, watched model, projection, store and statistics.

    Args:
        project: name of the store directory under ``root_dir``.
        root_dir: parent directory of projects (default ``./nnstat_logs``).
        config: optional initial configuration: a :class:`~nnstat.run.config.RunConfig` or
            its dict form (as :meth:`setup` takes).
        overwrite: start the store afresh: the first logging pass of this run deletes what
            the store holds (rows, projections, statistics, meta.json) before it writes. Needed
            to log a changed model (after training) into a store of the old one, which is
            refused otherwise. Eval-mode queries never delete. Settable later
            (``run.overwrite = True``): it applies at the next first pass of a schedule.

    Example:
        >>> run = Run("demo", root_dir="/tmp/nnstat_doc")  # doctest: +SKIP
        >>> with run(data_id=ids): loss.backward()  # doctest: +SKIP
    """

    def __init__(
        self,
        project: str,
        root_dir: str | Path = "./nnstat_logs",
        config: RunConfig | Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> None:
        if not project or not isinstance(project, str) or Path(project).name != project:
            raise ValueError(f"project must be a plain directory name, got {project!r}")
        self.project = project
        self.path = Path(root_dir) / project
        self.config = configured(RunConfig(), config or {})
        self.engine: Any = None
        self.model: nn.Module | None = None
        self.mode = "log"
        self.rank, self.world_size = rank_world()
        self._projection_args: dict[str, Any] = {"rank": None, "init": "random", "seed": 0}
        self._projection_set = False
        self._projections: dict[str, ModuleProjection] | None = None
        self._logger: StoreLogger | None = None
        self._collector: Any = None
        self._stats_state: dict[str, torch.Tensor] = {}
        self._pass = 0
        self._batch_flags = (False, False)
        # each run(...) block's rows, assembled in place in the writer's reused buffers
        self._rows = BatchRows()
        self._next_auto_id = 0
        self._pass_ids = store_io.PassIds()  # what a statistics pass saw: its coverage
        self._eval_ids: list[Any] = []
        self._eval_rows: list[torch.Tensor] = []
        self._eval_seen: set[Any] = set()
        self._atexit = False
        # SIGTERM/SIGINT while a pass is open: its rows are committed, then the signal goes on
        self._on_signal = CommitOnSignal(functools.partial(self._flush_at_exit, "a signal"))
        self.overwrite = bool(overwrite)
        # params_sha256 of the weights of the open pass (None: no pass begun), of the first
        # pass of the current schedule round, and of the current eval log
        self._pass_params: str | None = None
        self._pass_model: str | None = None  # model_sha256: every parameter and buffer
        self._round_params: tuple | None = None
        self._guard = BlockGuard()  # the model at the end of the pass's last block
        # the watched model, or the outermost modules holding it (found once per pass)
        self._covered: Models | None = None
        self._eval_params: str | None = None
        self._eval_model: str | None = None  # model_sha256 of the current eval log
        self._probe_reduction = True  # the first block of a pass / eval log checks the loss
        self._warned_once: set[str] = set()
        self._writer_error: StoreWriteError | None = None  # raised again by finalize()
        self._flushed_early = False  # this pass's rows were flushed (a signal, a refusal)

    def __repr__(self) -> str:
        return f"Run(project={self.project!r}, path={str(self.path)!r}, mode={self.mode!r})"

    # ---------------------------------------------------------------- configuration
    def setup(self, config: RunConfig | Mapping[str, Any]) -> Run:
        """Configure the run: a :class:`~nnstat.run.config.RunConfig` replaces the
        configuration; a dict of its keys updates the current one (``{"rank": 16}`` keeps
        the rest).

        Raises:
            ValueError: an unknown key or an invalid value, named in the message.
            RuntimeError: a logging pass is open (call :meth:`finalize` first).
        """
        self._require_no_open_pass("setup()")
        self.config = configured(self.config, config)
        return self

    def watch(
        self,
        model: nn.Module,
        name_filter: str | list[str] | None = None,
        type_filter: Any = None,
    ) -> list[str]:
        """Watch ``model``'s supported modules (regex ``name_filter``, classes ``type_filter``).

        Raises:
            RuntimeError: a logging pass is open (call :meth:`finalize` first).
            ValueError: a filter selects a module that cannot be captured
                (:class:`~nnstat.capture.engine.UnsupportedModuleError`), or one already watched.
        """
        self._require_no_open_pass("watch()")
        from nnstat.capture.engine import CaptureEngine

        if self.engine is None:
            self.engine = CaptureEngine()
            self.engine.add_consumer(self._on_capture)
        names = self.engine.watch(model, name_filter=name_filter, type_filter=type_filter)
        self.model = model
        self._projections = None  # layout changed: rebuilt from _projection_args
        return names

    def unwatch(self) -> None:
        """Remove every hook; the model is exactly as before :meth:`watch`."""
        if self.engine is not None:
            self.engine.unwatch()
        self._projections = None

    def add_projection(self, rank: int | None = 64, init: str = "random", seed: int = 0) -> dict:
        """Project every watched module's per-sample gradient to ``rank x rank`` (LoGra).

        ``init="random"``: Gaussian ``N(0, 1/rank)`` from ``seed``; ``init="pca"``: top
        eigenvectors of the forward/backward covariances of a previous statistics pass (this run's
        or ``statistics.safetensors`` in the store), an error if there is none. ``rank=None``
        stores full per-sample gradients. Returns the layout ``{module: (r_out, r_in)}``.

        Raises:
            RuntimeError: no watched model, or a logging pass is open.
            ValueError: ``init="pca"`` without a statistics pass, or an invalid ``rank``/``init``
                (the previous projection stays in place).
        """
        self._require_no_open_pass("add_projection()")
        old = (self._projection_args, self._projection_set, self._projections)
        self._projection_args = {"rank": rank, "init": init, "seed": seed}
        self._projection_set = True
        self._projections = None
        try:
            self._build_projections()
        except BaseException:  # a refused projection leaves the previous one in place
            self._projection_args, self._projection_set, self._projections = old
            raise
        assert self._projections is not None
        return {n: (p.r_out, p.r_in) for n, p in self._projections.items()}

    # ---------------------------------------------------------------------- capture
    @contextmanager
    def __call__(self, data_id: Any = None, mask: torch.Tensor | None = None) -> Iterator[Run]:
        """Capture the forward/backward passes inside the block as one batch of samples.

        ``data_id``: a list of ints/strings or a 1-D integer tensor (a ``DataLoader``'s batch of
        dataset indices): the ids, as they are; ``"hash"``: each sample's content hash
        (:func:`~nnstat.store.ids.content_id` of its row of the first tensor passed to the
        watched model's forward in the block, e.g. the token ids or images); any other tensor
        (float, or more than one dimension): its rows hashed the same way; ``None``:
        consecutive ints. ``mask``: ``[N]`` or ``[N, positions]`` (nonzero = keep).

        SIGTERM/SIGINT/SIGHUP inside the block are held until it ends (its rows complete), then
        handled (:mod:`nnstat.background.signals`).

        Raises:
            RuntimeError: no watched model, nothing captured in the block, or the store
                writer failed (its error as the cause).
            TypeError: ``data_id`` is a string other than ``"hash"``.
            ValueError: ``data_id`` does not match the batch (count, duplicates), or watched
                modules saw different batch sizes; the message names the fix.
        """
        with self._on_signal.hold(), self._block(data_id, mask) as run:
            yield run

    @contextmanager
    def _block(self, data_id: Any, mask: torch.Tensor | None) -> Iterator[Run]:
        if self.engine is None or not self.engine.watched:
            raise RuntimeError("call watch(model) before run(...)")
        self._check_writer()
        self._build_projections()
        hash_input = isinstance(data_id, str) and data_id == "hash"
        if isinstance(data_id, str) and not hash_input:
            raise TypeError(
                f"data_id={data_id!r}: a string is not a batch of ids; pass a list of ids, or "
                'data_id="hash" to hash the model\'s input'
            )
        ids = None if data_id is None or hash_input else normalize_ids(data_id)
        logging = self._saving()
        if self.mode == "log":
            store_io.refuse_other_streams(self._pass_spec().save)
        # unchanged since the pass's previous block: replaced or updated tensors are refused
        # here, the sampled values' flag is read with the block's rows flags at its end
        same: bool | torch.Tensor = True
        if self.mode == "log" and (logging or self._stats_on()):
            self._begin_pass()
            same = self._guard.begin(self._covered)
        elif self.mode == "eval" and self._eval_params is None:
            self._eval_params = params_fingerprint(self.engine)
            self._eval_model = model_fingerprint(
                enclosing(self.model) if self.model is not None else None
            )
        if logging:
            self._open_logger()
            assert self._logger is not None
        with self._writer_errors():
            keep = self._admit(ids) if ids is not None else None
        if self.mode == "log" and self._collector is None and self._stats_on():
            self._collector = StatisticsCollector(self.config)
        if self.mode == "log" and self._collector is not None and self._stats_on():
            # a K-FAC factor over max_factor_dim is kept in its side's logged space
            assert self._projections is not None
            self._collector.set_projections(
                {n: (p.p_in, p.p_out) for n, p in self._projections.items()}
            )
        # decided once per batch: the hooks below run per module
        self._batch_flags = (
            self.mode == "eval" or logging,
            self.mode == "log" and self._stats_on(),
        )
        restore = freeze_params(self.engine) if self._skip_param_grads() else None
        probe = reduction_probe(
            self.mode == "eval" or logging or self._stats_on(),
            self.model,
            self._probe_reduction,
            self.config.loss_reduction,
            self._warned_once,
        )
        assert self._projections is not None
        # the staging buffer (an accelerator) keeps words for the guard's flags after the rows;
        # queries are logged exact (dense) whatever the store's factors (refinement checks them)
        flags = same.numel() if isinstance(same, torch.Tensor) else 0
        self._rows.begin(self._projections, flags, factor=self.mode != "eval")
        try:
            with (
                self.engine.batch(
                    mask=mask,
                    loss_reduction=self.config.loss_reduction,
                    # sizes the expansion of modules whose input the batch shares (wpe)
                    samples="input" if ids is None else len(ids),
                    **({"outputs_require_grad": True} if restore is not None else {}),
                ),
                probe if probe is not None else nullcontext(),
                self.engine.recording_model_input() if hash_input else nullcontext(),
            ):
                yield self
        finally:
            if restore is not None:
                restore()
            block = self._rows.end()
        batch = block.rows
        if probe is not None and batch:
            warn_mean_loss(probe, next(iter(batch.values())).shape[0], self._warned_once)
        assert self._projections is not None
        refuse_left_out(self.engine.left_out, self._projections, ids, batch)
        with self._writer_errors():
            if hash_input:
                ids = input_ids(self.engine.model_input, batch, type(self.model).__name__)
                keep = self._admit(ids)
            self._complete(block, ids, keep, same)
        self._probe_reduction &= probe is None or not batch  # checked by a completed block
        if self.mode == "log" and self._pass_params is not None:
            self._guard.record(self._covered)

    def _on_capture(self, cap: Any) -> None:
        if not self._rows.open:
            return  # someone else's engine.batch(): not ours to record
        project, stats = self._batch_flags
        if stats and self._collector is not None:
            self._collector.on_capture(cap)
            self._pass_ids.samples = cap.num_samples  # auto ids of a pass storing no rows
        if project:
            in_place = self.mode == "log" and self._logger is not None
            self._rows.add(cap, self._logger.writer if in_place else None)

    def _complete(
        self, block: Block, ids: list | None, keep: Any, same: bool | torch.Tensor = True
    ) -> None:
        """Store (or keep, in eval mode) a closed block's rows. ``same``: the weights guard's
        flag (:meth:`BlockGuard.begin`), confirmed here; on an accelerator it travels with the
        rows and their NaN/Inf flags in the block's one copy, and the store's writer thread
        checks them all once the copy has landed: nothing is read back in the step (a refusal
        is raised at the next block or at finalize())."""
        if not (self.mode == "eval" or self._saving()):
            self._guard.confirm(same)
            self._pass_ids.note(ids)  # a statistics pass storing no rows: the ids it saw
            return
        assert self._projections is not None
        batch, rowbuf, factors = block.rows, block.buffer, block.factors
        warned = self.engine.no_gradient_warned  # one warning with the engine's (capture/build.py)
        cols = module_blocks(batch, self._projections, warned, self.mode != "eval")
        n = cols[0].shape[0]
        if rowbuf is not None:
            for name, col in zip(self._projections, cols, strict=True):
                if name not in batch:  # the reused buffer holds an older batch's values there
                    rowbuf[:, self._rows.columns[name]] = col
        if ids is None:
            ids = list(range(self._next_auto_id, self._next_auto_id + n))
            keep = self._admit(ids)
        elif len(ids) != n:
            raise ids_count_error(len(ids), n)
        self._next_auto_id += n
        if self.mode == "eval":
            if block.staged is not None:  # one copy, then checked on the host
                rows = block.staged.cpu()
            else:
                rows = torch.cat(cols, dim=1) if len(cols) > 1 else cols[0]
            ids, rows, _ = filter_nonfinite(ids, rows, self.config.nonfinite)
            self._eval_seen.update(ids)
            self._eval_ids += ids
            self._eval_rows.append(rows.detach().cpu())
            return
        recycle = rowbuf
        if self._logger is None:  # flushed by a second signal inside the block: reopened
            self._open_logger()
            keep, recycle = self._admit(ids), None  # the buffer was the closed writer's
        assert self._logger is not None
        if block.staged is not None:
            flag = same if isinstance(same, torch.Tensor) else None
            if flag is None:
                self._guard.confirm(same)
            confirm = self._guard.deferred() if flag is not None else None
            # the rows and their flags leave the device in one copy, queued; the writer's
            # thread waits for it, then checks the flags
            self._logger.add_staged(ids, block.staged, keep, block.flat, flag, confirm)
            return
        self._guard.confirm(same)
        if rowbuf is not None:
            # the rows were assembled in place: one contiguous block, one write in the thread
            self._logger.add(ids, rowbuf, keep, recycle=recycle, factors=factors)
        else:
            # module blocks go to the writer as they are: it writes them row by row (writev)
            self._logger.add(ids, [c.detach().cpu() for c in cols], keep)

    def _admit(self, ids: list) -> list[bool] | None:
        if self.mode == "eval":
            dup = [i for i in ids if i in self._eval_seen] or duplicate_ids(ids)
            if dup:
                raise ValueError(f"duplicate data ids in this eval log: {dup[:5]}")
            return None
        if self._logger is not None:
            return self._logger.admit(ids)
        return None

    # ------------------------------------------------------------------------ passes
    def schedule(self) -> Iterator[Any]:
        """Run every pass the configuration needs (EKFAC: factors, then eigenvalues + grads).

        Example:
            >>> for _ in run.schedule():  # doctest: +SKIP
            ...     for x, y in loader:
            ...         with run(data_id=ids): loss_fn(model(x), y).backward()

        Raises:
            RuntimeError: a logging pass is open, or ``finalize()`` was called inside the loop.
        """
        self._require_no_open_pass("schedule()")
        self._pass = 0
        self._round_params = None
        for i, spec in enumerate(self.config.passes()):
            if self._pass != i:
                raise RuntimeError("finalize() was called inside a schedule() loop")
            yield spec
            self.finalize_scheduled()

    def eval(self) -> Run:
        """Analysis mode: capture projected gradients in memory (for :meth:`get_log`), save nothing.

        Raises:
            RuntimeError: a logging pass is open (call :meth:`finalize` first).
        """
        self._require_no_open_pass("eval()")
        self.mode = "eval"
        self._eval_ids, self._eval_rows, self._eval_seen = [], [], set()
        self._next_auto_id = 0
        self._eval_params, self._eval_model, self._probe_reduction = None, None, True
        if self._projections is None and self.engine is not None and self.engine.watched:
            self._build_projections()  # from the store when it exists (see below)
        return self

    def train(self) -> Run:
        """Back to logging mode (the opposite of :meth:`eval`)."""
        self.mode = "log"
        return self

    def get_log(self) -> GradientLog:
        """Rows captured since :meth:`eval` (or the previous ``get_log``), then cleared.

        Raises:
            RuntimeError: the run is not in eval mode, or nothing was captured.
        """
        if self.mode != "eval":
            raise RuntimeError("get_log() returns what eval() mode captured: call eval() first")
        if not self._eval_ids:
            raise RuntimeError("get_log(): nothing captured since eval() / the last get_log()")
        rows = torch.cat(self._eval_rows) if len(self._eval_rows) > 1 else self._eval_rows[0]
        # read one tensor at a time by whoever uses them (hashed now, one tensor at a time)
        stats, stats_hash = store_io.lazy_statistics(self.path)
        # the weights when this log's first block was captured; scoring compares them with the
        # store's (meta["params_sha256"])
        meta = self.store_meta(params_sha256=self._eval_params, statistics_sha256=stats_hash)
        meta.update(dense_layout(meta))  # the queries' rows are dense (see _rows.begin)
        meta["model_sha256"] = self._eval_model  # every tensor of the model (and its parents)
        projections = projection_tensors(self._projections) if self._projections else {}
        log = GradientLog(list(self._eval_ids), rows, meta, stats, projections)
        self._eval_ids, self._eval_rows, self._eval_seen = [], [], set()
        self._next_auto_id = 0
        self._eval_params, self._eval_model, self._probe_reduction = None, None, True
        self._rows.energy = EnergyTally()  # queries' energy is not recorded anywhere
        return log

    def build_log_dataloader(self, batch_size: int = 1024, num_workers: int = 0) -> Any:
        """DataLoader of ``(ids, rows)`` blocks over this run's store (after :meth:`finalize`).

        Raises:
            RuntimeError: a logging pass is open (call :meth:`finalize` first).
        """
        self._require_no_open_pass("build_log_dataloader()")
        return make_log_dataloader(self.path, batch_size=batch_size, num_workers=num_workers)

    # ---------------------------------------------------------------------- internals
    def store_meta(
        self,
        hashed: bool = True,
        params_sha256: str | None = None,
        statistics_sha256: str | None = None,
    ) -> dict[str, Any]:
        """The meta.json describing rows of this run (layout, projection hash, config).

        ``hashed=False`` leaves ``projection_sha256`` ``None`` (the store fills it in later);
        ``params_sha256``/``statistics_sha256`` as in :func:`nnstat.store.meta.build_meta`.
        """
        self._build_projections()
        assert self._projections is not None
        args = dict(self._projection_args)
        if not self._projection_set:
            args["rank"] = self.config.rank
        return build_meta(
            self.project,
            self.config.content(),
            self.config.store.dtype,
            self.config.store.nonfinite,
            args,
            self._projections,
            hashed,
            params_sha256=params_sha256,
            statistics_sha256=statistics_sha256,
        )

    def _begin_pass(self) -> None:
        """At the first block of a logging pass: ``overwrite``, then the weights' fingerprint,
        refused when the store's rows (or this schedule's earlier passes) had other weights."""
        if self._pass_params is not None:
            return
        if self.overwrite and self._pass == 0:
            store_io.clear_store(self.path, self.rank, self.world_size)
            self.overwrite = False
        current = params_fingerprint(self.engine)
        self._covered = enclosing(self.model) if self.model is not None else None
        whole = model_fingerprint(self._covered)
        check_store_weights(self.path, current, self._warned_once, whole)
        if self._pass > 0 and self._round_params not in (None, (current, whole)):
            raise weights_changed_error([p.name for p in self.config.passes()], self._pass)
        if self._pass == 0:
            self._round_params = (current, whole)
        self._pass_params, self._pass_model = current, whole
        self._guard.reset()

    def _pass_spec(self) -> Any:
        return self.config.passes()[self._pass]

    def _saving(self) -> bool:
        return self.mode == "log" and bool(self._pass_spec().save.get("grad"))

    def _stats_on(self) -> bool:
        return any(self._pass_spec().statistic.values())

    def _skip_param_grads(self) -> bool:
        return self.mode == "log" and not self.config.param_grads

    def _build_projections(self) -> None:
        if self._projections is not None:
            return
        if self.engine is None or not self.engine.watched:
            raise RuntimeError("call watch(model) before add_projection() / logging")
        if self.mode == "eval" and not self._projection_set and (self.path / META_FILE).exists():
            # queries of an existing store (e.g. in a new process) use the store's projection
            self._projections, self._projection_args = store_io.projections_from_store(
                self.path, self.engine
            )
            self._projection_set = True
            return
        specs = [module_shape(n, m) for n, m in self.engine.watched.items()]
        args = dict(self._projection_args)
        if not self._projection_set:
            args["rank"] = self.config.rank
        stats = None
        if args["init"] == "pca" and args["rank"] is not None:
            stats = store_io.finalized_statistics(self._stats_state, self.path)
        self._projections = build_projections(
            specs, args["rank"], args["init"], args["seed"], stats, self.config.factors
        )

    def _open_logger(self) -> None:
        if self._logger is not None:
            return
        assert self._projections is not None
        meta = self.store_meta(hashed=False, params_sha256=self._pass_params)
        meta["model_sha256"] = self._pass_model
        prepare = functools.partial(prepare_store, self.path, self._projections, self.rank)
        self._logger = StoreLogger(
            self.path, meta, self.config.store, self.rank, self.world_size, prepare=prepare
        )
        self._on_signal.install()
        if not self._atexit:
            self._atexit = True
            atexit.register(self._flush_at_exit)
