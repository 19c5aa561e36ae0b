"""The statistics passes' per-batch path reads nothing back from a device.

Run on the ``meta`` device (the accelerator branch, no data): after a pass's first batch (which
decides the factor forms and moves the store projections to the device once), a batch issues
no host read, no copy between host and device, and none of the ops whose output size depends
on the data (``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``) or that read the
device back (``bincount``), however many modules are watched: a NaN/Inf batch is refused at
``finalize()`` (tested in test_curvature.py), masked position counts are read there too.
"""

from __future__ import annotations

import pytest
import torch
from _ledger import DeviceLedger
from torch import nn

from nnstat.capture import CaptureEngine
from nnstat.curvature import Covariance, Mean, StatisticsCollector


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Embedding(20, 8, padding_idx=3)]
    for _ in range(layers):
        mods += [nn.Linear(8, 8), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(8, 3))


def _batches(n: int = 3):
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        idx = torch.randint(0, 20, (4, 5), generator=g)
        yield idx, (torch.rand(4, 5, generator=g) > 0.3).float()


def _steps(model, col, device, projections=None):
    """Ledger counts of each batch but the first, and the sync-prone ops of all."""
    engine = CaptureEngine()
    engine.watch(model)
    engine.add_consumer(col)
    if projections:
        col.set_projections(projections)
    model.to(device)
    per_batch = []
    with DeviceLedger() as ledger:
        for idx, mask in _batches():
            idx, mask = idx.to(device), mask.to(device)  # the data's copies are not counted
            before = ledger.counts()
            with engine.batch(mask=mask):
                model(idx).square().sum().backward()
            model.zero_grad()
            per_batch.append(ledger.since(before))
    engine.unwatch()
    return per_batch[1:], ledger.sync_ops


def _projections(model: nn.Module) -> dict:
    """Store projections of the Linear layers: [4, 9] inputs (bias column), [4, d_out]."""
    g = torch.Generator().manual_seed(2)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out[name] = (
                torch.randn(4, 9, generator=g),
                torch.randn(4, m.out_features, generator=g),
            )
    return out


@pytest.mark.filterwarnings("ignore:.*over max_factor_dim")  # the 8-wide embedding side
@pytest.mark.parametrize(
    "config",
    [
        # factors over max_factor_dim=6 are kept projected (Linear, with the store projection)
        # or diagonal (the embedding's token counts, the head's 3-wide backward is dense)
        {"statistic": "kfac", "max_factor_dim": 6},
        {"statistic": "kfac"},
        {"statistic": {"forward": [Mean, Covariance], "backward": [Mean], "grad": [Mean]}},
    ],
)
def test_statistics_batches_on_a_device_read_nothing(config):
    counts = {}
    for layers in (2, 8):
        model = _model(layers)
        col = StatisticsCollector(config)
        counts[layers] = _steps(model, col, "meta", _projections(model))
    (few, ops_few), (many, ops_many) = counts[2], counts[8]
    assert few == many == [(0, 0, 0, 0)] * 2
    assert ops_few == ops_many == []


def test_ekfac_eigenvalue_batches_on_a_device_read_nothing():
    """The second EK-FAC pass rotates each batch into the factors' eigenbases (the embedding's
    by grouping its (sample, token) pairs: no unique)."""
    model = _model(2)
    col = StatisticsCollector({"log": "grad", "save": "grad", "statistic": "ekfac"})
    engine = CaptureEngine()
    engine.watch(model)
    engine.add_consumer(col)
    for idx, mask in _batches():  # the factors pass, on the CPU
        with engine.batch(mask=mask):
            model(idx).square().sum().backward()
    engine.unwatch()
    col.finalize()
    assert col.current_pass.name == "eigenvalues"
    col._state = {k: v.to("meta") for k, v in col._state.items()}  # as if computed there
    per_batch, ops = _steps(model, col, "meta")
    assert per_batch == [(0, 0, 0, 0)] * 2 and ops == []
