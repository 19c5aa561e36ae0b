"""Reading and scoring refuse a store whose files do not belong together .

Each test logs a real store with the plain API, tampers with one file on disk the way a swap, a
copy or a damaged disk would, and checks that opening or scoring raises a ValueError naming that
file before any score is returned.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import nnstat
from nnstat.influence import compute_influence_all, compute_self_influence
from nnstat.store import GradientStore
from nnstat.store.files import META_FILE, PROJECTIONS_FILE, STATISTICS_FILE
from nnstat.store.integrity import tensors_hash

N_TRAIN, BATCH = 40, 10


def _data():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN + 4, 6, generator=gen)
    return x, torch.randint(0, 3, (N_TRAIN + 4,), generator=gen)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="sum")


def _log(root, project, *, model=None, rank=4, seed=0, **setup):
    """A store of N_TRAIN rows in shards of 10 (K-FAC statistics), and a query log of 4 rows."""
    model = model or _model()
    x, y = _data()
    run = nnstat.init(project=project, root_dir=root)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac", "shard_rows": 10, **setup})
    nnstat.watch(model)
    if rank is not None:
        nnstat.add_projection(rank=rank, init="random", seed=seed)
    for start in range(0, N_TRAIN, BATCH):
        with run(data_id=list(range(start, start + BATCH))):
            _loss(model, x[start : start + BATCH], y[start : start + BATCH]).backward()
        model.zero_grad()
    nnstat.finalize()
    log = _query(run, model)
    nnstat.unwatch()
    return log, root / project


def _query(run, model):
    x, y = _data()
    nnstat.eval()
    with run(data_id=["q0", "q1", "q2", "q3"]):
        _loss(model, x[N_TRAIN:], y[N_TRAIN:]).backward()
    model.zero_grad()
    return nnstat.get_log()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One store per module; each test tampers with its own copy."""
    root = tmp_path_factory.mktemp("integrity")
    log, path = _log(root, "store")
    _, other = _log(root, "other", seed=1)  # same model and data, another projection seed
    return log, path, other


@pytest.fixture()
def store(pristine, tmp_path):
    log, path, other = pristine
    copy = tmp_path / "store"
    shutil.copytree(path, copy)
    return log, copy, other


def _score(log, path, **kw):
    return compute_influence_all(log, path, progress=False, **kw)


def _shard(path, i=0):
    return path / "shards" / f"rank0-{i:05d}.npy"


def _ids_file(path, i=0):
    return path / "shards" / f"rank0-{i:05d}.ids.json"


def test_untouched_store_scores_and_has_its_shards(store):
    log, path, _ = store
    assert len(GradientStore(path).shards) == 4  # the tests below rely on several shards
    res = _score(log, path, preconditioner="kfac", damping=0.1)
    assert torch.isfinite(res.scores).all() and res.train_ids == list(range(N_TRAIN))


# ----------------------------------------------------------------------------- hashes
def test_swapped_projections_are_refused_when_loaded(store):
    log, path, other = store
    shutil.copy(other / PROJECTIONS_FILE, path / PROJECTIONS_FILE)
    GradientStore(path)  # opening reads no safetensors: the hash is checked where they are loaded
    with pytest.raises(ValueError, match=r"projections\.safetensors does not belong"):
        GradientStore(path).projections()
    for kw in ({}, {"preconditioner": "kfac"}, {"preconditioner": "ekfac"}):
        with pytest.raises(ValueError, match=r"projections\.safetensors.*projection_sha256"):
            _score(log, path, damping=0.1, **kw)


def test_missing_projections_are_refused(store):
    log, path, _ = store
    (path / PROJECTIONS_FILE).unlink()
    with pytest.raises(ValueError, match=r"projections\.safetensors is missing"):
        _score(log, path, preconditioner="kfac", damping=0.1)


