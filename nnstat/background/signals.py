"""Flushing what is buffered (a logging pass's open shard, a Recorder's KPIs, a Tracker's steps
on their way to the sinks) when the process is told to stop: schedulers (SLURM, Kubernetes)
stop a job with SIGTERM, a user with Ctrl-C (SIGINT), a closed terminal with SIGHUP, and none
of them runs ``finalize()`` or ``close()``.

While a pass is open, :class:`CommitOnSignal` handles SIGTERM, SIGINT and SIGHUP. A signal
that arrives inside a ``run(...)`` block or inside ``finalize()`` is held until that section
ends (the block's rows are then complete, the writer is not interrupted half-way through a
shard); one that arrives between blocks is delivered at once. Delivering it flushes the pass
(the open shard is committed, as at a normal exit), then hands the signal to the handler that
was installed before: the user's own is called after the flush and may return ("set a flag,
finish the step, stop": the next ``run(...)`` block reopens the store and keeps logging);
Python's SIGINT handler raises ``KeyboardInterrupt``; without a handler the default action is
restored and the signal raised again, so the process still ends "killed by SIGTERM". A second
signal of the same kind while the first is held is delivered at once (a hung block still stops
on the second Ctrl-C).

Python installs signal handlers only from the main thread: a logging loop started in another
thread runs without them (see ``docs/store.md``). Never installed over an ignored signal,
removed when the pass ends.

Example:
    >>> flushed = []
    >>> guard = CommitOnSignal(lambda: flushed.append(1)); guard.install(); guard.restore()
    >>> flushed
    []
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP")


class CommitOnSignal:
    """Run ``flush`` on SIGTERM/SIGINT/SIGHUP, then the previous handler (see the module
    docstring); :meth:`hold` defers a signal to the end of a section."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush
        self._previous: dict[int, Any] = {}
        # the handlers a held signal goes on to: kept past restore() (finalize() restores
        # before the signal it held is delivered)
        self._chain: dict[int, Any] = {}
        self._depth = 0  # nested hold() sections
        self._pending: dict[int, Any] = {}  # signal -> frame, held until the section ends

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    @property
    def holding(self) -> bool:
        """Whether a :meth:`hold` section is running (a flush called now would cut into it: a
        second signal of a kind already held is delivered at once)."""
        return self._depth > 0

    def install(self) -> None:
        """Handle the signals (idempotent; a no-op outside the main thread)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for name in SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None or signal.getsignal(sig) in (signal.SIG_IGN, None):
                continue  # ignored on purpose (or set from C): leave it so
            self._previous[sig] = signal.signal(sig, self._handle)
        self._chain = dict(self._previous)

    def restore(self) -> None:
        """Put the previous handlers back (those still ours; idempotent)."""
        previous, self._previous = self._previous, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, handler)

    @contextmanager
    def hold(self) -> Iterator[None]:
        """A section a signal must not interrupt: one arriving inside is delivered at its end
        (also when the section raises)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._pending:
                signum, frame = next(iter(self._pending.items()))
                self._pending.clear()
                self._deliver(signum, frame)

    def _handle(self, signum: int, frame: Any) -> None:
        if self._depth > 0 and signum not in self._pending:
            self._pending[signum] = frame  # delivered when the section ends
            return
        self._pending.pop(signum, None)
        self._deliver(signum, frame)

    def _deliver(self, signum: int, frame: Any) -> None:
        previous = self._chain.get(signum, signal.SIG_DFL)
        self.restore()
        error: BaseException | None = None
        try:
            self._flush()
        except BaseException as e:  # noqa: BLE001 - raised or printed below, after the signal
            error = e
        if callable(previous):
            previous(signum, frame)  # the user's handler, or SIGINT's KeyboardInterrupt
        else:  # SIG_DFL: end the process as the signal would have
            if error is not None:
                traceback.print_exception(error, file=sys.stderr)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        if error is not None:
            raise error
