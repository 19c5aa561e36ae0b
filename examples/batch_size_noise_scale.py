"""Choosing a batch size with the gradient noise scale (McCandlish et al. 2018).

    python examples/batch_size_noise_scale.py
    NNSTAT_EXAMPLE_QUICK=1 python examples/batch_size_noise_scale.py

B_simple = tr(Σ)/‖G‖² approximates the critical batch size: below it, doubling the batch almost
halves the steps needed; above it, extra samples are mostly wasted. It grows as training
progresses (the mean gradient shrinks faster than its noise), so it is measured at several
points. Then a small experiment counts the steps to reach a target loss at several batch sizes,
which is what B_simple predicts.
"""

from __future__ import annotations

import os

import torch
from sklearn.datasets import load_digits
from torch import nn

import nnstat

QUICK = os.environ.get("NNSTAT_EXAMPLE_QUICK", "") not in ("", "0")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    X, y = load_digits(return_X_y=True)
    X = torch.tensor(X, dtype=torch.float32)
    return (X - X.mean(0)) / (X.std(0) + 1e-6), torch.tensor(y)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


def steps_to_target(X, y, batch: int, target: float, max_steps: int) -> int:
    """Optimizer steps (Adam, lr scaled with sqrt(batch)) until the full-data loss < target."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3 * (batch / 32) ** 0.5)
    g = torch.Generator().manual_seed(0)
    for step in range(1, max_steps + 1):
        idx = torch.randint(0, len(X), (batch,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(X[idx]), y[idx]).backward()
        opt.step()
        if step % 5 == 0:
            with torch.no_grad():
                if nn.functional.cross_entropy(model(X), y).item() < target:
                    return step
    return max_steps


def main() -> None:
    X, y = data()
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.functional.cross_entropy
    n_est, big = (2, 64) if QUICK else (32, 256)
    print("| training steps | method | B_simple | 95% interval |")
    print("| ---: | --- | ---: | --- |")
    for phase, steps in enumerate([0, 50, 200][: 1 if QUICK else 3]):
        for _ in range(steps - ([0, 50, 200][phase - 1] if phase else 0)):
            idx = torch.randint(0, len(X), (32,))
            opt.zero_grad()
            loss_fn(model(X[idx]), y[idx]).backward()
            opt.step()
        for method in ("two_batch", "per_sample", "fit"):
            r = nnstat.noise_scale(
                model,
                loss_fn,
                (X, y),
                method=method,
                small_batch=8,
                big_batch=big,
                n_estimates=n_est,
                seed=phase,
            )
            lo, hi = r.interval
            print(f"| {steps} | {method} | {r.b_simple:.0f} | {lo:.0f} - {hi:.0f} |")
    print("\nsteps to reach full-data loss < 0.3 (fewer steps per sample = batch below B_crit):")
    print("| batch | steps | samples |")
    print("| ---: | ---: | ---: |")
    for batch in [16] if QUICK else [8, 16, 32, 64, 128, 256, 512]:
        s = steps_to_target(X, y, batch, target=0.3, max_steps=10 if QUICK else 3000)
        print(f"| {batch} | {s} | {s * batch} |")


if __name__ == "__main__":
    main()
