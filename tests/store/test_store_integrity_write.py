"""What the writer guarantees: ids trace back to the data, rows of one store come
from one model, one writer per rank, no crash window, errors that name their cause."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import nnstat
from nnstat.store import StoreWriteError, StoreWriter, files
from nnstat.store.errors import ModelChangedError, StoreLockedError
from nnstat.store.ids import content_ids, normalize_ids, read_ids
from nnstat.store.meta import read_meta

# ---------------------------------------------------------------------------------- helpers


def make(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(24, 5, generator=g), torch.randint(0, 3, (24,), generator=g)
    return model, x, y


def sum_loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="sum")


def log(tmp_path, model, x, y, project="p", config=None, overwrite=False, rank=2, batch=8):
    """One schedule over (x, y) with ids = positions; returns the run."""
    run = nnstat.init(project=project, root_dir=tmp_path, overwrite=overwrite)
    nnstat.setup(config or {"statistic": "none"})
    nnstat.watch(model)
    nnstat.add_projection(rank=rank)
    try:
        for _ in run.schedule():
            for lo in range(0, len(x), batch):
                with run(data_id=list(range(lo, min(lo + batch, len(x))))):
                    sum_loss(model, x[lo : lo + batch], y[lo : lo + batch]).backward()
                model.zero_grad()
    finally:
        nnstat.unwatch()
    return run


def train_step(model, x, y):
    """One SGD step: the weights the store was logged with no longer exist."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    opt.zero_grad()
    sum_loss(model, x, y).backward()
    opt.step()
    opt.zero_grad()


def reference_params_sha256(model):
    """The documented recipe, written out with hashlib: watched modules in watch order, their
    own parameters in registration order, name + dtype + shape + bytes."""
    h = hashlib.sha256()
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            h.update(f"{mname}.{pname}".encode())
            h.update(f"{p.dtype}{tuple(p.shape)}".encode())
            h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def reference_file_sha256(path):
    """format.tensors_hash of a safetensors file, read with numpy (no torch, no nnstat)."""
    from safetensors.numpy import load_file

    arrays = load_file(str(path))
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode() + f"torch.{arrays[name].dtype}{arrays[name].shape}".encode())
        h.update(arrays[name].tobytes())
    return h.hexdigest()


