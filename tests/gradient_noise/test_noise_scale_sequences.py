"""Per-sample squared norms of layers over sequences: the two Grams' dot or the per-sample
matrices, whichever takes fewer multiply-adds, summed over the batch without per-sample values.

``‖Σ_t b_t a_tᵀ‖² = Σ_{t,s} (a_t·a_s)(b_t·b_s)`` costs ``T² (d_in + d_out)`` multiply-adds per
sample against ``T d_in d_out`` for forming ``G_i``: at GPT-2 small's T = 512 the qkv and MLP
layers take the Grams and the attention output projection (768 x 768) the matrices. Checked
against ``torch.func`` per-sample gradients on CPU, and on ``meta`` at GPT-2 small's shapes: the
kernels and bytes the noise scale adds per transformer layer, the path each layer takes, and no
host read inside the block.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from _ledger import DeviceLedger
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_flatten

import nnstat
from nnstat.capture.matrix import gram_is_cheaper
from nnstat.gradient_noise.persample import PerSampleNorms


class Seq(nn.Module):
    """A wide layer (takes the Grams at T = 16) then a narrow one (takes the matrices)."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.wide = nn.Linear(64, 96, bias=bias)
        self.narrow = nn.Linear(96, 8, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.narrow(torch.tanh(self.wide(x)))


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[dict, dict]:
    """``mean_i |g_i|^2`` and ``|mean_i g_i|^2`` per module from ``vmap(grad)``."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        return (functional_call(model, p, (xi[None],)) - yi[None]).square().mean()

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    small, big = collections.defaultdict(float), collections.defaultdict(float)
    for k, g in per.items():
        module = k.rsplit(".", 1)[0]
        g = g.double().flatten(1)
        small[module] += float(g.square().sum(1).mean())
        big[module] += float(g.mean(0).square().sum())
    return small, big


@pytest.mark.parametrize("bias", [True, False])
def test_sequence_norms_match_torch_func_on_both_paths(bias):
    torch.manual_seed(0)
    model = Seq(bias)
    n, t = 6, 16  # T > sqrt(d): still the Grams for the wide layer, not for the narrow one
    assert gram_is_cheaper(t, 64 + bias, 96) and not gram_is_cheaper(t, 96 + bias, 8)
    x, y = torch.randn(n, t, 64), torch.randn(n, t, 8)
    norms = PerSampleNorms(model)
    with norms.batch():
        (model(x) - y).square().mean().backward()
    small, big = norms.last[0], norms.last[1]
    ref_small, ref_big = _reference(model, x, y)
    for name in ("wide", "narrow"):
        assert small[name] == pytest.approx(ref_small[name], rel=1e-4)
        assert big[name] == pytest.approx(ref_big[name], rel=1e-4)
    norms.close()


@pytest.mark.parametrize("masked", [False, True])
def test_capture_sums_match_per_sample_norms_of_each_path(masked):
    from nnstat.capture.norms import sq_norm_sums

    torch.manual_seed(1)
    model = Seq(True)
    engine = nnstat.CaptureEngine()
    engine.watch(model)
    caps: list = []
    engine.add_consumer(caps.append)
    x = torch.randn(5, 16, 64)
    keep = (torch.rand(5, 16) > 0.3).float() if masked else None  # the bias's ones: kept rows
    with engine.batch(mask=keep):
        model(x).square().mean().backward()
    parts = dict(zip([c.name for c in caps], sq_norm_sums(caps), strict=True))
    # the wide layer: the Grams' dot and its bias term; the narrow one: G_i and Σ_t b_t
    assert [(len(t), len(v)) for t, v, _ in (parts["wide"], parts["narrow"])] == [(0, 2), (2, 0)]
    for cap in caps:
        tensors, values, c = parts[cap.name]
        total = c * (
            sum(float(t.double().square().sum()) for t in tensors) + sum(map(float, values))
        )
        want = float(cap.per_sample_grad().double().square().sum())
        assert total == pytest.approx(want, rel=1e-5)


class Inside(nn.Module):
    """``Seq``'s layers on ``[B, T, 64]`` sequences laid out inside as ``"batch"``-first, as
    ``"flat"`` rows ``[B*T, 64]`` or ``"seq"``-first ``[T, B, 64]``."""

    def __init__(self, layout: str) -> None:
        super().__init__()
        self.seq, self.layout = Seq(True), layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "flat":
            return self.seq(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:2], -1)
        if self.layout == "seq":
            return self.seq(x.transpose(0, 1)).transpose(0, 1)
        return self.seq(x)


@pytest.mark.parametrize("layout", ["flat", "seq"])
def test_rows_that_are_positions_not_samples_are_reported(layout):
    """Every module agrees on 24 ("flat") or 4 ("seq") rows for 6 sequences: no module check
    sees it, and the per-sample norms were per position (B_simple 25.0 against 6.9 of the
    sequences on one such batch), without a word. Now a warning names the modules, both
    counts and the fix; batch-first, the same layers match torch.func over the sequences."""
    torch.manual_seed(0)
    x, y = torch.randn(6, 4, 64), torch.randn(6, 4, 8)
    model = Inside(layout)
    norms = PerSampleNorms(model)
    with pytest.warns(UserWarning, match="rows in dim 0 where the block holds 6 samples") as seen:
        with norms.batch(loss_reduction="sum"):
            (model(x) - y).square().sum().backward()
    msg = str(next(w.message for w in seen if "rows in dim 0" in str(w.message)))
    assert f"each saw {24 if layout == 'flat' else 4} rows" in msg
    assert "'seq.wide', 'seq.narrow'" in msg and "batch_first=True" in msg
    norms.close()
    model.layout = "batch"
    norms = PerSampleNorms(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rows are the samples: nothing to report
        with norms.batch(loss_reduction="sum"):
            (model(x) - y).square().sum().backward()
    ref_small, ref_big = _reference(model.seq, x, y)
    for name in ("wide", "narrow"):  # the reference's loss is the mean over 4·8 positions
        assert norms.last[0][f"seq.{name}"] == pytest.approx(ref_small[name] * 32**2, rel=1e-4)
        assert norms.last[1][f"seq.{name}"] == pytest.approx(ref_big[name] * 32**2, rel=1e-4)
    norms.close()


D, T, N = 768, 512, 8  # GPT-2 small's width, sequence length and batch


class Layers(nn.Module):
    """GPT-2 small's per-layer linear maps (qkv, attention output, MLP in and out) over
    ``[N, T, D]`` rows; LayerNorms, embeddings and the head are left out (their own paths)."""

    def __init__(self, layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                dict(
                    c_attn=nn.Linear(D, 3 * D),
                    c_proj=nn.Linear(D, D),
                    c_fc=nn.Linear(D, 4 * D),
                    mlp_proj=nn.Linear(4 * D, D),
                )
            )
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            q, k, v = b["c_attn"](x).split(D, dim=-1)
            x = x + b["c_proj"](torch.tanh(q * k) * v)
            x = x + b["mlp_proj"](nn.functional.gelu(b["c_fc"](x)))
        return x


class Traffic(DeviceLedger):
    """Non-view ops, the bytes of their operands and results (an upper bound on memory
    traffic), and the shapes of the batched GEMMs' results, on top of the host-read ledger."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.bytes = 0
        self.bmm: collections.Counter[tuple[int, ...]] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if not func.is_view:
            self.ops += 1
            tensors = [
                t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)
            ]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            if func.overloadpacket.__name__ == "bmm":
                self.bmm[tuple(out.shape)] += 1
        return out


