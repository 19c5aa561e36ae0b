"""Files of a gradient store: their names, atomic writes, and reads whose errors name the file.

Layout (see docs/architecture.md, "Gradient store")::

    <root>/<project>/meta.json
    <root>/<project>/projections.safetensors
    <root>/<project>/statistics.safetensors
    <root>/<project>/shards/rank{r}-{n:05d}.npy        rows = samples
    <root>/<project>/shards/rank{r}-{n:05d}.ids.json   ids of those rows

A file is written to a temporary name (``TMP_SUFFIX``), fsynced and renamed into place
(:func:`atomic_write_bytes`); a reader sees the old file or the new one, never half of one. A
damaged or cut-short file is a ``ValueError`` naming it (:func:`read_json`, :func:`load_npy`,
:func:`load_safetensors`).

Example:
    >>> import tempfile; p = Path(tempfile.mkdtemp()) / META_FILE
    >>> atomic_write_json(p, {"a": 1}); read_json(p)
    {'a': 1}
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

META_FILE = "meta.json"
PROJECTIONS_FILE = "projections.safetensors"
STATISTICS_FILE = "statistics.safetensors"
SHARD_DIR = "shards"
TMP_SUFFIX = ".tmp"


def fsync_dir(directory: Path) -> None:
    """fsync ``directory`` itself, so a rename inside it survives a crash (a no-op where a
    directory cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems (and Windows) cannot open directories; rename still holds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync, rename and fsync the dir.

    Example:
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "x"; atomic_write_bytes(p, b"1")
        >>> p.read_bytes()
        b'1'
    """
    path = Path(path)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # a failed write (disk full, ...) leaves the old file as it was and nothing beside it
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_bytes` of ``obj`` as indented JSON."""
    atomic_write_bytes(Path(path), json.dumps(obj, indent=1, sort_keys=False).encode())


def read_json(path: Path) -> Any:
    """The JSON value in the file at ``path``; a damaged file is a ``ValueError`` naming it.

    Example:
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "m.json"; _ = p.write_text("{")
        >>> read_json(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../m.json: not valid JSON (Expecting property name ... at line 1, column 2); ...
    """
    path = Path(path)
    data = path.read_bytes()
    try:
        return json.loads(data.decode("utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); the file "
            f"is damaged or was cut short ({len(data)} bytes)"
        ) from e
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path}: not valid JSON (byte {e.start} is not UTF-8 text); the file is damaged"
        ) from e


class NpyHeader(NamedTuple):
    """What a ``.npy`` header says: ``shape``, ``dtype``, ``fortran_order`` and ``offset`` (the
    byte where the data starts)."""

    shape: tuple[int, ...]
    dtype: np.dtype
    fortran_order: bool
    offset: int


def read_npy_header(path: Path) -> NpyHeader:
    """The header of the ``.npy`` file at ``path``, checked against the file's size: a file too
    short for the data its header announces (cut short by a copy or a full disk), a damaged
    header or an object dtype (which would need pickle) is a ``ValueError`` naming the file.

    Example:
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "a.npy"
        >>> np.save(p, np.zeros((3, 2), np.float32)); read_npy_header(p).shape
        (3, 2)
        >>> _ = p.write_bytes(p.read_bytes()[:-4]); read_npy_header(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../a.npy: truncated: its header says shape (3, 2) float32 (24 bytes ...
    """
    import numpy.lib.format as npf

    path = Path(path)
    with open(path, "rb") as f:
        try:
            version = npf.read_magic(f)
            if version == (1, 0):
                shape, fortran, dtype = npf.read_array_header_1_0(f)
            else:
                shape, fortran, dtype = npf.read_array_header_2_0(f)
        except (ValueError, OSError, EOFError, SyntaxError) as e:
            raise ValueError(f"{path}: not a readable .npy file ({e})") from e
        offset = f.tell()
        size = os.fstat(f.fileno()).st_size
    if dtype.hasobject:
        raise ValueError(f"{path}: object dtype {dtype}; the store never writes (or unpickles) one")
    need = math.prod(shape) * dtype.itemsize
    if size - offset < need:
        raise ValueError(
            f"{path}: truncated: its header says shape {tuple(shape)} {dtype} ({need} bytes of "
            f"data) but the file holds {size - offset} bytes after the header"
        )
    return NpyHeader(tuple(shape), dtype, bool(fortran), offset)


def load_npy(path: Path, mmap_mode: str | None = "r") -> np.ndarray:
    """``numpy.load(path, mmap_mode, allow_pickle=False)`` after :func:`read_npy_header`, so a
    damaged or truncated file is a ``ValueError`` naming it (numpy's own errors do not)."""
    read_npy_header(path)
    try:
        return np.load(path, mmap_mode=mmap_mode, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: cannot read the array ({e})") from e


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at ``path`` (``{}`` when absent); a damaged file is a
    ``ValueError`` naming it (safetensors' own error does not).

    Example:
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "x.safetensors"
        >>> _ = p.write_bytes(b"garbage!"); load_safetensors(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../x.safetensors: not a readable safetensors file (...)...
    """
    path = Path(path)
    if not path.exists():
        return {}
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, OSError, RuntimeError) as e:
        raise ValueError(
            f"{path}: not a readable safetensors file ({e}); it is damaged or was cut short"
        ) from e
