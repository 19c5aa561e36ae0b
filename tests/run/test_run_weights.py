"""The fingerprint covers everything the rows depend on (every parameter and
buffer of the watched model) and is checked between the blocks of a pass."""

import pytest
import torch
from _ledger import host_reads
from torch import nn

import nnstat
from nnstat.store.errors import ModelChangedError

X = torch.randn(32, 5, generator=torch.Generator().manual_seed(0))


def _pass(tmp_path, model, ids, step=None, **watch):
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "rank": 2})
    nnstat.watch(model, **watch)
    try:
        for lo in range(0, len(ids), 4):
            with run(data_id=ids[lo : lo + 4]):
                model(X[ids[lo : lo + 4]]).square().sum().backward()
            if step is not None:
                step()
            model.zero_grad()
        nnstat.finalize()
    finally:
        nnstat.unwatch()


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))


def test_a_retrained_layer_that_is_not_watched_is_refused(tmp_path):
    model = _mlp()
    _pass(tmp_path, model, list(range(8)), name_filter="2")
    with torch.no_grad():
        model[0].weight.mul_(3)  # re-trained: module "2"'s rows now differ
    with pytest.raises(ModelChangedError, match=r"model_sha256 .*outside the watched modules"):
        _pass(tmp_path, model, list(range(8, 16)), name_filter="2")
    assert len(nnstat.GradientStore(tmp_path / "p")) == 8


def test_changed_batchnorm_statistics_are_refused(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).eval()
    _pass(tmp_path, model, list(range(8)), name_filter="2")
    model[1].running_mean.add_(0.5)  # eval mode: the rows of module "2" read these
    with pytest.raises(ModelChangedError, match="model_sha256"):
        _pass(tmp_path, model, list(range(8, 16)), name_filter="2")


@pytest.mark.parametrize("how", ["sgd", "fused-adam", "data"])
def test_training_while_logging_is_refused_at_the_next_block(tmp_path, how):
    model = _mlp()
    if how == "data":  # bypasses the version counter: caught by the checksum

        def step():
            model[2].bias.data.add_(1.0)

    else:
        opt = (
            torch.optim.SGD(model.parameters(), lr=0.1)
            if how == "sgd"
            else torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
        )
        step = opt.step
    with pytest.raises(ModelChangedError, match=r"changed between two run\(\.\.\.\) blocks"):
        _pass(tmp_path, model, list(range(16)), step=step)
    nnstat.finalize()  # the refused pass: what it had logged is flushed


def test_train_mode_batchnorm_inside_blocks_is_not_a_change(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Linear(6, 3)).train()
    _pass(tmp_path, model, list(range(16)), name_filter="2")  # running stats move in forward
    assert len(nnstat.GradientStore(tmp_path / "p")) == 16


def test_the_block_check_reads_the_device_once_per_block_boundary():
    """Recording a block's end state copies nothing to the host; the check at the next block
    reads one flag, however many tensors, dtypes (here float32 and BatchNorm's int64) there are."""
    from nnstat.run.weights import BlockGuard

    for layers in (1, 12):
        model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)], nn.BatchNorm1d(4))
        guard, reads = BlockGuard(), []
        with host_reads(reads):
            guard.record(model)
            assert reads == []
            guard.check(model)
        assert len(reads) == 1
        with torch.no_grad():
            model[0].weight.data[0, 0] += 1.0  # .data: no _version bump, only the samples tell
        with pytest.raises(ModelChangedError, match="checksum"):
            guard.check(model)
