"""Cost of nnstat's HF Trainer callback vs. wandb.watch, side by side in one process.

    python benchmarks/hf_callback_overhead.py [--steps 60] [--repeats 3]

A 4-layer GPT-2 (n_embd 128, built from a config) trained by ``transformers.Trainer`` on random
tokens (batch 16, 64 tokens), ``logging_steps=10``, W&B offline. Rows, each the median wall time
of the training loop relative to a plain Trainer (``report_to="none"``):

* ``report_to="wandb"`` with ``WANDB_WATCH=all`` (HF's own wandb.watch: weight and gradient
  histograms of every parameter every ``logging_steps``),
* ``NNStatCallback(noise_scale=False)``: the Tracker's default statistics (l2, rms, abs_max,
  nonfinite of weights, grads, Adam states and updates, trust ratios) on logging steps,
* ``NNStatCallback()``: the default, the same plus the per-sample noise scale on one step in
  ``NOISE_SCALE_EVERY`` (8),
* ``NNStatCallback(noise_scale_every=1)``: the noise scale on **every** step.

Prints a markdown table: per row the median over repeats of the loop's wall and CPU (process)
time, and the median of each repeat's ratio to the plain loop of the same repeat (the rows run
interleaved, so load drifts cancel in those); the last column is the time spent inside the
callback's own event methods (robust to a busy machine; the per-sample capture runs inside
backward and shows only in the ratios).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import transformers
from nnstat.integrations.huggingface import NNStatCallback

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.x = torch.randint(0, 512, (n, 64), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class _Timer(transformers.TrainerCallback):
    """Times the training loop only (not Trainer construction or W&B start-up)."""

    def on_train_begin(self, *a, **k):
        self.start, self.cpu_start = time.perf_counter(), time.process_time()

    def on_train_end(self, *a, **k):
        self.seconds = time.perf_counter() - self.start
        self.cpu = time.process_time() - self.cpu_start


class _TimedNNStat(NNStatCallback):
    """NNStatCallback that also sums the time spent in its own event methods."""

    seconds = 0.0

    def __getattribute__(self, name: str):
        attr = super().__getattribute__(name)
        if not name.startswith("on_") or not callable(attr):
            return attr

        def timed(*a, **k):
            t0 = time.perf_counter()
            try:
                return attr(*a, **k)
            finally:
                type(self).seconds += time.perf_counter() - t0

        return timed


KINDS = {  # row label -> NNStatCallback options (None: no nnstat callback)
    "plain": None,
    "wandb.watch": None,
    "NNStatCallback(noise_scale=False)": {"noise_scale": False},
    "NNStatCallback() (default: noise scale every 8th step)": {},
    "NNStatCallback(noise_scale_every=1)": {"noise_scale_every": 1},
}


def run(kind: str, steps: int, out: str) -> tuple[float, float, float]:
    """(wall s, CPU s, s inside the callback's methods) of one training loop."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=512,
        n_positions=64,
        n_embd=128,
        n_layer=4,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    _TimedNNStat.seconds = 0.0
    model = transformers.GPT2LMHeadModel(cfg)
    report = "wandb" if kind == "wandb.watch" else "none"
    os.environ["WANDB_WATCH"] = "all" if kind == "wandb.watch" else "false"
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=16,
        logging_steps=10,
        report_to=report,
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    timer = _Timer()
    callbacks: list = [timer]
    if KINDS[kind] is not None:
        callbacks.append(_TimedNNStat(**KINDS[kind]))
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(steps * 16), callbacks=callbacks
    )
    trainer.train()
    if report == "wandb":
        import wandb

        wandb.finish()
    return timer.seconds, timer.cpu, _TimedNNStat.seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip-wandb", action="store_true", help="leave out the wandb.watch row")
    a = p.parse_args()
    kinds = [k for k in KINDS if not (a.skip_wandb and k == "wandb.watch")]
    wall: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    inside: dict[str, list[float]] = {k: [] for k in kinds}
    with tempfile.TemporaryDirectory() as out:
        os.environ.setdefault("WANDB_DIR", out)
        run("plain", 10, out)  # warm-up
        for r in range(a.repeats):
            # interleaved, rotating the first row, so machine noise hits every row alike
            for k in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                total, used, own = run(k, a.steps, out)
                wall[k].append(total)
                cpu[k].append(used)
                inside[k].append(own)
    med = statistics.median
    print(
        f"\n{a.steps} steps, GPT-2 4x128, batch 16x64 tokens, logging_steps=10, "
        f"{torch.get_num_threads()} torch threads, median of {a.repeats}, load average "
        f"{os.getloadavg()[0]:.1f}\n"
    )
    print(
        "| training loop | wall s | wall / plain, per repeat | CPU s | CPU / plain, per repeat "
        "| in nnstat's callback methods |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for k in kinds:
        rw = med(x / b for x, b in zip(wall[k], wall["plain"], strict=True))
        rc = med(x / b for x, b in zip(cpu[k], cpu["plain"], strict=True))
        own = f"{med(inside[k]):.2f} s" if KINDS[k] is not None else ""
        print(f"| {k} | {med(wall[k]):.2f} | {rw:.3f}x | {med(cpu[k]):.2f} | {rc:.3f}x | {own} |")


if __name__ == "__main__":
    main()
