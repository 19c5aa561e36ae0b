"""Batched consumers (on_backward) and ModuleCapture.sq_norm_factors vs torch.func."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from nnstat.capture import CaptureEngine


def reference_sq_norms(model, x, y) -> dict[str, torch.Tensor]:
    """{module name: [N]} squared per-sample gradient norms via torch.func (no hooks)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    out: dict[str, torch.Tensor] = {}
    for k, g in per.items():
        mod = k.rsplit(".", 1)[0]
        out[mod] = out.get(mod, 0) + g.flatten(1).double().pow(2).sum(1)
    return out


class Both:
    """A consumer with on_capture AND on_backward: both must be called, in watch order."""

    def __init__(self) -> None:
        self.single: list[str] = []
        self.batches: list[list[str]] = []

    def on_capture(self, cap) -> None:
        self.single.append(cap.name)

    def on_backward(self, caps) -> None:
        self.batches.append([c.name for c in caps])


def test_on_backward_gets_every_capture_of_each_backward_in_watch_order():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    engine = CaptureEngine()
    engine.watch(model)
    both, only_batch = Both(), []

    class OnlyBatch:
        def on_backward(self, caps):
            only_batch.append(len(caps))

    engine.add_consumer(both)
    ob = OnlyBatch()
    engine.add_consumer(ob)
    x = torch.randn(3, 4)
    with engine.batch():
        model(x).sum().backward()
        model[2:](torch.randn(3, 6)).sum().backward()  # second backward: two modules only
    assert both.single == ["0", "2", "4", "2", "4"]
    assert both.batches == [["0", "2", "4"], ["2", "4"]]
    assert only_batch == [3, 2]
    engine.remove_consumer(ob)
    with engine.batch():
        model(x).sum().backward()
    assert only_batch == [3, 2]
    engine.unwatch()
    with pytest.raises(TypeError, match="on_backward"):
        engine.add_consumer(object())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_sq_norm_factors_sum_to_per_sample_squared_norms(bias, reduction):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 3, bias=bias))
    x, y = torch.randn(9, 5), torch.randint(0, 3, (9,))
    engine = CaptureEngine()
    engine.watch(model)
    caps = {}
    engine.add_consumer(lambda c: caps.__setitem__(c.name, c))
    with engine.batch(loss_reduction=reduction):
        F.cross_entropy(model(x), y, reduction=reduction).backward()
    engine.unwatch()
    ref = reference_sq_norms(model, x, y)  # each sample's own loss, independent of the hooks
    for name, cap in caps.items():
        tensors, c = cap.sq_norm_factors()
        assert len(tensors) == 1 + bias
        got = c * sum(float(t.double().pow(2).sum()) for t in tensors)
        assert got == pytest.approx(float(ref[name].sum()), rel=1e-5)
        # the lazily rescaled backward stream gives the same per-sample norms
        torch.testing.assert_close(
            cap.per_sample_sq_norm().double(), ref[name], rtol=1e-4, atol=1e-6
        )
        scale = 9.0 if reduction == "mean" else 1.0
        assert cap.backward.abs().sum() > 0
        torch.testing.assert_close(cap.backward, cap._b_raw * scale)


def test_sq_norm_factors_none_for_sequences():
    torch.manual_seed(2)
    lin = nn.Linear(4, 3)
    engine = CaptureEngine()
    engine.watch(lin)
    caps = []
    engine.add_consumer(caps.append)
    with engine.batch():
        lin(torch.randn(2, 5, 4)).sum().backward()
    engine.unwatch()
    assert caps[0].sq_norm_factors() is None


class SeqThenHead(nn.Module):
    """A per-token Linear (several positions: no factors), a conv whose output is 1x1 (one
    position, [N, 1, d] rows) and a head on the pooled features (one position, [N, d])."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Linear(4, 6)
        self.conv = nn.Conv1d(6, 5, kernel_size=3)
        self.head = nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [N, 3, 4]
        h = torch.tanh(self.tok(x))  # [N, 3, 6]
        c = torch.tanh(self.conv(h.transpose(1, 2)))  # [N, 5, 1]
        return self.head(c.squeeze(-1))


def test_sq_norm_factors_of_mixed_captures_match_torch_func():
    from nnstat.capture.norms import sq_norm_factors

    torch.manual_seed(5)
    model = SeqThenHead()
    x, y = torch.randn(7, 3, 4), torch.randint(0, 3, (7,))
    engine = CaptureEngine()
    engine.watch(model)
    batches = []

    class Keep:
        def on_backward(self, caps):
            batches.append(caps)

    engine.add_consumer(Keep())
    with engine.batch(loss_reduction="mean"):
        F.cross_entropy(model(x), y).backward()
    engine.unwatch()
    (caps,) = batches
    assert [c.name for c in caps] == ["tok", "conv", "head"]
    factors = sq_norm_factors(caps)
    assert factors[0] is None  # three positions: no row factorisation
    ref = reference_sq_norms(model, x, y)
    for cap, f in zip(caps[1:], factors[1:], strict=True):
        tensors, c = f
        got = c * sum(float(t.double().pow(2).sum()) for t in tensors)
        assert got == pytest.approx(float(ref[cap.name].sum()), rel=1e-5), cap.name
        one, c_one = cap.sq_norm_factors()  # the per-capture method agrees with the batch
        assert c_one * sum(float(t.double().pow(2).sum()) for t in one) == pytest.approx(got)
    torch.testing.assert_close(
        caps[0].per_sample_sq_norm().double(), ref["tok"], rtol=1e-4, atol=1e-6
    )
