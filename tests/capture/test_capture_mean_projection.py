"""Projected rows under ``loss_reduction="mean"``: the capture multiplies the output gradients
by the batch size so each row is the gradient of the sample's own loss. That factor is applied
to the projected rows (``[N, T, r]``), never to the output gradients themselves (``[N, T, d]``,
GPT-2's logits gradient: 0.8 GB per batch). Checked on a batch size that is not a power of two
(where the two orders round differently) against ``torch.func`` per-sample gradients of each
sample's own loss, for a sequence Linear, a LayerNorm, a one-position Linear and an embedding
tied to the output head; and by counting, on the same model, the scalar multiplications and
concatenations as large as an output gradient that capturing and projecting add beside the plain
backward (none). The capture's statistics (per-sample squared norms, output-gradient sums,
Grams and squared sums) likewise multiply their results, not the gradients: a mean-reduced loss
gives the sum-reduced loss's statistics, and the per-sample norms equal ``torch.func``'s. So do
the batch gradients (``batch_grad``, the DDP noise scale's per-step input), which on a device
read nothing back: an embedding's positions are masked arithmetically, not selected."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import nnstat

V, D, T, N, R_OUT, R_IN = 50, 16, 5, 3, 3, 2


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.ln = nn.LayerNorm(D)
        self.mid = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.ln(self.wte(ids))
        return self.lm_head(x + torch.tanh(self.mid(x)))


def _sample_loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.square().sum() / 7 + logits[..., 0].sum()


class LargeWrites(TorchDispatchMode):
    """Records the scalar multiplications (one tensor operand) and concatenations whose output
    holds at least `size` elements: what rescaling or joining output gradients takes."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size, self.ops = size, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        tensors = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor) and a.dim()]
        if (name == "mul" and len(tensors) == 1) or name == "cat":
            if any(t.numel() >= self.size for t in tree_flatten(out)[0]):
                self.ops.append(name)
        return out


def _captured(model: nn.Module, ids: torch.Tensor, projections: dict, watch: bool = True):
    """(captures, rows, large writes) of one mean-loss backward and its projections."""
    engine = nnstat.CaptureEngine()
    caps: dict[str, object] = {}
    if watch:
        engine.watch(model)
        engine.add_consumer(lambda c: caps.update({c.name: c}))
    # outputs of D elements per position or more: every output gradient, never a projection
    mode = LargeWrites(N * T * D)
    with mode:
        with engine.batch(loss_reduction="mean"):
            (_sample_loss(model(ids)) / ids.shape[0]).backward()
        rows = {k: caps[k].project(*projections[k]) for k in caps}
    engine.unwatch()
    model.zero_grad(set_to_none=True)
    return caps, rows, mode.ops


def _per_sample(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}
    return vmap(
        grad(lambda p, x: _sample_loss(functional_call(model, p, (x[None],)))),
        in_dims=(None, 0),
    )(params, ids)


def test_mean_loss_rows_are_each_samples_own_projected_gradient_and_output_grads_stay_unscaled():
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    proj = {
        "lm_head": (torch.randn(R_IN, D, generator=g), torch.randn(R_OUT, V, generator=g)),
        "mid": (torch.randn(R_IN, D + 1, generator=g), torch.randn(R_OUT, D, generator=g)),
        "ln": (torch.randn(R_IN, 2 * D, generator=g),),
    }
    caps, rows, large = _captured(model, ids, proj)
    assert sorted(caps) == ["lm_head", "ln", "mid"]  # wte is captured under lm_head
    ps = _per_sample(model, ids)
    w_mid = torch.cat([ps["mid.weight"], ps["mid.bias"][..., None]], -1)  # [N, D, D + 1]
    want = {
        "lm_head": proj["lm_head"][1] @ ps["wte.weight"] @ proj["lm_head"][0].T,
        "mid": proj["mid"][1] @ w_mid @ proj["mid"][0].T,
        "ln": torch.cat([ps["ln.weight"], ps["ln.bias"]], -1) @ proj["ln"][0].T,
    }
    for name, w in want.items():
        w = w.reshape(N, -1)
        tol = dict(rtol=1e-5, atol=1e-5 * w.abs().max().item())
        torch.testing.assert_close(rows[name], w, **tol)

    # beside the plain backward, capturing and projecting neither rescales nor joins anything
    # of an output gradient's size (the old code scaled wte's, mid's and ln's [N, T, D] and
    # the head's [N, T, V] gradients, and joined the tied pair's)
    _, _, plain = _captured(model, ids, {}, watch=False)
    assert large == plain, (large, plain)


