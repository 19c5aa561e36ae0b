"""``NoiseScale.batch(loss_reduction=...)``: a mean and a sum loss give the same, exact estimates.

Reference: per-sample gradients by ``torch.func`` (``vmap(grad)`` of each sample's own loss),
from which ``tr(Sigma)`` is the unbiased sample covariance's trace and ``|G|^2`` the unbiased
``|mean g|^2 - tr(Sigma) / N``; neither depends on how the batch's loss was reduced.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.capture.reduction import MeanLossProbe


def _exact(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, tuple[float, float]]:
    """Per module (and ``""`` for the model): exact unbiased ``(|G|^2, tr(Sigma))``."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def own_loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(own_loss), in_dims=(None, 0, 0))(params, x, y)
    n = len(x)
    out, flats = {}, []
    for mod in ("0", "2"):
        flat = torch.cat([g[f"{mod}.{k}"].reshape(n, -1) for k in ("weight", "bias")], 1)
        flats.append(flat.double())
    for key, flat in (("0", flats[0]), ("2", flats[1]), ("", torch.cat(flats, 1))):
        mean = flat.mean(0)
        trace = float((flat - mean).pow(2).sum() / (n - 1))
        out[key] = (float(mean.pow(2).sum()) - trace / n, trace)
    return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_estimates_match_torch_func_for_either_reduction(reduction):
    model = _model()
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,)).clamp(max=1)  # a clear mean gradient
    exact = _exact(model, x, y)
    gns = nnstat.NoiseScale(window=1)
    gns.watch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the right reduction: no mismatch warning
        with gns.batch(loss_reduction=reduction):
            nn.functional.cross_entropy(model(x), y, reduction=reduction).backward()
    g_sq, trace = exact[""]
    assert g_sq > 0
    assert gns.grad_sq_norm == pytest.approx(g_sq, rel=1e-4, abs=1e-8)
    assert gns.trace_sigma == pytest.approx(trace, rel=1e-4)
    assert gns.value == pytest.approx(trace / g_sq, rel=1e-3)
    for mod, (got_g, got_t) in gns.layer_estimates().items():
        assert (got_g, got_t) == pytest.approx(exact[mod], rel=1e-4, abs=1e-8), mod
    # a second batch (no probe any more) with accumulation on .grad: the same exact values
    x2, y2 = torch.randn(64, 5), torch.randint(0, 3, (64,))
    with gns.batch(loss_reduction=reduction):
        nn.functional.cross_entropy(model(x2), y2, reduction=reduction).backward()
    g_sq, trace = _exact(model, x2, y2)[""]
    assert (gns.grad_sq_norm, gns.trace_sigma) == pytest.approx((g_sq, trace), rel=1e-4)
    gns.unwatch()


@pytest.mark.parametrize(
    "declared, loss, fix",
    [
        ("mean", lambda o, y: nn.functional.cross_entropy(o, y, reduction="sum"), "'sum'"),
        ("mean", lambda o, y: nn.functional.cross_entropy(o, y, reduction="none").sum(), "'sum'"),
        ("sum", lambda o, y: nn.functional.cross_entropy(o, y), "'mean'"),
        ("sum", lambda o, y: nn.functional.cross_entropy(o, y, reduction="none").mean(), "'mean'"),
    ],
)
def test_mismatched_reduction_warns_naming_the_argument(declared, loss, fix):
    model = _model()
    x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
    gns = nnstat.NoiseScale(window=1)
    gns.watch(model)
    with pytest.warns(UserWarning, match=rf"loss_reduction={fix}") as rec:
        with gns.batch(loss_reduction=declared):
            loss(model(x), y).backward()
    assert rec[0].filename == __file__  # points at the user's with-statement
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # checked once per reduction: no probe any more
        with gns.batch(loss_reduction=declared):
            loss(model(x), y).backward()
    gns.unwatch()
    with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum'"):
        gns.watch(model)
        gns.batch(loss_reduction="avg")
    gns.unwatch()


def test_probe_tells_means_from_sums():
    x = torch.randn(16, 3, requires_grad=True)
    cases = [
        (lambda: x.pow(2).mean(), "mean", None),
        (lambda: x.pow(2).sum(), None, "sum"),
        (lambda: 0.5 * x.pow(2).sum(), None, "sum"),  # a constant factor is not a mean
        (lambda: x.pow(2).sum() / 16, None, None),  # sum then divided: weight 1/N, not a sum
        (lambda: x.pow(2).mean() * 16, None, None),  # a sum written as a mean times N
        (lambda: nn.functional.mse_loss(x, torch.zeros(16, 3), reduction="sum"), None, "sum"),
    ]
    for i, (loss, mean, total) in enumerate(cases):
        with MeanLossProbe() as probe:
            loss().backward()
        got_mean, got_sum = probe.mean_over_batch(16), probe.sum_over_batch(16)
        assert (got_mean is None, got_sum is None) == (mean is None, total is None), i


def test_a_batch_size_other_than_the_blocks_samples_is_refused():
    """``batch(batch_size=32)`` on a block of 16 samples scaled every per-sample gradient of
    the mean loss by 2 (|G|^2 came out negative): refused, naming both numbers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    gns = nnstat.NoiseScale(window=10)
    gns.watch(model)
    with pytest.raises(ValueError, match=r"batch_size=32\) but the watched modules saw 16"):
        with gns.batch(batch_size=32):
            nn.functional.mse_loss(model(x), y).backward()
    model.zero_grad()
    with gns.batch(batch_size=16):  # the right number, and the capture still works after
        nn.functional.mse_loss(model(x), y).backward()
    assert gns.n_updates == 1 and gns.trace_sigma > 0
    gns.unwatch()
