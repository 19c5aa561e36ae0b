"""Shards of a gradient store: how rows are encoded (float32, float16, bfloat16) and how a shard
file is written, committed, listed and cleaned up.

A shard is ``shards/rank{r}-{n:05d}.npy`` (rows = samples) with its ``.ids.json``; it counts
only when both files exist. The ``.npy`` is streamed to a temporary name, its header fixed and
fsynced, then the ids file is written (temporary name, fsync, rename) and the ``.npy`` renamed
last, so a crash at any point leaves either a whole shard or an orphan ids file / temporary
file that readers ignore (and the next writer of that rank removes: :func:`remove_incomplete`).

Example:
    >>> shard_stem(0, 3)
    'rank0-00003'
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nnstat.store import files
from nnstat.store.ids import DataId

_SHARD_RE = re.compile(r"^rank(\d+)-(\d{5,})\.npy$")

# dtype name -> (numpy dtype of the file, torch dtype of the values)
STORE_DTYPES: dict[str, tuple[Any, torch.dtype]] = {
    "float32": (np.float32, torch.float32),
    "float16": (np.float16, torch.float16),
    # numpy has no bfloat16: the raw 16-bit patterns are stored as uint16 and meta.json says so.
    "bfloat16": (np.uint16, torch.bfloat16),
}


def shard_stem(rank: int, index: int) -> str:
    """File stem of shard ``index`` written by process ``rank``.

    Example:
        >>> shard_stem(1, 7)
        'rank1-00007'
    """
    return f"rank{rank}-{index:05d}"


def overflow_threshold(dtype: str) -> float:
    """The smallest magnitude that ``dtype`` storage rounds to infinity (``inf`` for float32).

    Largest finite value plus half its spacing (round to nearest, ties to even go up there).

    Example:
        >>> overflow_threshold("float16")
        65520.0
    """
    if dtype == "float32":
        return math.inf
    info = torch.finfo(STORE_DTYPES[dtype][1])
    _, exponent = math.frexp(info.max)  # max = m * 2**exponent, 0.5 <= m < 1
    return float(info.max) + math.ldexp(info.eps, exponent - 2)  # + half the spacing at max


def encode_rows(rows: torch.Tensor, dtype: str, out: np.ndarray | None = None) -> np.ndarray:
    """Convert a float tensor ``[b, w]`` to the numpy array stored for ``dtype``.

    ``out`` (a ``[b, w]`` array of the stored numpy dtype) receives a 16-bit conversion and is
    returned; float32 rows come back as they are (a view when already float32 on the CPU).
    """
    if dtype not in STORE_DTYPES:
        raise ValueError(f"unknown store dtype {dtype!r}; valid: {sorted(STORE_DTYPES)}")
    if rows.dim() != 2 or not rows.dtype.is_floating_point:
        raise TypeError(f"rows must be a 2-D float tensor, got {rows.dtype} {tuple(rows.shape)}")
    np_dtype, torch_dtype = STORE_DTYPES[dtype]
    if out is not None and dtype != "float32":
        target = torch.from_numpy(out.view(np.int16) if dtype == "bfloat16" else out)
        target.view(torch_dtype).copy_(rows.detach())
        return out
    t = rows.detach().to("cpu", torch_dtype).contiguous()
    if dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy().astype(np_dtype, copy=False)


def decode_rows(array: np.ndarray, dtype: str) -> torch.Tensor:
    """Inverse of :func:`encode_rows`, always returning float32 (a copy, safe to modify)."""
    if dtype == "bfloat16":
        a = np.ascontiguousarray(array).view(np.int16)
        return torch.from_numpy(a.copy()).view(torch.bfloat16).float()
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True))


_HEADER_BYTES = 128  # fixed, so the row count can be rewritten in place when a shard closes


def npy_header(rows: int, width: int, np_dtype: Any, nbytes: int = _HEADER_BYTES) -> bytes:
    """A ``.npy`` (format 1.0) header of exactly ``nbytes`` (a multiple of 64, default 128) for a
    C-order ``[rows, width]`` array.

    Example:
        >>> len(npy_header(3, 4, np.float32))
        128
    """
    descr = np.dtype(np_dtype).str
    d = f"{{'descr': {descr!r}, 'fortran_order': False, 'shape': ({rows}, {width}), }}"
    body = d.ljust(nbytes - 10 - 1) + "\n"
    if len(body) != nbytes - 10 or nbytes % 64 or nbytes > 10000:
        raise ValueError(f"npy header too long for shape ({rows}, {width})")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(body)) + body.encode("latin1")


def rows_hasher() -> Any:
    """The content hash of a shard: SHA-256 over its rows' bytes as stored (the file after its
    ``.npy`` header, whatever the header's size), fed by the writer as it writes the rows, so
    the file is never read back. :func:`file_rows_digest` recomputes it from a file.

    Example:
        >>> h = rows_hasher(); h.update(np.zeros(2, np.float32)); len(h.hexdigest())
        64
    """
    return hashlib.sha256()


def file_rows_digest(path: Path, offset: int, nbytes: int, chunk: int = 16 * 2**20) -> str:
    """:func:`rows_hasher`'s digest of ``nbytes`` bytes of rows starting at ``offset`` in the
    file at ``path`` (a shard's data, after its header), read in chunks of ``chunk`` bytes."""
    h = rows_hasher()
    buf = bytearray(min(chunk, max(nbytes, 1)))
    view = memoryview(buf)
    with open(path, "rb") as f:
        f.seek(offset)
        left = nbytes
        while left:
            got = f.readinto(view[: min(len(buf), left)])
            if not got:
                raise ValueError(f"{path}: ends {left} bytes before the rows its header announces")
            h.update(view[:got])
            left -= got
    return h.hexdigest()


def check_blocks(stem: str, blocks: Sequence[np.ndarray], width: int, np_dtype: Any) -> int:
    """The row count ``b`` of column blocks ``[b, w_k]`` (same ``b``, widths adding up to
    ``width``, all of ``np_dtype``); otherwise an error naming the shard ``stem``."""
    n = blocks[0].shape[0]
    if sum(b.shape[1] for b in blocks) != width or any(b.shape[0] != n for b in blocks):
        raise ValueError(f"{stem}: blocks {[b.shape for b in blocks]} != [*, {width}]")
    if any(b.dtype != np_dtype for b in blocks):
        raise TypeError(f"{stem}: blocks must be {np_dtype}")
    return n


class ShardFile:
    """One shard being streamed to ``{stem}.npy.tmp``; :meth:`commit` makes it count.

    Rows arrive as column blocks (one per module) and go to the file with ``os.writev`` straight
    from the blocks' memory, so no joined copy of the rows is ever made.
    """

    def __init__(self, shard_dir: Path, stem: str, width: int, np_dtype: Any) -> None:
        self.dir, self.stem, self.width = Path(shard_dir), stem, width
        self.np_dtype = np.dtype(np_dtype)
        self.target = self.dir / f"{stem}.npy"
        self.tmp = self.target.with_name(self.target.name + files.TMP_SUFFIX)
        self.rows = 0
        self.hasher = rows_hasher()  # the rows' bytes in file order, as they are written
        self._f = open(self.tmp, "wb")
        self._f.write(npy_header(0, width, self.np_dtype))
        self._f.flush()

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * self.np_dtype.itemsize

    def rows_digest(self) -> str:
        """:func:`rows_hasher`'s digest of the rows appended so far (what the commit log
        records for the shard)."""
        return self.hasher.hexdigest()

    def append(self, blocks: list[np.ndarray]) -> None:
        """Write rows given as column blocks ``[b, w_k]`` whose widths add up to ``width``."""
        n = check_blocks(self.stem, blocks, self.width, self.np_dtype)
        blocks = [np.ascontiguousarray(b) for b in blocks]
        if len(blocks) == 1 or not hasattr(os, "writev"):
            joined = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)
            self.hasher.update(memoryview(joined).cast("B"))
            self._f.write(memoryview(joined).cast("B"))
        else:
            views = [memoryview(b[i]).cast("B") for i in range(n) for b in blocks]
            for v in views:  # the file's order: row by row, each row's blocks in turn
                self.hasher.update(v)
            _writev_all(self._f.fileno(), views)
        self.rows += n

    def commit(self, ids: list[DataId]) -> None:
        """Fix the header, fsync, write the ids file, then rename the ``.npy`` into place."""
        if len(ids) != self.rows:
            raise ValueError(f"shard {self.stem}: {self.rows} rows but {len(ids)} ids")
        self._seal()
        files.atomic_write_json(self.dir / f"{self.stem}.ids.json", ids)
        os.replace(self.tmp, self.target)
        files.fsync_dir(self.dir)

    def _seal(self) -> None:
        """Everything on disk: the final header, fsync, file closed."""
        f = self._f
        f.seek(0)
        f.write(npy_header(self.rows, self.width, self.np_dtype))
        f.flush()
        os.fsync(f.fileno())
        f.close()

    def abort(self) -> None:
        """Close and delete the temporary file (the shard never counted)."""
        self._f.close()
        self.tmp.unlink(missing_ok=True)
        remove_orphan_ids(self.dir, self.stem)


