"""`nnstat demo`: train a small MLP on scikit-learn's digits with nnstat watching, then explain it.

The demo is a sequence of small steps: `prepare_log_dir` (a fresh run folder), `load_digits_data`
(with a few planted wrong labels), `build`, `watch_training` (train/test curves and noise scale),
`train`, `log_training_gradients` (EK-FAC + projected per-sample gradients to a gradient store),
`explain_misclassified` (influence), `find_mislabels` (self-influence and the training loss
against the planted labels), `check_explanations` (RelatIF beside raw influence, and the
counterfactual check: remove what each names, retrain, compare with the loss and random),
`save_explanations` (the arrays behind those numbers), `save_for_viewer`, `report` (console)
and `write_report` (the self-contained HTML report). ``NNSTAT_DEMO_QUICK=1`` shortens it (400 digits, 12 epochs of 5 steps; the tests).

Example:
    >>> from nnstat.demo import main
    >>> main(["--epochs", "1", "--no-wandb"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nnstat
from nnstat.demo.attribution import check_explanations, save_explanations
from nnstat.demo.model import fit, make_model
from nnstat.demo.steps import (
    describe_table,
    evaluate,
    explain_misclassified,
    extras,
    find_mislabels,
    log_training_gradients,
    save_for_viewer,
    watch_training,
)
from nnstat.demo.write import write_report
from nnstat.netdict import trust_ratio

__all__ = ["main", "run", "DemoConfig", "DemoState", "DEMO_OUTPUTS", "MARKER"]

#: What the demo writes into its log folder; a re-run replaces exactly these.
DEMO_OUTPUTS = (
    "tensorboard",
    "wandb",
    "gradients",
    "metrics",
    "report.html",
    "influence.png",
    "explanations.npz",
    "counterfactual.json",
)
#: An empty file naming a folder as the demo's own, so a re-run may clear what it wrote there.
MARKER = ".nnstat-demo"


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
    #: share of training digits given a wrong label before training (the self-influence
    #: section then shows how many of them the top of its ranking finds)
    mislabel_fraction: float = 0.025
    log_every: int = 5  # Tracker steps between two logged steps


@dataclass
class DemoState:
    """What the steps pass to each other."""

    config: DemoConfig
    started: float = field(default_factory=time.perf_counter)  # the one clock of the run
    wall_seconds: float | None = None  # set once, when the report is written
    X_train: torch.Tensor | None = None
    y_train: torch.Tensor | None = None  # the labels trained on (planted ones wrong)
    y_train_true: torch.Tensor | None = None  # scikit-learn's labels
    planted: list[int] = field(default_factory=list)  # training positions given a wrong label
    X_test: torch.Tensor | None = None
    y_test: torch.Tensor | None = None
    images_train: torch.Tensor | None = None  # raw 8x8 images for the report's figures
    images_test: torch.Tensor | None = None
    model: nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    tracker: nnstat.Tracker | None = None
    W_init: nnstat.NetDict | None = None
    W_before_last_step: nnstat.NetDict | None = None
    accuracy: float = float("nan")
    wandb_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    extras: Any = None  # nnstat.demo.steps.DemoExtras


def prepare_log_dir(state: DemoState) -> None:
    """Start from a clean run folder: remove what an earlier demo wrote there.

    TensorBoard draws every event file under its log dir, and W&B adds one offline run per
    ``wandb.init``, so a re-run into the same folder would draw every curve twice. The demo
    replaces its folder's contents (rather than writing timestamped runs beside the old ones):
    one folder, one run. It only clears a folder it marked as its own (or an empty one); a
    folder holding other files is refused rather than emptied."""
    root = state.config.log_dir
    if root.exists():
        if not root.is_dir():
            raise SystemExit(f"nnstat demo: --log-dir {root} is a file, not a folder")
        entries = {p.name for p in root.iterdir()}
        foreign = sorted(entries - set(DEMO_OUTPUTS) - {MARKER})
        if foreign and MARKER not in entries:
            raise SystemExit(
                f"nnstat demo: --log-dir {root} holds files the demo did not write "
                f"({', '.join(foreign[:5])}); choose a new or empty folder"
            )
        for name in DEMO_OUTPUTS:
            path = root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            elif path.exists() or path.is_symlink():
                path.unlink()
    root.mkdir(parents=True, exist_ok=True)
    (root / MARKER).touch()


def plant_mislabels(
    labels: torch.Tensor, fraction: float, seed: int, n_classes: int = 10
) -> tuple[torch.Tensor, list[int]]:
    """A copy of ``labels`` with ``round(fraction * n)`` of them (chosen with ``seed``) moved to
    another class, uniformly among the other ``n_classes - 1``; returns it and the positions.

    Example:
        >>> noisy, where = plant_mislabels(torch.arange(10) % 10, 0.2, seed=0)
        >>> len(where), bool((noisy[where] != torch.arange(10)[where]).all())
        (2, True)
    """
    n = len(labels)
    k = int(round(fraction * n))
    g = torch.Generator().manual_seed(seed)
    where = torch.randperm(n, generator=g)[:k].sort().values
    shift = torch.randint(1, n_classes, (k,), generator=g)  # never 0: the label always changes
    noisy = labels.clone()
    noisy[where] = (labels[where] + shift) % n_classes
    return noisy, where.tolist()


def load_digits_data(state: DemoState) -> None:
    """8x8 digits from scikit-learn (bundled, no download), standardised, 80/20 split; a few
    training labels are then changed on purpose (``mislabel_fraction``, fixed seed)."""
    from sklearn.datasets import load_digits

    cfg = state.config
    digits = load_digits()
    X = torch.tensor(digits.data, dtype=torch.float32)
    y = torch.tensor(digits.target, dtype=torch.long)
    images = torch.tensor(digits.images, dtype=torch.float32)
    g = torch.Generator().manual_seed(cfg.seed)
    perm = torch.randperm(len(X), generator=g)
    X, y, images = X[perm], y[perm], images[perm]
    if cfg.quick:
        X, y, images = X[:400], y[:400], images[:400]
    X = (X - X.mean(0)) / (X.std(0) + 1e-6)
    n_train = int(0.8 * len(X))
    state.X_train, state.y_train_true = X[:n_train], y[:n_train]
    state.y_train, state.planted = plant_mislabels(
        state.y_train_true, cfg.mislabel_fraction, seed=cfg.seed + 1
    )
    state.X_test, state.y_test = X[n_train:], y[n_train:]
    state.images_train, state.images_test = images[:n_train], images[n_train:]


def build(state: DemoState) -> None:
    """A 64-h-h-10 MLP with AdamW and a Tracker writing TensorBoard, JSON lines for
    ``nnstat view`` (+ W&B offline when wandb is installed)."""
    cfg = state.config
    torch.manual_seed(cfg.seed)
    state.model = make_model(cfg)
    state.W_init = nnstat.get_weight(state.model)
    state.optimizer = torch.optim.AdamW(state.model.parameters(), lr=cfg.lr)
    from nnstat.integrations.tensorboard import TensorBoardSink

    sinks: list[Any] = [TensorBoardSink(cfg.log_dir / "tensorboard")]
    if cfg.wandb and importlib.util.find_spec("wandb") is not None:
        from nnstat.integrations.wandb import WandbSink

        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        sink = WandbSink(project="nnstat-demo", dir=str(cfg.log_dir))
        state.wandb_dir = sink.run.dir
        sinks.append(sink)
    # the same metrics dict every sink gets, as JSON lines that `nnstat view` reads
    from nnstat.integrations import JsonlLogger

    sinks.append(JsonlLogger(cfg.log_dir / "metrics"))
    state.tracker = nnstat.Tracker(
        state.model, state.optimizer, every=cfg.log_every, histograms=True, sinks=sinks
    )


def train(state: DemoState) -> None:
    """Mini-batch training; one `tracker.step()` per iteration logs every 5th step."""
    cfg, model = state.config, state.model
    t0 = time.perf_counter()

    def before_step(epoch: int, last: bool) -> None:
        if epoch == cfg.epochs - 1 and last:
            state.W_before_last_step = nnstat.get_weight(model)

    def after_epoch(epoch: int, loss: float) -> None:
        print(f"epoch {epoch + 1}/{cfg.epochs}  train loss {loss:.4f}")

    fit(
        model,
        state.optimizer,
        state.X_train,
        state.y_train,
        cfg,
        generator=torch.Generator().manual_seed(cfg.seed),
        before_step=before_step,
        after_step=state.tracker.step,
        after_epoch=after_epoch,
    )
    # the Tracker's statistics, the evaluations and the noise scale run inside these steps
    extras(state).timings["training (with Tracker, evaluation, noise scale)"] = (
        time.perf_counter() - t0
    )
    # the final weights' numbers (the last logged step may be a few steps before the end)
    extras(state).final = evaluate(state)
    state.accuracy = extras(state).final["test/accuracy"]


def report(state: DemoState) -> None:
    """Final describe table, trust ratios of the last step, and where the logs are."""
    W = nnstat.get_weight(state.model)
    print(f"\ntest accuracy {state.accuracy:.3f}\n")
    print("weights, per layer:")
    print(describe_table(state))
    print("\ntrust ratio ||W_t|| / ||W_t - W_t-1|| of the last step:")
    for name, r in trust_ratio(state.W_before_last_step, W).items():
        print(f"  {name:<12} {r:12.1f}")
    state.tracker.close()
    print(f"\nTensorBoard logs: {state.config.log_dir / 'tensorboard'}")
    print(
        f"  view with: {installed('tensorboard')} --logdir {state.config.log_dir / 'tensorboard'}"
    )
    if state.wandb_dir:
        print(f"W&B offline run: {Path(state.wandb_dir).parent}  (upload with: wandb sync <dir>)")
    for note in state.notes:
        print(note)


#: The demo's steps, in order.
STEPS = [
    prepare_log_dir,
    load_digits_data,
    build,
    watch_training,
    train,
    log_training_gradients,
    explain_misclassified,
    find_mislabels,
    check_explanations,
    save_explanations,
    save_for_viewer,
    report,
    write_report,
]


def _parse(argv: list[str]) -> DemoConfig:
    quick = os.environ.get("NNSTAT_DEMO_QUICK", "") not in ("", "0")
    p = argparse.ArgumentParser(prog="nnstat demo", description=__doc__.splitlines()[0])
    p.add_argument(
        "--epochs",
        type=int,
        default=12 if quick else DemoConfig.epochs,
        help="training epochs (default: %(default)s)",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=DemoConfig.log_dir,
        help="run folder; a re-run replaces what the demo wrote there (default: %(default)s)",
    )
    p.add_argument("--no-wandb", action="store_true", help="do not write the (offline) W&B run")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    a = p.parse_args(argv)
    if a.epochs < 1:
        p.error("--epochs must be >= 1")
    return DemoConfig(
        epochs=a.epochs, log_dir=a.log_dir, wandb=not a.no_wandb, seed=a.seed, quick=quick
    )


def run(config: DemoConfig, steps: Sequence[Callable[[DemoState], None]] = ()) -> DemoState:
    """Run the demo's ``steps`` (default: all of :data:`STEPS`) with ``config``; returns the
    final state (the tests read it)."""
    state = DemoState(config=config)
    # one intra-op thread: the demo's matrices are at most 1437 x 128, too small to share
    # between threads; two threads spent 6x the CPU time waiting on each other (measured: 31 s
    # vs 4 s for the training loop on a busy 2-core machine)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in steps or STEPS:
            step(state)
    finally:
        torch.set_num_threads(threads)
    return state


def main(argv: list[str] | None = None) -> int:
    """Run the demo; returns the process exit code."""
    state = run(_parse(list(argv or [])))
    # the number the report shows: measured once, when the report was written
    print(f"\ndemo finished in {state.wall_seconds:.1f} s (data to report, as in the report)")
    print(f"browse everything it wrote: {installed('nnstat')} view {state.config.log_dir}")
    return 0


def installed(command: str) -> str:
    """How to run an installed command from here: its path beside this Python (a venv's
    ``bin/``, which need not be on PATH: ``make demo`` does not activate it), else its name."""
    beside = Path(sys.executable).parent / command
    if beside.exists() and shutil.which(command) != str(beside):
        return shlex.quote(str(beside))
    return command
