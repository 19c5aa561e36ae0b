"""Embeddings with ``padding_idx`` and masked positions, and eval-mode dropout on a shared output.

References are independent of the engine: per-sample gradients by ``torch.func`` (``vmap(grad)``)
of each sample's own loss, where a masked position's embedding output is detached (the mask's
meaning: that position gives the weight no gradient), and one-hot matrices built by hand.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.capture import CaptureEngine
from nnstat.gradient_noise.persample import batch_grad_sq


class Pooled(nn.Module):
    """Token embedding (``padding_idx=0``) pooled over every position, padded ones included, so
    a padded position's output gradient is not zero: only its index says it has none."""

    def __init__(self, vocab: int, dim: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.head = nn.Linear(dim, 3)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
        e = self.emb(ids)
        if keep is not None:  # the reference's mask: a masked position gives no weight gradient
            e = torch.where(keep.unsqueeze(-1), e, e.detach())
        return self.head(torch.tanh(e).mean(1))


def _data(vocab: int, t: int, n: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, t), generator=g)
    ids[:, -2:] = 0  # trailing padding in every sample, and more at random
    ids[0, 0] = 0
    keep = torch.rand(n, t, generator=g) > 0.3
    return ids, torch.randint(0, 3, (n,), generator=g), keep


def _reference(model: nn.Module, ids, y, keep=None) -> dict[str, torch.Tensor]:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def own_loss(p, xi, yi, ki):
        out = functional_call(model, p, (xi[None], None if ki is None else ki[None]))
        return F.cross_entropy(out, yi[None])

    dims = (None, 0, 0, None if keep is None else 0)
    return vmap(grad(own_loss), in_dims=dims)(params, ids, y, keep)


# (vocab, positions): t * t > vocab materialises the per-sample gradient, else the Gram form
SIZES = [(10, 6), (50, 5)]


@pytest.mark.parametrize("vocab, t", SIZES)
@pytest.mark.parametrize("masked", [False, True])
def test_embedding_per_sample_grads_and_norms_skip_padded_and_masked_positions(vocab, t, masked):
    torch.manual_seed(0)
    model = Pooled(vocab)
    ids, y, keep = _data(vocab, t)
    ref = _reference(model, ids, y, keep if masked else None)["emb.weight"]
    assert ref[:, 0].abs().max() == 0  # torch: the padding row gets no gradient
    engine = CaptureEngine()
    engine.watch(model)
    caps = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap}))
    with engine.batch(loss_reduction="mean", mask=keep if masked else None):
        F.cross_entropy(model(ids), y).backward()
    cap = caps["emb"]
    got = cap.per_sample_grads_by_param()["weight"]
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    want = ref.flatten(1).double().pow(2).sum(1)
    torch.testing.assert_close(cap.per_sample_sq_norm().double(), want, rtol=1e-5, atol=1e-9)
    # the batch gradient from the capture (the noise scale's DDP path)
    total = ref.double().sum(0).pow(2).sum()
    torch.testing.assert_close(batch_grad_sq(cap).double(), total, rtol=1e-5, atol=1e-9)
    # unmasked positions (padded ones count: their rows are zero one-hots)
    assert cap.num_positions == (int(keep.sum()) if masked else ids.numel())
    engine.unwatch()


def _onehot(ids: torch.Tensor, vocab: int, keep: torch.Tensor) -> torch.Tensor:
    """``[N*T, V]`` one-hot rows by hand, zero where the position is padded or masked."""
    rows = torch.zeros(ids.numel(), vocab)
    for r, (i, k) in enumerate(zip(ids.flatten().tolist(), keep.flatten().tolist(), strict=True)):
        if i != 0 and k:
            rows[r, i] = 1.0
    return rows


