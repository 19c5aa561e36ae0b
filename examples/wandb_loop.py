"""A plain PyTorch loop logging layer statistics to W&B with one line per step.

    python examples/wandb_loop.py            # W&B offline unless WANDB_MODE says otherwise
    NNSTAT_EXAMPLE_QUICK=1 python examples/wandb_loop.py

`W.describe_layers()` is a flat ``{"<layer>/<stat>": float}`` dict, so it goes straight into
``wandb.log``; the update ``W1 - W0`` of each step is a NetDict too, and the trust ratio
‖W_t‖/‖W_t − W_{t−1}‖ comes from the same two snapshots.
"""

from __future__ import annotations

import os

import torch
import wandb
from sklearn.datasets import load_digits
from torch import nn

import nnstat

QUICK = os.environ.get("NNSTAT_EXAMPLE_QUICK", "") not in ("", "0")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def main() -> None:
    torch.manual_seed(0)
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32) / 16.0
    y = torch.tensor(y)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run = wandb.init(project="nnstat-examples", dir=os.getcwd(), config={"lr": 3e-3})
    steps = 20 if QUICK else 300
    for step in range(steps):
        idx = torch.randint(0, len(X), (64,))
        W0 = nnstat.get_weight(model)
        loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        G = nnstat.get_grad(model)
        optimizer.step()
        if step % 10 == 0:
            W1 = nnstat.get_weight(model)
            update = W1 - W0
            wandb.log({"loss": loss.item()}, step=step)
            wandb.log(W1.describe_layers(prefix="weight/", stats=["l2", "rms"]), step=step)
            wandb.log(G.describe_layers(prefix="grad/", stats=["l2", "abs_max"]), step=step)
            wandb.log(update.describe_layers(prefix="update/", stats=["rms"]), step=step)
            trust = nnstat.trust_ratio(W0, W1)
            wandb.log({f"trust_ratio/{k}": v for k, v in trust.items()}, step=step)
    W = nnstat.get_weight(model)
    W.describe(layerwise=True, stats=["numel", "mean", "std", "l2"], display=True)
    print(f"W&B run saved to {run.dir} (upload with `wandb sync`)")
    run.finish()


if __name__ == "__main__":
    main()
