"""End to end on a tiny nanoGPT-style transformer: ``wpe`` looked up on ``torch.arange(T)``
(no batch dimension), ``wte`` tied to ``lm_head``, and an ``nn.MultiheadAttention`` block.

The plain workflow (setup, watch, run blocks, finalize, query blocks) logs every module, and
``compute_influence_all`` equals a brute-force reference built from ``torch.func`` per-sample
gradients in float64 (the ``raw`` preconditioner: each module's damped Fisher of the logged
rows). The tied weight is one module of the store and of its K-FAC statistics, whose factors
count both of its uses."""

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


def tied_kfac(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K-FAC factors of the tied weight (docs/capture.md: its two uses are positions of one
    layer), in lm_head's orientation ``[V, D]``: ``A = (1/#positions) Σ a aᵀ`` over lm_head's
    inputs and wte's output gradients, ``S = (1/N) Σ b bᵀ`` over the logits' gradients and
    wte's one-hot tokens. Built from plain hooks on an unwatched forward."""
    seen = {}
    hooks = [
        model.lm_head.register_forward_hook(lambda m, i, o: seen.update(h=i[0], logits=o)),
        model.wte.register_forward_hook(lambda m, i, o: seen.update(emb=o)),
    ]
    logits = model(ids)
    for h in hooks:
        h.remove()
    seen["logits"].retain_grad()
    seen["emb"].retain_grad()
    lm_loss(logits, ids).backward()
    model.zero_grad()
    h = seen["h"].detach().reshape(-1, D)
    emb_grad = seen["emb"].grad.reshape(-1, D)
    logit_grad = seen["logits"].grad.reshape(-1, V)
    a = torch.cat([h, emb_grad])
    counts = torch.bincount(ids.flatten(), minlength=V).double()
    s = (logit_grad.T @ logit_grad + torch.diag(counts)) / len(ids)
    return a.T @ a / len(a), s


def test_nanogpt_store_influence_matches_torch_func(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT().double()
    gen = torch.Generator().manual_seed(1)
    train = torch.randint(0, V, (N_TRAIN, T), generator=gen)
    query = torch.randint(0, V, (3, T), generator=gen)
    run = nnstat.init(project="gpt", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac"})
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
    # the tied weight is one module of the store and of its statistics, never two
    store = nnstat.GradientStore(tmp_path / "gpt")
    assert [m["name"] for m in store.modules] == names
    stats = store.statistics()
    assert not any(k.startswith("wte/") for k in stats)
    a_ref, s_ref = tied_kfac(model, train)
    for got, want_f in (
        (stats["lm_head/forward/covariance"], a_ref),
        (stats["lm_head/backward/covariance"], s_ref),
    ):
        torch.testing.assert_close(
            got.double(), want_f, rtol=0, atol=1e-5 * want_f.abs().max().item()
        )
    scale = want.abs().max().item()
    torch.testing.assert_close(result.scores.double(), want, rtol=1e-3, atol=1e-4 * scale)
