"""DDP on CPU (gloo): the noise scale for free from DDP's own all-reduce, layer statistics on
rank 0, and a gradient store written by both ranks.

    torchrun --nproc_per_node 2 examples/ddp_noise_scale.py
    NNSTAT_EXAMPLE_QUICK=1 torchrun --nproc_per_node 2 examples/ddp_noise_scale.py

Each rank's local gradient is a mean over its own batch (B_small = per-rank batch) and the
all-reduced gradient a mean over the global batch (B_big = world size × per-rank batch), so a
communication hook gets both squared norms in the same collective, with no extra step.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import nnstat

QUICK = os.environ.get("NNSTAT_EXAMPLE_QUICK", "") not in ("", "0")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    X, y = load_digits(return_X_y=True)
    data = TensorDataset(torch.tensor(X, dtype=torch.float32) / 16.0, torch.tensor(y))
    if QUICK:
        data = TensorDataset(*(t[:256] for t in data.tensors))
    local_batch = 32
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=local_batch, sampler=sampler, drop_last=True)
    model = DDP(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    gns = nnstat.NoiseScale(beta=0.95)
    gns.register_ddp(model, local_batch_size=local_batch)
    # statistics are the same on every rank after the all-reduce: rank 0 logs them
    tracker = (
        nnstat.Tracker(model.module, opt, every=10, stats=["l2", "rms"]) if rank == 0 else None
    )
    if tracker is not None:
        tracker.add_provider(gns.as_provider())
    step = 0
    for epoch in range(1 if QUICK else 5):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            nn.functional.cross_entropy(model(xb), yb).backward()
            opt.step()
            if tracker is not None:
                metrics = tracker.step(step)
                if metrics and step % 20 == 0:
                    print(
                        f"step {step}: B_simple {metrics['noise_scale/b_simple']:.1f} "
                        f"(B_small {local_batch}, B_big {local_batch * world}), trust ratio "
                        f"{metrics['trust_ratio/0.weight']:.0f}"
                    )
            step += 1

    # per-sample gradients of the whole data set: each rank logs its share to its own shards
    root = [tempfile.mkdtemp(prefix="nnstat-ddp-") if rank == 0 else None]
    dist.broadcast_object_list(root)
    run = nnstat.init(project="digits", root_dir=root[0])
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "none"})
    nnstat.watch(model.module)
    nnstat.add_projection(rank=8)
    mine = list(range(rank, len(data), world))
    for s in range(0, len(mine), 128):
        ids = mine[s : s + 128]
        xb, yb = data.tensors[0][ids], data.tensors[1][ids]
        with run(data_id=ids):
            nn.functional.cross_entropy(model.module(xb), yb, reduction="sum").backward()
        model.module.zero_grad()
    nnstat.finalize()
    dist.barrier()
    if rank == 0:
        store = nnstat.GradientStore(run.path)
        print(
            f"gradient store {run.path}: {len(store)} rows from {world} ranks "
            f"(all {len(data)} ids: {sorted(store.ids) == list(range(len(data)))})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
