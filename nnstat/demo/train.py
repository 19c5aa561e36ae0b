"""`nnstat demo`: train a small MLP on scikit-learn's digits with nnstat watching, then explain it.

The demo is a sequence of small steps: `load_digits_data`, `build`, `watch_training` (history
and noise scale), `train`, `log_training_gradients` (EK-FAC + projected per-sample gradients to
a gradient store), `explain_misclassified` (influence), `report` (console) and `write_report`
(the self-contained HTML report). ``NNSTAT_DEMO_QUICK=1`` shortens it (used by the tests).

Example:
    >>> from nnstat.demo import main
    >>> main(["--epochs", "1", "--no-wandb"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nnstat
from nnstat.demo.steps import (
    explain_misclassified,
    log_training_gradients,
    watch_training,
    write_report,
)
from nnstat.netdict import trust_ratio

__all__ = ["main", "DemoConfig", "DemoState"]


@dataclass
class DemoConfig:
    """Settings of one demo run."""

    epochs: int = 8
    batch_size: int = 64
    lr: float = 1e-3
    hidden: int = 128
    log_dir: Path = Path("nnstat-demo-logs")
    wandb: bool = True
    seed: int = 0
    quick: bool = False


@dataclass
class DemoState:
    """What the steps pass to each other."""

    config: DemoConfig
    X_train: torch.Tensor | None = None
    y_train: torch.Tensor | None = None
    X_test: torch.Tensor | None = None
    y_test: torch.Tensor | None = None
    images_train: torch.Tensor | None = None  # raw 8x8 images for the report's figures
    images_test: torch.Tensor | None = None
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    tracker: nnstat.Tracker | None = None
    W_before_last_step: nnstat.NetDict | None = None
    accuracy: float = float("nan")
    wandb_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    extras: Any = None  # nnstat.demo.steps.DemoExtras


def load_digits_data(state: DemoState) -> None:
    """8x8 digits from scikit-learn (bundled, no download), standardised, 80/20 split."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    X = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    images = torch.tensor(digits.images, dtype=torch.float32)
    g = torch.Generator().manual_seed(state.config.seed)
    perm = torch.randperm(len(X), generator=g)
    X, y, images = X[perm], y[perm], images[perm]
    if state.config.quick:
        X, y, images = X[:400], y[:400], images[:400]
    X = (X - X.mean(0)) / (X.std(0) + 1e-6)
    n_train = int(0.8 * len(X))
    state.X_train, state.y_train = X[:n_train], y[:n_train]
    state.X_test, state.y_test = X[n_train:], y[n_train:]
    state.images_train, state.images_test = images[:n_train], images[n_train:]


def build(state: DemoState) -> None:
    """A 64-h-h-10 MLP with AdamW and a Tracker writing TensorBoard (+ W&B offline)."""
    cfg = state.config
    torch.manual_seed(cfg.seed)
    state.model = nn.Sequential(
        nn.Linear(64, cfg.hidden),
        nn.ReLU(),
        nn.Linear(cfg.hidden, cfg.hidden),
        nn.ReLU(),
        nn.Linear(cfg.hidden, 10),
    )
    state.optimizer = torch.optim.AdamW(state.model.parameters(), lr=cfg.lr)
    from nnstat.integrations.tensorboard import TensorBoardSink

    sinks: list[Any] = [TensorBoardSink(cfg.log_dir / "tensorboard")]
    if cfg.wandb and importlib.util.find_spec("wandb") is not None:
        from nnstat.integrations.wandb import WandbSink

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        sink = WandbSink(project="nnstat-demo", dir=str(cfg.log_dir))
        state.wandb_dir = sink.run.dir
        sinks.append(sink)
    state.tracker = nnstat.Tracker(
        state.model, state.optimizer, every=5, histograms=True, sinks=sinks
    )


def train(state: DemoState) -> None:
    """Mini-batch training; one `tracker.step()` per iteration logs every 5th step."""
    cfg, model, opt = state.config, state.model, state.optimizer
    g = torch.Generator().manual_seed(cfg.seed)
    n = len(state.X_train)
    for epoch in range(cfg.epochs):
        perm = torch.randperm(n, generator=g)
        total = 0.0
        for i in range(0, n, cfg.batch_size):
            idx = perm[i : i + cfg.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(state.X_train[idx]), state.y_train[idx])
            loss.backward()
            if epoch == cfg.epochs - 1 and i + cfg.batch_size >= n:
                state.W_before_last_step = nnstat.get_weight(model)
            opt.step()
            state.tracker.step()
            total += loss.detach().item() * len(idx)
        print(f"epoch {epoch + 1}/{cfg.epochs}  train loss {total / n:.4f}")
    with torch.no_grad():
        pred = model(state.X_test).argmax(1)
    state.accuracy = float((pred == state.y_test).float().mean())


def report(state: DemoState) -> None:
    """Final describe table, trust ratios of the last step, and where the logs are."""
    W = nnstat.get_weight(state.model)
    print(f"\ntest accuracy {state.accuracy:.3f}\n")
    print("weights, per layer:")
    W.describe(
        layerwise=True, stats=["numel", "mean", "std", "skew", "kurtosis", "l2"], display=True
    )
    print("\ntrust ratio ||W_t|| / ||W_t - W_t-1|| of the last step:")
    for name, r in trust_ratio(state.W_before_last_step, W).items():
        print(f"  {name:<12} {r:12.1f}")
    state.tracker.close()
    print(f"\nTensorBoard logs: {state.config.log_dir / 'tensorboard'}")
    print(f"  view with: tensorboard --logdir {state.config.log_dir / 'tensorboard'}")
    if state.wandb_dir:
        print(f"W&B offline run: {Path(state.wandb_dir).parent}  (upload with: wandb sync <dir>)")
    for note in state.notes:
        print(note)


#: The demo's steps, in order.
STEPS = [
    load_digits_data,
    build,
    watch_training,
    train,
    log_training_gradients,
    explain_misclassified,
    report,
    write_report,
]


def _parse(argv: list[str]) -> DemoConfig:
    quick = os.environ.get("NNSTAT_DEMO_QUICK", "") not in ("", "0")
    p = argparse.ArgumentParser(prog="nnstat demo", description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=2 if quick else DemoConfig.epochs)
    p.add_argument("--log-dir", type=Path, default=DemoConfig.log_dir)
    p.add_argument("--no-wandb", action="store_true", help="do not log to W&B (offline)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.epochs < 1:
        p.error("--epochs must be >= 1")
    return DemoConfig(
        epochs=a.epochs, log_dir=a.log_dir, wandb=not a.no_wandb, seed=a.seed, quick=quick
    )


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code."""
    cfg = _parse(list(argv or []))
    state = DemoState(config=cfg)
    start = time.perf_counter()
    for step in STEPS:
        step(state)
    print(f"\ndemo finished in {time.perf_counter() - start:.1f} s")
    return 0
