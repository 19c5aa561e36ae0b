"""End to end on a tiny nanoGPT-style transformer: ``wpe`` looked up on ``torch.arange(T)``
(no batch dimension), ``wte`` tied to ``lm_head``, and an ``nn.MultiheadAttention`` block.

The plain workflow (setup, watch, run blocks, finalize, query blocks) logs every module, and
``compute_influence_all`` equals a brute-force reference built from ``torch.func`` per-sample
gradients in float64 (the ``raw`` preconditioner: each module's damped Fisher of the logged
rows)."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.influence import compute_influence_all

V, D, H, T = 11, 8, 2, 5
N_TRAIN, BATCH, DAMPING = 12, 4, 1e-2


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(V, D), nn.Embedding(T, D)
        self.ln1, self.ln_f = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, H, batch_first=True)
        self.fc = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(t))  # [T] ids, broadcast over the batch
        h = self.ln1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(t, dtype=h.dtype)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return self.lm_head(self.ln_f(x + torch.tanh(self.fc(x))))


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")


def store_rows(model: nn.Module, ids: torch.Tensor, names: list[str]) -> dict:
    """{module: [n, width]} per-sequence gradients in the store's layout (docs/architecture.md:
    ``[d_out, d_in(+1)]`` row-major with the bias last, an embedding ``[D, V]``, a LayerNorm
    ``[weight, bias]``), from torch.func in float64."""

    def one(p, x):
        return lm_loss(functional_call(model, p, (x[None],)), x[None])

    params = {k: v.detach() for k, v in model.named_parameters()}
    g = vmap(grad(one), in_dims=(None, 0))(params, ids)
    n = len(ids)
    rows = {
        "wpe": g["wpe.weight"].transpose(1, 2),
        "ln1": torch.cat([g["ln1.weight"], g["ln1.bias"]], 1),
        "attn": torch.cat([g["attn.in_proj_weight"], g["attn.in_proj_bias"][..., None]], 2),
        "attn.out_proj": torch.cat(
            [g["attn.out_proj.weight"], g["attn.out_proj.bias"][..., None]], 2
        ),
        "fc": torch.cat([g["fc.weight"], g["fc.bias"][..., None]], 2),
        "ln_f": torch.cat([g["ln_f.weight"], g["ln_f.bias"]], 1),
        "lm_head": g["wte.weight"],  # the one tied parameter: both uses
    }
    assert set(rows) == set(names)
    return {k: rows[k].reshape(n, -1) for k in names}


def test_nanogpt_store_influence_matches_torch_func(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT().double()
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(0, V, (N_TRAIN, T), generator=gen)
    query = torch.randint(0, V, (3, T), generator=gen)
    run = nnstat.init(project="gpt", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing skipped, left out or stored as zeros
        names = nnstat.watch(model)
        for lo in range(0, N_TRAIN, BATCH):
            with run(data_id=list(range(lo, lo + BATCH))):
                lm_loss(model(train[lo : lo + BATCH]), train[lo : lo + BATCH]).backward()
            model.zero_grad()
        nnstat.finalize()
        nnstat.eval()
        loader = nnstat.build_log_dataloader(batch_size=8)
        with run(data_id=["q0", "q1", "q2"]):
            lm_loss(model(query), query).backward()
        model.zero_grad()
        log = nnstat.get_log()
        result = compute_influence_all(
            log, loader, preconditioner="raw", damping=DAMPING, progress=False
        )
    nnstat.unwatch()
    assert set(names) == {"wpe", "ln1", "ln_f", "attn", "attn.out_proj", "fc", "lm_head"}
    assert result.train_ids == list(range(N_TRAIN)) and result.test_ids == ["q0", "q1", "q2"]
    gt, gq = store_rows(model, train, names), store_rows(model, query, names)
    want = torch.zeros(3, N_TRAIN, dtype=torch.float64)
    for m in names:
        fisher = gt[m].T @ gt[m] / N_TRAIN
        eye = torch.eye(len(fisher), dtype=fisher.dtype)
        want += gq[m] @ torch.linalg.solve(fisher + DAMPING * eye, gt[m].T)
    scale = want.abs().max().item()
    torch.testing.assert_close(result.scores.double(), want, rtol=1e-3, atol=1e-4 * scale)
