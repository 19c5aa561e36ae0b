"""LayerNorm's per-sample gradients without ``x̂``: ``Σ_t r (b∘x) - Σ_t μ r b`` with the mean
and ``1/std`` autograd saved for the layer's own backward (no statistics recomputed), or
computed from the input where those cannot be taken (saved-tensor hooks, a module called twice,
a subclass that normalises something else than its input). Each case against torch.func's
per-sample gradients in float64, on inputs far from zero mean (where ``Σ r b∘x`` and
``Σ μ r b`` nearly cancel: the error grows with mean/std, as the error of ``x - μ`` does when
``x̂`` is formed)."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from nnstat.capture import CaptureEngine

N, T, D = 4, 6, 16


class Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class Shifted(nn.LayerNorm):
    """Normalises ``2x + 1``, not its input: autograd's statistics are not the input's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(2 * x + 1)


class Twice(nn.Module):
    def __init__(self, ln: nn.Module) -> None:
        super().__init__()
        self.ln, self.head = ln, nn.Linear(D, 3)

    def forward(self, x: torch.Tensor, twice: bool = False) -> torch.Tensor:
        h = self.ln(x)
        if twice:
            h = h + self.ln(x.flip(1))
        return self.head(h)


def _model(ln: nn.Module) -> Twice:
    torch.manual_seed(0)
    with torch.no_grad():
        ln.weight.normal_()
        if ln.bias is not None:
            ln.bias.normal_()
    return Twice(ln)


def _reference(model: Twice, x: torch.Tensor, y: torch.Tensor, twice: bool) -> dict:
    model = model.double()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),), {"twice": twice})
        return F.cross_entropy(out.reshape(-1, 3), yi.reshape(-1), reduction="sum")

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x.double(), y)
    model.float()
    return {k[len("ln.") :]: v.float() for k, v in g.items() if k.startswith("ln.")}


def _captured(model: Twice, x, y, twice: bool, hooks: bool) -> tuple[dict, Ops]:
    engine, caps = CaptureEngine(), []
    engine.watch(model.ln)
    engine.add_consumer(caps.append)
    with engine.batch():
        if hooks:  # saved-tensor hooks (as checkpointing or offloading install them)
            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
                out = model(x, twice)
        else:
            out = model(x, twice)
        F.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction="sum").backward()
    (cap,) = caps
    with Ops() as ops:
        got = cap.per_sample_grads_by_param()
    return got, ops


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    # per-position means of about 40 against a spread of about 3: Σ r b∘x and Σ μ r b are
    # ~13x the result (float32 keeps ~1e-6 of it; x̂ itself is only known to ~eps μ/σ)
    x = 40 + 3 * torch.randn(N, T, D)
    return x, torch.randint(0, 3, (N, T))


@pytest.mark.parametrize("bias", [True, False])
def test_gradients_reuse_autograd_statistics_of_the_input(bias):
    """A plain LayerNorm: no statistic of the input is computed again (no ``layer_norm``,
    ``var_mean``), and the gradients equal torch.func's in float64."""
    model = _model(nn.LayerNorm(D, bias=bias))
    x, y = _data()
    got, ops = _captured(model, x, y, twice=False, hooks=False)
    assert not {"native_layer_norm", "var_mean", "mean", "var"} & set(ops.names), ops.names
    ref = _reference(model, x, y, twice=False)
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-4, msg=k)


@pytest.mark.parametrize(
    "case", ["saved-tensor hooks", "called twice", "normalises another tensor"]
)
def test_gradients_compute_the_statistics_when_autograd_s_cannot_be_taken(case):
    """Under saved-tensor hooks (not unpacked in the forward), for a module called twice in one
    backward (rows of two calls) and for a subclass whose ``layer_norm`` input is not its own
    input, the statistics come from the captured input: gradients equal torch.func's."""
    ln = Shifted(D, eps=0.0) if case == "normalises another tensor" else nn.LayerNorm(D)
    model = _model(ln)
    x, y = _data()
    twice = case == "called twice"
    got, ops = _captured(model, x, y, twice=twice, hooks=case == "saved-tensor hooks")
    assert ops.names["var_mean"] == 1, ops.names
    ref = _reference(model, x, y, twice=twice)
    # x̂ of 2x + 1 is x̂ of x with eps = 0: the capture's rows (the input) give the same gradient
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-4, msg=k)


def test_a_bfloat16_layer_s_16_bit_statistics_are_not_used():
    """A bfloat16 LayerNorm on the CPU saves a bfloat16 mean and ``1/std``: the capture computes
    them in float32 from its input instead, so the gradient is ``Σ_t b∘x̂`` with ``x̂`` of the
    input in float32 (as torch's ``layer_norm`` in float32 gives it), for the captured ``b``."""
    torch.manual_seed(0)
    ln = nn.LayerNorm(D).to(torch.bfloat16)
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    x = (40 + 3 * torch.randn(N, T, D)).to(torch.bfloat16)
    assert ln(x).grad_fn._saved_result1.dtype == torch.bfloat16  # what the capture refuses
    engine, caps = CaptureEngine(), []
    engine.watch(ln)
    engine.add_consumer(caps.append)
    with engine.batch():
        ln(x).float().square().sum().backward()
    (cap,) = caps
    with Ops() as ops:
        got = cap.per_sample_grads_by_param()
    assert ops.names["var_mean"] == 1, ops.names
    xh = F.layer_norm(x.float().double(), (D,), eps=ln.eps)
    b = cap.backward.double()
    torch.testing.assert_close(got["weight"].double(), (b * xh).sum(1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got["bias"].double(), b.sum(1), rtol=1e-5, atol=1e-5)
