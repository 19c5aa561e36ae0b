"""``statistics.safetensors`` read one tensor at a time (`LazyStatistics`).

A K-FAC run's full-width factors are 1.5 GB at GPT-2 small: the scorer and a query log
(``get_log()``) read them one module at a time instead of loading the file whole.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch


class LazyStatistics(Mapping):
    """``statistics.safetensors`` read one tensor at a time: a K-FAC run's full-width factors
    (1.5 GB for GPT-2 small) are never all in memory while the preconditioner projects them.

    `open` checks the file against meta.json's ``statistics_sha256`` first, hashing it one
    tensor at a time with plain reads (a memory map would keep every page resident), and
    returns ``None`` when it cannot (then the store's reader loads it whole and raises its own
    error on a mismatch). Every read checks that the file is still the one that was hashed.

    Example:
        >>> LazyStatistics.open(Path("/nonexistent/statistics.safetensors"), "abc") is None
        True
        >>> LazyStatistics.scan(Path("/nonexistent/statistics.safetensors"))
        (None, None)
    """

    _DTYPES = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
    }

    def __init__(self, path: Path, entries: dict[str, tuple], base: int, stamp: tuple) -> None:
        self.path, self._entries, self._base, self._stamp = path, entries, base, stamp

    @staticmethod
    def _stat(path: Path) -> tuple:
        st = path.stat()
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    @classmethod
    def open(cls, path: Path, expected: str | None) -> LazyStatistics | None:
        """The file read lazily once its hash is ``expected`` (``None``: never)."""
        if expected is None:
            return None
        obj, digest = cls.scan(path)
        return obj if digest == expected else None

    @classmethod
    def scan(cls, path: Path) -> tuple[LazyStatistics | None, str | None]:
        """``(the file read lazily, its tensors_hash)``, hashed one tensor at a time with plain
        reads; ``(None, None)`` where it cannot (no file, damaged or unusual: the store's
        reader then loads it whole and raises its own error)."""
        if not path.exists() or sys.byteorder != "little":
            return None, None
        from nnstat.store.integrity import hash_tensor

        stamp = cls._stat(path)
        try:
            with open(path, "rb") as f:
                size = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(size))
                header.pop("__metadata__", None)
                entries = {
                    k: (cls._DTYPES[v["dtype"]], tuple(v["shape"]), *v["data_offsets"])
                    for k, v in header.items()
                }
                obj = cls(path, entries, 8 + size, stamp)
                h = hashlib.sha256()
                for k in sorted(entries):
                    hash_tensor(h, k, obj._read(f, k))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError):
            return None, None
        if cls._stat(path) != stamp:
            return None, None
        return obj, h.hexdigest()

    def _read(self, f: Any, key: str) -> torch.Tensor:
        dtype, shape, lo, hi = self._entries[key]
        f.seek(self._base + lo)
        buf = bytearray(f.read(hi - lo))
        if len(buf) != hi - lo:
            raise ValueError(f"{self.path}: cut short")
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._entries:
            raise KeyError(key)
        if self._stat(self.path) != self._stamp:
            raise ValueError(
                f"{self.path} changed after it was checked against meta.json's "
                "statistics_sha256: open the store again"
            )
        with open(self.path, "rb") as f:
            return self._read(f, key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries  # Mapping's own would read the tensor

    def shape(self, key: str) -> tuple[int, ...]:
        """The stored shape of ``key``, without reading its data."""
        return self._entries[key][1]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)
