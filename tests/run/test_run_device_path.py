"""Logging on an accelerator: a block's projected rows stay on the device until one copy at its
end, and the block reads the device back once (the weights guard's flag and the rows' NaN/Inf
flags together), however many modules are watched.

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


def test_forced_device_branch_on_the_cpu_reads_once_and_stores_the_same_bytes(
    tmp_path, monkeypatch
):
    few, _ = _log_cpu(tmp_path, 2, True, monkeypatch, "few")
    many, staged = _log_cpu(tmp_path, 8, True, monkeypatch, "many")
    assert few == many
    # one read (guard + NaN/Inf flags), one copy into the host buffer, no sync-prone op
    assert set(few) == {(1, 1, 0)}
    _, host = _log_cpu(tmp_path, 8, False, monkeypatch, "host")
    assert staged.ids == host.ids == list(range(16))
    assert staged.shards and len(staged.shards) == len(host.shards)
    for a, b in zip(staged.shards, host.shards, strict=True):
        assert a.read_bytes() == b.read_bytes()
