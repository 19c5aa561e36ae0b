"""A shard file written with ``O_DIRECT`` from one reused, page-aligned staging buffer.

Same on-disk result and commit protocol as :class:`~nnstat.store.shards.ShardFile` (temporary
name, header fixed, fsync, ids file, rename). Why: writing a store through the page cache makes
the kernel allocate and fill a fresh page for every 4 KiB written, which under virtualisation
(host-backed guest pages) costs several times the copy itself, on the cores training uses. With
``O_DIRECT`` the rows are copied once into a staging buffer that is reused for every shard and
the disk reads them from there. Filesystems without ``O_DIRECT`` (tmpfs, some overlays) fall back
to ordinary writes of the same bytes.

Example:
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> shard = DirectShardFile(d, "rank0-00000", 3, np.float32, StagingBuffer())
    >>> shard.append([np.ones((2, 3), np.float32)]); shard.commit([0, 1])
    >>> np.load(d / "rank0-00000.npy").shape
    (2, 3)
"""

from __future__ import annotations

import errno
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from nnstat.store.files import TMP_SUFFIX
from nnstat.store.shards import (
    ShardFile,
    check_blocks,
    npy_header,
    remove_orphan_ids,
    rows_hasher,
)

#: bytes staged before one direct write (a multiple of every logical block size in use)
STAGE_BYTES = 4 * 2**20
_ALIGN = 4096
#: npy header size of a direct shard: one block, so the rows start block-aligned
HEADER_BYTES = _ALIGN


class StagingBuffer:
    """A page-aligned anonymous mapping, touched once and reused for every shard of a writer."""

    def __init__(self, nbytes: int = STAGE_BYTES) -> None:
        if nbytes % _ALIGN:
            raise ValueError(f"staging buffer size must be a multiple of {_ALIGN}, got {nbytes}")
        self.map = mmap.mmap(-1, nbytes)
        self.view = memoryview(self.map)
        # copies go through numpy, which releases the GIL for them (a memoryview slice
        # assignment would hold it for the whole copy and stall the training thread)
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.nbytes = nbytes


class DirectShardFile(ShardFile):
    """One shard streamed to ``{stem}.npy.tmp`` through ``stage``; :meth:`commit` makes it count.

    A :class:`~nnstat.store.shards.ShardFile` (same ``commit``) whose bytes take another path.

    Args:
        shard_dir: directory of the shard.
        stem: file stem (``rank{r}-{n:05d}``).
        width: columns per row.
        np_dtype: numpy dtype of the stored values.
        stage: the writer's :class:`StagingBuffer` (one shard at a time uses it).
    """

    def __init__(
        self, shard_dir: Path, stem: str, width: int, np_dtype: Any, stage: StagingBuffer
    ) -> None:
        self.dir, self.stem, self.width = Path(shard_dir), stem, width
        self.np_dtype = np.dtype(np_dtype)
        self.target = self.dir / f"{stem}.npy"
        self.tmp = self.target.with_name(self.target.name + TMP_SUFFIX)
        self.rows = 0
        self.hasher = rows_hasher()  # the rows' bytes in file order, as they are written
        self._stage = stage
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        self.direct = hasattr(os, "O_DIRECT")
        try:
            self._fd = os.open(self.tmp, flags | (os.O_DIRECT if self.direct else 0), 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.direct = False  # the filesystem refuses O_DIRECT: ordinary writes
            self._fd = os.open(self.tmp, flags, 0o644)
        header = npy_header(0, width, self.np_dtype, HEADER_BYTES)
        stage.view[: len(header)] = header
        self._fill = len(header)  # bytes of the file held in the stage, not yet written

    def append(self, blocks: list[np.ndarray]) -> None:
        """Write rows given as column blocks ``[b, w_k]`` whose widths add up to ``width``."""
        n = check_blocks(self.stem, blocks, self.width, self.np_dtype)
        rows = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)
        src = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
        self.hasher.update(src)  # hashlib releases the GIL for large buffers
        stage, pos = self._stage, 0
        if (
            self.direct
            and self._fill % _ALIGN == 0
            and len(src) % _ALIGN == 0
            and src.ctypes.data % _ALIGN == 0
        ):
            # block-aligned rows at a block-aligned file offset (the writer's row buffers are
            # page-aligned and shards hold whole blocks of rows): the disk reads them in place
            if self._fill:
                self._write(stage.view[: self._fill])
                self._fill = 0
            self._write(memoryview(src))
            self.rows += n
            return
        while pos < len(src):
            take = min(stage.nbytes - self._fill, len(src) - pos)
            np.copyto(stage.array[self._fill : self._fill + take], src[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == stage.nbytes:
                self._write(stage.view)
                self._fill = 0
        self.rows += n

    def _write(self, data: memoryview) -> None:
        while len(data):
            try:
                done = os.write(self._fd, data)
            except OSError as e:
                if e.errno != errno.EINVAL or not self.direct:
                    raise
                self._to_buffered()  # O_DIRECT accepted at open, refused at write
                continue
            if done < len(data) and self.direct:
                # a short direct write may stop at an unaligned length: finish without O_DIRECT
                self._to_buffered()
            data = data[done:]

    def _to_buffered(self) -> None:
        offset = os.lseek(self._fd, 0, os.SEEK_CUR)
        os.close(self._fd)
        self._fd = os.open(self.tmp, os.O_WRONLY)
        os.lseek(self._fd, offset, os.SEEK_SET)
        self.direct = False

    def _seal(self) -> None:
        """Write the tail, fix the header, fsync and close (the rest of ``commit`` is shared)."""
        size = HEADER_BYTES + self.nbytes
        if self._fill:
            # a direct write needs whole blocks: pad the tail, then cut the file to its size
            end = -(-self._fill // _ALIGN) * _ALIGN if self.direct else self._fill
            self._stage.view[self._fill : end] = bytes(end - self._fill)
            self._write(self._stage.view[:end])
            self._fill = 0
        os.close(self._fd)
        self._fd = -1
        fd = os.open(self.tmp, os.O_WRONLY)  # the header is 128 bytes: an ordinary write
        try:
            os.ftruncate(fd, size)
            os.pwrite(fd, npy_header(self.rows, self.width, self.np_dtype, HEADER_BYTES), 0)
            os.fsync(fd)  # also flushes the device cache after the direct writes
        finally:
            os.close(fd)

    def abort(self) -> None:
        """Close and delete the temporary file (the shard never counted)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        self.tmp.unlink(missing_ok=True)
        remove_orphan_ids(self.dir, self.stem)
