"""A first run end to end: a small HuggingFace causal LM trained on local text with the Trainer
and `NNStatCallback`, then `nnstat.noise_scale`, a gradient store, influence for held-out
sequences with their texts, and a folder `nnstat view` opens.

    python examples/hf_journey.py                 # ~2 layers x 128, 200 steps: a few minutes
    python examples/hf_journey.py --quick         # ~30 s on 2 CPU cores (what CI runs)
    nnstat view hf_journey                        # charts, and the influence explorer

The text is the standard library's own source files (no download), as bytes: the vocabulary is
the 256 byte values, so no tokenizer is needed. The model is a random-init GPT-2 from a config.
The Trainer clips gradients (``max_grad_norm=1.0``, its default); the callback's noise scale
reads the gradients before that clip.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

import torch
from nnstat.integrations.huggingface import (
    JsonlCallback,
    NNStatArguments,
    patch_trainer,
)
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import nnstat


def stdlib_text(files: int) -> list[tuple[str, bytes]]:
    """``(file name, bytes)`` of the first ``files`` standard-library modules, sorted by name."""
    lib = Path(os.__file__).parent
    paths = sorted(p for p in lib.glob("*.py") if p.stat().st_size > 4000)[:files]
    return [(p.name, p.read_bytes()) for p in paths]


class Bytes(torch.utils.data.Dataset):
    """Fixed-length byte sequences cut from texts: ``input_ids`` are the byte values."""

    def __init__(self, texts: list[tuple[str, bytes]], length: int, per_file: int) -> None:
        rows = []
        for _, data in texts:
            starts = range(0, len(data) - length, max(1, (len(data) - length) // per_file))
            rows += [list(data[s : s + length]) for s in list(starts)[:per_file]]
        self.x = torch.tensor(rows, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def as_text(row: dict[str, torch.Tensor]) -> str:
    return bytes(row["input_ids"].tolist()).decode("utf-8", errors="replace")


def next_byte_loss(out, targets: torch.Tensor) -> torch.Tensor:
    """Batch-mean next-byte cross-entropy, for `nnstat.noise_scale` (``loss_fn(model(x), y)``)."""
    logits = out.logits[:, :-1]
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--quick", action="store_true", help="a small run (what CI runs)")
    parser.add_argument("--out", default="hf_journey", help="folder for `nnstat view`")
    a, _ = parser.parse_known_args()  # known only: tests run this file under pytest's argv
    quick = a.quick or os.environ.get("NNSTAT_EXAMPLE_QUICK", "") not in ("", "0")
    width, steps, length, per_file = (64, 16, 32, 8) if quick else (128, 200, 64, 64)
    out = Path(a.out)
    shutil.rmtree(out, ignore_errors=True)

    texts = stdlib_text(9 if quick else 20)
    train, held_out = Bytes(texts[:-1], length, per_file), Bytes(texts[-1:], length, 3)
    print(
        f"data: {len(train)} training sequences of {length} bytes from {len(texts) - 1} "
        f"standard-library files; 3 held out from {texts[-1][0]}"
    )

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=256,
        n_positions=length,
        n_embd=width,
        n_layer=2,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)

    # 1. train: statistics + noise scale on the logging steps, written as metrics.jsonl
    nnstat_args = NNStatArguments(
        "store",
        root_dir=str(out),
        rank=8,
        text_fn=as_text,
        callback_options={"noise_scale_every": 1, "stats": ["l2", "rms", "nonfinite"]},
    )
    args = TrainingArguments(
        output_dir=str(out / "trainer"),
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        max_steps=steps,
        logging_steps=4 if quick else 10,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=16,
        learning_rate=3e-3,
        disable_tqdm=True,
        seed=0,
    )
    trainer = patch_trainer(Trainer)(
        nnstat_args=nnstat_args,
        model=model,
        args=args,
        train_dataset=train,
        callbacks=[JsonlCallback(out / "runs" / "train")],
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "noise_scale/b_simple" in h]
    last = logged[-1]
    print(
        f"callback: step {last['step']} loss {last['loss']:.3f}, noise scale "
        f"B_simple {last['noise_scale/b_simple']:.1f} (max_grad_norm={args.max_grad_norm})"
    )

    # 2. the noise scale at the trained weights, from fresh batches (two batch sizes)
    model.eval()
    result = nnstat.noise_scale(
        model,
        next_byte_loss,
        ({"input_ids": train.x}, train.x),
        small_batch=4,
        big_batch=16 if quick else 64,
        n_estimates=4 if quick else 16,
    )
    low, high = result.interval
    print(
        f"noise_scale: B_simple {result.b_simple:.1f} "
        f"(95% interval {low:.1f} to {high:.1f}, {result.n_estimates} estimates)"
    )

    # 3. a store of every training sequence (EK-FAC, rank-8 projection), texts beside it
    run = trainer.extract_log()
    print(f"store: {run.path} ({len(train)} sequences)")

    # 4. influence of the training sequences on the held-out ones, queries saved with texts
    top = trainer.influence(held_out, top_k=2, preconditioner="ekfac")
    for q, (ids, scores) in enumerate(zip(top.helpful_ids, top.helpful_scores, strict=True)):
        query = as_text(held_out[q]).replace("\n", "\\n")[:40]
        best = as_text(train[int(ids[0])]).replace("\n", "\\n")[:40]
        print(
            f"query {q} {query!r}: most helpful #{ids[0]} {best!r} "
            f"(score {float(scores[0]):.3g})"
        )
    print(f"open it: nnstat view {out}")


if __name__ == "__main__":
    main()