def sha1_id(row: torch.Tensor) -> str:
    h = hashlib.sha1()
    h.update(str(row.dtype).encode())
    h.update(str(tuple(row.shape)).encode())
    h.update(row.contiguous().numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------- 1. ids


def test_dataloader_index_tensors_are_stored_as_dataset_indices(tmp_path):
    model, x, y = make()
    dataset = torch.utils.data.TensorDataset(x, y, torch.arange(len(x)))
    loader = torch.utils.data.DataLoader(dataset, batch_size=5, shuffle=True)
    run = nnstat.init(project="ids", root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    seen = []
    for inputs, targets, ids in loader:  # the README's loop: ids is an int64 tensor
        assert ids.dtype == torch.int64
        seen += ids.tolist()
        with run(data_id=ids):
            sum_loss(model, inputs, targets).backward()
    nnstat.finalize()
    nnstat.unwatch()
    store = nnstat.GradientStore(run.path)
    assert store.ids == seen and sorted(store.ids) == list(range(24))
    assert all(type(i) is int for i in store.ids)
    # each row is the gradient of the dataset row its id names
    model.zero_grad()
    nnstat.init(project="ref", root_dir=tmp_path)
    nnstat.watch(model)
    with nnstat.run(data_id=list(range(24))):
        sum_loss(model, x, y).backward()
    nnstat.finalize()
    nnstat.unwatch()
    ref = nnstat.GradientStore(tmp_path / "ref")
    torch.testing.assert_close(store.rows(0, 24), ref.rows(0, 24)[store.ids])


def test_hashing_is_asked_for_and_hashes_the_model_input(tmp_path):
    model, x, y = make()
    tokens = torch.randint(0, 9, (4, 3))
    assert normalize_ids(torch.tensor([5, 2])) == [5, 2]  # 1-D integer: ids
    assert normalize_ids(tokens) == [sha1_id(r) for r in tokens]  # 2-D: hashed rows
    assert normalize_ids(x[:2]) == [sha1_id(r) for r in x[:2]]  # floating point: hashed
    assert content_ids(torch.tensor([5, 2])) == [
        sha1_id(torch.tensor(5)),
        sha1_id(torch.tensor(2)),
    ]
    run = nnstat.init(project="h", root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    with run(data_id="hash"):  # the first tensor passed to the watched model
        sum_loss(model, x[:4], y[:4]).backward()
    with pytest.raises(TypeError, match='"hash"'):
        with run(data_id="rows"):
            pass
    with pytest.raises(RuntimeError, match="was not called"):
        with run(data_id="hash"):
            pass
    nnstat.finalize()
    nnstat.unwatch()
    assert nnstat.GradientStore(run.path).ids == [sha1_id(r) for r in x[:4]]


@dataclasses.dataclass
class Batch:
    features: torch.Tensor


class TakesDataclass(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, batch: Batch) -> torch.Tensor:
        return self.inner(batch.features)


def test_hashing_finds_the_input_inside_a_dataclass_batch(tmp_path):
    # a dataclass batch was searched for no tensor: the error said forward was never called
    inner, x, y = make()
    model = TakesDataclass(inner)
    run = nnstat.init(project="dc", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "rank": None})
    nnstat.watch(model)
    with run(data_id="hash"):
        nn.functional.cross_entropy(model(Batch(x[:4])), y[:4], reduction="sum").backward()
    nnstat.finalize()
    nnstat.unwatch()
    store = nnstat.GradientStore(run.path)
    assert store.ids == [sha1_id(r) for r in x[:4]]
    rows = store.module_view(store.rows(0, 4), "inner.2")  # [4, 3, 6 + 1]: weight, bias
    for i in range(4):
        inner.zero_grad()
        sum_loss(inner, x[i : i + 1], y[i : i + 1]).backward()
        torch.testing.assert_close(rows[i, :, :-1], inner[2].weight.grad, rtol=1e-4, atol=1e-6)


def test_hashing_a_first_input_with_repeated_rows_names_the_tensor_and_the_fix(tmp_path):
    # a mask passed first hashed to one id per batch: "duplicate data ids" named no cause
    inner, x, y = make()

    class MaskFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, mask, features):
            return self.inner(features * mask)

    model = MaskFirst()
    run = nnstat.init(project="mask", root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    mask = torch.ones(4, 5, dtype=torch.bool)
    with pytest.raises(
        ValueError, match=r"3 of the 4 rows .*\(shape \(4, 5\), torch.bool\).*data_id=\["
    ):
        with run(data_id="hash"):
            nn.functional.cross_entropy(model(mask, x[:4]), y[:4], reduction="sum").backward()
    with run(data_id=[0, 1, 2, 3]):  # the fix: ids of the samples; the refused block left none
        nn.functional.cross_entropy(model(mask, x[:4]), y[:4], reduction="sum").backward()
    nnstat.finalize()
    nnstat.unwatch()
    assert nnstat.GradientStore(run.path).ids == [0, 1, 2, 3]


# ------------------------------------------------------- 2. one model per store


def test_meta_records_the_weights_and_statistics_the_rows_go_with(tmp_path):
    model, x, y = make()
    run = log(tmp_path, model, x, y, config={"statistic": "ekfac"})
    meta = json.loads((run.path / "meta.json").read_text())
    assert meta["params_sha256"] == reference_params_sha256(model)
    assert meta["statistics_sha256"] == reference_file_sha256(run.path / "statistics.safetensors")


def test_query_log_records_the_weights_at_capture_time(tmp_path):
    model, x, y = make()
    run = log(tmp_path, model, x, y, config={"statistic": "kfac"})
    stored = json.loads((run.path / "meta.json").read_text())
    train_step(model, x, y)
    at_capture = reference_params_sha256(model)
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.watch(model)
    nnstat.eval()
    with run(data_id=["q0"]):
        sum_loss(model, x[:1], y[:1]).backward()
    train_step(model, x, y)  # after the capture: not what the log describes
    query = nnstat.get_log()
    nnstat.unwatch()
    assert query.meta["params_sha256"] == at_capture != stored["params_sha256"]
    assert query.meta["statistics_sha256"] == stored["statistics_sha256"]


def test_a_changed_model_is_refused_and_overwrite_starts_afresh(tmp_path):
    model, x, y = make()
    run = log(tmp_path, model, x, y, config={"statistic": "kfac"})
    before = {p.name: p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    train_step(model, x, y)
    with pytest.raises(ModelChangedError, match=r"params_sha256.*overwrite=True"):
        log(tmp_path, model, x, y, config={"statistic": "kfac"})
    after = {p.name: p.read_bytes() for p in run.path.rglob("*") if p.is_file()}
    assert after == before  # nothing written: not the statistics either

    run = log(tmp_path, model, x, y, config={"statistic": "kfac"}, overwrite=True)
    store = nnstat.GradientStore(run.path)
    assert sorted(store.ids) == list(range(24))  # the old ids were not "already stored"
    assert store.meta["params_sha256"] == reference_params_sha256(model)
    fresh = log(tmp_path, model, x, y, project="fresh", config={"statistic": "kfac"})
    ref = nnstat.GradientStore(fresh.path)
    torch.testing.assert_close(store.rows(0, 24), ref.rows(0, 24))
    for key, value in ref.statistics().items():
        torch.testing.assert_close(store.statistics()[key], value)


def test_weights_that_change_between_the_passes_of_a_schedule_are_refused(tmp_path):
    model, x, y = make()
    run = nnstat.init(project="e", root_dir=tmp_path)
    nnstat.setup({"statistic": "ekfac"})
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    with pytest.raises(ModelChangedError, match="'factors' and pass 'eigenvalues'"):
        for _ in run.schedule():
            with run(data_id=list(range(8))):
                sum_loss(model, x[:8], y[:8]).backward()
            train_step(model, x, y)  # an optimizer step inside the schedule
    nnstat.unwatch()
    assert not (run.path / "meta.json").exists()  # no rows of the second pass


def test_huggingface_extract_log_after_training_is_refused_then_overwritten(tmp_path):
    transformers = pytest.importorskip("transformers")
    from nnstat.integrations.huggingface import NNStatArguments, patch_trainer

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=20, n_positions=8, n_embd=8, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    model = transformers.GPT2LMHeadModel(cfg)
    tokens = torch.randint(1, 20, (8, 6), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True, save_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        max_steps=2, learning_rate=0.1,
    )  # fmt: skip
    trainer = patch_trainer(transformers.Trainer)(
        nnstat_args=NNStatArguments(
            "hf", root_dir=str(tmp_path), rank=2, config={"statistic": "none"}, track=False,
            progress=False,
        ),
        model=model, args=args, train_dataset=data,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # modules left out of the watch
        run = trainer.extract_log()
    first = nnstat.GradientStore(run.path).meta["params_sha256"]
    trainer.train()
    with pytest.raises(ModelChangedError, match="params_sha256") as info:
        trainer.extract_log()
    assert "trainer.extract_log(overwrite=True)" in str(info.value) + str(
        getattr(info.value, "__notes__", "")
    )
    assert nnstat.GradientStore(run.path).meta["params_sha256"] == first
    trainer.extract_log(overwrite=True)
    store = nnstat.GradientStore(run.path)
    assert store.meta["params_sha256"] != first and sorted(store.ids) == list(range(8))


# ------------------------------------------------------------------- 3. one writer

HOLDER = r"""
import sys, time, torch
from torch import nn
import nnstat

root = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
run = nnstat.init(project="p", root_dir=root)
nnstat.setup({"statistic": "none", "shard_rows": 1000})  # rows stay in an open shard
nnstat.watch(model)
with run(data_id=list(range(4))):
    nn.functional.cross_entropy(model(torch.randn(4, 5)), torch.tensor([0, 1, 2, 0]),
                                reduction="sum").backward()
while not list((run.path / "shards").glob("*.npy.tmp")):
    time.sleep(0.01)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_second_writer_is_refused_and_a_killed_holder_frees_the_lock(tmp_path):
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "ready"
        shards = tmp_path / "p" / "shards"
        in_progress = list(shards.glob("*.npy.tmp"))
        assert in_progress
        model, x, y = make()
        run = nnstat.init(project="p", root_dir=tmp_path)
        nnstat.watch(model)
        with pytest.raises(StoreLockedError, match=rf"pid {proc.pid}\).*rank 0"):
            with run(data_id=[100]):
                sum_loss(model, x[:1], y[:1]).backward()
        with pytest.raises(StoreLockedError):
            StoreWriter(shards, 32)
        assert all(p.exists() for p in in_progress)  # the holder's file was left alone
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    # the kernel released the dead holder's lock: the next writer takes it and cleans up
    with run(data_id=[100]):
        sum_loss(model, x[:1], y[:1]).backward()
    nnstat.finalize()
    nnstat.unwatch()
    assert not list(shards.glob("*.tmp"))
    assert nnstat.GradientStore(tmp_path / "p").ids == [100]


def test_an_unfinalized_pass_of_the_same_process_holds_the_lock(tmp_path):
    model, x, y = make()
    first = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.watch(model)
    with first(data_id=[0]):
        sum_loss(model, x[:1], y[:1]).backward()
    nnstat.unwatch()
    with pytest.warns(UserWarning, match="not finalize"):
        second = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.watch(model)
    with pytest.raises(StoreLockedError, match=r"this process.*finalize\(\)"):
        with second(data_id=[1]):
            sum_loss(model, x[1:2], y[1:2]).backward()
    first.finalize()
    with second(data_id=[1]):
        sum_loss(model, x[1:2], y[1:2]).backward()
    second.finalize()
    nnstat.unwatch()
    assert nnstat.GradientStore(second.path).ids == [0, 1]


# --------------------------------------------------------------- 5. crash window


def test_projections_left_by_a_run_that_died_before_meta_are_replaced(tmp_path, monkeypatch):
    real = files.atomic_write_json

    def die_at_meta(path, obj):  # the process "dies" between projections and meta.json
        if Path(path).name == "meta.json":
            raise OSError(5, "killed")
        real(path, obj)

    model, x, y = make()
    monkeypatch.setattr(files, "atomic_write_json", die_at_meta)
    with pytest.raises(StoreWriteError):
        log(tmp_path, model, x, y, rank=2)
    monkeypatch.setattr(files, "atomic_write_json", real)
    path = tmp_path / "p"
    assert (path / "projections.safetensors").exists() and not (path / "meta.json").exists()
    stale = reference_file_sha256(path / "projections.safetensors")

    log(tmp_path, model, x, y, rank=3)  # another projection
    meta = json.loads((path / "meta.json").read_text())
    on_disk = reference_file_sha256(path / "projections.safetensors")
    assert on_disk != stale and meta["projection_sha256"] == on_disk


# ------------------------------------------------------------------------ 6. errors


def test_writer_failure_is_the_error_of_finalize_and_leaves_no_tmp_files(tmp_path, monkeypatch):
    model, x, y = make()
    run = nnstat.init(project="full", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "shard_rows": 1000})
    nnstat.watch(model)
    with run(data_id=list(range(8))):
        sum_loss(model, x[:8], y[:8]).backward()
    for _ in range(500):  # the writer's first job has written meta.json
        if (run.path / "meta.json").exists():
            break
        time.sleep(0.01)

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)  # the shard and the meta rewrite both fail
    with pytest.raises(StoreWriteError, match="No space left") as info:
        nnstat.finalize()
    assert isinstance(info.value.__cause__, OSError)
    assert "meta.json was not rewritten either" in "".join(getattr(info.value, "__notes__", []))
    monkeypatch.undo()
    nnstat.unwatch()
    assert not list(run.path.rglob("*.tmp")) and not list(run.path.rglob("*.ids.json"))
    assert json.loads((run.path / "meta.json").read_text())["skipped_rows"] == 0


def test_an_empty_batch_stores_nothing(tmp_path):
    model, x, y = make()
    run = nnstat.init(project="empty", root_dir=tmp_path)
    nnstat.setup({"statistic": "kfac"})
    nnstat.watch(model)
    with run(data_id=[]):
        sum_loss(model, x[:0], y[:0]).backward()
    with run(data_id=[3, 4]):
        sum_loss(model, x[3:5], y[3:5]).backward()
    nnstat.finalize()
    nnstat.unwatch()
    assert nnstat.GradientStore(run.path).ids == [3, 4]


FORGETFUL = r"""
import sys, torch
from torch import nn
import nnstat

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
run = nnstat.init(project="p", root_dir=sys.argv[1])
nnstat.setup({"statistic": "none", "shard_rows": 1000})
nnstat.watch(model)
for lo in range(0, 12, 4):
    with run(data_id=list(range(lo, lo + 4))):
        nn.functional.cross_entropy(model(torch.randn(4, 5)), torch.tensor([0, 1, 2, 0]),
                                    reduction="sum").backward()
# no finalize()
"""


def test_rows_of_a_pass_never_finalized_are_flushed_at_exit(tmp_path):
    script = tmp_path / "forget.py"
    script.write_text(FORGETFUL)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "never finalize()d" in out.stderr
    store = nnstat.GradientStore(tmp_path / "p")
    assert store.ids == list(range(12))  # one open shard of 12 rows: all of them on disk


def test_damaged_files_are_named_in_the_errors(tmp_path):
    good = tmp_path / "a.npy"
    np.save(good, np.ones((4, 3), np.float32))
    cut = tmp_path / "cut.npy"
    cut.write_bytes(good.read_bytes()[:-5])
    with pytest.raises(ValueError, match=r"cut\.npy: truncated.*\(4, 3\) float32"):
        files.read_npy_header(cut)
    with pytest.raises(ValueError, match=r"cut\.npy: truncated"):
        files.load_npy(cut)
    assert files.load_npy(good).shape == (4, 3)
    (tmp_path / "junk.npy").write_bytes(b"not numpy at all")
    with pytest.raises(ValueError, match=r"junk\.npy: not a readable \.npy"):
        files.load_npy(tmp_path / "junk.npy")
    (tmp_path / "meta.json").write_text('{"format_version": 1, "row_width": ')
    with pytest.raises(ValueError, match=r"meta\.json: not valid JSON.*line 1"):
        files.read_json(tmp_path / "meta.json")
    (tmp_path / "meta.json").write_text('{"format_version": 1, "modules": []}')
    with pytest.raises(ValueError, match=r"meta\.json: missing 'row_width'"):
        read_meta(tmp_path / "meta.json")
    (tmp_path / "x.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")
    with pytest.raises(ValueError, match=r"x\.safetensors: not a readable safetensors file"):
        files.load_safetensors(tmp_path / "x.safetensors")
    assert files.load_safetensors(tmp_path / "absent.safetensors") == {}
    (tmp_path / "rank0-00000.ids.json").write_text('[1, "a", 2.5]')
    with pytest.raises(ValueError, match=r"rank0-00000\.ids\.json: ids must be ints or strings"):
        read_ids(tmp_path / "rank0-00000.ids.json")


# ------------------------------------------------------------- 7. a mean-reduced loss


@pytest.mark.parametrize(
    "loss, reduction, warns",
    [
        (lambda o, y: nn.functional.cross_entropy(o, y), "sum", True),
        (lambda o, y: nn.CrossEntropyLoss()(o, y) + 0.0 * o.sum(), "sum", True),
        (lambda o, y: o.pow(2).mean(), "sum", True),
        (lambda o, y: nn.functional.cross_entropy(o, y, reduction="sum"), "sum", False),
        (lambda o, y: nn.functional.cross_entropy(o, y) * o.shape[0], "sum", False),
        (lambda o, y: nn.functional.cross_entropy(o, y), "mean", False),
    ],
)
def test_a_mean_loss_under_loss_reduction_sum_is_warned_about(tmp_path, loss, reduction, warns):
    model, x, y = make()
    run = nnstat.init(project="m", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "loss_reduction": reduction})
    nnstat.watch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for lo in (0, 8):
            with run(data_id=list(range(lo, lo + 8))):
                loss(model(x[lo : lo + 8]), y[lo : lo + 8]).backward()
    nnstat.finalize()
    nnstat.unwatch()
    said = [str(w.message) for w in caught if "loss_reduction" in str(w.message)]
    assert len(said) == (1 if warns else 0), said
    if warns:
        assert "setup({'loss_reduction': 'mean'})" in said[0] and "8 samples" in said[0]


def test_a_failed_first_block_leaves_the_mean_loss_check_to_the_next_block(tmp_path):
    """The first block (a summed loss) is refused (data_id names 7 of its 8 samples): the
    loss check counts only for a block that completed, so the next block's loss, a mean over
    the batch under loss_reduction="sum", is still warned about."""
    model, x, y = make()
    run = nnstat.init(project="m", root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ValueError, match="data_id has 7 entries but the batch has 8"):
            with run(data_id=list(range(7))):
                sum_loss(model, x[:8], y[:8]).backward()
        with run(data_id=list(range(8, 16))):
            nn.functional.cross_entropy(model(x[8:16]), y[8:16]).backward()
    nnstat.finalize()
    nnstat.unwatch()
    said = [str(w.message) for w in caught if "loss_reduction" in str(w.message)]
    assert len(said) == 1 and "8 samples" in said[0], said


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_a_token_mean_loss_is_warned_about_under_either_reduction(tmp_path, reduction):
    """An LM loss averaged over the tokens (cross_entropy(logits.view(-1, V), ...), 13 counted
    of 20 with ignore_index). Under loss_reduction="mean" each row was 5/13 of its sequence's
    own (summed) gradient, a factor that follows the tokens counted in each batch, without a
    word; now it is warned about. Under "sum" the warning no longer suggests "mean" (which
    would leave that factor)."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    V = 7
    model = nn.Sequential(nn.Embedding(V, 6), nn.Linear(6, V))
    ids = torch.randint(0, V, (5, 4))
    tgt = ids.roll(1, 1)
    tgt[:, 0], tgt[1, 1:3] = -100, -100  # 13 tokens counted

    def token_mean(logits, t):
        return nn.functional.cross_entropy(logits.reshape(-1, V), t.reshape(-1))

    run = nnstat.init(project="lm", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "loss_reduction": reduction})
    nnstat.watch(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with run(data_id=list(range(5))):
            token_mean(model(ids), tgt).backward()
    nnstat.finalize()
    nnstat.unwatch()
    said = [str(w.message) for w in caught if "loss_reduction" in str(w.message)]
    assert len(said) == 1, said
    if reduction == "mean":
        assert "a mean over 20 rows" in said[0] and "4 per sample" in said[0]
        assert "reduction='sum'" in said[0] and "loss_reduction='sum'" in said[0]
    else:
        assert "setup({'loss_reduction': 'mean'})" not in said[0] and "positions" in said[0]
    params = {k: v.detach() for k, v in model.named_parameters()}

    def own(p, x, t):  # the sequence's own loss: its tokens summed
        out = functional_call(model, p, (x[None],)).reshape(-1, V)
        return nn.functional.cross_entropy(out, t.reshape(-1), reduction="sum")

    ref = vmap(grad(own), in_dims=(None, 0, 0))(params, ids, tgt)
    store = nnstat.GradientStore(run.path)
    spec = next(m for m in store.modules if m["name"] == "1")
    rows = store.rows(0, 5)[:, spec["offset"] : spec["offset"] + spec["width"]]
    want = torch.cat([ref["1.weight"], ref["1.bias"][:, :, None]], 2).reshape(5, -1)
    scale = 5 / 13 if reduction == "mean" else 1 / 13  # the factor the warning reports
    torch.testing.assert_close(rows, want * scale, rtol=1e-4, atol=1e-6)


def test_a_filesystem_without_locks_is_written_with_a_warning(tmp_path, monkeypatch):
    import errno
    import fcntl

    def unsupported(fd, op):
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(fcntl, "flock", unsupported)
    with pytest.warns(UserWarning, match="does not support file locks"):
        w = StoreWriter(tmp_path / "shards", 2)
    w.put([0], torch.zeros(1, 2))
    assert w.close() == 1
    monkeypatch.setattr(
        fcntl, "flock", lambda fd, op: (_ for _ in ()).throw(OSError(errno.EIO, "I/O"))
    )
    with pytest.raises(OSError, match="I/O"):  # any other failure is an error, not a warning
        StoreWriter(tmp_path / "shards", 2)