def test_mean_loss_rows_of_one_position_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, 4))
    x = torch.randn(N, D)
    g = torch.Generator().manual_seed(3)
    proj = {"0": (torch.randn(R_IN, D + 1, generator=g), torch.randn(R_OUT, 8, generator=g))}
    engine = nnstat.CaptureEngine()
    engine.watch(model, name_filter="0")
    caps = []
    engine.add_consumer(caps.append)
    with engine.batch(loss_reduction="mean"):
        model(x).square().sum(1).mean().backward()
    engine.unwatch()
    params = {k: v.detach() for k, v in model.named_parameters()}
    ps = vmap(
        grad(lambda p, xi: functional_call(model, p, (xi[None],)).square().sum()),
        in_dims=(None, 0),
    )(params, x)
    w = torch.cat([ps["0.weight"], ps["0.bias"][..., None]], -1)
    want = (proj["0"][1] @ w @ proj["0"][0].T).reshape(N, -1)
    torch.testing.assert_close(caps[0].project(*proj["0"]), want, rtol=1e-5, atol=1e-6)


def _stats(model: nn.Module, ids: torch.Tensor, reduction: str) -> dict[str, dict]:
    engine = nnstat.CaptureEngine()
    engine.watch(model)
    out: dict[str, dict] = {}

    def keep(c) -> None:
        stats = {"sq_norm": c.per_sample_sq_norm(), "sum": c.backward_sum()}
        stats["gram"], stats["sq_sum"] = c.backward_gram(), c.backward_sq_sum()
        stats["proj_gram"] = c.backward_gram(torch.ones(2, c.d_out) / c.d_out)
        out[c.name] = stats

    engine.add_consumer(keep)
    with engine.batch(loss_reduction=reduction):
        loss = _sample_loss(model(ids))
        (loss / ids.shape[0] if reduction == "mean" else loss).backward()
    engine.unwatch()
    model.zero_grad(set_to_none=True)
    return out


def test_mean_loss_statistics_equal_the_summed_losses_and_per_sample_norms_torch_funcs():
    # the factor multiplies each statistic (squared where the statistic is quadratic in the
    # output gradients), so a mean-reduced loss gives the sum-reduced loss's numbers
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(4))
    mean, total = _stats(model, ids, "mean"), _stats(model, ids, "sum")
    assert sorted(mean) == ["lm_head", "ln", "mid"]
    for name in mean:
        for key, got in mean[name].items():
            want = total[name][key]
            tol = dict(rtol=1e-5, atol=1e-6 * want.abs().max().item())
            torch.testing.assert_close(got, want, **tol, msg=f"{name} {key}")
    ps = _per_sample(model, ids)
    sq = {k: v.reshape(N, -1).square().sum(1) for k, v in ps.items()}
    want = {
        "lm_head": sq["wte.weight"],
        "ln": sq["ln.weight"] + sq["ln.bias"],
        "mid": sq["mid.weight"] + sq["mid.bias"],
    }
    for name, w in want.items():
        torch.testing.assert_close(mean[name]["sq_norm"], w, rtol=1e-4, atol=0.0)


def test_batch_gradients_equal_the_summed_per_sample_gradients():
    # Σ_i G_i from one product over all positions, the mean-loss factor on the result; the
    # tied weight's from its parts (both uses), the embedding's by a scatter
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(6))
    engine = nnstat.CaptureEngine()
    engine.watch(model)
    got = {}
    engine.add_consumer(lambda c: got.update({c.name: c.batch_grad()}))
    with engine.batch(loss_reduction="mean"):
        (_sample_loss(model(ids)) / N).backward()
    engine.unwatch()
    ps = {k: v.sum(0) for k, v in _per_sample(model, ids).items()}
    want = {
        "lm_head": ps["wte.weight"],
        "ln": torch.cat([ps["ln.weight"], ps["ln.bias"]]),
        "mid": torch.cat([ps["mid.weight"], ps["mid.bias"][:, None]], 1),
    }
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-5 * w.abs().max().item())


def test_an_embeddings_batch_gradient_reads_nothing_back_on_a_device():
    # the DDP noise scale's per-step path: no boolean-mask selection of the positions with a
    # gradient (its size is data-dependent: a host sync on an accelerator), checked on meta
    from _ledger import DeviceLedger

    from nnstat.gradient_noise.persample import batch_grad_sq

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, 2))
    ids = torch.zeros(N, T, dtype=torch.long, device="meta")
    mask = torch.ones(N, T, device="meta")
    engine = nnstat.CaptureEngine()
    engine.watch(model)
    ledger = DeviceLedger()
    sizes = []

    def consume(cap) -> None:
        with ledger:
            sizes.append(tuple(batch_grad_sq(cap).shape))

    engine.add_consumer(consume)
    with engine.batch(mask=mask, loss_reduction="mean"):
        model(ids).sum().backward()
    engine.unwatch()
    assert sizes == [(), ()] and ledger.sync_ops == [] and ledger.reads == 0
