"""Store format, background writer, reader and log dataloader (no capture involved)."""

import json

import numpy as np
import pytest
import torch

from nnstat.run.config import RunConfig
from nnstat.store import GradientStore, StoreWriteError, StoreWriter, make_log_dataloader
from nnstat.store.files import atomic_write_json
from nnstat.store.ids import content_id, normalize_ids
from nnstat.store.logger import StoreLogger, check_resumable, filter_nonfinite
from nnstat.store.shards import ShardFile, overflow_threshold


def _meta(width=6, dtype="float32"):
    # a linear module and a layernorm filling the row (4 + 2 columns), or one linear [1, width]
    two = [
        {"name": "a", "kind": "linear", "offset": 0, "width": 4, "r_out": 2, "r_in": 2},
        {"name": "b", "kind": "layernorm", "offset": 4, "width": 2, "r_out": None, "r_in": 2},
    ]
    one = [{"name": "a", "kind": "linear", "offset": 0, "width": width, "r_out": 1, "r_in": width}]
    return {
        "format_version": 1,
        "row_width": width,
        "dtype": dtype,
        "modules": two if width == 6 else one,
    }


def _write(tmp_path, rows, ids, dtype="float32", shard_rows=4):
    atomic_write_json(tmp_path / "meta.json", _meta(rows.shape[1], dtype))
    w = StoreWriter(tmp_path / "shards", rows.shape[1], shard_rows=shard_rows, dtype=dtype)
    for lo in range(0, len(ids), 3):  # blocks that straddle shard boundaries
        w.put(ids[lo : lo + 3], rows[lo : lo + 3])
    assert w.close() == len(ids)
    return GradientStore(tmp_path)


def test_roundtrip_ids_types_blocks_and_plain_numpy(tmp_path):
    torch.manual_seed(0)
    rows = torch.randn(10, 6)
    ids = [0, "x", 2, "y", 4, 5, 6, 7, 8, "z"]
    store = _write(tmp_path, rows, ids)
    assert store.ids == ids and len(store) == 10 and store.row_width == 6
    assert len(store.shards) == 3  # 4 + 4 + 2
    torch.testing.assert_close(store.rows(0, 10), rows)
    torch.testing.assert_close(store.rows(3, 9), rows[3:9])  # across shards
    blocks = list(store.iter_blocks(4))
    assert [b[0] for b in blocks] == [ids[0:4], ids[4:8], ids[8:10]]
    torch.testing.assert_close(torch.cat([b[1] for b in blocks]), rows)
    # a shard is a plain .npy: numpy reads it without nnstat
    first = np.load(store.shards[0], mmap_mode="r")
    np.testing.assert_array_equal(np.asarray(first), rows[:4].numpy())
    assert json.loads((tmp_path / "shards" / "rank0-00000.ids.json").read_text()) == ids[:4]
    view = store.module_view(rows[:2], "a")
    torch.testing.assert_close(view, rows[:2, :4].reshape(2, 2, 2))
    assert store.module_view(rows[:2], "b").shape == (2, 1, 2)
    per_shard = list(store.iter_shard_blocks(store.shards[1], 3))
    assert [i for i, _ in per_shard] == [ids[4:7], ids[7:8]]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_dtypes(tmp_path, dtype):
    torch.manual_seed(0)
    rows = torch.randn(8, 6) * torch.logspace(-9, 6, 8).unsqueeze(1)  # under/overflow included
    # rounding ties, the largest finite halves, just past them, signed zero and subnormals
    rows[0] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 65519.0, 65520.0, -0.0])
    rows[1] = torch.tensor([2**-24, 2**-25, 3 * 2**-26, -(2**-20), 1e-30, float("inf")])
    store = _write(tmp_path, rows, list(range(8)), dtype=dtype)
    ref = rows.to(getattr(torch, dtype)).float()  # torch's conversion is the reference
    torch.testing.assert_close(store.rows(0, 8), ref, rtol=0, atol=0)
    assert torch.equal(torch.signbit(store.rows(0, 8)), torch.signbit(ref))
    raw = np.load(store.shards[0])
    assert raw.dtype == (np.float16 if dtype == "float16" else np.uint16)
    # column blocks (one per module) and whole-row blocks of changing sizes in one pass
    w = StoreWriter(tmp_path / "blocks", 6, shard_rows=5, dtype=dtype)
    w.put([0, 1, 2], [rows[:3, :2], rows[:3, 2:]])
    w.put([3], rows[3:4])
    w.put([4, 5, 6, 7], [rows[4:, :5], rows[4:, 5:]])
    assert w.close() == 8
    got = np.concatenate([np.load(p) for p in sorted((tmp_path / "blocks").glob("*.npy"))])
    want = rows.to(getattr(torch, dtype))
    want = want.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else want.numpy()
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_dataloader_yields_blocks_with_workers(tmp_path):
    rows = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    _write(tmp_path, rows, list(range(10)))
    loader = make_log_dataloader(tmp_path, batch_size=4, num_workers=1)
    assert isinstance(loader.dataset.store, GradientStore)
    got = list(loader)
    assert [ids for ids, _ in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    torch.testing.assert_close(torch.cat([r for _, r in got]), rows)


def test_incomplete_shards_are_ignored_and_cleaned(tmp_path):
    rows = torch.ones(4, 6)
    _write(tmp_path, rows, [1, 2, 3, 4])
    shards = tmp_path / "shards"
    # a crash between the two renames leaves an orphan ids file; one during a write a .tmp
    (shards / "rank0-00001.ids.json").write_text("[9]")
    (shards / "rank0-00002.npy.tmp").write_bytes(b"garbage")
    assert GradientStore(tmp_path).ids == [1, 2, 3, 4]
    w = StoreWriter(shards, 6, shard_rows=4)
    assert not (shards / "rank0-00001.ids.json").exists()
    assert not (shards / "rank0-00002.npy.tmp").exists()
    w.put([5], torch.zeros(1, 6))
    w.close()
    assert GradientStore(tmp_path).ids == [1, 2, 3, 4, 5]


def test_writer_error_is_raised_in_caller(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ShardFile, "commit", boom)
    w = StoreWriter(tmp_path / "shards", 2, shard_rows=1, queue_size=1)
    w.put([0], torch.zeros(1, 2))
    with pytest.raises(StoreWriteError, match="No space left") as info:
        for i in range(1, 50):  # the queue keeps draining after the error: put never deadlocks
            w.put([i], torch.zeros(1, 2))
        w.close()
    assert isinstance(info.value.__cause__, OSError)


def test_shard_dir_that_is_a_file_fails_loudly(tmp_path):
    (tmp_path / "shards").write_text("not a directory")
    with pytest.raises(OSError):
        StoreWriter(tmp_path / "shards", 2)


def test_logger_duplicates_resume_and_nonfinite(tmp_path):
    opts = RunConfig(shard_rows=2).store
    log = StoreLogger(tmp_path, _meta(2), opts)
    log.add([0, 1, 2], torch.zeros(3, 2), log.admit([0, 1, 2]))
    with pytest.raises(ValueError, match="duplicate"):
        log.admit([2, 3])
    with pytest.raises(ValueError, match="duplicate"):
        log.admit([5, 5])
    log.close()
    # resume: stored ids are skipped, new ones appended
    log = StoreLogger(tmp_path, _meta(2), opts)
    keep = log.admit([1, 2, 3, 4])
    assert keep == [False, False, True, True]
    log.add([1, 2, 3, 4], torch.ones(4, 2), keep)
    log.close()
    store = GradientStore(tmp_path)
    assert sorted(store.ids) == [0, 1, 2, 3, 4]
    # ... or refused when asked to
    log = StoreLogger(tmp_path, _meta(2), RunConfig(on_stored_id="error").store)
    with pytest.raises(ValueError, match="already in the store"):
        log.admit([4])
    log.close()
    # NaN/Inf policy
    rows = torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [float("inf"), 1.0]])
    with pytest.raises(ValueError, match="NaN/Inf"):
        filter_nonfinite([7, 8, 9], rows, "error")
    assert filter_nonfinite([7, 8, 9], rows, "skip")[0] == [7]
    assert filter_nonfinite([7, 8, 9], rows, "keep")[2] == 0


