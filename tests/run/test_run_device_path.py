"""Logging on an accelerator: a block's projected rows stay on the device until one copy at its
end, which also carries the weights guard's flag and the rows' NaN/Inf flags; the training
thread reads nothing back (the store's writer thread checks the flags from the host copy),
however many modules are watched.

Checked on the ``meta`` device (which takes the accelerator branch; its host reads are answered
by the ledger) and on the CPU with the accelerator branch forced, where the store can be
compared byte for byte with the one the CPU path writes.
"""

from __future__ import annotations

import pytest
import torch
from _ledger import DeviceLedger, host_reads
from torch import nn

import nnstat
from nnstat.run import rows as run_rows
from nnstat.store.errors import ModelChangedError
from nnstat.store.logger import nonfinite_error
from nnstat.store.writer import StoreWriter


def _mlp(layers: int, device: str = "cpu") -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Embedding(20, 8)]
    for _ in range(layers):
        mods += [nn.Linear(8, 8), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(8, 3)).to(device)


def _blocks(device: str, n_blocks: int = 4):
    g = torch.Generator().manual_seed(1)
    for b in range(n_blocks):
        idx = torch.randint(0, 20, (4, 5), generator=g)
        mask = (torch.rand(4, 5, generator=g) > 0.3).float()
        yield list(range(4 * b, 4 * b + 4)), idx.to(device), mask.to(device)


def _log(tmp_path, layers, device, config=None, name="p"):
    """Per block after the first (the first also fingerprints the weights and moves the
    projections to the device): (host reads, copies to the host, copies to the device,
    sync-prone ops)."""
    model = _mlp(layers, device)
    per_block = []
    with DeviceLedger() as ledger:
        run = nnstat.init(project=name, root_dir=tmp_path)
        nnstat.setup({"statistic": "none", "rank": 4, **(config or {})})
        nnstat.watch(model)
        try:
            for ids, idx, mask in _blocks(device):
                before = ledger.counts()
                with run(data_id=ids, mask=mask):
                    model(idx).square().sum().backward()
                model.zero_grad()
                per_block.append(ledger.since(before))
            nnstat.finalize()
        finally:
            nnstat.unwatch()
    return per_block[1:], ledger.sync_ops


@pytest.mark.parametrize("config", [{}, {"nonfinite": "keep"}, {"dtype": "float16"}])
def test_a_logged_block_on_a_device_reads_once_and_copies_its_rows_once(tmp_path, config):
    few, ops_few = _log(tmp_path / "a", 2, "meta", config)
    many, ops_many = _log(tmp_path / "b", 8, "meta", config)
    # 4 vs 10 watched modules (embedding, linears, head), a padding mask: the same counts; was
    # 5 vs 11 reads (a mask count per module), 4 vs 10 copies to the host (one per module) and
    # 8 vs 20 copies of the projections to the device per block
    assert few == many
    for reads, to_host, to_device, _ in few:
        assert reads <= 1 and to_host == 1 and to_device == 0
    assert ops_few == ops_many == []


def _log_cpu(tmp_path, layers, staged, monkeypatch, name):
    """The same blocks on the CPU, the accelerator branch forced when ``staged``; per block:
    host reads (Python level) and the ops that wrote into the writer's host row buffers."""
    monkeypatch.setattr(run_rows, "on_accelerator", lambda device: staged, raising=False)
    buffers: list[int] = []
    real = StoreWriter.row_buffer

    def row_buffer(self, *args, **kwargs):
        buf = real(self, *args, **kwargs)
        buffers.append(buf.untyped_storage().data_ptr())
        return buf

    monkeypatch.setattr(StoreWriter, "row_buffer", row_buffer)

    class Writes(DeviceLedger):
        def __init__(self):
            super().__init__()
            self.into_buffers = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            targets = [a for a in args[:1] if func._schema.is_mutable]
            targets += [v for k, v in (kwargs or {}).items() if k == "out"]
            if any(
                isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in buffers
                for t in targets
            ):
                self.into_buffers += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    model = _mlp(layers)
    per_block = []
    run = nnstat.init(project=name, root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "rank": 4})
    nnstat.watch(model)
    try:
        for ids, idx, mask in _blocks("cpu"):
            reads: list[str] = []
            with Writes() as ops, host_reads(reads, this_thread=True):
                with run(data_id=ids, mask=mask):
                    model(idx).square().sum().backward()
            model.zero_grad()
            per_block.append((len(reads), ops.into_buffers, len(ops.sync_ops)))
        nnstat.finalize()
    finally:
        nnstat.unwatch()
    return per_block[1:], nnstat.GradientStore(tmp_path / name)


@pytest.mark.parametrize(
    "config", [{}, {"nonfinite": "skip"}, {"nonfinite": "keep"}, {"dtype": "float16"}]
)
def test_a_logged_block_on_a_device_reads_nothing_back(tmp_path, config):
    """The guard's and the NaN/Inf flags travel in the rows' copy: no read in the step."""
    blocks, ops = _log(tmp_path, 8, "meta", config)
    assert [reads for reads, *_ in blocks] == [0] * len(blocks)
    assert all(to_host == 1 and to_device == 0 for _, to_host, to_device, _ in blocks)
    assert ops == []


