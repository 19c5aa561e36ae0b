"""Cost of a gradient store's content hashes: SHA-256 speed, writing a store with and without the
writer thread's hashing, opening it (no rows read) and ``GradientStore.verify()`` (every byte).
Not a test; CI never runs it. Timings on a shared CPU are noisy: compare within one run.

    .venv/bin/python benchmarks/store_provenance.py [--rows 40000] [--width 1344]
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import nnstat.store.direct as direct
import nnstat.store.shards as shards
from nnstat.store import GradientStore
from nnstat.store.files import atomic_write_json
from nnstat.store.writer import StoreWriter


class _NoHash:
    """Stands in for the rows' hasher: the write without content hashing, for comparison."""

    def update(self, data: object) -> None:
        pass

    def hexdigest(self) -> str:
        return "0" * 64


def _write(d: Path, rows: torch.Tensor, shard_rows: int) -> float:
    width = rows.shape[1]
    atomic_write_json(
        d / "meta.json",
        {
            "format_version": 1,
            "row_width": width,
            "dtype": "float32",
            "modules": [{"name": "fc", "offset": 0, "width": width, "r_out": 1, "r_in": width}],
        },
    )
    t = time.perf_counter()
    w = StoreWriter(d / "shards", width, shard_rows=shard_rows)
    for lo in range(0, rows.shape[0], 1000):
        w.put(list(range(lo, min(lo + 1000, rows.shape[0]))), rows[lo : lo + 1000])
    w.close()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=40000)
    parser.add_argument("--width", type=int, default=1344)
    args = parser.parse_args()
    data = np.random.rand(16 << 20).astype(np.float32).view(np.uint8)
    t = time.perf_counter()
    hashlib.sha256(data).hexdigest()
    print(f"sha256: {64 / (time.perf_counter() - t):.0f} MiB/s")
    rows = torch.randn(args.rows, args.width)
    mib = rows.numel() * 4 / 2**20
    hasher = shards.rows_hasher
    for mode in ("hashed", "unhashed", "hashed", "unhashed"):
        direct.rows_hasher = shards.rows_hasher = hasher if mode == "hashed" else _NoHash
        d = Path(tempfile.mkdtemp())
        took = _write(d, rows, args.rows // 10)
        print(f"write {mib:.0f} MiB in 10 shards, {mode}: {took:.3f} s")
        if mode == "hashed":
            t = time.perf_counter()
            store = GradientStore(d)
            print(f"open: {(time.perf_counter() - t) * 1e3:.1f} ms")
            t = time.perf_counter()
            store.verify()
            print(f"verify (page cache warm): {time.perf_counter() - t:.3f} s")
        shutil.rmtree(d)


if __name__ == "__main__":
    main()