def test_resume_with_different_meta_is_refused_naming_the_difference(tmp_path):
    StoreLogger(tmp_path, _meta(2), RunConfig().store).close()
    other = _meta(2)
    other["modules"][0]["r_in"] = 3
    with pytest.raises(ValueError, match=r"modules\[0\]\.r_in: 2 -> 3"):
        StoreLogger(tmp_path, other, RunConfig().store)
    with pytest.raises(ValueError, match="nonfinite: 'error' -> 'skip'"):
        StoreLogger(tmp_path, _meta(2), RunConfig(nonfinite="skip").store)
    check_resumable(_meta(2), _meta(2), tmp_path)


def test_skipped_rows_recorded_in_meta(tmp_path):
    log = StoreLogger(tmp_path, _meta(2), RunConfig(nonfinite="skip").store)
    rows = torch.tensor([[0.0, 1.0], [float("nan"), 0.0], [1.0, float("-inf")]])
    log.add([1, 2, 3], rows, log.admit([1, 2, 3]))
    log.close()
    store = GradientStore(tmp_path)
    assert store.ids == [1] and store.meta["skipped_rows"] == 2


def test_store_settings_are_validated_by_the_run_config():
    with pytest.raises(ValueError, match=r"unknown nonfinite 'drop'; valid: error, skip, keep"):
        RunConfig(nonfinite="drop")
    with pytest.raises(ValueError, match="bfloat16"):
        RunConfig(dtype="int8")


