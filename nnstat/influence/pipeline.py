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
Each block is staged and copied in its own dtype where it is narrower than float32
(`staging_dtype`) and widened on the device, on the scoring stream, into one kept buffer.
`stream_to` reads a store's rows as stored: a 16-bit store (``dtype`` float16 or bfloat16)
crosses at half the bytes of float32, and a store of factored rows (``factors=c``) at 4-8x
fewer bytes than dense, its rows staying factored on the device, where the scoring contracts
them chunk by chunk (`nnstat.influence.ondevice`).

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


def staging_dtype(stored: torch.dtype, scored: torch.dtype) -> torch.dtype:
    """The dtype a block of ``stored`` rows is staged and copied to the device in, for scoring in
    ``scored``: the stored one where it is a narrower float (float16, bfloat16 under float32:
    half the bytes cross, and widening is exact, so the device widens them after the copy),
    else ``scored`` (the rows are converted while they are staged, as they would be anyway).

    Args:
        stored: the dtype of the rows as read (a store's ``dtype``).
        scored: the dtype the device scores in (torch's default, float32).

    Returns:
        The dtype of the host buffers and of the host-to-device copy.

    Example:
        >>> staging_dtype(torch.bfloat16, torch.float32), staging_dtype(torch.float64, torch.float32)
        (torch.bfloat16, torch.float32)
    """
    if stored.is_floating_point and stored.itemsize < scored.itemsize:
        return stored
    return scored


class _Widened:
    """One kept buffer the rows of each block are converted into, on their device and on the
    current (scoring) stream: the work queued there on the block before has read the buffer by
    the time the next conversion writes it, so no buffer is allocated per block."""

    def __init__(self, dtype: torch.dtype | None) -> None:
        self.dtype = dtype  # None: rows are handed out as they crossed
        self._buffer: torch.Tensor | None = None

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if self.dtype is None or rows.dtype == self.dtype:
            return rows
        n, width = rows.shape
        buf = self._buffer
        if buf is None or buf.device != rows.device or buf.shape[0] < n or buf.shape[1] != width:
            buf = self._buffer = torch.empty(n, width, dtype=self.dtype, device=rows.device)
        return buf[:n].copy_(rows)


class _DeviceCopies:
    """Two device buffers filled on a side stream; the scoring stream waits for each copy's
    event, and a buffer is refilled only after the scoring stream is done with it: after the
    block's scoring, or, for rows widened on the device, after the widening read it."""

    def __init__(self, device: torch.device, widen: _Widened) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.widen = widen
        self._buffers: list[torch.Tensor | None] = [None] * DEPTH
        self._scored: list[Any] = [None] * DEPTH
        self._next = 0

    def copy(self, rows: torch.Tensor) -> tuple[torch.Tensor, Any, int | None]:
        """``rows`` (host, pinned) on the device as they are, then widened on the scoring stream;
        returns the device rows, the copy's event and the buffer to mark `scored` after the
        block (``None``: released already, once the widening read it)."""
        i, self._next = self._next, (self._next + 1) % DEPTH
        compute = torch.cuda.current_stream(self.device)
        buf = self._buffers[i]
        n, width = rows.shape
        if buf is None or buf.shape[0] < n or buf.shape[1] != width or buf.dtype != rows.dtype:
            # allocated on the scoring stream, which is the last to use it
            buf = torch.empty(n, width, dtype=rows.dtype, device=self.device)
            self._buffers[i] = buf
        with torch.cuda.stream(self.stream):
            if self._scored[i] is not None:
                self.stream.wait_event(self._scored[i])
            dst = buf[:n]
            dst.copy_(rows, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        compute.wait_event(copied)
        out = self.widen(dst)
        if out is dst:
            return dst, copied, i
        self.scored(i)  # the widening is queued: the next copy into the buffer waits for it
        return out, copied, None

    def scored(self, i: int) -> None:
        """The scoring stream's work on buffer ``i`` is queued: later copies into it wait for it."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self._scored[i] = event


def read_ahead(
    blocks: Iterator[Block], device: torch.device | str, max_rows: int = 0, widen: bool = True
) -> Iterator[Block]:
    """``blocks`` read on a background thread one block ahead, their rows on ``device``.

    Host rows are copied on the thread into one of two host buffers (pinned for a CUDA device)
    of their own dtype where it is narrower than torch's default (`staging_dtype`: a 16-bit
    store's rows as stored), and from there to ``device``, where they are widened to the
    default dtype into one kept buffer; rows already on ``device`` pass through (widened the
    same way). The rows of a block are valid until the next block is requested.

    Args:
        blocks: ``(key, ids, rows)`` blocks (`units`).
        device: where the rows are handed out.
        max_rows: rows of the largest block (sizes the host buffers once).
        widen: hand the rows out in torch's default dtype (``False``: as they crossed, in
            their `staging_dtype`).

    Returns:
        ``(key, ids, rows on device)`` blocks, valid until the next is requested.

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
    scored = torch.get_default_dtype()
    widened = _Widened(scored if widen else None)

    def fill(block: Block) -> tuple[Block, torch.Tensor | None]:
        # on the reader thread: the disk read (a memory-mapped shard is read here)
        key, ids, rows = block
        if rows.device.type != "cpu":
            return block, None
        n, width = rows.shape
        # waits, if need be, until the device has read the buffer's previous rows
        flat = pool.take(max(n, max_rows) * width, staging_dtype(rows.dtype, scored))
        return (key, ids, flat[: n * width].view(n, width).copy_(rows)), flat

    reader = Reader(blocks, fill, DEPTH, "nnstat-shard-reader")
    copies = _DeviceCopies(device, widened) if cuda else None
    try:
        for (key, ids, rows), flat in reader:
            if copies is not None and rows.device != device:
                rows, copied, i = copies.copy(rows)
                if flat is not None:
                    pool.give(flat, copied)  # refilled once the copy has read it
                reader.done()
                yield key, ids, rows
                if i is not None:
                    copies.scored(i)
            else:
                if rows.device != device:
                    rows = rows.to(device)
                yield key, ids, widened(rows)
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

    A store is read as stored (`StoreSource.stored_rows`): the host buffers and the
    host-to-device copy carry the stored bytes. 16-bit rows (a store's ``dtype`` float16 or
    bfloat16) cross as such and are widened to float32 on ``device`` (`read_ahead`); factored
    rows (`StoreSource.factored`) stay factored there (the consumer scores them with
    `FactoredScores`, or multiplies a chunk out at a time with `StoreSource.dense`).

    Args:
        source: the training rows.
        blocks_of: cuts a source into blocks (`units`, or this rank's share of them).
        device: where the rows are scored.
        max_rows: rows of the largest block (sizes the host buffers once).

    Returns:
        ``(key, ids, float32 rows on device, factored as stored)`` blocks, valid until the
        next is requested.

    Example:
        >>> from nnstat.influence.sources import TensorSource
        >>> src = TensorSource(torch.ones(3, 2))
        >>> [rows.shape[0] for _, _, rows in stream_to(src, lambda s: units(s, 2), "cpu")]
        [2, 1]
    """
    stored = getattr(source, "stored_rows", None)
    if stored is not None:
        source = stored()
    return read_ahead(blocks_of(source), device, max_rows)
