"""Op budget of a logged batch on an accelerator: every aten op of one ``run(...)`` block
(forward, backward, projection into the staging buffer, the block's flags) of a GPT-2-shaped
model on the ``meta`` device (which takes the accelerator branch and holds no memory), counted
with a ``TorchDispatchMode``, minus the ops of the same forward+backward unlogged.

What must hold: the ops nnstat adds per transformer layer (2 LayerNorms, 4 linear layers on
``[N, T, d]`` rows) stay within 2 x 6 + 4 x 3 (was 2 x 7 + 4 x 5: a copy of every module's
projected rows into the staging buffer and a reshape per matmul); the ops per block outside
the layers (weights guard, flags, the position table's expansion, the tied head and
embedding) stay within a fixed budget; and no tensor nnstat builds is larger than the largest
of the plain pass (the logits): the tied embedding's one-hot token rows ``[N, T, V]`` and
their concatenation with the logits' gradients ``[N, 2T, V]`` are never built.
"""

from __future__ import annotations

import collections
import contextlib

import torch
from _ledger import DeviceLedger
from torch import nn
from torch.utils._pytree import tree_flatten

import nnstat

V, D, T, N = 1000, 16, 8, 4


class TinyGPT(nn.Module):
    """GPT-2's modules at small widths: token and position embeddings (the position ids
    without a batch dimension), per layer LayerNorm -> qkv -> out projection and
    LayerNorm -> MLP, a final LayerNorm and a head tied to the token embedding."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    ln_1=nn.LayerNorm(D),
                    c_attn=nn.Linear(D, 3 * D),
                    c_proj=nn.Linear(D, D),
                    ln_2=nn.LayerNorm(D),
                    c_fc=nn.Linear(D, 4 * D),
                    mlp_proj=nn.Linear(4 * D, D),
                )
            )
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            q, k, v = b["c_attn"](b["ln_1"](x)).split(D, dim=-1)
            x = x + b["c_proj"](torch.tanh(q * k) * v)
            x = x + b["mlp_proj"](nn.functional.gelu(b["c_fc"](b["ln_2"](x))))
        return self.lm_head(self.ln_f(x))


class Ops(DeviceLedger):
    """Non-view ops (what launches kernels on an accelerator) and the largest op output in
    bytes, on top of the ledger's host-read accounting (which answers meta reads)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.largest = max(self.largest, t.numel() * t.element_size())
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)[:, :-1]
    return nn.functional.cross_entropy(
        logits.reshape(-1, V), ids[:, 1:].reshape(-1), reduction="sum"
    )


def _counts(tmp_path, layers: int, logged: bool) -> Ops:
    """Ops of the third block (the first fingerprints the weights and moves the projections to
    the device), or of a plain forward+backward."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = TinyGPT(layers)
    ids = torch.zeros(N, T, dtype=torch.long, device="meta")
    if logged:
        run = nnstat.init(project=f"ops{layers}", root_dir=tmp_path)
        nnstat.setup({"statistic": "none", "rank": 4})
        assert len(nnstat.watch(model)) == 6 * layers + 3  # wte is logged under lm_head
    try:
        for b in range(3):
            with Ops() as ops:
                block = run(data_id=list(range(N * b, N * b + N))) if logged else None
                with block if block is not None else contextlib.nullcontext():
                    _loss(model, ids).backward()
                model.zero_grad(set_to_none=True)
        if logged:
            nnstat.finalize()
    finally:
        if logged:
            nnstat.unwatch()
    return ops


def test_a_logged_batch_adds_few_ops_per_layer_and_no_token_sized_tensors(tmp_path):
    plain = {n: _counts(tmp_path, n, False) for n in (1, 3)}
    logged = {n: _counts(tmp_path, n, True) for n in (1, 3)}
    extra = {n: logged[n].total - plain[n].total for n in (1, 3)}
    per_layer = (extra[3] - extra[1]) / 2
    # 2 LayerNorms x 6 (recomputed normalised input, its product with the output gradient,
    # two sums over positions, their concatenation, one GEMM into the staging buffer) and
    # 4 linear layers x 3 (P_in a, P_out b, their batched product into the staging buffer)
    assert per_layer <= 2 * 6 + 4 * 3, (per_layer, logged[3].ops - plain[3].ops)
    # outside the layers: weights guard (6), NaN/Inf flags and their read (6), staging buffer
    # and its copy (2), the final LayerNorm (6), wpe's expansion and projection (7), the tied
    # head and embedding (9)
    fixed = extra[1] - per_layer
    assert fixed <= 36, (fixed, logged[1].ops - plain[1].ops)
    # the largest tensor of the block is the plain pass's (logits / their gradient)
    assert logged[3].largest == plain[3].largest == N * T * V * 4
    for ops in logged.values():
        assert ops.reads <= 1 and ops.sync_ops == []