def test_projections_without_a_recorded_hash_are_refused(store):
    log, path, _ = store
    meta = json.loads((path / META_FILE).read_text())
    meta.pop("projection_sha256")
    (path / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"projections\.safetensors.*records no projection_sha256"):
        GradientStore(path).projections()


def test_statistics_from_another_run_are_refused(store, tmp_path):
    log, path, _ = store
    recorded = json.loads((path / META_FILE).read_text())["statistics_sha256"]
    assert recorded == tensors_hash(load_file(path / STATISTICS_FILE))  # the writer's
    # another run: the same model trained one step further, so its K-FAC factors differ
    model = _model()
    x, y = _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    _loss(model, x[:N_TRAIN], y[:N_TRAIN]).backward()
    opt.step()
    model.zero_grad()
    _, elsewhere = _log(tmp_path, "retrained", model=model)
    shutil.copy(elsewhere / STATISTICS_FILE, path / STATISTICS_FILE)
    with pytest.raises(ValueError, match=r"statistics\.safetensors does not belong"):
        GradientStore(path).statistics()
    for kw in ({}, {"preconditioner": "kfac"}):  # the default reads them to choose K-FAC
        with pytest.raises(ValueError, match=r"statistics\.safetensors.*statistics_sha256"):
            _score(log, path, damping=0.1, **kw)
    with pytest.raises(ValueError, match=r"statistics\.safetensors"):
        compute_self_influence(path, preconditioner="kfac", progress=False)


def test_statistics_beside_a_null_statistics_hash_are_refused(store, tmp_path):
    # a store logged without statistics records statistics_sha256 null; a statistics file
    # that appears there belongs to another store (as projections would)
    log, path, _ = store
    _, bare = _log(tmp_path, "bare", statistic="none")
    assert json.loads((bare / META_FILE).read_text())["statistics_sha256"] is None
    shutil.copy(path / STATISTICS_FILE, bare / STATISTICS_FILE)
    shutil.copy(path / "statistics.json", bare / "statistics.json")
    match = r"statistics\.safetensors: .*meta\.json records statistics_sha256 null"
    with pytest.raises(ValueError, match=match):
        GradientStore(bare).statistics()
    for kw in ({}, {"preconditioner": "kfac"}):  # the default reads them to choose K-FAC
        with pytest.raises(ValueError, match=match):
            _score(log, bare, damping=0.1, **kw)
    (bare / STATISTICS_FILE).unlink()
    assert GradientStore(bare).statistics() == {}


def test_stores_without_statistics_and_params_hashes_are_scored_without_them(store):
    # a store whose meta.json lacks statistics_sha256 and params_sha256 (an older format) is
    # scored without those checks (the projection hash is in every format)
    log, path, _ = store
    meta = json.loads((path / META_FILE).read_text())
    later = ("shard_logs", "format_revision", "store_id")  # keys of later format revisions
    for key in ("statistics_sha256", "params_sha256", *later):
        meta.pop(key, None)
    (path / META_FILE).write_text(json.dumps(meta))
    before = _score(log, path, preconditioner="kfac", damping=0.1)
    shutil.copy(path / STATISTICS_FILE, path / "kept.safetensors")
    stats = load_file(path / STATISTICS_FILE)
    save_file({k: v * 2 for k, v in stats.items()}, path / STATISTICS_FILE)
    after = _score(log, path, preconditioner="kfac", damping=0.1)  # nothing to check against
    assert not torch.allclose(before.scores, after.scores)


def test_statistics_swapped_in_after_their_hash_key_was_deleted_are_refused(store, tmp_path):
    log, path, _ = store
    meta = json.loads((path / META_FILE).read_text())
    assert meta["shard_logs"] is True  # a store written since every hash key is recorded
    del meta["statistics_sha256"]
    (path / META_FILE).write_text(json.dumps(meta))
    stats = load_file(path / STATISTICS_FILE)
    save_file({k: v * 2 for k, v in stats.items()}, path / STATISTICS_FILE)
    match = r"statistics\.safetensors: .*meta\.json records no statistics_sha256"
    with pytest.raises(ValueError, match=match):
        GradientStore(path).statistics()
    with pytest.raises(ValueError, match=match):  # before: scored with the swapped statistics
        _score(log, path, preconditioner="kfac", damping=0.1)


