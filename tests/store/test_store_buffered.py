"""The buffered shard writer (no ``os.O_DIRECT``, as on macOS) against the direct path.

Without ``O_DIRECT`` the writer streams shards through ``format.ShardFile`` (``os.writev`` of
the column blocks, a 128-byte header) instead of ``direct.DirectShardFile`` (a page-aligned
staging buffer, a 4096-byte header). Both must store the same rows: the payloads are compared
byte for byte with each other and with an independent encoding of the input (numpy / torch
casts), and the files must read back with plain ``np.load``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from nnstat.store.shards import STORE_DTYPES, list_shards
from nnstat.store.writer import StoreWriter

WIDTHS = (3, 5, 2)  # three column blocks (three modules), 10 columns
BATCHES = (7, 300, 1, 250)  # 558 rows: shards of 200, 200 and 158 rows


def _batches():
    gen = torch.Generator().manual_seed(0)
    out, start = [], 0
    for n in BATCHES:
        blocks = [torch.randn(n, w, generator=gen) * 3 for w in WIDTHS]
        out.append((list(range(start, start + n)), blocks))
        start += n
    return out


def _write(shard_dir: Path, dtype: str) -> list[str]:
    writer = StoreWriter(shard_dir, sum(WIDTHS), shard_rows=200, dtype=dtype)
    for ids, blocks in _batches():
        writer.put(ids, [b.clone() for b in blocks])
    writer.close()
    return writer.shards_written


def _expected_bytes(dtype: str) -> np.ndarray:
    """All rows as stored, encoded independently of the store: ``[558, 10]``."""
    rows = torch.cat([torch.cat(blocks, 1) for _, blocks in _batches()])
    if dtype == "bfloat16":  # the raw 16-bit patterns, as uint16
        return rows.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return rows.numpy().astype(STORE_DTYPES[dtype][0])


def _parse(path: Path) -> tuple[int, tuple[int, ...], np.dtype, bytes]:
    """(header length, shape, dtype, payload bytes) of a .npy file, read with numpy's parser."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        assert version == (1, 0)
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        assert not fortran
        offset = f.tell()
        return offset, shape, dtype, f.read()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_buffered_shards_store_the_same_rows_as_direct_shards(tmp_path, monkeypatch, dtype):
    direct_stems = _write(tmp_path / "direct", dtype)
    monkeypatch.delattr(os, "O_DIRECT", raising=False)  # a platform without O_DIRECT
    buffered_stems = _write(tmp_path / "buffered", dtype)
    assert direct_stems == buffered_stems == ["rank0-00000", "rank0-00001", "rank0-00002"]

    want = _expected_bytes(dtype)
    start = 0
    for stem in buffered_stems:
        d_off, d_shape, d_dtype, d_payload = _parse(tmp_path / "direct" / f"{stem}.npy")
        b_off, b_shape, b_dtype, b_payload = _parse(tmp_path / "buffered" / f"{stem}.npy")
        if hasattr(os, "O_DIRECT"):  # the two runs really took the two paths
            assert d_off == 4096
        assert b_off == 128
        assert d_shape == b_shape and d_dtype == b_dtype == np.dtype(STORE_DTYPES[dtype][0])
        n = b_shape[0]
        # the payloads: byte-identical to each other and to the independent encoding, with
        # nothing after the last row (the direct path pads its tail write, then truncates)
        assert b_payload == d_payload == want[start : start + n].tobytes()
        # plain numpy reads the buffered shard, and the ids file is the same JSON list
        got = np.load(tmp_path / "buffered" / f"{stem}.npy", allow_pickle=False)
        np.testing.assert_array_equal(got, want[start : start + n])
        b_ids = (tmp_path / "buffered" / f"{stem}.ids.json").read_bytes()
        assert b_ids == (tmp_path / "direct" / f"{stem}.ids.json").read_bytes()
        assert json.loads(b_ids) == list(range(start, start + n))
        start += n
    assert start == sum(BATCHES)
    assert not list((tmp_path / "buffered").glob("*.tmp"))


def test_buffered_shard_survives_short_writev(tmp_path, monkeypatch):
    """``os.writev`` may write less than asked (and a shard spans several 512-view chunks):
    the rest must follow in order."""
    real_writev = os.writev
    calls = []

    def short_writev(fd, views):
        calls.append(len(views))
        # write only the first view and half of the second (if any)
        head = [views[0]] + ([memoryview(views[1])[: len(views[1]) // 2]] if len(views) > 1 else [])
        return real_writev(fd, head)

    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    monkeypatch.setattr(os, "writev", short_writev)
    _write(tmp_path, "float32")
    assert max(calls) == 512 and len(calls) > 3  # chunked below IOV_MAX, several chunks
    want = _expected_bytes("float32")
    got = np.concatenate(
        [np.load(path, allow_pickle=False) for *_, path, _ in list_shards(tmp_path)]
    )
    np.testing.assert_array_equal(got, want)
