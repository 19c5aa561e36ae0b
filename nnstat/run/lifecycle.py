"""How a logging pass of a :class:`~nnstat.run.core.Run` ends: ``finalize()``, a signal or the
interpreter's exit without it (:mod:`nnstat.background.signals`), or a writer failure.

:class:`PassEnd` is a part of ``Run`` (its base class), kept apart because these paths share
one concern: the open pass's rows reach the disk whichever way the pass ends.

Example:
    >>> from nnstat.run import Run
    >>> issubclass(Run, PassEnd)
    True
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from nnstat.background.signals import CommitOnSignal
from nnstat.run import store_io
from nnstat.store.errors import StoreWriteError
from nnstat.store.factored import EnergyTally
from nnstat.store.logger import StoreLogger
from nnstat.store.meta import record_factor_energy


def next_pass_message(path: Path, passes: list[Any], done: int) -> str:
    """The warning after pass ``done`` of a configuration that has more: a user who ran one
    loop and ``finalize()`` (as with ``kfac``) would otherwise find no rows in the store.

    Example:
        >>> from nnstat.run import RunConfig
        >>> passes = RunConfig(log="grad", save="grad", statistic="ekfac").passes()
        >>> print(next_pass_message(Path("logs/p"), passes, 1))  # doctest: +ELLIPSIS
        finalize(): pass 1 of 2 ('factors') of logs/p is done; ... the next loop over the data is pass 2 ('eigenvalues'), which stores the rows: ...
    """
    stores = "which stores the rows" if passes[done].save.get("grad") else "which stores no rows"
    later = any(p.save.get("grad") for p in passes[:done])
    return (
        f"finalize(): pass {done} of {len(passes)} ({passes[done - 1].name!r}) of {path} is done; "
        f"{'' if later else 'the store holds no rows yet: '}the next loop over the data is "
        f"pass {done + 1} ({passes[done].name!r}), {stores}: run the logging loop again with the "
        "same weights, or loop over run.schedule(), which runs every pass and finalizes each"
    )


class PassEnd:
    """Ending a logging pass (see the module docstring); the state is the ``Run``'s."""

    _scheduled = False  # inside schedule(): it runs the passes left, no warning about them

    path: Path
    rank: int
    mode: str
    config: Any
    _logger: StoreLogger | None
    _collector: Any
    _stats_state: dict
    _on_signal: CommitOnSignal
    _pass: int
    _pass_params: str | None
    _probe_reduction: bool
    _guard: Any
    _writer_error: StoreWriteError | None
    _flushed_early: bool
    _next_auto_id: int
    _rows: Any
    _pass_ids: store_io.PassIds

    def _stats_on(self) -> bool:  # pragma: no cover - Run's
        raise NotImplementedError

    def finalize(self) -> None:
        """End the pass: flush the store (tqdm when long), save statistics, raise writer errors.

        In eval mode there is nothing to finalize (queries stay in memory until get_log()).

        Raises:
            Exception: the store writer's error (disk full, a failed write), re-raised here once
                the pass is closed.
            ValueError: on an accelerator, a refusal the writer's thread found in the flags of
                a block's copy (NaN/Inf under ``nonfinite="error"``, or
                :class:`~nnstat.store.errors.ModelChangedError`) and no block raised yet: the
                rows before the refused block are stored, none from it on.
        """
        if self.mode == "eval":
            return
        # a signal while the store is flushed is handled once it is complete (the handlers are
        # still ours until then: a restored SIGTERM would end the process half-way through)
        with self._on_signal.hold():
            self._finalize()

    def _finalize(self) -> None:
        collector = self._collector if self._stats_on() else None
        logger, self._logger = self._logger, None
        self._pass_params, self._probe_reduction = None, True
        self._guard.reset()
        error, self._writer_error = self._writer_error, None
        first = self._pass == 0  # a round's first pass: its statistics start afresh
        try:
            saved = store_io.close_pass(
                logger,
                collector,
                self.path,
                self.rank,
                error,
                seen=lambda logged: self._pass_ids.end_pass(logged, first),
            )
            if collector is None:
                self._pass_ids.discard()
            energy, self._rows.energy = self._rows.energy, EnergyTally()
            if logger is not None:
                record_factor_energy(self.path, self.rank, energy.summary())
        finally:
            self._on_signal.restore()
            if collector is not None and collector.done:
                self._collector = None
        self._stats_state = saved if saved is not None else self._stats_state
        self._next_auto_id = 0
        flushed, self._flushed_early = self._flushed_early, False
        if logger is None and collector is None and not flushed:
            # an empty pass is not a pass: the next loop is still this one
            warnings.warn("finalize(): nothing was logged in this pass", stacklevel=2)
            return
        # the next loop is the next pass (EK-FAC: factors, then eigenvalues); after the last,
        # a new round starts
        passes = self.config.passes()
        self._pass = (self._pass + 1) % len(passes)
        if self._pass and not self._scheduled:
            warnings.warn(next_pass_message(self.path, passes, self._pass), stacklevel=3)

    def finalize_scheduled(self) -> None:
        """:meth:`finalize` as ``schedule()`` calls it between passes: without the warning
        that the configuration has a pass left (the schedule runs it)."""
        self._scheduled = True
        try:
            self.finalize()
        finally:
            self._scheduled = False

    def _flush_at_exit(self, why: str = "exit") -> None:
        """A pass never finalize()d: its rows are flushed at exit or on SIGTERM/SIGINT (whole
        shards, meta.json), so none is lost; its statistics are not saved (their all-reduce
        needs every rank)."""
        logger, self._logger = self._logger, None
        self._on_signal.restore()
        if logger is None:
            return
        self._flushed_early = why == "a signal"
        warnings.warn(
            f"nnstat: the logging pass of {self.path} was never finalize()d; its rows are "
            f"flushed at {why}, but its statistics are not saved. Call finalize() after each "
            "pass (or loop over run.schedule(), which does).",
            stacklevel=1,
        )
        # no all-reduce: other ranks may be gone; an error here is printed by atexit
        logger.close(progress=False, collective=False)

    def _check_writer(self) -> None:
        with self._writer_errors():
            if self._logger is not None:
                self._logger.writer.check()

    @contextmanager
    def _writer_errors(self) -> Iterator[None]:
        """A writer failure ends the pass where it surfaces: the writer is stopped (its lock
        released, so another run may write the store) and the error is kept for finalize().
        A refusal of staged rows by their flags, found in the writer's thread (NaN/Inf under
        ``nonfinite="error"``, a changed model), ends the store's writing the same way where
        it surfaces, raised once: the rows before it are stored, a later block resumes."""
        try:
            yield
        except ValueError as e:
            logger = self._logger
            if logger is None or e is not logger.writer.refused:
                raise
            self._logger = None
            self._on_signal.restore()
            store_io.close_after_failure(logger, e)
            self._flushed_early = True  # the rows before the refusal: flushed, a pass
            raise
        except StoreWriteError as e:
            logger, self._logger = self._logger, None
            self._on_signal.restore()
            if logger is not None:
                store_io.close_after_failure(logger, e)
            self._writer_error = e
            raise

    def _require_no_open_pass(self, what: str) -> None:
        if self._logger is not None:
            raise RuntimeError(f"{what} during a logging pass: call finalize() first")
