"""A layer kind is one module: registering a new kind is all it takes to capture a new layer."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from nnstat.capture import CaptureEngine
from nnstat.capture.kinds import REGISTRY, Kind, detect_kind, kind_named


class Affine(nn.Module):
    """A layer no built-in kind knows: ``y = x Wᵀ`` with its own parameter name."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d_out, d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w.T


@pytest.fixture
def toy_kind():
    """Registers the toy kind (its whole definition is this class) and removes it after."""

    class ToyAffine(Kind):
        name = "toy_affine"
        modules = (Affine,)
        params = ("w", "b")  # no bias: Affine has no attribute b
        plain = True

        def dims(self, module: nn.Module) -> tuple[int, int]:
            return module.w.shape[1], module.w.shape[0]

    try:
        yield REGISTRY["toy_affine"]
    finally:
        REGISTRY.pop("toy_affine", None)


def test_a_kind_registered_in_one_class_is_captured_like_a_built_in_one(toy_kind):
    torch.manual_seed(0)
    model = nn.Sequential(Affine(3, 4), nn.Tanh(), nn.Linear(4, 2))
    assert detect_kind(model[0]) is toy_kind and toy_kind == "toy_affine"
    x = torch.randn(5, 6, 3)  # 6 positions per sample
    engine = CaptureEngine()
    assert engine.watch(model) == ["0", "2"]
    caps = {}
    engine.add_consumer(lambda c: caps.__setitem__(c.name, c))
    with engine.batch():
        model(x).square().sum().backward()

    params = {k: v.detach() for k, v in model.named_parameters()}
    want = vmap(
        grad(lambda p, xi: functional_call(model, p, (xi[None],)).square().sum()),
        in_dims=(None, 0),
    )(params, x)
    cap = caps["0"]
    assert cap.kind is toy_kind and (cap.d_in, cap.d_out) == (3, 4)
    torch.testing.assert_close(cap.per_sample_grads_by_param()["w"], want["0.w"])
    torch.testing.assert_close(cap.batch_grad(), model[0].w.grad)
    torch.testing.assert_close(
        cap.per_sample_sq_norm(), want["0.w"].flatten(1).square().sum(1), rtol=1e-5, atol=1e-5
    )
    # the K-FAC sums come from the same rows: Σ a aᵀ over every position
    torch.testing.assert_close(cap.forward_gram(), x.reshape(-1, 3).T @ x.reshape(-1, 3))


def test_a_module_without_a_kind_is_left_out_with_the_reason():
    assert detect_kind(Affine(3, 4)) is None
    with pytest.warns(UserWarning, match="no per-sample gradient rule"):
        names = CaptureEngine().watch(nn.Sequential(Affine(3, 4), nn.Linear(4, 2)))
    assert names == ["1"]


def test_kinds_are_their_names_and_unknown_names_are_refused():
    built_in = ("linear", "conv", "conv1d_hf", "embedding", "attention", "layernorm")
    assert tuple(REGISTRY)[:6] == built_in  # registration order: the order errors list them in
    for name in built_in:
        assert kind_named(name) == name and kind_named(name) in built_in
    assert not kind_named("layernorm").outer and kind_named("embedding").tokens
    conv = kind_named("conv")  # one instance per kind, also through a copy or a pickle
    assert copy.deepcopy(conv) is conv and pickle.loads(pickle.dumps(conv)) is conv
    with pytest.raises(ValueError, match="registered kinds"):
        kind_named("lstm")
    with pytest.raises(ValueError, match="already registered"):

        class Again(Kind):
            name = "linear"