def _block(layers: int, tracked: bool) -> Traffic:
    """The third block's counts (the first ones set up the tracker's buffers)."""
    with torch.device("meta"):
        model = Layers(layers)
    x = torch.zeros(N, T, D, device="meta")
    gns = nnstat.NoiseScale(beta=0.9)
    if tracked:
        assert len(gns.watch(model)) == 4 * layers
    for _ in range(3):
        with Traffic() as counts:
            with gns.batch() if tracked else torch.enable_grad():
                model(x).mean().backward()
            model.zero_grad(set_to_none=True)
    # each block staged its values (one vector, read when it has arrived: never, on meta)
    assert gns.n_observed == (3 if tracked else 0)
    gns.unwatch()
    return counts


def test_gpt2_small_layers_at_512_positions_take_the_cheaper_path_in_few_kernels():
    plain = {n: _block(n, False) for n in (1, 3)}
    tracked = {n: _block(n, True) for n in (1, 3)}
    per_layer = {
        what: (
            getattr(tracked[3], what)
            - getattr(plain[3], what)
            - getattr(tracked[1], what)
            + getattr(plain[1], what)
        )
        / 2
        for what in ("ops", "bytes")
    }
    # the paths: qkv, MLP in and MLP out take their rows' two [N, T, T] Grams; the attention
    # output projection (768 x 768, where T (d_in + d_out) > d_in d_out) its [N, d, d] matrices
    extra_bmm = tracked[3].bmm - plain[3].bmm
    assert extra_bmm == {(N, T, T): 3 * 2 * 3, (N, D, D): 3}, extra_bmm
    # per layer: 3 x (two Grams, their dot, the bias's sum) + 1 x (G_i, Σ_t b_t); was 4 x 7
    # (the [N] per-sample values, their scaling and mean, the ones column's copy)
    assert per_layer["ops"] <= 3 * 4 + 2, per_layer
    # bytes (float32): each Gram reads its rows (twice: two operands) and writes [N, T, T], the
    # dot reads both Grams, the bias's sum one; the matrix path reads a and b, writes G_i and
    # Σ_t b_t, which the one foreach norm reads with the layer's weight gradients (read for
    # |G_B|^2 on any path). Was 0.645 GB per layer: the ones column's copy, G_i squared and summed.
    gram = N * T * T
    rows = N * T * (3 * D + D + D + 4 * D + 4 * D + D)  # a, b of the three Gram-path layers
    grams = 2 * rows + 6 * gram + 3 * 2 * gram + 3 * gram
    matrix = 3 * N * T * D + 2 * N * D * D + 2 * N * D
    weights = 12 * D * D + 9 * D
    assert per_layer["bytes"] <= 4 * (grams + matrix + weights) * 1.01, per_layer
    for counts in tracked.values():
        assert counts.reads == 0 and counts.sync_ops == []  # the block's one read is deferred
