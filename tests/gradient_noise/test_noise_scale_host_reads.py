"""`noise_scale`'s estimators read the device back once per chunk, not once per parameter.

On a GPU every host read waits for the queue to drain; a read per parameter tensor made the
two-batch and fit estimators stall once per tensor per chunk. The ledger (`_ledger.host_reads`)
counts the calls that copy a tensor's values to the host, here on CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
from _ledger import host_reads
from torch import nn

import nnstat


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4) for _ in range(layers)] + [nn.Linear(4, 3)]
    return nn.Sequential(*mods)


def _reads(method: str, layers: int, **kw) -> int:
    model = _model(layers)
    gen = torch.Generator().manual_seed(1)
    X, y = torch.randn(64, 4, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    counter: list[str] = []
    with host_reads(counter):
        nnstat.noise_scale(model, nn.functional.cross_entropy, (X, y), method=method, seed=0, **kw)
    return len(counter)


@pytest.mark.parametrize(
    "method, kw",
    [
        ("two_batch", {"small_batch": 4, "big_batch": 16, "n_estimates": 3}),
        ("fit", {"batch_sizes": [4, 8, 16], "n_estimates": 3}),
    ],
)
def test_host_reads_do_not_grow_with_parameter_tensors(method, kw):
    few, many = _reads(method, 1, **kw), _reads(method, 12, **kw)  # 4 vs 26 parameter tensors
    assert few == many
    # one read per gradient computed (4 chunks of a 16-batch, 3 estimates: 12 for two_batch;
    # 16/4 = 4 chunks for the nested fit: 12) and one copy per result array (was 66 and 330,
    # 69 and 333: a read per tensor per chunk)
    assert few <= 12 + 2
