"""`noise_scale`'s estimators read the device back once per chunk, not once per parameter.

On a GPU every host read waits for the queue to drain; a read per parameter tensor made the
two-batch and fit estimators stall once per tensor per chunk, ``per_sample`` read the loss and
then the norms of every batch, the Hessian noise scale read twice, and a Dataset source read
its sample indices one at a time. The ledger (`_ledger.host_reads`) counts the calls that copy a
tensor's values to the host, here on CPU tensors.
"""

from __future__ import annotations

import pytest
import torch
from _ledger import host_reads
from torch import nn
from torch.utils.data import Dataset

import nnstat
from nnstat.gradient_noise import hessian_noise_scale


def _model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4) for _ in range(layers)] + [nn.Linear(4, 3)]
    return nn.Sequential(*mods)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(64, 4, generator=gen), torch.randint(0, 3, (64,), generator=gen)


class _Items(Dataset):
    """A map-style Dataset (read one sample at a time, as a user's would be)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _reads(method: str, layers: int, dataset: bool = False, **kw) -> int:
    model = _model(layers)
    data = _data()
    counter: list[str] = []
    with host_reads(counter):
        nnstat.noise_scale(
            model,
            nn.functional.cross_entropy,
            _Items(*data) if dataset else data,
            method=method,
            seed=0,
            **kw,
        )
    return len(counter)


CASES = [
    # one read per gradient computed (4 chunks of a 16-batch, 3 estimates: 12 for two_batch;
    # 16/4 = 4 chunks for the nested fit: 12; one batch per estimate for per_sample: 3) and one
    # copy per result array (was 66 and 330, 69 and 333: a read per tensor per chunk; 6 for
    # per_sample: the loss, then the norms)
    ("two_batch", {"small_batch": 4, "big_batch": 16, "n_estimates": 3}, 12 + 2),
    ("fit", {"batch_sizes": [4, 8, 16], "n_estimates": 3}, 12 + 1),
    ("per_sample", {"big_batch": 16, "n_estimates": 3}, 3),
]


@pytest.mark.parametrize("method, kw, budget", CASES)
def test_host_reads_do_not_grow_with_parameter_tensors(method, kw, budget):
    few, many = _reads(method, 1, **kw), _reads(method, 12, **kw)  # 4 vs 26 parameter tensors
    assert few == many
    assert few <= budget


@pytest.mark.parametrize("method, kw, budget", CASES)
def test_a_dataset_source_reads_its_indices_once_per_batch(method, kw, budget):
    # a batch drawn from a Dataset reads its index tensor once (was once per sample: 48 more
    # reads for these 48 samples); the two_batch chunks and fit's one big batch per estimate
    batches = {"two_batch": 12, "fit": 3, "per_sample": 3}[method]
    assert _reads(method, 1, dataset=True, **kw) <= budget + batches


def test_hessian_noise_scale_reads_once_whatever_the_chunks_and_tensors():
    x, y = _data()
    counts = []
    for layers, chunk in ((1, 64), (6, 8)):  # 4 vs 14 tensors, 1 vs 8 chunks
        counter: list[str] = []
        with host_reads(counter):
            hessian_noise_scale(_model(layers), nn.functional.cross_entropy, x, y, chunk=chunk)
        counts.append(len(counter))
    assert counts == [1, 1]  # was 2: G^T H G and the trace, read one after the other