def test_content_id_is_stable_and_sensitive():
    x = torch.arange(6.0).reshape(2, 3)
    a = normalize_ids(x, 2)
    assert a == normalize_ids(x.clone(), 2) and a[0] != a[1]
    assert content_id(x[0]) != content_id(x[0].double())
    assert content_id(x[0]) != content_id(x[0].reshape(3, 1))
    assert normalize_ids(np.array([3, 4]), 2) == [3, 4]
    with pytest.raises(TypeError, match="int or str"):
        normalize_ids([1.5, 2], 2)
    with pytest.raises(ValueError, match="3 entries but the batch has 2"):
        normalize_ids([1, 2, 3], 2)


def test_bad_dtype_in_writer_is_raised_in_caller(tmp_path):
    w = StoreWriter(tmp_path / "shards", 2)
    w.put([0, 1], torch.ones(2, 2, dtype=torch.int64))  # the thread's conversion fails
    with pytest.raises(StoreWriteError, match="2-D float tensor") as info:
        w.close()
    assert isinstance(info.value.__cause__, TypeError)


def test_shard_that_disagrees_with_its_ids_is_refused(tmp_path):
    _write(tmp_path, torch.ones(4, 6), [1, 2, 3, 4])
    (tmp_path / "shards" / "rank0-00000.ids.json").write_text("[1, 2, 3]")
    # the commit log records 4 rows: refused at open, naming the ids file and the log
    with pytest.raises(ValueError, match=r"rank0-00000.ids.json: 3 ids, but .*rank0.log records 4"):
        GradientStore(tmp_path)
    (tmp_path / "shards" / "rank0.log").unlink()  # a store written before the commit logs
    # its shard's header says 4 rows: refused at open too, naming the shard
    with pytest.raises(ValueError, match=r"rank0-00000.npy: 4 rows, but its ids file"):
        GradientStore(tmp_path)


@pytest.mark.parametrize("refuse_direct", [False, True])
def test_direct_shard_file_spans_the_staging_buffer(tmp_path, monkeypatch, refuse_direct):
    # rows cross several fills of a small staging buffer and end unaligned; with O_DIRECT
    # refused by the filesystem (EINVAL) the same bytes are written the ordinary way
    import errno
    import os

    from nnstat.store.direct import HEADER_BYTES, DirectShardFile, StagingBuffer

    if refuse_direct:
        real_open = os.open

        def no_direct(path, flags, *args):
            if flags & getattr(os, "O_DIRECT", 0):
                raise OSError(errno.EINVAL, "O_DIRECT not supported")
            return real_open(path, flags, *args)

        monkeypatch.setattr(os, "open", no_direct)
    rng = np.random.default_rng(0)
    data = rng.standard_normal((1003, 7)).astype(np.float32)  # 28 bytes per row
    shard = DirectShardFile(tmp_path, "rank0-00000", 7, np.float32, StagingBuffer(8192))
    if refuse_direct:
        assert not shard.direct
    for lo, hi in [(0, 1), (1, 300), (300, 301), (301, 1003)]:
        shard.append([data[lo:hi, :3], data[lo:hi, 3:]] if lo == 1 else [data[lo:hi]])
    shard.commit(list(range(1003)))
    got = np.load(tmp_path / "rank0-00000.npy", allow_pickle=False)
    np.testing.assert_array_equal(got, data)
    assert (tmp_path / "rank0-00000.npy").stat().st_size == HEADER_BYTES + data.nbytes
    assert not list(tmp_path.glob("*.tmp"))


def test_direct_shard_writes_aligned_rows_in_place(tmp_path):
    # page-aligned rows of whole 4 KiB blocks go to the disk without the staging copy; a
    # misaligned piece in between falls back to the stage; the bytes on disk are the same
    import mmap

    from nnstat.store.direct import HEADER_BYTES, DirectShardFile, StagingBuffer

    width = 1024  # 4096 bytes per float32 row
    aligned = np.frombuffer(mmap.mmap(-1, 8 * width * 4), dtype=np.float32).reshape(8, width)
    aligned[:] = np.random.default_rng(1).standard_normal((8, width))
    odd = np.random.default_rng(2).standard_normal((3, width)).astype(np.float32)[:, :]
    shard = DirectShardFile(tmp_path, "rank0-00000", width, np.float32, StagingBuffer(8192))
    for part in (aligned[:4], odd[:, :], aligned[4:]):
        shard.append([part])
    shard.commit(list(range(11)))
    got = np.load(tmp_path / "rank0-00000.npy", mmap_mode="r", allow_pickle=False)
    np.testing.assert_array_equal(got, np.concatenate([aligned[:4], odd, aligned[4:]]))
    assert (tmp_path / "rank0-00000.npy").stat().st_size == HEADER_BYTES + 11 * width * 4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_overflow_threshold_is_where_torch_starts_rounding_to_inf(dtype):
    limit = np.float32(overflow_threshold(dtype))
    assert float(limit) == overflow_threshold(dtype)  # a float32 value, exactly
    below = np.nextafter(limit, np.float32(0))
    x = torch.from_numpy(np.array([limit, below, -limit, -below], dtype=np.float32))
    stored = x.to(getattr(torch, dtype))
    assert torch.isinf(stored[[0, 2]]).all() and torch.isfinite(stored[[1, 3]]).all()
    assert overflow_threshold("float32") == float("inf")
