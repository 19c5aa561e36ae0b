"""One background thread that runs CPU statistic jobs while the training thread goes on.

numpy's block reductions release the GIL, so on a CPU training run the statistics of step ``t``
can use the core the training step leaves idle. One worker thread serves every Tracker of the
process (jobs run in submission order); it is a daemon started on first use, restarted after a
``fork``, and it sets its own intra-op thread count to 1 (the statistic passes are blocked for
one core) without changing the process-wide setting the training thread uses.

A job never swallows an exception: it is stored and re-raised by `Job.result` in the thread that
collects the job.

Example:
    >>> job = submit(lambda: 6 * 7)
    >>> job.result()
    42
    >>> submit(lambda: 1 / 0).result()
    Traceback (most recent call last):
    ...
    ZeroDivisionError: division by zero
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Job", "submit", "start_one_thread_worker"]


class Job:
    """A function run on the worker thread; `wait` blocks until it is done."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._value: Any = None
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            self._value = self._fn()
        except BaseException as e:  # handed to the collecting thread, never dropped
            self.error = e
        finally:
            self._fn = None  # release what the closure holds (tensors of the step)
            self._done.set()

    def done(self) -> bool:
        """True once the function has returned or raised."""
        return self._done.is_set()

    def wait(self) -> None:
        """Block until the job is done (its error, if any, is kept for `result`)."""
        self._done.wait()

    def result(self) -> Any:
        """Wait, then return the value or re-raise the job's exception in this thread."""
        self.wait()
        if self.error is not None:
            raise self.error
        return self._value


class _Worker:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._start()
        self._queue.put(job)
        return job

    def _start(self) -> None:
        self._queue = queue.SimpleQueue()
        self._thread = start_one_thread_worker(self._loop, "nnstat-statistics")

    def _loop(self) -> None:
        while True:
            self._queue.get()._run()


def start_one_thread_worker(target: Callable[[], None], name: str) -> threading.Thread:
    """Start daemon thread ``name`` running ``target()`` with torch on one intra-op thread there.

    The worker takes one core, and its reductions round exactly as on the synchronous
    one-thread path; the caller's thread count is unchanged.

    Example:
        >>> done = threading.Event()
        >>> t = start_one_thread_worker(done.set, "example"); t.join(); done.is_set()
        True
    """
    n = torch.get_num_threads()
    ready = threading.Event()

    def run() -> None:
        # thread-local for OpenMP/MKL; get_num_threads first: it runs torch's once-per-thread
        # initialisation, which would otherwise later reset this thread to the process count
        torch.get_num_threads()
        torch.set_num_threads(1)
        ready.set()
        target()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    ready.wait()
    # torch.set_num_threads also sets the default new threads inherit; the worker's call above
    # changed it to 1, so put back the caller's value (its own OpenMP setting was never touched)
    torch.set_num_threads(n)
    return thread


_WORKER = _Worker()


def _after_fork() -> None:
    # the child has no worker thread; a fresh one starts on its first job
    global _WORKER
    _WORKER = _Worker()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def submit(fn: Callable[[], Any]) -> Job:
    """Run ``fn()`` on the shared statistics thread; returns its `Job`."""
    return _WORKER.submit(Job(fn))
