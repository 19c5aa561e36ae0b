"""Threads beside training: the shared statistics worker, reader threads, one error relay.

numpy's block reductions release the GIL, so on a CPU training run the statistics of step ``t``
can use the core the training step leaves idle. One worker thread serves every Tracker of the
process (jobs run in submission order); it is a daemon started on first use, restarted after a
``fork``, and it sets its own intra-op thread count to 1 (the statistic passes are blocked for
one core) without changing the process-wide setting the training thread uses.

`Reader` runs an iterator on its own thread a few items ahead of its consumer (the scoring
pipeline's shard reads). Nothing swallows an exception: a `Relay` holds the first error of a
thread and re-raises it in the thread that collects the result (`Job.result`, the item a
`Reader` would have yielded, the store writer's next call).

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

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

__all__ = ["Job", "Reader", "Relay", "submit", "start_one_thread_worker"]


class Relay:
    """The first exception raised on a background thread, kept for the thread that collects
    its results (never dropped: re-raised there, at the next call or at close).

    Example:
        >>> relay = Relay()
        >>> with relay.catching():
        ...     1 / 0
        >>> relay.raise_error()
        Traceback (most recent call last):
        ...
        ZeroDivisionError: division by zero
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        """Keep an exception raised in the block (the first one: it caused the others)."""
        try:
            yield
        except BaseException as e:  # handed to the collecting thread, never dropped
            if self.error is None:
                self.error = e

    def raise_error(self) -> None:
        """Re-raise the kept exception, if any.

        Raises:
            BaseException: the first exception caught on the thread.
        """
        if self.error is not None:
            raise self.error


class Job:
    """A function run on the worker thread; `wait` blocks until it is done."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._done = threading.Event()
        self._value: Any = None
        self._relay = Relay()

    @property
    def error(self) -> BaseException | None:
        """The exception the function raised (``None``: none, or not done yet)."""
        return self._relay.error

    def run(self) -> None:
        """Run the function here (the worker thread), keeping its value or its exception."""
        try:
            with self._relay.catching():
                self._value = self._fn()
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
        self._relay.raise_error()
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
            self._queue.get().run()


_END = object()


class Reader:
    """`items` iterated on a daemon thread, at most `depth` items ahead of the consumer.

    ``fill(item)`` runs on the thread for each item (e.g. a disk read into a host buffer); the
    consumer iterates the reader and calls `done` once it no longer needs an item's host
    memory, which lets the thread read one more. An exception on the thread is re-raised in the
    consumer where its item would have come (`Relay`); `close` (also when the consumer stops
    early or fails) stops the thread and closes `items`.

    Example:
        >>> reader = Reader(iter([1, 2, 3]), lambda x: 10 * x, depth=2, name="example")
        >>> out = []
        >>> for x in reader:
        ...     out.append(x); reader.done()
        >>> reader.close(); out
        [10, 20, 30]
    """

    def __init__(self, items: Iterable[Any], fill: Callable[[Any], Any], depth: int, name: str):
        self._items, self._fill = items, fill
        self._ready: queue.SimpleQueue = queue.SimpleQueue()
        self._free = threading.Semaphore(depth)
        self._stop = threading.Event()
        self._relay = Relay()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._relay.catching():
            for item in self._items:
                while not self._free.acquire(timeout=0.05):
                    if self._stop.is_set():
                        return  # the consumer stopped
                if self._stop.is_set():
                    return
                self._ready.put(self._fill(item))
        self._ready.put(_END)

    def __iter__(self) -> Iterator[Any]:
        while True:
            item = self._ready.get()
            if item is _END:
                self._relay.raise_error()
                return
            yield item

    def done(self) -> None:
        """The consumer is done with one item's host memory: the thread may read one more."""
        self._free.release()

    def close(self) -> None:
        """Stop the thread, then close `items` (a generator left mid-way releases what it holds)."""
        self._stop.set()
        self._thread.join()
        close = getattr(self._items, "close", None)
        if close is not None:
            close()


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
