"""Planted wrong labels the network has memorised: does self-influence find them where the
training loss no longer can?

    python benchmarks/demo_memorised.py [--epochs 8 30 60] [--quick]

The demo's own pipeline (``nnstat demo``: 64-128-128-10 MLP, scikit-learn digits, 2.5% of the
training labels flipped with a fixed seed, AdamW) trained for each number of epochs, without
the Tracker's curves; then the demo's EK-FAC gradient store and self-influence. The longer it
trains, the more planted digits the network predicts as their wrong label (memorised), and the
lower their training loss. Per number of epochs it prints a markdown row: the share memorised,
and for the self-influence and the training-loss rankings the recall at k = number planted and
the rank by which every planted digit is found (random order: k/n).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nnstat.demo.steps import find_mislabels, log_training_gradients
from nnstat.demo.train import DemoConfig, build, load_digits_data, prepare_log_dir, run, train
from nnstat.plot.frames import ranking_hits


def measure(epochs: int, quick: bool, log_dir: Path) -> dict[str, float]:
    cfg = DemoConfig(epochs=epochs, log_dir=log_dir, wandb=False, quick=quick)
    steps = [
        prepare_log_dir,
        load_digits_data,
        build,
        train,
        log_training_gradients,
        find_mislabels,
    ]
    t0 = time.perf_counter()
    state = run(cfg, steps=steps)
    state.tracker.close()
    m = state.extras.mislabels
    row: dict[str, float] = {
        "epochs": epochs,
        "memorised": state.extras.final["train/planted_memorised"],
        "test accuracy": state.accuracy,
        "k": m.k,
        "n": len(m.scores),
    }
    for name, values in (("self-influence", m.scores), ("loss", m.loss)):
        hits = ranking_hits(values, m.planted)
        row[f"{name} found"] = int(hits[m.k - 1])
        row[f"{name} all at"] = int(np.searchsorted(hits, m.k) + 1)
    row["seconds"] = time.perf_counter() - t0
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, nargs="+", default=[8, 30, 60])
    p.add_argument("--quick", action="store_true", help="400 digits (the demo's quick mode)")
    a = p.parse_args()
    torch.set_num_threads(1)
    print(
        "| epochs | planted memorised | test accuracy | self-influence: found in top k | "
        "all found by rank | loss: found in top k | all found by rank |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for epochs in a.epochs:
            r = measure(epochs, a.quick, Path(tmp) / f"e{epochs}")
            k = r["k"]
            print(
                f"| {epochs} | {r['memorised']:.0%} | {r['test accuracy']:.3f} | "
                f"{r['self-influence found']}/{k} | {r['self-influence all at']} | "
                f"{r['loss found']}/{k} | {r['loss all at']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
