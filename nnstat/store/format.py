"""On-disk format of the gradient store (format version 1), as pure helpers.

Layout (see docs/architecture.md, "Gradient store")::

    <root>/<project>/meta.json
    <root>/<project>/projections.safetensors
    <root>/<project>/shards/rank{r}-{n:05d}.npy        rows = samples
    <root>/<project>/shards/rank{r}-{n:05d}.ids.json   ids of those rows

A shard counts only when both files exist. The ``.npy`` is streamed to a temporary name, its
header fixed and fsynced, then the ids file is written (temporary name, fsync, rename) and the
``.npy`` renamed last, so a crash at any point leaves either a whole shard or an orphan ids file /
temporary file that readers ignore.

Example:
    >>> ids = normalize_ids([3, "a"], 2)
    >>> ids
    [3, 'a']
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

FORMAT_VERSION = 1
META_FILE = "meta.json"
PROJECTIONS_FILE = "projections.safetensors"
STATISTICS_FILE = "statistics.safetensors"
SHARD_DIR = "shards"
TMP_SUFFIX = ".tmp"
_SHARD_RE = re.compile(r"^rank(\d+)-(\d{5,})\.npy$")

# dtype name -> (numpy dtype of the file, torch dtype of the values)
STORE_DTYPES: dict[str, tuple[Any, torch.dtype]] = {
    "float32": (np.float32, torch.float32),
    "float16": (np.float16, torch.float16),
    # numpy has no bfloat16: the raw 16-bit patterns are stored as uint16 and meta.json says so.
    "bfloat16": (np.uint16, torch.bfloat16),
}

DataId = int | str


def shard_stem(rank: int, index: int) -> str:
    """File stem of shard ``index`` written by process ``rank``.

    Example:
        >>> shard_stem(1, 7)
        'rank1-00007'
    """
    return f"rank{rank}-{index:05d}"


def content_id(row: torch.Tensor) -> str:
    """Stable id of one sample's tensor: sha1 of its dtype, shape and bytes (40 hex chars).

    Example:
        >>> content_id(torch.zeros(2)) == content_id(torch.zeros(2))
        True
    """
    t = row.detach().to("cpu").contiguous()
    h = hashlib.sha1()
    h.update(str(t.dtype).encode())
    h.update(str(tuple(t.shape)).encode())
    # bfloat16 & co have no numpy view; raw bytes through uint8 work for every dtype.
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def content_ids(batch: torch.Tensor) -> list[str]:
    """One :func:`content_id` per row of ``batch`` (its dimension 0): content hashing asked
    for explicitly, whatever the dtype and shape (``data_id="hash"`` uses it).

    Example:
        >>> content_ids(torch.tensor([3, 4]))[0] == content_id(torch.tensor(3))
        True
    """
    if batch.dim() == 0:
        raise ValueError("content_ids needs a batch dimension, got a scalar tensor")
    return [content_id(row) for row in batch]


def _is_integer_tensor(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def normalize_ids(data_id: Any, n: int | None = None) -> list[DataId]:
    """Turn a user's ``data_id`` into ids (ints or strings, types preserved); ``n`` checks the count.

    * a list/sequence of ints and strings: kept as they are (numpy integers become ``int``);
    * a **1-D integer** tensor or array (what a ``DataLoader`` collates dataset indices into):
      a list of int ids, so rows trace back to dataset indices;
    * any other tensor or array (floating point, bool, or more than one dimension): a batch
      whose rows are hashed, one :func:`content_id` each. To hash a 1-D integer tensor, ask for
      it: :func:`content_ids`, or ``run(data_id="hash")`` (the Run hashes the model's input).

    Example:
        >>> normalize_ids(torch.tensor([7, 3]))
        [7, 3]
        >>> normalize_ids(torch.tensor([[1.0], [2.0]]), 2)[0] != normalize_ids(torch.tensor([[2.0]]), 1)[0]
        True
    """
    if isinstance(data_id, torch.Tensor):
        if data_id.dim() == 0:
            raise ValueError("data_id tensor must have a batch dimension, got a scalar")
        if data_id.dim() == 1 and _is_integer_tensor(data_id):
            ids: list[DataId] = [int(x) for x in data_id.tolist()]
        else:
            ids = content_ids(data_id)
    elif isinstance(data_id, np.ndarray):
        if data_id.ndim == 0:
            raise ValueError("data_id array must have a batch dimension, got a scalar")
        if data_id.dtype.kind in "iu" and data_id.ndim == 1:
            ids = [int(x) for x in data_id]
        else:
            ids = [content_id(torch.from_numpy(np.ascontiguousarray(r))) for r in data_id]
    elif type(data_id) is list and all(type(x) is int for x in data_id):
        ids = list(data_id)  # the common case, one C-level pass (exact ints: bool is excluded)
    elif isinstance(data_id, Sequence) and not isinstance(data_id, str | bytes):
        ids = []
        for x in data_id:
            if isinstance(x, bool) or not isinstance(x, int | np.integer | str):
                raise TypeError(
                    f"data_id entries must be int or str, got {type(x).__name__} ({x!r})"
                )
            ids.append(x if isinstance(x, str) else int(x))
    else:
        raise TypeError(
            "data_id must be a list of ints/strings, a 1-D integer tensor of ids, a batch "
            f'tensor to hash, "hash" (in run(...)) or None; got {type(data_id).__name__}'
        )
    if n is not None and len(ids) != n:
        raise ValueError(f"data_id has {len(ids)} entries but the batch has {n} samples")
    return ids


def _fsync_dir(directory: Path) -> None:
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
    _fsync_dir(path.parent)


def atomic_write_json(path: Path, obj: Any) -> None:
    """:func:`atomic_write_bytes` of ``obj`` as indented JSON."""
    atomic_write_bytes(Path(path), json.dumps(obj, indent=1, sort_keys=False).encode())


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
        self.tmp = self.target.with_name(self.target.name + TMP_SUFFIX)
        self.rows = 0
        self._f = open(self.tmp, "wb")
        self._f.write(npy_header(0, width, self.np_dtype))
        self._f.flush()

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * self.np_dtype.itemsize

    def append(self, blocks: list[np.ndarray]) -> None:
        """Write rows given as column blocks ``[b, w_k]`` whose widths add up to ``width``."""
        n = check_blocks(self.stem, blocks, self.width, self.np_dtype)
        blocks = [np.ascontiguousarray(b) for b in blocks]
        if len(blocks) == 1 or not hasattr(os, "writev"):
            joined = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)
            self._f.write(memoryview(joined).cast("B"))
        else:
            views = [memoryview(b[i]).cast("B") for i in range(n) for b in blocks]
            _writev_all(self._f.fileno(), views)
        self.rows += n

    def commit(self, ids: list[DataId]) -> None:
        """Fix the header, fsync, write the ids file, then rename the ``.npy`` into place."""
        if len(ids) != self.rows:
            raise ValueError(f"shard {self.stem}: {self.rows} rows but {len(ids)} ids")
        self._seal()
        atomic_write_json(self.dir / f"{self.stem}.ids.json", ids)
        os.replace(self.tmp, self.target)
        _fsync_dir(self.dir)

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


def write_shard(shard_dir: Path, stem: str, rows: np.ndarray, ids: list[DataId]) -> None:
    """Write one whole ``[n, w]`` shard atomically (see :class:`ShardFile`)."""
    if rows.shape[0] != len(ids):
        raise ValueError(f"shard {stem}: {rows.shape[0]} rows but {len(ids)} ids")
    shard = ShardFile(shard_dir, stem, rows.shape[1], rows.dtype)
    try:
        shard.append([rows])
        shard.commit(ids)
    except BaseException:
        shard.abort()
        raise


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


def read_meta(path: Path) -> dict[str, Any]:
    """A store's ``meta.json`` (:func:`read_json`) with the fields every reader relies on
    checked: ``format_version`` (this version), ``row_width`` (a positive int), ``dtype`` (one of
    :data:`STORE_DTYPES`, default float32) and ``modules`` (a list of ``{name, offset, width,
    r_in}`` inside the row). Anything else is a ``ValueError`` naming the file and the field.

    Example:
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "meta.json"
        >>> atomic_write_json(p, {"format_version": 1, "modules": []})
        >>> read_meta(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../meta.json: missing 'row_width' ...
    """
    meta = read_json(path)
    if not isinstance(meta, dict):
        raise ValueError(
            f"{path}: expected a JSON object (a store's meta), got {type(meta).__name__}"
        )
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {version!r}, this nnstat reads {FORMAT_VERSION}")
    problems: list[str] = []
    width = meta.get("row_width")
    if "row_width" not in meta:
        problems.append("missing 'row_width' (columns per row)")
    elif isinstance(width, bool) or not isinstance(width, int) or width < 1:
        problems.append(f"'row_width' must be a positive int, got {width!r}")
        width = None
    if meta.get("dtype", "float32") not in STORE_DTYPES:
        problems.append(f"'dtype' {meta.get('dtype')!r} is not one of {sorted(STORE_DTYPES)}")
    modules = meta.get("modules")
    if not isinstance(modules, list):
        problems.append(f"'modules' must be a list, got {modules!r}")
        modules = []
    for i, m in enumerate(modules):
        if not isinstance(m, dict):
            problems.append(f"modules[{i}] must be an object, got {m!r}")
            continue
        missing = [k for k in ("name", "offset", "width", "r_in") if k not in m]
        if missing:
            problems.append(f"modules[{i}] ({m.get('name')!r}) misses {missing}")
            continue
        ints = (m["offset"], m["width"])
        if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in ints):
            problems.append(f"modules[{i}] ({m['name']!r}): offset/width must be ints >= 0")
        elif isinstance(width, int) and m["offset"] + m["width"] > width:
            problems.append(
                f"modules[{i}] ({m['name']!r}) ends at column {m['offset'] + m['width']}, "
                f"past row_width {width}"
            )
    if problems:
        raise ValueError(
            f"{path}: " + "; ".join(problems) + " (the file is damaged or not a "
            "gradient store's meta.json)"
        )
    return meta


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


def load_safetensors(path: Path, missing_ok: bool = True) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file at ``path`` (``{}`` when absent and ``missing_ok``);
    a damaged file is a ``ValueError`` naming it (safetensors' own error does not).

    Example:
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "x.safetensors"
        >>> _ = p.write_bytes(b"garbage!"); load_safetensors(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../x.safetensors: not a readable safetensors file (...)...
    """
    path = Path(path)
    if not path.exists():
        if missing_ok:
            return {}
        raise FileNotFoundError(f"{path}: no such file")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, OSError, RuntimeError) as e:
        raise ValueError(
            f"{path}: not a readable safetensors file ({e}); it is damaged or was cut short"
        ) from e


def read_ids(ids_path: Path) -> list[DataId]:
    """Ids of one shard, as written (ints and strings); anything else names the file."""
    ids = read_json(ids_path)
    if not isinstance(ids, list):
        raise ValueError(f"{ids_path}: expected a JSON list of ids, got {type(ids).__name__}")
    bad = [x for x in ids if isinstance(x, bool) or not isinstance(x, int | str)]
    if bad:
        raise ValueError(f"{ids_path}: ids must be ints or strings, got {bad[:3]!r}")
    return ids


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
        if p.name.endswith(TMP_SUFFIX) or orphan:
            p.unlink()
            removed.append(p)
    return removed


def tensors_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over sorted names, dtypes, shapes and bytes of ``tensors``."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        hash_tensor(h, name, tensors[name])
    return h.hexdigest()


def hash_tensor(h: Any, name: str, tensor: torch.Tensor) -> None:
    """Feed one named tensor to ``h`` as `tensors_hash` does (callers go in sorted name order;
    a reader can then hash a file one tensor at a time)."""
    t = tensor.detach().to("cpu").contiguous()
    h.update(name.encode())
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy


def diff_dicts(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Human-readable differences between two JSON-like values (``key: old -> new``).

    Example:
        >>> diff_dicts({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 3}})
        ['b.c: 2 -> 3']
    """
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append(f"{key}: (absent) -> {new[k]!r}")
            elif k not in new:
                out.append(f"{key}: {old[k]!r} -> (absent)")
            else:
                out += diff_dicts(old[k], new[k], key)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            out += diff_dicts(a, b, f"{prefix}[{i}]")
        return out
    return [] if old == new else [f"{prefix or '<root>'}: {old!r} -> {new!r}"]


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (Python 3.11+); on 3.10 the note joins the message."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{note}", *error.args[1:])
    else:
        error.args = (*error.args, note)


class ModelChangedError(ValueError):
    """The watched parameters differ from those the store's rows were computed with
    (``meta.json`` ``params_sha256``): adding rows would mix two models in one store."""


def params_hash(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over ``(name, tensor)`` pairs **in the given order** (unlike :func:`tensors_hash`,
    which sorts): each pair adds its name, then ``f"{dtype}{tuple(shape)}"``, then the raw
    bytes of the whole tensor (on the CPU, contiguous). The Run passes the watched parameters
    as ``"{module}.{param}"`` in watch order (``nnstat.run.support.params_fingerprint``).

    Example:
        >>> a = [("w", torch.ones(2))]
        >>> params_hash(a) == params_hash([("w", torch.ones(2))]) != params_hash([("w", torch.zeros(2))])
        True
    """
    h = hashlib.sha256()
    for name, tensor in named:
        t = tensor.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()