def test_forced_device_branch_on_the_cpu_reads_nothing_and_stores_the_same_bytes(
    tmp_path, monkeypatch
):
    few, _ = _log_cpu(tmp_path, 2, True, monkeypatch, "few")
    many, staged = _log_cpu(tmp_path, 8, True, monkeypatch, "many")
    assert few == many
    # no read in the training thread (the flags are read by the writer's thread from the
    # host copy), one copy into the host buffer, no sync-prone op
    assert set(few) == {(0, 1, 0)}
    _, host = _log_cpu(tmp_path, 8, False, monkeypatch, "host")
    assert staged.ids == host.ids == list(range(16))
    assert staged.shards and len(staged.shards) == len(host.shards)
    for a, b in zip(staged.shards, host.shards, strict=True):
        assert a.read_bytes() == b.read_bytes()


def _log_blocks(
    tmp_path, name, monkeypatch, staged, blocks=6, nan_at=None, between=None, config=None
):
    """Blocks of 4 samples on the CPU (the accelerator branch forced when ``staged``); sample
    ``nan_at`` has a NaN input, ``between(b)`` runs after block ``b``. Returns the error raised
    by a block or by finalize() (``None``: none) and the store."""
    monkeypatch.setattr(run_rows, "on_accelerator", lambda device: staged, raising=False)
    model = _mlp(2)
    idx = torch.randint(0, 20, (4 * blocks, 5), generator=torch.Generator().manual_seed(2))
    run = nnstat.init(project=name, root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "rank": 4, **(config or {})})
    nnstat.watch(model)
    error = None
    try:
        for b in range(blocks):
            ids = list(range(4 * b, 4 * b + 4))
            with run(data_id=ids):
                out = model(idx[ids])
                if nan_at in ids:
                    out = out * torch.tensor([0.0 if i != nan_at else float("nan") for i in ids])[
                        :, None, None
                    ].add(1.0)
                out.square().sum().backward()
            model.zero_grad()
            if between is not None:
                between(model, b)
    except ValueError as e:  # raised by a block
        error = e
    try:
        nnstat.finalize()  # the rows before a refusal raised by a block were flushed then
    except ValueError as e:
        assert error is None, "a refusal is raised once"
        error = e
    finally:
        nnstat.unwatch()
    return error, nnstat.GradientStore(tmp_path / name)


def _rows(store):
    return store.rows(0, len(store))


def test_nan_rows_found_after_the_copy_are_refused_at_the_next_call_rows_before_kept(
    tmp_path, monkeypatch
):
    """Under nonfinite="error", a NaN row found by the writer's thread (after the block's copy
    has landed) is refused with the same message as on the host path, at the next block or
    at finalize(); the blocks before it are stored intact, nothing from its block on."""
    error, host = _log_blocks(tmp_path, "host", monkeypatch, False, nan_at=9)
    assert isinstance(error, ValueError) and "ids [9] contain NaN/Inf" in str(error)
    error, staged = _log_blocks(tmp_path, "staged", monkeypatch, True, nan_at=9)
    assert type(error) is ValueError
    # the host path's message (Python 3.10 appends the note about the later blocks to it)
    assert str(error).split("\n")[0] == str(nonfinite_error([9], "float32"))
    assert staged.ids == list(range(8))  # blocks 0 and 1; block 2 (ids 8-11) and later: none
    clean_error, clean = _log_blocks(tmp_path, "clean", monkeypatch, False)
    assert clean_error is None
    assert torch.equal(_rows(staged), _rows(clean)[:8])
    # the host path refuses the block at its end: the same rows before it
    assert host.ids == list(range(8)) and torch.equal(_rows(host), _rows(staged))


def test_nan_rows_under_skip_are_dropped_in_the_writer_thread(tmp_path, monkeypatch):
    skip = {"nonfinite": "skip"}
    error, staged = _log_blocks(tmp_path, "s", monkeypatch, True, nan_at=9, config=skip)
    assert error is None
    error, host = _log_blocks(tmp_path, "h", monkeypatch, False, nan_at=9, config=skip)
    assert error is None
    assert staged.ids == host.ids == [i for i in range(24) if i != 9]
    assert staged.meta["skipped_rows"] == host.meta["skipped_rows"] == 1
    assert torch.equal(_rows(staged), _rows(host))


def test_a_model_changed_through_data_is_refused_from_the_copied_flag(tmp_path, monkeypatch):
    """A change only the checksum tells (``.data``: no version bump) between blocks: on the
    accelerator branch its flag is read by the writer's thread, and the refusal comes at the
    next block or finalize(); the blocks before the change are stored, none after it."""

    def step(model, b):
        if b == 1:
            model[1].bias.data.add_(1.0)

    error, store = _log_blocks(tmp_path, "w", monkeypatch, True, between=step)
    assert isinstance(error, ModelChangedError)
    assert "changed between two run(...) blocks" in str(error) and "checksum" in str(error)
    assert store.ids == list(range(8))
