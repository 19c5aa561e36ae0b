"""Background shard writer: a bounded queue drained by one thread that writes whole shards.

Training only waits on disk when the queue is full. Any error in the thread is kept and raised
in the training process by the next :meth:`StoreWriter.put`, :meth:`StoreWriter.check` or
:meth:`StoreWriter.close` — never swallowed. Rows staged on a device (:meth:`StoreWriter.put_staged`)
may come with flags the thread reads from their host copy, once it has landed: when those
refuse the rows (NaN/Inf under ``nonfinite="error"``, a changed model), the thread commits the
rows before them, stores nothing from then on, and the refusal is raised as it is (a
``ValueError``), once, by the next call.

Example:
    >>> import tempfile, torch
    >>> d = Path(tempfile.mkdtemp())
    >>> w = StoreWriter(d, row_width=3, shard_rows=2)
    >>> w.put([0, 1, 2], torch.ones(3, 3))
    >>> w.close()
    3
    >>> len(list_shards(d))
    2
"""

from __future__ import annotations

import math
import mmap
import os
import queue
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nnstat.background import start_one_thread_worker
from nnstat.background.transfer import HostBuffers, copy_to_host
from nnstat.store import outer
from nnstat.store.commits import (
    append_begin,
    append_commit,
    check_ids,
    committed_shards,
    recover_log,
)
from nnstat.store.direct import DirectShardFile, StagingBuffer
from nnstat.store.errors import StoreWriteError
from nnstat.store.ids import DataId, ids_digest, read_ids
from nnstat.store.lock import WriterLock
from nnstat.store.shards import (
    STORE_DTYPES,
    ShardFile,
    encode_rows,
    list_shards,  # noqa: F401 - the module's example counts shards with it
    next_shard_index,
    remove_incomplete,
    shard_stem,
)

#: target size of one shard file when ``shard_rows`` is not given
SHARD_BYTES = 64 * 2**20


_ANON_FLAGS = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
_ANON_FLAGS |= getattr(mmap, "MAP_POPULATE", 0)


def anon_array(count: int, dtype: Any) -> np.ndarray:
    """A flat array in its own anonymous mapping: page-aligned (direct I/O reads it in place),
    private and populated up front (about half the cost of faulting in a shared mapping page
    by page)."""
    nbytes = count * np.dtype(dtype).itemsize
    if nbytes == 0:  # mmap refuses a zero-length mapping (EINVAL): an empty batch has no rows
        return np.empty(0, dtype=dtype)
    m = mmap.mmap(-1, nbytes, flags=_ANON_FLAGS) if _ANON_FLAGS else mmap.mmap(-1, nbytes)
    return np.frombuffer(m, dtype=dtype, count=count)


def _mapped_rows(count: int, dtype: torch.dtype) -> torch.Tensor:
    # float32 rows in their own anonymous mapping (`anon_array`), for the writer's row buffers
    return torch.from_numpy(anon_array(count, np.float32))


_STOP = object()