@pytest.mark.parametrize("masked", [False, True])
def test_embedding_forward_gram_counts_only_kept_positions(masked):
    torch.manual_seed(0)
    vocab, t = 9, 5
    model = Pooled(vocab)
    ids, y, keep = _data(vocab, t, seed=1)
    keep = keep if masked else torch.ones_like(keep)
    engine = CaptureEngine()
    engine.watch(model, name_filter="emb")
    caps = []
    engine.add_consumer(caps.append)
    with engine.batch(mask=keep if masked else None):
        F.cross_entropy(model(ids), y, reduction="sum").backward()
    engine.unwatch()
    (cap,) = caps
    a = _onehot(ids, vocab, keep)
    torch.testing.assert_close(cap.forward_gram(), a.T @ a)
    torch.testing.assert_close(cap.forward_sum(), a.sum(0))
    torch.testing.assert_close(cap.forward.reshape(-1, vocab), a)
    proj = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(cap.forward_gram(proj), (a @ proj.T).T @ (a @ proj.T))


@pytest.mark.parametrize("vocab, t", SIZES)
def test_noise_scale_with_padding_matches_torch_func(vocab, t):
    torch.manual_seed(1)
    model = Pooled(vocab)
    ids, y, _ = _data(vocab, t, n=16, seed=3)
    y[:] = 1  # a clear mean gradient, so |G|^2 > 0
    ref = _reference(model, ids, y)
    gns = nnstat.NoiseScale(window=1)
    assert gns.watch(model) == ["emb", "head"]
    with gns.batch():
        F.cross_entropy(model(ids), y).backward()
    n = len(ids)
    for mod in ("emb", "head"):
        flat = torch.cat([v.reshape(n, -1) for k, v in ref.items() if k.startswith(mod)], 1)
        flat = flat.double()
        mean = flat.mean(0)
        trace = float((flat - mean).pow(2).sum() / (n - 1))
        g_sq = float(mean.pow(2).sum()) - trace / n
        got = gns.layer_estimates()[mod]
        assert got == pytest.approx((g_sq, trace), rel=1e-4, abs=1e-9), mod
    gns.unwatch()


class SharedDropout(nn.Module):
    """A position embedding fed ``[1, T]`` ids; dropout on its shared output before the add."""

    def __init__(self, functional: bool) -> None:
        super().__init__()
        self.tok = nn.Embedding(10, 4)
        self.pos = nn.Embedding(6, 4)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4, 3)
        self.functional = functional

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        p = self.pos(torch.arange(ids.shape[1])[None])
        if self.functional:
            p = F.dropout(p, p=0.5, training=self.training)
        else:
            p = self.drop(p)
        return self.head(torch.tanh(self.tok(ids) + p).mean(1))


@pytest.mark.parametrize("functional", [False, True])
def test_eval_mode_dropout_on_a_shared_output_keeps_it_per_sample(functional):
    """In eval mode dropout is the identity: the shared output stays expanded and ``pos`` gets
    each sample's exact gradient. In training mode (a mask drawn per call) it is left out."""
    torch.manual_seed(0)
    model = SharedDropout(functional).eval()
    ids, y = torch.randint(0, 10, (4, 6)), torch.randint(0, 3, (4,))
    engine = CaptureEngine()
    names = engine.watch(model)
    caps = {}
    engine.add_consumer(lambda cap: caps.update({cap.name: cap.per_sample_grads_by_param()}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left out, nothing to warn about
        with engine.batch(samples="input"):
            F.cross_entropy(model(ids), y, reduction="sum").backward()
    assert set(caps) == set(names) and engine.left_out == {}

    def own_loss(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None], reduction="sum")

    params = {k: v.detach() for k, v in model.named_parameters()}
    ref = vmap(grad(own_loss), in_dims=(None, 0, 0))(params, ids, y)
    for name in names:
        for k, got in caps[name].items():
            torch.testing.assert_close(got, ref[f"{name}.{k}"], rtol=1e-5, atol=1e-6)
    model.train()
    caps.clear()
    with pytest.warns(UserWarning, match="'pos'"):
        with engine.batch(samples="input"):
            F.cross_entropy(model(ids), y, reduction="sum").backward()
    assert "pos" in engine.left_out and "pos" not in caps
    engine.unwatch()
