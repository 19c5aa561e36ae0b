"""Recorder overhead: nnstat.Recorder vs comgra on the same small network, one process.

Measures, relative to a plain training step: the cost of a recorded step and the average step at
a 1-in-100 recording rate, plus bytes written per recorded step. Not a test; CI never runs it.

    .venv/bin/pip install -r benchmarks/requirements.txt
    .venv/bin/python benchmarks/recorder_overhead.py [--steps 400] [--every 100]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from nnstat.recorder import Recorder, nonfinite

WIDTH, DEPTH, BATCH, D_IN, CLASSES = 128, 4, 64, 64, 10


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers, d = [], D_IN
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(d, WIDTH), torch.nn.ReLU()]
        d = WIDTH
    layers.append(torch.nn.Linear(d, CLASSES))
    return torch.nn.Sequential(*layers)


def data(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(steps, BATCH, D_IN, generator=g), torch.randint(0, CLASSES, (steps, BATCH))


def forward(model: torch.nn.Module, x: torch.Tensor, register: Callable) -> torch.Tensor:
    h = x
    for i, layer in enumerate(model):
        h = layer(h)
        if isinstance(layer, torch.nn.ReLU):
            h = register(f"h{i}", h)
    return h


def run(kind: str, steps: int, every: int, root: Path) -> tuple[list[float], set[int], int]:
    """Per-step wall times, the steps that were recorded, bytes on disk."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs, ys = data(steps)
    folder = root / kind
    rec = comgra_rec = None
    if kind.startswith("nnstat"):
        rules = [nonfinite()] if kind == "nnstat+nonfinite rule" else []
        rec = Recorder(folder, group="bench", every=every, rules=rules, overwrite=True)
        rec.track_module(model)
    elif kind == "comgra":
        from comgra.objects import DecisionMakerForRecordingsFrequencyPerType
        from comgra.recorder import ComgraRecorder

        folder.mkdir(parents=True, exist_ok=True)
        comgra_rec = ComgraRecorder(
            comgra_root_path=folder,
            group="bench",
            trial_id="baseline",
            decision_maker_for_recordings=DecisionMakerForRecordingsFrequencyPerType(every),
            max_num_batch_size_to_record=4,
        )
        comgra_rec.track_module("net", model)
    times, recorded = [], set()
    for step in range(steps):
        x, y = xs[step], ys[step]
        t0 = time.perf_counter()
        if rec is not None:
            rec.start_batch(step)
            rec.register_tensor("x", x, role="input")
            rec.register_tensor("y", y, role="target")
            out = rec.register_tensor("logits", forward(model, x, rec.register_tensor), "output")
            loss = rec.register_tensor("loss", torch.nn.functional.cross_entropy(out, y), "loss")
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if rec.finish_batch() is not None:
                recorded.add(step)
        elif comgra_rec is not None:
            comgra_rec.start_batch(step, BATCH, type_of_execution="train")
            active = comgra_rec.recording_is_active()
            comgra_rec.start_iteration()

            def register(name: str, t: torch.Tensor) -> torch.Tensor:
                comgra_rec.register_tensor(name, t)
                return t

            x = x.clone()
            comgra_rec.register_tensor("x", x, is_input=True)
            # comgra sets requires_grad on every registered tensor, so integer targets cannot be registered
            out = forward(model, x, register)
            comgra_rec.register_tensor("logits", out)
            loss = torch.nn.functional.cross_entropy(out, y)
            comgra_rec.register_tensor("loss", loss, is_loss=True)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            comgra_rec.record_current_gradients("loss")
            comgra_rec.finish_iteration()
            comgra_rec.finish_batch()
            if active:
                recorded.add(step)
        else:
            out = forward(model, x, lambda n, t: t)
            loss = torch.nn.functional.cross_entropy(out, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    if comgra_rec is not None:
        comgra_rec.finalize()
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.exists() else 0
    return times, recorded, size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--no-comgra", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    kinds = ["plain", "nnstat", "nnstat+nonfinite rule"]
    if not args.no_comgra:
        kinds.append("comgra")
    root = Path(tempfile.mkdtemp(prefix="nnstat-recorder-bench-"))
    try:
        results = {k: run(k, args.steps, args.every, root) for k in kinds}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    warm = 5  # first steps pay for lazy initialisation in every variant
    plain = statistics.median(results["plain"][0][warm:])
    print(
        f"MLP {DEPTH}x{WIDTH}, batch {BATCH}, {args.steps} steps, 1 recorded step in {args.every},"
        f" torch threads 1; plain step median {plain * 1e3:.3f} ms\n"
    )
    print(
        "| recorder | recorded step (ms) | recorded / plain | unrecorded step / plain "
        "| average step / plain | bytes per recorded step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for kind in kinds:
        times, rec_steps, size = results[kind]
        rec_t = [t for i, t in enumerate(times) if i in rec_steps and i >= warm] or [
            t for i, t in enumerate(times) if i in rec_steps
        ]
        other = [t for i, t in enumerate(times) if i not in rec_steps and i >= warm]
        n = len(rec_steps)
        rec_s = statistics.median(rec_t) if rec_t else 0.0
        # medians, not means: the shared machine adds spikes unrelated to the recorder
        avg = ((args.steps - n) * statistics.median(other) + n * rec_s) / args.steps / plain
        rec_ms = rec_s * 1e3 if kind != "plain" else float("nan")
        rec_cells = "– | –" if kind == "plain" else f"{rec_ms:.2f} | {rec_ms / 1e3 / plain:.1f}"
        print(
            f"| {kind} | {rec_cells} | {statistics.median(other) / plain:.2f} | {avg:.2f} |"
            f" {size / n if n else 0:,.0f} |"
        )


if __name__ == "__main__":
    main()
