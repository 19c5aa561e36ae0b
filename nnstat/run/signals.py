"""Committing a logging pass when the process is told to stop: schedulers (SLURM, Kubernetes)
stop a job with SIGTERM, a user with Ctrl-C (SIGINT), and neither runs ``finalize()``.

While a pass is open, :class:`CommitOnSignal` handles SIGTERM and SIGINT: it flushes the pass
(the open shard is committed, as at a normal exit), then hands the signal to the handler that
was installed before (the user's own is called after the flush; Python's SIGINT handler raises
``KeyboardInterrupt``; the default SIGTERM behaviour is restored and the signal raised again,
so the process still ends "killed by SIGTERM"). Installed only from the main thread (Python
allows no other), never over an ignored signal, and removed when the pass ends.

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
from collections.abc import Callable
from typing import Any

SIGNALS = ("SIGTERM", "SIGINT")


class CommitOnSignal:
    """Run ``flush`` on SIGTERM/SIGINT, then the previous handler (see the module docstring)."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush
        self._previous: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def install(self) -> None:
        """Handle the signals (idempotent; a no-op outside the main thread)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for name in SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None or signal.getsignal(sig) in (signal.SIG_IGN, None):
                continue  # ignored on purpose (or set from C): leave it so
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put the previous handlers back (those still ours; idempotent)."""
        previous, self._previous = self._previous, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in previous.items():
            if signal.getsignal(sig) == self._handle:
                signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        previous = self._previous.get(signum, signal.SIG_DFL)
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
