"""Under torch.distributed (2 gloo processes) every rank's statistics equal the single-process
result on the union of the data, for K-FAC factors, raw covariance and both EK-FAC passes."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from _dist import spawn
from safetensors.torch import load_file, save_file
from torch import nn

from nnstat.capture import CaptureEngine
from nnstat.curvature import Covariance, Mean, StatisticsCollector

# rank 0 gets 6 samples, rank 1 gets 2: unequal shards catch an average of per-rank averages
SPLITS = ((0, 6), (6, 8))


def data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 5, 4, generator=g), torch.randint(0, 3, (8, 5), generator=g)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.LayerNorm(6), nn.Linear(6, 3))


def collect(x, y, config):
    m = model()
    engine = CaptureEngine()
    engine.watch(m)
    col = StatisticsCollector(config)
    engine.add_consumer(col)
    for _ in col.passes:
        for i in range(0, len(x), 2):  # batches of 2
            with engine.batch(loss_reduction="mean"):
                out = m(x[i : i + 2])
                F.cross_entropy(out.reshape(-1, 3), y[i : i + 2].reshape(-1)).backward()
            m.zero_grad()
        col.finalize()
    return col.state_dict()


CONFIGS = {
    "ekfac": "ekfac",
    "low": {"forward": [Mean, Covariance], "backward": [Covariance], "grad": [Mean, Covariance]},
}


def worker(rank, out_dir):
    x, y = data()
    lo, hi = SPLITS[rank]
    for name, cfg in CONFIGS.items():
        state = collect(x[lo:hi], y[lo:hi], cfg)
        save_file(state, os.path.join(out_dir, f"{name}-rank{rank}.safetensors"))


def test_two_gloo_ranks_equal_single_process_on_union(tmp_path):
    spawn(worker, str(tmp_path), world=2)
    x, y = data()
    for name, cfg in CONFIGS.items():
        want = collect(x, y, cfg)
        for rank in range(2):
            got = load_file(str(tmp_path / f"{name}-rank{rank}.safetensors"))
            assert set(got) == set(want)
            for k in want:
                if k.endswith("eigenvectors"):  # defined up to sign: |<a_j, b_j>| = 1
                    overlap = (got[k] * want[k]).sum(0).abs()
                    torch.testing.assert_close(overlap, torch.ones_like(overlap), atol=1e-3, rtol=0)
                    continue
                torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=f"{name} {k}")
