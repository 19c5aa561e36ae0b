"""HuggingFace Trainer: layer statistics through `report_to`, then influence with the
LogIX-style `patch_trainer` workflow, on a tiny GPT-2 built from a config (no download).

    python examples/hf_trainer.py
    NNSTAT_EXAMPLE_QUICK=1 python examples/hf_trainer.py

The data is a toy language: each sequence counts upwards modulo the vocabulary from a random
start, except a few "noisy" sequences of random tokens. After training, the noisy sequences
should have the largest self-influence, and the training sequences most helpful to a test
sequence should share its pattern.
"""

from __future__ import annotations

import os
import tempfile

import torch
from nnstat.integrations.huggingface import NNStatArguments, NNStatCallback, patch_trainer
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

QUICK = os.environ.get("NNSTAT_EXAMPLE_QUICK", "") not in ("", "0")
VOCAB, LENGTH = 32, 12


class Counting(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int, noisy: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        step = torch.randint(1, 3, (n, 1), generator=g)
        self.x = (start + step * torch.arange(LENGTH)) % VOCAB
        self.noisy = list(range(noisy))
        self.x[:noisy] = torch.randint(0, VOCAB, (noisy, LENGTH), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.x[i]
        return {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def main() -> None:
    out = tempfile.mkdtemp(prefix="nnstat-hf-")
    os.environ.setdefault("TENSORBOARD_LOGGING_DIR", os.path.join(out, "tensorboard"))
    train = Counting(64 if QUICK else 512, seed=0, noisy=4 if QUICK else 16)
    model = tiny_gpt2()
    args = TrainingArguments(
        output_dir=out,
        max_steps=6 if QUICK else 300,
        per_device_train_batch_size=16,
        learning_rate=3e-3,
        logging_steps=2 if QUICK else 25,
        report_to="tensorboard",
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=QUICK,
        per_device_eval_batch_size=64,
    )
    # 1. statistics during training, reported through TensorBoard with the Trainer's own logs
    callback = NNStatCallback(stats=["l2", "rms"])
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[callback])
    trainer.train()
    logged = [h for h in trainer.state.log_history if "noise_scale/b_simple" in h]
    name = "transformer.h.0.attn.c_attn.weight"
    for h in logged[-3:]:
        print(
            f"step {h['step']}: loss {h['loss']:.3f}  trust_ratio({name}) "
            f"{h[f'trust_ratio/{name}']:.1f}  B_simple {h['noise_scale/b_simple']:.1f}"
        )
    print(f"TensorBoard: tensorboard --logdir {os.environ['TENSORBOARD_LOGGING_DIR']}")

    # 2. influence: log projected per-sample gradients of the training set, then score queries
    NNStatTrainer = patch_trainer(Trainer)
    nnstat_args = NNStatArguments(project="counting", root_dir=out, rank=8, track=False)
    analysis = NNStatTrainer(nnstat_args=nnstat_args, model=model, args=args, train_dataset=train)
    analysis.extract_log()
    test = Counting(4, seed=1)
    top = analysis.influence(test, top_k=3)
    for q, test_id in enumerate(top.test_ids):
        print(f"test sequence {test.x[test_id].tolist()}")
        for j in top.helpful_ids[q]:
            print(f"    helped by training #{j}: {train.x[j].tolist()}")
    self_inf = analysis.self_influence()
    ranked = self_inf.scores.argsort(descending=True)[: len(train.noisy)].tolist()
    found = sorted(set(ranked) & set(train.noisy))
    print(
        f"{len(found)} of the {len(train.noisy)} random (noisy) training sequences have the "
        f"highest self-influence"
    )


if __name__ == "__main__":
    main()