class StoreWriter:
    """Buffers rows into shards of ``shard_rows`` and writes them from a background thread.

    Args:
        shard_dir: directory of the shards (created if missing).
        row_width: number of columns of every row.
        shard_rows: rows per shard (the last one of a pass may be smaller); default: about
            64 MiB per shard.
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"``.
        rank: process rank, part of the shard names (``rank{r}-{n:05d}``).
        queue_size: maximum number of pending blocks before :meth:`put` blocks.
        lock: this rank's :class:`WriterLock`, already taken (the logger takes it before it
            reads the store); by default the writer takes it. Released by :meth:`close`.
        require_log: the store's meta.json says its writers keep commit logs
            (``shard_logs``): a rank with shards but no ``rank{r}.log`` is refused
            (:mod:`nnstat.store.commits`).

    Raises:
        StoreLockedError: another writer of the same rank is writing into ``shard_dir``.

    Example:
        >>> import tempfile, numpy as np, torch
        >>> w = StoreWriter(Path(tempfile.mkdtemp()), row_width=2, shard_rows=4)
        >>> w.put(["a", "b"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        >>> w.close()  # flushes the last (short) shard, raises what the thread met: rows written
        2
        >>> [(p.name, np.load(p).tolist()) for _, _, p, _ in list_shards(w.shard_dir)]
        [('rank0-00000.npy', [[1.0, 2.0], [3.0, 4.0]])]
    """

    def __init__(
        self,
        shard_dir: Path,
        row_width: int,
        shard_rows: int | None = None,
        dtype: str = "float32",
        rank: int = 0,
        queue_size: int = 16,
        lock: WriterLock | None = None,
        require_log: bool = False,
    ) -> None:
        if dtype not in STORE_DTYPES:
            raise ValueError(f"unknown store dtype {dtype!r}; valid: {sorted(STORE_DTYPES)}")
        itemsize = np.dtype(STORE_DTYPES[dtype][0]).itemsize
        if shard_rows is None:  # about SHARD_BYTES per shard, a whole number of 4 KiB blocks
            row_bytes = max(1, row_width * itemsize)
            per_block = 4096 // math.gcd(row_bytes, 4096)  # rows that fill whole blocks
            shard_rows = max(1, min(65536, SHARD_BYTES // row_bytes))
            shard_rows = max(per_block, shard_rows // per_block * per_block)
        if shard_rows < 1 or row_width < 1 or queue_size < 1:
            raise ValueError("shard_rows, row_width and queue_size must be positive")
        self.shard_dir = Path(shard_dir)
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        # the lock first: only the holder may delete this rank's leftovers (a live writer's
        # temporary file looks exactly like a crashed one's)
        self._lock = lock if lock is not None else WriterLock(self.shard_dir, rank)
        try:
            # the log first: a logged shard that lost its .npy must be reported, not have its
            # ids file removed as an orphan
            self._lock.check()
            recover_log(self.shard_dir, rank, require_log)
            remove_incomplete(self.shard_dir, rank)
            index = next_shard_index(self.shard_dir, rank)
        except BaseException:
            self._lock.release()
            raise
        self.row_width, self.shard_rows, self.dtype, self.rank = row_width, shard_rows, dtype, rank
        self._index = index
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        # a refusal of staged rows by their flags (set by the thread), and the same object
        # once it was raised in the caller's thread (raised once: the pass may go on)
        self._refusal: ValueError | None = None
        self.refused: ValueError | None = None
        self._shard: ShardFile | None = None
        self._stage: StagingBuffer | None = None  # the direct-I/O staging buffer, made once
        self._shard_ids: list[DataId] = []
        self.rows_written = 0
        self.bytes_written = 0
        self.shards_written: list[str] = []
        # rows are assembled in reused buffers: fresh multi-MB tensors every batch cost page
        # faults (expensive under virtualisation) in the training thread; pinned ones (rows
        # copied from a CUDA device) are kept apart from the mapped ones. Every buffer that can be
        # in flight (the queue's, one being written, one being filled) is kept for reuse: a slow
        # fsync lets the queue fill, and re-mapping the buffers it took costs the training
        # thread ~1.2 ms each the next time (6.6 MB, populated)
        keep = queue_size + 2
        self._mapped = HostBuffers(pin=False, keep=keep, minimum=0, alloc=_mapped_rows)
        self._pinned = HostBuffers(pin=True, keep=keep)
        self._half: np.ndarray | None = None  # 16-bit rows of one batch, reused (see _encode)
        # torch ops in the thread (16-bit encoding) run on it alone, next to training's threads
        self._thread = start_one_thread_worker(self._loop, "nnstat-store-writer")

    # ----------------------------------------------------------------- training-process side
    def check(self) -> None:
        """Raise :class:`StoreWriteError` if the background thread failed; raise the refusal of
        staged rows by their flags (:meth:`put_staged`) as it is, the first time it is seen.

        Raises:
            StoreWriteError: the thread failed (the original exception is the ``__cause__``).
            ValueError: staged rows were refused (NaN/Inf under ``nonfinite="error"``, or
                :class:`~nnstat.store.errors.ModelChangedError`); nothing after them is stored.
        """
        if self._error is not None:
            err = self._error
            raise StoreWriteError(
                f"gradient store writer failed in {self.shard_dir}: {err!r}"
            ) from err
        if self._refusal is not None and self.refused is None:
            self.refused = self._refusal
            raise self._refusal

    def row_buffer(self, n: int, pinned: bool = False, extra: int = 0) -> torch.Tensor:
        """A float32 ``[n, row_width]`` buffer to fill and pass to :meth:`put` as ``recycle``.

        Its content is undefined. The writer takes it back once the rows are on disk, so the
        same few buffers circulate instead of a fresh allocation per batch. ``pinned``: in
        page-locked memory, the target of a non-blocking copy from a CUDA device. ``extra``:
        words kept after the rows in the same flat buffer (the view's ``_base``).
        """
        pool = self._pinned if pinned else self._mapped
        size = (max(n, 1) if pinned else n) * self.row_width + extra
        return pool.take(size, torch.float32)[: n * self.row_width].view(n, self.row_width)

    def put(
        self,
        ids: list[DataId],
        rows: torch.Tensor | list[torch.Tensor],
        recycle: torch.Tensor | None = None,
        factors: list[outer.OuterFactors] | None = None,
    ) -> None:
        """Queue ``rows`` ``[len(ids), row_width]``, or column blocks that concatenate to it.

        Blocks are joined in the background thread, straight into the shard file. ``recycle``: a
        :meth:`row_buffer` the rows live in (or were copied from); it is reused once written.
        ``factors``: columns of ``rows`` (a tensor) the thread fills with these outer products
        before writing (see :mod:`nnstat.store.outer`).
        """
        self.check()
        blocks = rows if isinstance(rows, list) else [rows]
        width = sum(b.shape[1] if b.dim() == 2 else -1 for b in blocks)
        if width != self.row_width or any(b.dim() != 2 or b.shape[0] != len(ids) for b in blocks):
            shapes = [tuple(b.shape) for b in blocks]
            raise ValueError(f"expected rows of shape [{len(ids)}, {self.row_width}], got {shapes}")
        if len(ids):
            self._queue.put((list(ids), [b.detach() for b in blocks], recycle, factors))
        elif recycle is not None:
            self._release(recycle)

    def put_staged(
        self,
        ids: list[DataId],
        rows: torch.Tensor,
        flat: torch.Tensor | None = None,
        decide: Callable[[torch.Tensor], list[int] | None] | None = None,
    ) -> None:
        """Queue rows ``[N, row_width]`` that are on a device (``len(ids) == N``): ONE copy into
        a reused host row buffer, non-blocking from CUDA into pinned memory with an event the
        thread waits on before writing, so the training thread never waits for the device.

        ``flat``: the flat device buffer ``rows`` is the start of, followed by flag words: the
        whole of it is the one copy, and once it has landed the thread calls ``decide(words)``
        with the host copy of the words after the rows. ``decide`` returns the positions of the
        rows to write (``None``: all; e.g. NaN/Inf rows skipped by the policy), or raises a
        ``ValueError`` refusing them (see the module docstring).

        Raises:
            ValueError: ``rows`` is not ``[len(ids), row_width]``, or an earlier block's rows were
                refused by their flags (:meth:`check`).
            StoreWriteError: the thread failed.
        """
        self.check()
        if rows.dim() != 2 or rows.shape != (len(ids), self.row_width):
            raise ValueError(
                f"expected rows of shape [{len(ids)}, {self.row_width}], got {tuple(rows.shape)}"
            )
        if not len(ids):
            return
        n = rows.shape[0] * self.row_width
        src = rows.detach() if flat is None else flat.detach()
        host = self.row_buffer(rows.shape[0], rows.device.type == "cuda", src.numel() - n)
        whole = host._base if host._base is not None else host
        ready = copy_to_host(whole[: src.numel()].view(src.shape), src)
        words = whole[n : src.numel()]
        self._queue.put((list(ids), [host], host, None, ready, decide, words))

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` in the thread, in order with the rows (an error is raised like theirs)."""
        self.check()
        self._queue.put(fn)

    def _release(self, buf: torch.Tensor) -> None:
        (self._pinned if self._pinned.owns(buf) else self._mapped).give(buf)

    def pending(self) -> int:
        """Blocks not yet taken by the thread."""
        return self._queue.qsize()

    def close(self, progress: bool = False) -> int:
        """Flush the partial shard, stop the thread and return the rows written (this writer).

        ``progress=True`` shows a tqdm bar while the queue drains.
        """
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=1.0)
            if progress and self._thread.is_alive():  # flushing is long: show where it stands
                from tqdm.auto import tqdm

                total = self._queue.qsize()
                # disable=None: no bar when stderr is not a terminal (CI logs, batch jobs)
                bar_args = dict(desc="nnstat: flushing gradient store", unit="block", disable=None)
                with tqdm(total=total, **bar_args) as bar:
                    while self._thread.is_alive():
                        bar.update(max(0, total - self._queue.qsize() - bar.n))
                        self._thread.join(timeout=0.1)
                    bar.update(total - bar.n)
            self._thread.join()
        self._lock.release()  # the thread is done: nothing of this writer touches the files
        self.check()
        return self.rows_written

    # ----------------------------------------------------------------- background side
    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                if self._error is None and self._refusal is None:
                    self._run_guarded(self._flush)
                if self._shard is not None:  # after an error: the partial shard never counts
                    self._run_guarded(self._shard.abort)
                return
            if self._error is not None or self._refusal is not None:
                continue  # keep draining so put() never deadlocks; the error is raised there
            if callable(item):
                self._run_guarded(item)
            else:
                self._run_guarded(self._add, *item)

    def _run_guarded(self, fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - kept and re-raised in the caller's thread
            self._error = e

    def _add(
        self,
        ids: list[DataId],
        blocks: list[torch.Tensor],
        recycle: torch.Tensor | None,
        factors: list[outer.OuterFactors] | None,
        ready: Any = None,
        decide: Callable[[torch.Tensor], list[int] | None] | None = None,
        words: torch.Tensor | None = None,
    ) -> None:
        try:
            if ready is not None:  # the copy from the device (put_staged) has landed
                ready.synchronize()
            if decide is not None:
                try:
                    select = decide(words)
                except ValueError as refusal:
                    # the rows before these were good: committed; none from here on
                    self._flush()
                    self._refusal = refusal
                    return
                if select is not None:
                    ids = [ids[j] for j in select]
                    blocks = [b[select] for b in blocks]
            if factors:
                outer.fill(blocks[0], factors)
            self._write(ids, blocks)
        finally:
            if recycle is not None:
                self._release(recycle)

    def _write(self, ids: list[DataId], blocks: list[torch.Tensor]) -> None:
        # one reused 16-bit buffer: a single block (column blocks are encoded one by one)
        if len(blocks) == 1:
            arrays = [self._encode(blocks[0])]
        else:
            arrays = [encode_rows(b, self.dtype) for b in blocks]
        pos = 0
        while pos < len(ids):
            if self._shard is None:
                self._open_shard(arrays[0].dtype)
            assert self._shard is not None
            take = min(self.shard_rows - self._shard.rows, len(ids) - pos)
            self._shard.append([a[pos : pos + take] for a in arrays])
            self._shard_ids.extend(ids[pos : pos + take])
            pos += take
            if self._shard.rows == self.shard_rows:
                self._commit()

    def _encode(self, rows: torch.Tensor) -> np.ndarray:
        """The rows as stored. A 16-bit dtype is converted into one reused page-aligned buffer
        (a fresh tensor per batch would page fault and miss the in-place direct write)."""
        if self.dtype == "float32" or rows.device.type != "cpu" or rows.dim() != 2:
            return encode_rows(rows, self.dtype)
        n, w = rows.shape
        if self._half is None or self._half.size < n * w:
            self._half = anon_array(n * w, STORE_DTYPES[self.dtype][0])
        return encode_rows(rows, self.dtype, out=self._half[: n * w].reshape(n, w))

    def _open_shard(self, np_dtype: np.dtype) -> None:
        need = self.shard_rows * self.row_width * np.dtype(np_dtype).itemsize
        free = shutil.disk_usage(self.shard_dir).free
        if need > free:
            raise OSError(f"not enough disk space for a {need}-byte shard ({free} bytes free)")
        self._lock.check()  # a shard is created only by the holder of the rank's lock
        stem = shard_stem(self.rank, self._index)
        if hasattr(os, "O_DIRECT"):
            if self._stage is None:
                self._stage = StagingBuffer()
            self._shard = DirectShardFile(
                self.shard_dir, stem, self.row_width, np_dtype, self._stage
            )
        else:
            self._shard = ShardFile(self.shard_dir, stem, self.row_width, np_dtype)
        self._shard_ids = []

    def _flush(self) -> None:
        if self._shard is not None and self._shard.rows:
            self._commit()

    def _commit(self) -> None:
        shard, self._shard = self._shard, None
        assert shard is not None
        try:
            # first: the shard may be adopted as pending (a crash before its log line) only
            # with this line, whose digest its ids are checked against whenever they are read
            digest = ids_digest(self._shard_ids)
            content = shard.rows_digest()  # hashed as the rows were written
            append_begin(self.shard_dir, self.rank, shard.stem, shard.rows, digest, content)
            shard.commit(self._shard_ids)
        except BaseException:
            shard.abort()
            raise
        self._index += 1
        # the last step of the commit: from here on readers need the shard's two files
        append_commit(self.shard_dir, self.rank, shard.stem, shard.rows)
        self.rows_written += shard.rows
        self.bytes_written += shard.nbytes
        self.shards_written.append(shard.stem)
        self._shard_ids = []


def stored_ids(shard_dir: Path, require_log: bool = False) -> set[DataId]:
    """All ids of the shards that count, of every rank in ``shard_dir`` (checked against the
    commit logs: :func:`~nnstat.store.commits.committed_shards`)."""
    out: set[DataId] = set()
    for shard in committed_shards(shard_dir, require_log):
        ids = read_ids(shard.ids)
        check_ids(shard, ids)
        out.update(ids)
    return out