def remove_orphan_ids(shard_dir: Path, stem: str) -> None:
    """Delete ``{stem}.ids.json`` when its ``.npy`` never got renamed into place (a commit that
    failed between the two renames): readers ignore it, but it would outlive the error."""
    if not (Path(shard_dir) / f"{stem}.npy").exists():
        (Path(shard_dir) / f"{stem}.ids.json").unlink(missing_ok=True)


def _writev_all(fd: int, views: list[memoryview]) -> None:
    for i in range(0, len(views), 512):  # below IOV_MAX (1024 on Linux)
        chunk = views[i : i + 512]
        written = os.writev(fd, chunk)
        want = sum(v.nbytes for v in chunk)
        if written < want:  # short write (rare for regular files): finish plainly
            rest = memoryview(b"".join(chunk))[written:]
            while rest:
                rest = rest[os.write(fd, rest) :]


def list_shards(shard_dir: Path) -> list[tuple[int, int, Path, Path]]:
    """Complete shards in ``shard_dir`` as ``(rank, index, npy_path, ids_path)``, sorted."""
    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        return []
    found = []
    for p in shard_dir.iterdir():
        m = _SHARD_RE.match(p.name)
        if m is None:
            continue
        ids_path = p.with_name(p.name[: -len(".npy")] + ".ids.json")
        if ids_path.exists():
            found.append((int(m.group(1)), int(m.group(2)), p, ids_path))
    return sorted(found)


def next_shard_index(shard_dir: Path, rank: int) -> int:
    """First unused shard index of ``rank`` (after complete shards and orphan id files)."""
    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        return 0
    pat = re.compile(rf"^rank{rank}-(\d{{5,}})\.")
    used = [int(m.group(1)) for p in shard_dir.iterdir() if (m := pat.match(p.name))]
    return max(used) + 1 if used else 0


def remove_incomplete(shard_dir: Path, rank: int) -> list[Path]:
    """Delete temporary files and orphan ids files of ``rank`` (left by a crash)."""
    shard_dir = Path(shard_dir)
    removed: list[Path] = []
    if not shard_dir.is_dir():
        return removed
    for p in shard_dir.iterdir():
        if not p.name.startswith(f"rank{rank}-"):
            continue
        orphan = (
            p.name.endswith(".ids.json")
            and not p.with_name(p.name[: -len(".ids.json")] + ".npy").exists()
        )
        if p.name.endswith(files.TMP_SUFFIX) or orphan:
            p.unlink()
            removed.append(p)
    return removed
