"""RMSNorm capture (``torch.nn.RMSNorm`` and transformers' ``LlamaRMSNorm``): per-sample weight
gradients against per-sample autograd, one sample at a time, and the look-alikes left out."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nnstat
from nnstat.capture.kinds import detect_kind


def _norms() -> list[tuple[str, nn.Module]]:
    out = [("torch", nn.RMSNorm(6, eps=1e-5)), ("torch, 2-d", nn.RMSNorm((2, 3), eps=1e-5))]
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    out.append(("llama", llama.LlamaRMSNorm(6, eps=1e-6)))
    return out


class Collect:
    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_capture(self, cap) -> None:
        self.grads[cap.name] = cap.per_sample_grads_by_param()["weight"]


@pytest.mark.parametrize("which", ["torch", "torch, 2-d", "llama"])
def test_rmsnorm_per_sample_grads_match_autograd(which):
    norm = dict(_norms())[which]
    torch.manual_seed(0)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)  # not the all-ones init: the weight must not cancel out
    shape = norm.weight.shape
    model = nn.Sequential(nn.Linear(4, 6), nn.Unflatten(-1, shape), norm, nn.Flatten(-len(shape)))
    model.append(nn.Linear(6, 3))
    x, y = torch.randn(5, 7, 4), torch.randn(5, 7, 3)
    assert detect_kind(norm) == "rmsnorm"
    engine = nnstat.CaptureEngine()
    assert "2" in engine.watch(model)
    got = Collect()
    engine.add_consumer(got)
    with engine.batch():
        ((model(x) - y) ** 2).sum().backward()
    engine.unwatch()
    want = []
    for i in range(len(x)):
        model.zero_grad()
        ((model(x[i : i + 1]) - y[i : i + 1]) ** 2).sum().backward()
        want.append(norm.weight.grad.clone())
    assert torch.allclose(got.grads["2"], torch.stack(want), rtol=1e-5, atol=1e-6)


def test_rmsnorm_look_alikes_and_an_unknown_epsilon_are_skipped_with_a_warning():
    class GemmaLikeRMSNorm(nn.Module):  # (1 + weight) * x̂: another formula, not captured
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(6))
            self.eps = 1e-6

        def forward(self, x):
            xh = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return (1 + self.weight) * xh

    model = nn.Sequential(
        nn.Linear(4, 6), GemmaLikeRMSNorm(), nn.RMSNorm(6, elementwise_affine=False)
    )
    engine = nnstat.CaptureEngine()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert engine.watch(model) == ["0"]
    assert any("GemmaLikeRMSNorm" in str(w.message) for w in caught)
    engine.unwatch()
