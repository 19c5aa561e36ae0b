"""Row provenance beyond the ids: each shard's content hash in its commit log (checked by
``GradientStore.verify()``), the store's identity binding the examples saved beside it, every
hash key of meta.json required once the format revision has it, and missing files named."""

from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

import nnstat
from nnstat.store.commits import log_path
from nnstat.store.files import atomic_write_json, read_json
from nnstat.store.meta import REQUIRED_SINCE
from nnstat.viewer import load_examples, save_examples


def _store(tmp_path, project, n=120, shard_rows=64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    x = torch.randn(n, 5)
    run = nnstat.init(project=project, root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "rank": 2, "shard_rows": shard_rows})
    nnstat.watch(model)
    try:
        for lo in range(0, n, 50):
            with run(data_id=list(range(lo, min(n, lo + 50)))):
                model(x[lo : lo + 50]).logsumexp(1).sum().backward()
        nnstat.finalize()
    finally:
        nnstat.unwatch()
    return tmp_path / project


def test_the_commit_log_records_each_shards_content_hash_as_written(tmp_path):
    path = _store(tmp_path, "p")
    lines = log_path(path / "shards", 0).read_text().splitlines()
    begins = [ln.split() for ln in lines if ln.startswith("begin ")]
    assert len(begins) == 2
    for _, stem, rows, _ids, content in begins:
        npy = path / "shards" / f"{stem}.npy"
        data = np.load(npy)  # the reference: numpy's own reading of the rows, hashed
        assert data.shape[0] == int(rows)
        assert content == hashlib.sha256(np.ascontiguousarray(data).tobytes()).hexdigest()
    assert nnstat.GradientStore(path).verify() == 2


def test_a_shard_whose_bytes_changed_at_the_same_size_is_refused_by_verify(tmp_path):
    path = _store(tmp_path, "p")
    npy = path / "shards" / "rank0-00001.npy"
    size = npy.stat().st_size
    shard = np.load(npy, mmap_mode="r+")
    shard[3, 1] = shard[3, 1] * 2 + 1  # one value, size unchanged: opening cannot see it
    shard.flush()
    del shard
    assert npy.stat().st_size == size
    store = nnstat.GradientStore(path)  # cheap checks only: sizes and headers agree
    with pytest.raises(ValueError, match=r"rank0-00001\.npy: its rows are not the ones committed"):
        store.verify()  # before: no check could see it


def test_a_shard_of_the_same_shape_from_another_store_is_refused_by_verify(tmp_path):
    a, b = _store(tmp_path, "a"), _store(tmp_path, "b", n=120)
    other = np.load(b / "shards" / "rank0-00000.npy")
    np.save(a / "shards" / "rank0-00000.npy", other * 3)  # same shape, other rows
    store = nnstat.GradientStore(a)
    with pytest.raises(ValueError, match=r"rank0-00000\.npy: its rows are not the ones"):
        store.verify()


def test_a_store_logged_before_content_hashes_opens_and_verifies_nothing(tmp_path):
    path = _store(tmp_path, "p")
    log = log_path(path / "shards", 0)
    old = [
        " ".join(ln.split()[:4]) if ln.startswith("begin ") else ln
        for ln in log.read_text().splitlines()
    ]
    log.write_text("".join(f"{ln}\n" for ln in old))
    with pytest.raises(ValueError, match=r"rank0-00000\.npy: .*records no content hash"):
        nnstat.GradientStore(path)  # revision 3 says every shard has one: the log was edited
    meta = read_json(path / "meta.json")
    for key in ("format_revision", "store_id"):  # as a store of revision 2 was written
        del meta[key]
    atomic_write_json(path / "meta.json", meta)
    store = nnstat.GradientStore(path)
    assert len(store) == 120 and store.verify() == 0


@pytest.mark.parametrize("key", sorted(REQUIRED_SINCE))
def test_every_hash_key_of_the_format_revision_is_required(tmp_path, key):
    path = _store(tmp_path, "p")
    meta = read_json(path / "meta.json")
    assert meta["format_revision"] == 4 and key in meta
    del meta[key]
    atomic_write_json(path / "meta.json", meta)
    with pytest.raises(ValueError, match=rf"meta\.json: .*records no {key}"):
        nnstat.GradientStore(path)


def test_examples_copied_from_another_store_with_the_same_ids_are_refused(tmp_path):
    a, b = _store(tmp_path, "a"), _store(tmp_path, "b")
    ids = list(range(120))
    assert nnstat.GradientStore(a).ids == nnstat.GradientStore(b).ids  # same ids, same digest
    assert read_json(a / "meta.json")["store_id"] != read_json(b / "meta.json")["store_id"]
    save_examples(b, ids[:3], texts=["x", "y", "z"])
    save_examples(a, ids[:3], texts=["p", "q", "r"])
    assert load_examples(a).texts == ["p", "q", "r"]
    shutil.copytree(b / "viewer", a / "viewer", dirs_exist_ok=True)
    with pytest.raises(ValueError, match=r"viewer/examples\.json: saved for another store"):
        load_examples(a)  # before: shown as this store's ("x", "y", "z")


def test_examples_of_a_store_without_an_id_still_load(tmp_path):
    path = _store(tmp_path, "p")
    meta = read_json(path / "meta.json")
    for key in ("format_revision", "store_id"):
        del meta[key]
    atomic_write_json(path / "meta.json", meta)
    save_examples(path, [0, 1], labels=[3, 4])
    assert json.loads((path / "viewer" / "examples.json").read_text())["store_id"] is None
    assert load_examples(path).labels == [3, 4]


@pytest.mark.parametrize(
    "name, match",
    [
        ("meta.json", r"p is not a gradient store: no meta\.json"),
        ("projections.safetensors", r"projections\.safetensors is missing"),
        ("shards/rank0-00000.npy", r"rank0-00000\.npy is missing"),
        ("shards/rank0-00001.ids.json", r"rank0-00001\.ids\.json is missing"),
        ("shards/rank0.log", r"rank0\.log is missing"),
    ],
)
def test_each_missing_file_is_named_with_the_fix(tmp_path, name, match):
    path = _store(tmp_path, "p")
    (path / name).unlink()
    with pytest.raises((ValueError, FileNotFoundError), match=match) as info:
        store = nnstat.GradientStore(path)
        store.projections()
    text = str(info.value)
    assert "restore" in text or "log the store again" in text or "not a gradient store" in text


def test_a_shard_removed_after_opening_is_named_with_the_fix(tmp_path):
    path = _store(tmp_path, "p")
    store = nnstat.GradientStore(path)
    (path / "shards" / "rank0-00001.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"rank0-00001\.npy is missing: .* restore it"):
        store.rows(0, len(store))  # before: numpy's bare "[Errno 2] No such file"
