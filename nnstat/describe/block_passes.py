"""Blocked passes run on this thread, or shared block by block with a second thread.

A blocked pass reduces a list of tensors in cache-sized blocks (the CPU backend,
`nnstat.describe.numpy_blocks`), each block's result in its own slot, combined in block order
afterwards. Inside `share_blocks` this thread and a second one (the Tracker's statistics
worker) take the blocks one at a time, with the numbers of one thread bit for bit; a
`BlockPass` is such a pass prepared but not run, and `run_passes` runs several as ONE, so the
second thread is handed one job and waited for once.

Example:
    >>> import numpy as np
    >>> x = np.arange(6.0)
    >>> out = np.zeros(3)
    >>> def block(k, lane):
    ...     out[k] = x[2 * k : 2 * k + 2].sum()
    >>> run_passes([BlockPass(3, block, lambda: out.tolist())])
    [[1.0, 5.0, 9.0]]
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["BlockPass", "run_passes", "share_blocks", "Submit"]


#: ``submit(fn)``: runs ``fn()`` on a second thread (see `share_blocks`); None: this thread only
Submit = Callable[[Callable[[], None]], object]
_SECOND: contextvars.ContextVar[Submit | None] = contextvars.ContextVar(
    "nnstat_blocks_second_thread", default=None
)


@contextlib.contextmanager
def share_blocks(submit: Submit) -> Iterator[None]:
    """Inside the block, the blocked passes run from this thread (`run_passes`, the passes of
    `nnstat.describe.numpy_blocks`) hand out their blocks to this thread and to the thread
    `submit` runs a function on, one at a time.

    Both threads take the next free block until none is left, so they finish together whatever
    the sizes of the tensors and however the OS shares the cores (a split by tasks left one
    thread waiting for the other's weight/update pass). Every block's result is stored in its
    own slot and the slots are combined in block order afterwards, so the numbers are bit for
    bit those of one thread. A call returns once every block it handed out is done, without
    waiting for `submit`'s thread to start (it may be busy: this thread then does them all).
    numpy's reductions release the GIL, so the two threads run at once.

    Example:
        >>> import threading
        >>> def submit(fn):
        ...     threading.Thread(target=fn).start()
        >>> x, out = np.arange(8.0), np.zeros(4)
        >>> def block(k, lane):
        ...     out[k] = x[2 * k : 2 * k + 2].sum()
        >>> with share_blocks(submit):
        ...     run_passes([BlockPass(4, block, lambda: float(out.sum()))])
        [28.0]
    """
    token = _SECOND.set(submit)
    try:
        yield
    finally:
        _SECOND.reset(token)


class _Blocks:
    """Blocks ``0..n-1`` handed out one at a time to the threads calling `work`.

    The next block comes from an `itertools.count` (one call, atomic under the GIL): no lock
    per block, so the two threads contend only for the GIL. `busy` is held by the second
    thread (lane 1) while it works, so the caller can wait for its last block."""

    def __init__(self, n: int, fn: Callable[[int, int], None]) -> None:
        self.n, self.fn = n, fn
        self.taken = itertools.count()
        self.stopped = False
        self.error: BaseException | None = None
        self.busy = threading.Lock()

    def work(self, lane: int) -> None:
        """Run ``fn(k, lane)`` on free blocks until none is left (or one failed)."""
        with np.errstate(over="ignore", invalid="ignore"):
            if lane == 0:
                self._work(lane)
                return
            with self.busy:
                self._work(lane)

    def _work(self, lane: int) -> None:
        fn, n, taken = self.fn, self.n, self.taken
        while not self.stopped:
            k = next(taken)
            if k >= n:
                return
            try:
                fn(k, lane)
            except BaseException as e:  # re-raised by the calling thread in `_run_blocks`
                if self.error is None:
                    self.error = e
                self.stopped = True

    def stop_and_wait(self) -> None:
        """Hand out no more blocks; return once every block handed out is done."""
        self.stopped = True
        with self.busy:  # the second thread's last block (it sees `stopped` after it)
            pass
        self.fn = _nothing  # a helper job still queued need not keep the tensors alive


def _nothing(k: int, lane: int) -> None:
    return None


def _run_blocks(n: int, fn: Callable[[int, int], None]) -> None:
    """``fn(k, lane)`` for every block ``k < n``: on this thread (lane 0) and, inside
    `share_blocks`, on the second thread too (lane 1); re-raises the first failure.

    Overflow/NaN are detected and handled per block by `fn`, so numpy need not warn about them
    (its error state is per thread: set on both)."""
    submit = _SECOND.get()
    if submit is None or n < 2:
        with np.errstate(over="ignore", invalid="ignore"):
            for k in range(n):
                fn(k, 0)
        return
    blocks = _Blocks(n, fn)
    submit(lambda: blocks.work(1))
    try:
        blocks.work(0)
    finally:
        # never return while the other thread still reads (or refreshes) the caller's tensors
        blocks.stop_and_wait()
    if blocks.error is not None:
        raise blocks.error


@dataclass
class BlockPass:
    """A blocked pass prepared but not run: ``fn(k, lane)`` reduces block ``k < blocks`` into
    its own slot (on either thread, see `share_blocks`); ``finish()`` gives the pass' result
    once every block is done. `run_passes` runs several as one."""

    blocks: int
    fn: Callable[[int, int], None]
    finish: Callable[[], Any]

    def then(self, post: Callable[[Any], Any]) -> BlockPass:
        """The same blocks, with ``post(result)`` as the result."""
        return BlockPass(self.blocks, self.fn, lambda: post(self.finish()))


def run_passes(passes: Sequence[BlockPass]) -> list[Any]:
    """Every block of `passes` in ONE blocked pass, then each pass' ``finish()``, in order.

    Inside `share_blocks` the second thread gets one job for all of them and the caller waits
    for it once at the end, instead of once per pass (where it waits for the block that thread
    holds, a scheduler slice when the OS preempted it). Each block still writes its own slot,
    so the results are those of running the passes one by one, bit for bit.

    Args:
        passes: prepared passes (`BlockPass`), e.g. `nnstat.describe.numpy_blocks`' ``*_pass``.

    Returns:
        Each pass' ``finish()``, in the order of `passes`.

    Raises:
        Exception: the first failure of a block (on either thread), once no block is running.

    Example:
        >>> x, sums, maxima = np.arange(6.0), np.zeros(3), np.zeros(2)
        >>> def sum_of(k, lane):
        ...     sums[k] = x[2 * k : 2 * k + 2].sum()
        >>> def max_of(k, lane):
        ...     maxima[k] = x[3 * k : 3 * k + 3].max()
        >>> run_passes([BlockPass(3, sum_of, sums.tolist), BlockPass(2, max_of, maxima.tolist)])
        [[1.0, 5.0, 9.0], [2.0, 5.0]]
    """
    starts = list(itertools.accumulate((p.blocks for p in passes), initial=0))
    owner = [j for j, p in enumerate(passes) for _ in range(p.blocks)]
    fns = [p.fn for p in passes]

    def one(k: int, lane: int) -> None:
        j = owner[k]
        fns[j](k - starts[j], lane)

    _run_blocks(starts[-1], one)
    return [p.finish() for p in passes]