def test_a_missing_statistics_file_with_a_recorded_hash_is_refused(store):
    log, path, _ = store
    (path / STATISTICS_FILE).unlink()
    with pytest.raises(ValueError, match=r"statistics\.safetensors is missing"):
        _score(log, path, damping=0.1)  # else the default would fall back to "raw" silently


# ----------------------------------------------------------------------------- weights
def test_query_captured_from_other_weights_is_refused(tmp_path):
    model = _model()
    x, y = _data()
    run = nnstat.init(project="weights", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac", "rank": 4})
    nnstat.watch(model)
    for start in range(0, N_TRAIN, BATCH):
        with run(data_id=list(range(start, start + BATCH))):
            _loss(model, x[start : start + BATCH], y[start : start + BATCH]).backward()
        model.zero_grad()
    nnstat.finalize()
    same = _query(run, model)
    with torch.no_grad():
        model[0].weight.mul_(1.01)  # a small training step between logging and the queries
    moved = _query(run, model)
    nnstat.unwatch()
    path = tmp_path / "weights"
    stored = json.loads((path / META_FILE).read_text())["params_sha256"]
    assert same.meta["params_sha256"] == stored != moved.meta["params_sha256"]
    assert not torch.allclose(same.rows, moved.rows)  # rows alone could not tell the weights
    res = compute_influence_all(same, path, preconditioner="kfac", damping=0.1, progress=False)
    assert torch.isfinite(res.scores).all()
    pattern = (
        r"the query log \(GradientLog\) \(params_sha256 \w+\.\.\.\) and the store "
        r".*weights \(params_sha256 \w+\.\.\.\) were captured from different weights"
        r".*Re-capture the queries with the weights the store was logged with, or log a new store"
    )
    calls = [
        lambda: compute_influence_all(moved, path, progress=False),
        lambda: compute_influence_all(moved, GradientStore(path), top_k=2, progress=False),
        lambda: compute_self_influence(moved, path, progress=False),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=pattern):
            call()
    # a query log from before nnstat recorded the weights is scored without the comparison
    moved.meta.pop("params_sha256")
    with pytest.raises(ValueError, match=r"model_sha256 \w+\.\.\.\) .*whole model"):
        compute_influence_all(moved, path, progress=False)  # the whole model still differs
    moved.meta.pop("model_sha256")
    compute_influence_all(moved, path, preconditioner="kfac", damping=0.1, progress=False)


# ----------------------------------------------------------------------------- ids
def test_duplicate_ids_across_shards_are_refused_at_open(store):
    log, path, _ = store
    ids = json.loads(_ids_file(path, 2).read_text())
    ids[3] = 5  # id 5 is in shard 0
    _ids_file(path, 2).write_text(json.dumps(ids))
    pattern = r"id 5 is stored in .*rank0-00000\.npy and in .*rank0-00002\.npy"
    with pytest.raises(ValueError, match=pattern):
        GradientStore(path)
    with pytest.raises(ValueError, match=pattern):
        _score(log, path, preconditioner="identity")
    with pytest.raises(ValueError, match=pattern):
        compute_self_influence(path, preconditioner="identity", progress=False)


def test_duplicate_ids_within_a_shard_are_refused(store):
    _, path, _ = store
    ids = json.loads(_ids_file(path, 1).read_text())
    ids[0] = ids[1]
    _ids_file(path, 1).write_text(json.dumps(ids))
    with pytest.raises(ValueError, match=r"id 11 is stored twice in .*rank0-00001\.npy"):
        GradientStore(path)


@pytest.mark.parametrize("bad", [3.0, {"id": 3}, None, True, [3], 1e300])
def test_ids_of_invalid_types_are_refused(store, bad):
    _, path, _ = store
    ids = json.loads(_ids_file(path, 1).read_text())
    ids[4] = bad
    _ids_file(path, 1).write_text(json.dumps(ids))
    with pytest.raises(ValueError, match=r"rank0-00001\.ids\.json: ids must be ints or strings"):
        GradientStore(path)


def test_ids_file_that_is_not_json_is_named(store):
    _, path, _ = store
    _ids_file(path, 3).write_text("[30, 31, 3")
    with pytest.raises(ValueError, match=r"rank0-00003\.ids\.json: not valid JSON"):
        GradientStore(path)


def test_build_log_dataloader_refuses_a_tampered_store(tmp_path):
    _log(tmp_path, "current")  # the current run's store
    ids_file = _ids_file(tmp_path / "current", 1)
    ids_file.write_text(json.dumps([0.5] * 10))
    with pytest.raises(ValueError, match=r"rank0-00001\.ids\.json"):
        nnstat.build_log_dataloader(batch_size=8)


# ----------------------------------------------------------------------------- shard headers
def test_shard_of_another_dtype_is_refused_at_open(store):
    log, path, _ = store
    rows = np.load(_shard(path, 1))
    np.save(_shard(path, 1), rows.astype(np.float16))  # values readable, but not this store's
    with pytest.raises(ValueError, match=r"rank0-00001\.npy: rows stored as float16.*'float32'"):
        GradientStore(path)
    with pytest.raises(ValueError, match=r"rank0-00001\.npy"):
        _score(log, path, preconditioner="identity")


def test_shard_of_another_width_is_refused_at_open(store):
    _, path, _ = store
    rows = np.load(_shard(path, 2))
    np.save(_shard(path, 2), np.concatenate([rows, rows[:, :1]], axis=1))
    with pytest.raises(ValueError, match=r"rank0-00002\.npy: shape \(10, \d+\), but meta.json"):
        GradientStore(path)


def test_truncated_shard_is_named(store):
    _, path, _ = store
    data = _shard(path, 0).read_bytes()
    _shard(path, 0).write_bytes(data[:-7])
    with pytest.raises(ValueError, match=r"rank0-00000\.npy: truncated"):
        GradientStore(path)
    _shard(path, 0).write_bytes(data[:50])  # not even a whole header
    with pytest.raises(ValueError, match=r"rank0-00000\.npy: not a readable \.npy"):
        GradientStore(path)


# ----------------------------------------------------------------------------- NaN/Inf
def _poison(path, shard, row, value=float("nan")):
    array = np.load(_shard(path, shard), mmap_mode="r+")
    array[row, 3] = value
    array.flush()
    del array


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_values_in_a_finite_store_are_refused_where_scoring_reads(store, value):
    log, path, _ = store
    assert json.loads((path / META_FILE).read_text())["nonfinite"] == "error"
    _poison(path, 2, 6, value)  # id 26
    pattern = r"rank0-00002\.npy: rows of ids \[26\] hold NaN/Inf, but .*nonfinite='error'"
    # the streaming score loop (no fit pass), full matrix and top-k
    for kw in ({"preconditioner": "identity"}, {"preconditioner": "kfac", "top_k": 3}):
        with pytest.raises(ValueError, match=pattern):
            _score(log, path, damping=0.1, **kw)
    # the preconditioner fit's pass over the rows, and self-influence's
    with pytest.raises(ValueError, match=pattern):
        _score(log, path, preconditioner="raw", damping=0.1)
    with pytest.raises(ValueError, match=pattern):
        compute_self_influence(path, preconditioner="identity", progress=False)
    # the query side read from a store
    with pytest.raises(ValueError, match=pattern):
        compute_influence_all(path, log, preconditioner="identity", progress=False)


def test_nonfinite_rows_kept_by_policy_are_named_with_their_file(tmp_path):
    x, y = _data()
    x = x.clone()
    x[13, 0] = float("nan")
    model = _model()
    run = nnstat.init(project="kept", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "rank": 4, "shard_rows": 10, "nonfinite": "keep"})
    nnstat.watch(model)
    for start in range(0, N_TRAIN, BATCH):
        with run(data_id=list(range(start, start + BATCH))):
            _loss(model, x[start : start + BATCH], y[start : start + BATCH]).backward()
        model.zero_grad()
    nnstat.finalize()
    log = _query(run, model)
    nnstat.unwatch()
    with pytest.raises(ValueError, match=r"rank0-00001\.npy: rows of ids \[13\].*'keep'"):
        _score(log, tmp_path / "kept", preconditioner="identity")


