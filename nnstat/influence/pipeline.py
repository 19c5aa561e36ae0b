"""Training rows streamed to the scoring device: read ahead on a thread, two blocks in flight.

`units` cuts a source into ``(key, ids, rows)`` blocks, shard by shard (this rank's shards under
``torch.distributed``), and asks the OS to read the next shard ahead (`GradientStore.prefetch`,
an asynchronous hint: the CPU branch of scoring reads the memory maps straight from `units`, so
a cold store's disk reads overlap its scoring without a thread or a copy).

`read_ahead` runs that iterator on a reader thread for the device branch: the thread reads block
``k + 1`` from disk into one of two host buffers (pinned when the device is a GPU) while the
device scores block ``k``; the main thread copies each buffer to the device with
``non_blocking=True`` on a side stream, and the scoring stream waits for that copy's event, so
disk reads, host-to-device copies and scoring overlap. Rows already on the device pass through.
`stream_to` does the same for a source whose store holds factored rows (``factors=c``): the
rows travel as stored, 4-8x fewer bytes than dense, and stay factored on the device, where the
scoring contracts them chunk by chunk (`nnstat.influence.ondevice`).

The thread is a `nnstat.background.worker.Reader` and the host buffers a
`nnstat.background.transfer.HostBuffers` pool, handed back with the event of the device copy
that reads them. An error raised while reading (a damaged shard, a shape that does not match its
ids) is re-raised in the consumer, with its traceback, where its block would have come; the
thread stops when the consumer does (an error there, or a consumer that stops early).

Example:
    >>> from nnstat.influence.sources import TensorSource
    >>> src = TensorSource(torch.arange(10.0)[:, None], shard_rows=4)
    >>> [(key, ids) for key, ids, _ in read_ahead(units(src, 3), "cpu")]
    [((0, 0), [0, 1, 2]), ((0, 1), [3]), ((1, 0), [4, 5, 6]), ((1, 1), [7]), ((2, 0), [8, 9])]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from nnstat.background.transfer import HostBuffers
from nnstat.background.worker import Reader

from .sources import RowSource

Block = tuple[tuple, list, torch.Tensor]

#: host buffers of the reader thread: block ``k + 1`` is read while block ``k`` is scored
DEPTH = 2


def units(source: RowSource, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[Block]:
    """``(unit key, ids, rows)`` blocks of this rank's shards; keys sort in single-process order.

    Before the blocks of a shard, the next shard of this rank is read ahead where the source
    can (`StoreSource.prefetch`): the OS reads it while this one is scored.

    Example:
        >>> from nnstat.influence.sources import TensorSource
        >>> src = TensorSource(torch.zeros(5, 2), shard_rows=2)
        >>> [key for key, _, _ in units(src, 2, rank=1, world=2)]
        [(1, 0)]
    """
    shards = source.iter_shards()
    if world == 1 or len(shards) >= world:
        mine = [(s_idx, shard) for s_idx, shard in enumerate(shards) if s_idx % world == rank]
        prefetch = getattr(source, "prefetch", None)
        for n, (s_idx, shard) in enumerate(mine):
            if prefetch is not None and n + 1 < len(mine):
                prefetch(mine[n + 1][1])
            for b_idx, (ids, rows) in enumerate(source.iter_shard_blocks(shard, batch_size)):
                yield (s_idx, b_idx), ids, rows
        return
    # fewer shards than ranks: split blocks round-robin instead
    for b_idx, (ids, rows) in enumerate(source.iter_blocks(batch_size)):
        if b_idx % world == rank:
            yield (0, b_idx), ids, rows


class _DeviceCopies:
    """Two device buffers filled on a side stream; the scoring stream waits for each copy's
    event, and a buffer is refilled only after the scoring stream is done with it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._buffers: list[torch.Tensor | None] = [None] * DEPTH
        self._scored: list[Any] = [None] * DEPTH
        self._next = 0

    def copy(self, rows: torch.Tensor) -> tuple[torch.Tensor, Any, int]:
        i, self._next = self._next, (self._next + 1) % DEPTH
        compute = torch.cuda.current_stream(self.device)
        buf = self._buffers[i]
        n, width = rows.shape
        if buf is None or buf.shape[0] < n or buf.shape[1] != width:
            # allocated on the scoring stream, which is the last to use it
            buf = self._buffers[i] = torch.empty(n, width, device=self.device)
        with torch.cuda.stream(self.stream):
            if self._scored[i] is not None:
                self.stream.wait_event(self._scored[i])
            dst = buf[:n]
            dst.copy_(rows, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        compute.wait_event(copied)
        return dst, copied, i

    def scored(self, i: int) -> None:
        """The scoring stream's work on buffer ``i`` is queued: later copies into it wait for it."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._scored[i] = event


def read_ahead(
    blocks: Iterator[Block], device: torch.device | str, max_rows: int = 0
) -> Iterator[Block]:
    """``blocks`` read on a background thread one block ahead, their rows on ``device``.

    Host rows are copied on the thread into one of two host buffers (pinned for a CUDA device),
    and from there to ``device``; rows already on ``device`` pass through. The rows of a block
    are valid until the next block is requested.

    Example:
        >>> blocks = iter([((0, 0), [0], torch.ones(1, 2)), ((0, 1), [1], torch.zeros(1, 2))])
        >>> [rows.sum().item() for _, _, rows in read_ahead(blocks, "cpu")]
        [2.0, 0.0]
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    if cuda and device.index is None:  # "cuda" names the current device: rows there pass
        device = torch.device("cuda", torch.cuda.current_device())
    pool = HostBuffers(pin=cuda, keep=DEPTH)
    dtype = torch.get_default_dtype()

    def fill(block: Block) -> tuple[Block, torch.Tensor | None]:
        # on the reader thread: the disk read (a memory-mapped shard is read here)
        key, ids, rows = block
        if rows.device.type != "cpu":
            return block, None
        n, width = rows.shape
        # waits, if need be, until the device has read the buffer's previous rows
        flat = pool.take(max(n, max_rows) * width, dtype)
        return (key, ids, flat[: n * width].view(n, width).copy_(rows)), flat

    reader = Reader(blocks, fill, DEPTH, "nnstat-shard-reader")
    copies = _DeviceCopies(device) if cuda else None
    try:
        for (key, ids, rows), flat in reader:
            if copies is not None and rows.device != device:
                rows, copied, i = copies.copy(rows)
                if flat is not None:
                    pool.give(flat, copied)  # refilled once the copy has read it
                reader.done()
                yield key, ids, rows
                copies.scored(i)
            else:
                if rows.device != device:
                    rows = rows.to(device)
                yield key, ids, rows
                if flat is not None:
                    pool.give(flat)  # the consumer is done with these rows
                reader.done()
    finally:
        reader.close()


def stream_to(
    source: RowSource,
    blocks_of: Callable[[RowSource], Iterator[Block]],
    device: torch.device | str,
    max_rows: int = 0,
) -> Iterator[Block]:
    """`read_ahead` of ``blocks_of(source)`` with the rows on ``device`` as stored.

    A store of factored rows (`StoreSource.factored`) is read as stored (`StoreSource.stored_rows`):
    the host buffers and the host-to-device copy carry the stored bytes, and the blocks stay
    factored on ``device`` (the consumer scores them with `FactoredScores`, or multiplies a chunk
    out at a time with `StoreSource.dense`).

    Args:
        source: the training rows.
        blocks_of: cuts a source into blocks (`units`, or this rank's share of them).
        device: where the rows are scored.
        max_rows: rows of the largest block (sizes the host buffers once).

    Returns:
        ``(key, ids, rows on device as stored)`` blocks, valid until the next is requested.

    Example:
        >>> from nnstat.influence.sources import TensorSource
        >>> src = TensorSource(torch.ones(3, 2))
        >>> [rows.shape[0] for _, _, rows in stream_to(src, lambda s: units(s, 2), "cpu")]
        [2, 1]
    """
    if getattr(source, "factored", False):
        source = source.stored_rows()
    return read_ahead(blocks_of(source), device, max_rows)
