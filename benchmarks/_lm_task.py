"""The transformer task of `influence_quality.py`: a one-layer causal character transformer.

Text that needs no download: the source of a standard-library module (``textwrap.py`` by
default), lowercased, whitespace runs collapsed to one space, characters outside a small
alphabet mapped to one "other" symbol. Examples are non-overlapping windows of ``context + 1``
characters in a seeded random order: the first ``n_train`` train, the next ``n_query`` are the
held-out queries. An example's loss is its mean next-character cross-entropy over the window
(`lm_loss`). The corpus depends on the Python version, so its sha256 is reported.

The model (`CharTransformer`): token and position embeddings (the positions looked up as
``[B, T]`` ids), one causal self-attention block (``nn.Linear`` q/k/v and output projection) on
the residual stream, optionally a GELU MLP (``--lm-mlp``), and a linear head; no LayerNorm (its
scale invariance under weight decay made L-BFGS crawl). Every training run (the scored model and
each LDS retraining) starts from the same initialisation (seed ``--lm-init-seed``), so a
retrained subset lands in the basin the influence of the scored model describes rather than in
a permuted copy of it.

Continuous symmetries: rotating the residual stream (embeddings, q/k/v input, output projection,
head), or one head's q and k together, or its v and its slice of the output projection,
changes neither the loss nor ‖θ‖². At a stationary point of loss + wd/2‖θ‖² each one that
moves θ is a zero eigenvalue of ``H + wd·I`` orthogonal to every example's gradient. The group
has `rotation_dimension` dimensions; fewer move θ where weight decay has left dimensions of the
residual stream or of a head unused (rotations among them change nothing).
"""

from __future__ import annotations

import hashlib
import math
import re
import sysconfig
from pathlib import Path

import numpy as np
import torch
from torch import nn

ALPHABET = "abcdefghijklmnopqrstuvwxyz .,_()'="
OTHER = "~"  # every character outside ALPHABET (digits, +, /, ...)


def stdlib_text(module: str = "textwrap") -> str:
    """The source text of a standard-library module, read from the interpreter's own files."""
    return (Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py").read_text(encoding="utf-8")


def encode(text: str) -> tuple[torch.Tensor, str]:
    """Character ids of the normalised text and the vocabulary (the characters present)."""
    text = re.sub(r"\s+", " ", text.lower())
    text = "".join(c if c in ALPHABET else OTHER for c in text)
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([index[c] for c in text]), vocab


def windows(ids: torch.Tensor, context: int, n_train: int, n_query: int, seed: int = 0):
    """``(inputs, targets)`` for training and queries: ``[n, context]`` each, targets shifted."""
    n = len(ids) // (context + 1)
    if n < n_train + n_query:
        raise ValueError(
            f"the text has {n} windows of {context + 1} characters, fewer than "
            f"n_train + n_query = {n_train + n_query}: lower them or the context"
        )
    w = ids[: n * (context + 1)].view(n, context + 1)
    w = w[torch.as_tensor(np.random.default_rng(seed).permutation(n))]
    x, y = w[:, :-1].contiguous(), w[:, 1:].contiguous()
    return (x[:n_train], y[:n_train]), (
        x[n_train : n_train + n_query],
        y[n_train : n_train + n_query],
    )


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
    """Per window: the mean next-character cross-entropy over its positions; then reduced over
    windows (``"mean"``, ``"sum"`` or ``"none"``). ``logits [B, T, V]``, ``targets [B, T]``."""
    per_token = nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    per_window = per_token.view(targets.shape).mean(-1)
    if reduction == "none":
        return per_window
    return per_window.sum() if reduction == "sum" else per_window.mean()


class CharTransformer(nn.Module):
    """One pre-norm transformer layer over characters; ``forward(ids [B, T]) -> logits
    [B, T, V]``."""

    def __init__(self, vocab: int, context: int, d: int, heads: int, mlp: int) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"d_model {d} must be a multiple of heads {heads}")
        self.heads = heads
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = mlp
        if mlp:
            self.fc1 = nn.Linear(d, mlp)
            self.fc2 = nn.Linear(mlp, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        # [B, T] position ids: the layout nnstat's capture takes for every embedding today
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device).expand(b, t))
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # [B, H, T, dh]
        att = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).triu(1)
        att = att.masked_fill(causal, float("-inf")).softmax(-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))
        if self.mlp:
            x = x + self.fc2(nn.functional.gelu(self.fc1(x)))
        return self.head(x)


def rotation_dimension(d: int, heads: int) -> int:
    """Dimension of the rotation symmetries above: so(d) for the residual stream (with an MLP
    its input and output rotate with the stream as well), and per head so(d/h) twice."""
    dh = d // heads
    return d * (d - 1) // 2 + 2 * heads * dh * (dh - 1) // 2


def make_lm(args):
    """``(describe, make_model, train, query, info)`` of the task from the command line."""
    text = stdlib_text(args.lm_text)
    ids, vocab = encode(text)
    train, query = windows(ids, args.lm_context, args.n_train, args.n_query)
    shape = (len(vocab), args.lm_context, args.lm_d, args.lm_heads, args.lm_mlp)

    def make_model() -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(args.lm_init_seed)
            return CharTransformer(*shape)

    n_params = sum(p.numel() for p in make_model().parameters())
    describe = (
        f"stdlib {args.lm_text}.py, char transformer (1 layer, d {args.lm_d}, {args.lm_heads} "
        f"heads, MLP {args.lm_mlp}, context {args.lm_context}, vocabulary {len(vocab)}; "
        f"{n_params} parameters)"
    )
    info = {
        "text": f"{args.lm_text}.py",
        "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "characters": len(ids),
        "vocabulary": vocab,
        "rotation_dimension": rotation_dimension(args.lm_d, args.lm_heads),
    }
    return describe, make_model, train, query, info


def add_arguments(ap) -> None:
    ap.add_argument("--lm-text", default="textwrap", help="lm: stdlib module whose source is read")
    ap.add_argument("--lm-context", type=int, default=16, help="lm: characters per window")
    ap.add_argument("--lm-d", type=int, default=16, help="lm: model width")
    ap.add_argument("--lm-heads", type=int, default=2, help="lm: attention heads")
    ap.add_argument("--lm-mlp", type=int, default=0, help="lm: MLP hidden width (0: none)")
    ap.add_argument("--lm-init-seed", type=int, default=0, help="lm: the one initialisation")