# ----------------------------------------------------------------------------- parse errors
def test_meta_json_damage_is_named(store):
    log, path, _ = store
    meta_file = path / META_FILE
    good = json.loads(meta_file.read_text())
    meta_file.write_text(meta_file.read_text()[:-20])
    with pytest.raises(ValueError, match=r"meta\.json: not valid JSON"):
        GradientStore(path)
    meta_file.write_text(json.dumps({k: v for k, v in good.items() if k != "row_width"}))
    with pytest.raises(ValueError, match=r"meta\.json: missing 'row_width'"):
        GradientStore(path)
    meta_file.write_text(json.dumps({**good, "dtype": "float64"}))
    with pytest.raises(ValueError, match=r"meta\.json: 'dtype' 'float64'"):
        GradientStore(path)
    meta_file.write_text(json.dumps({**good, "modules": good["modules"][:1]}))
    with pytest.raises(ValueError, match=r"meta\.json: 'row_width' 28 != 16, the sum of the"):
        _score(log, path, preconditioner="identity")


def _edit_module(meta, i, **changes):
    return {
        **meta,
        "modules": [{**m, **changes} if j == i else m for j, m in enumerate(meta["modules"])],
    }


@pytest.mark.parametrize(
    "changes, match",
    [
        (
            {"r_in": 3, "r_out": 4},
            r"modules\[1\] \('2'\): r_in 3, but projection rank 4 and d_in 9 give 4",
        ),
        ({"name": "../../x"}, r"modules\[1\]\.name '\.\./\.\./x' is not a module path"),
        ({"name": "0"}, r"modules\[1\]\.name '0' appears twice"),
        ({"kind": "zzz"}, r"modules\[1\] \('2'\): kind 'zzz' is not one of \['linear'"),
        ({"offset": 15}, r"modules\[1\] \('2'\): offset 15, but the previous modules end at 16"),
        ({"width": 11}, r"modules\[1\] \('2'\): width 11 != r_out \* r_in = 12"),
        ({"r_out": None}, r"modules\[1\] \('2'\): r_in 4 / r_out None must be positive ints"),
    ],
)
def test_meta_json_modules_are_checked_at_open(store, changes, match):
    # a damaged layout is refused at open, naming the file, the module and the key (not
    # later by scoring, blaming the query: "query 8 != train 16")
    log, path, _ = store
    meta_file = path / META_FILE
    good = json.loads(meta_file.read_text())
    assert [(m["name"], m["r_out"], m["r_in"]) for m in good["modules"]] == [
        ("0", 4, 4),
        ("2", 3, 4),
    ]
    meta_file.write_text(json.dumps(_edit_module(good, 1, **changes)))
    with pytest.raises(ValueError, match=r"meta\.json: .*" + match):
        GradientStore(path)
    with pytest.raises(ValueError, match=match):
        _score(log, path, preconditioner="identity")


def test_garbage_safetensors_is_named(store):
    log, path, _ = store
    (path / STATISTICS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match=r"statistics\.safetensors: not a readable safetensors"):
        _score(log, path, preconditioner="kfac", damping=0.1)
