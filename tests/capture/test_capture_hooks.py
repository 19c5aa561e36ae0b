"""Hook hygiene and hard cases: autocast, checkpointing, unsupported modules, no side effects."""

from __future__ import annotations

import warnings
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

from nnstat.capture import CaptureEngine, UnsupportedModuleError


def ref_grads(model, x, y):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), yi.reshape(-1), reduction="sum")

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)


def collect(engine):
    caps = {}
    engine.add_consumer(lambda cap: caps.__setitem__(cap.name, cap.per_sample_grads_by_param()))
    return caps


@pytest.mark.parametrize("arch", ["mlp", "cnn"])
def test_autocast_bf16_within_1e2_and_float32_stats(arch):
    torch.manual_seed(0)
    if arch == "mlp":
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
        x = torch.randn(8, 16)
    else:
        model = nn.Sequential(
            nn.Conv2d(2, 6, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(6 * 5 * 5, 4)
        )
        x = torch.randn(8, 2, 5, 5)
    y = torch.randint(0, 4, (8,))
    ref = ref_grads(model, x, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # torch.func under the same autocast
        ref16 = ref_grads(model, x, y)
    engine = CaptureEngine()
    engine.watch(model)
    dtypes = []
    engine.add_consumer(lambda cap: dtypes.append((cap.forward.dtype, cap.backward.dtype)))
    caps = collect(engine)
    with engine.batch(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
        assert out.dtype == torch.bfloat16
        F.cross_entropy(out.float(), y, reduction="sum").backward()
    assert set(dtypes) == {(torch.float32, torch.float32)} and len(caps) == 2

    def rel(a, b):
        return (a - b).flatten(1).norm(dim=1) / b.flatten(1).norm(dim=1)

    for name, got in caps.items():
        for p, g in got.items():
            want, want16 = ref[f"{name}.{p}"], ref16[f"{name}.{p}"].float()
            # exact w.r.t. what autocast computed (float32 maths on bf16 output gradients)
            assert rel(g, want16).max() < 1e-2, (name, p, rel(g, want16).max())
            # and within 1e-2 of float32 per sample for the MLP. The bf16 conv's error vs float32
            # is larger, but torch.func under the same autocast deviates as much (bf16's own
            # error, not the capture's): ours must be no worse
            if arch == "mlp":
                assert rel(g, want).max() < 1e-2, (name, p, rel(g, want).max())
            else:
                assert rel(g, want).max() <= rel(want16, want).max() * 1.05 + 1e-3
                batch_err = (g - want).norm() / want.norm()
                assert batch_err <= (want16 - want).norm() / want.norm() * 1.05 + 1e-3


class Checkpointed(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.use_checkpoint = True
        self.block = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.LayerNorm(8), nn.Linear(8, 6))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        if not self.use_checkpoint:  # torch.func cannot differentiate through checkpoint
            return self.head(self.block(x))
        h = checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_same_grads_no_double_count(reentrant):
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    x, y = torch.randn(5, 4, 6), torch.randint(0, 3, (5, 4))
    model.use_checkpoint = False
    ref = ref_grads(model, x, y)
    model.use_checkpoint = True
    engine = CaptureEngine()
    engine.watch(model)
    calls = []
    engine.add_consumer(calls.append)
    caps = collect(engine)
    xin = x.clone().requires_grad_(reentrant)  # reentrant checkpoint needs an input with grad
    with engine.batch():
        out = model(xin)
        F.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction="sum").backward()
    assert sorted(c.name for c in calls) == sorted(["block.0", "block.2", "block.3", "head"])
    for name, got in caps.items():
        for p, g in got.items():
            torch.testing.assert_close(g, ref[f"{name}.{p}"], rtol=1e-4, atol=1e-5)


def test_create_graph_backward_is_refused_and_the_next_batch_is_exact():
    # a gradient penalty reaches the weights through the gradient's own graph, not through the
    # layer outputs: captured as before, its rows were silently wrong (the sum of both backwards)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    engine = CaptureEngine()
    engine.watch(model)
    caps = collect(engine)
    xin = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=r"create_graph=True.*reached watched module .2.*Fix"):
        with engine.batch():
            loss = F.cross_entropy(model(xin), y, reduction="sum")
            (gx,) = torch.autograd.grad(loss, xin, create_graph=True)
            (loss + gx.pow(2).sum()).backward()
    assert caps == {}
    model.zero_grad()
    with engine.batch():
        F.cross_entropy(model(x), y, reduction="sum").backward()
    ref = ref_grads(model, x, y)
    for name, got in caps.items():
        for p, g in got.items():
            torch.testing.assert_close(g, ref[f"{name}.{p}"], rtol=1e-4, atol=1e-5)
    assert sorted(caps) == ["0", "2"]


def test_a_watched_module_replaced_after_watch_is_refused_until_watched_again():
    # the hooks stayed on the old module: the new layer was silently missing from every batch
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
    model = nn.Sequential(OrderedDict(body=body, head=nn.Linear(8, 3)))
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    engine = CaptureEngine()
    engine.watch(model)
    model.body = nn.Sequential(nn.Linear(6, 8), nn.Tanh())  # the parent of a watched module
    with pytest.raises(RuntimeError, match=r"watched module 'body' was replaced.*watch\(model\)"):
        with engine.batch():
            pass
    engine.unwatch()
    engine.watch(model)
    caps = collect(engine)
    with engine.batch():
        F.cross_entropy(model(x), y, reduction="sum").backward()
    ref = ref_grads(model, x, y)
    assert sorted(caps) == ["body.0", "head"]
    for name, got in caps.items():
        for p, g in got.items():
            torch.testing.assert_close(g, ref[f"{name}.{p}"], rtol=1e-4, atol=1e-5)


def test_watching_changes_nothing_and_unwatch_removes_everything():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 2))
    model[0].weight.requires_grad_(False)  # a user-frozen parameter stays frozen
    flags = {k: p.requires_grad for k, p in model.named_parameters()}
    x = torch.randn(3, 4)

    def run():
        model.zero_grad()
        out = model(x)
        out.pow(2).sum().backward()
        return out.detach().clone(), {
            k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None
        }

    out0, g0 = run()
    engine = CaptureEngine()
    engine.watch(model)
    seen = []
    engine.add_consumer(seen.append)
    with engine.batch():
        out1, g1 = run()
    assert seen, "the watched pass captured nothing"
    torch.testing.assert_close(out1, out0, rtol=0, atol=0)
    assert g1.keys() == g0.keys()
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=0)
    assert {k: p.requires_grad for k, p in model.named_parameters()} == flags
    # outside a batch the hooks are inert
    seen.clear()
    run()
    assert seen == []
    engine.unwatch()
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    with engine.batch():
        run()
    assert seen == [] and engine.watched == {}


def test_filters_select_by_regex_and_type():
    model = nn.Sequential(nn.Linear(2, 3), nn.Conv1d(3, 3, 1), nn.Linear(3, 1))
    assert CaptureEngine().watch(model, name_filter=r"^[02]$") == ["0", "2"]
    assert CaptureEngine().watch(model, type_filter=nn.Conv1d) == ["1"]
    assert CaptureEngine().watch(model, type_filter=["Linear"]) == ["0", "2"]


class Attn(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, **kwargs)
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        h = self.ln(x)
        return self.fc(self.attn(h, h, h, need_weights=False)[0])


def test_multihead_attention_is_watched_with_its_out_proj():
    assert CaptureEngine().watch(Attn()) == ["ln", "attn", "attn.out_proj", "fc"]
    assert CaptureEngine().watch(Attn(), type_filter=nn.Linear) == ["attn.out_proj", "fc"]


def test_unsupported_multihead_attention_is_reported_not_logged_as_zeros():
    model = Attn(add_bias_kv=True)
    engine = CaptureEngine()
    with pytest.warns(UserWarning, match="attn .*MultiheadAttention.*add_bias_kv") as rec:
        names = engine.watch(model)
    assert names == ["ln", "fc"]
    assert "attn.out_proj" in str(rec[0].message)
    with pytest.raises(UnsupportedModuleError, match="attn"):
        CaptureEngine().watch(model, name_filter="attn")
    with pytest.raises(UnsupportedModuleError, match="out_proj.*add_bias_kv"):
        CaptureEngine().watch(model, type_filter=nn.Linear)


def test_unsupported_module_with_parameters_raises_when_selected():
    model = nn.Sequential(nn.Linear(3, 3), nn.GRU(3, 3), nn.BatchNorm1d(3))
    with pytest.raises(UnsupportedModuleError, match=r"1 \(GRU\)"):
        CaptureEngine().watch(model, name_filter="1")
    with pytest.raises(UnsupportedModuleError, match="scale_grad_by_freq"):
        CaptureEngine().watch(nn.Embedding(4, 2, scale_grad_by_freq=True), type_filter="Embedding")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert CaptureEngine().watch(model) == ["0"]
    assert len(w) == 1 and "GRU" in str(w[0].message) and "BatchNorm1d" in str(w[0].message)


@pytest.mark.parametrize(
    "layer",
    [
        nn.LSTM(3, 3),
        nn.GRU(3, 3, batch_first=True),
        nn.EmbeddingBag(5, 3),
        nn.Bilinear(3, 3, 2),
        nn.Conv3d(2, 2, 2),
        nn.ConvTranspose2d(2, 2, 2),
        nn.GroupNorm(1, 3),
        nn.InstanceNorm2d(3, affine=True),
    ],
    ids=lambda m: type(m).__name__,
)
def test_an_unsupported_layer_is_named_with_the_supported_module_types(layer):
    name = type(layer).__name__
    with pytest.raises(UnsupportedModuleError) as err:
        CaptureEngine().watch(nn.Sequential(nn.Linear(3, 3), layer), name_filter="^1$")
    msg = str(err.value)
    assert f"1 ({name})" in msg
    for supported in ("Linear", "Conv1d/Conv2d", "Embedding", "MultiheadAttention", "LayerNorm"):
        assert supported in msg.split("with a rule:")[1]


def test_a_scripted_model_is_refused_naming_the_eager_one():
    scripted = torch.jit.script(nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2)))
    with pytest.raises(UnsupportedModuleError, match=r"0 \(RecursiveScriptModule\): a TorchScript"):
        CaptureEngine().watch(scripted, name_filter="0")
    with pytest.warns(UserWarning, match="watch the eager model"):
        assert CaptureEngine().watch(scripted) == []


@pytest.mark.parametrize("how", ["weight_norm", "spectral_norm", "hook_weight_norm"])
def test_a_parametrized_weight_is_left_out_naming_the_fix(how):
    # its capture was the gradient of the computed weight, not of original0/original1: the
    # per-sample noise scale mixed it with those parameters' .grad (layer 0 came out inf)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.nn.utils.weight_norm is deprecated
        if how == "hook_weight_norm":
            torch.nn.utils.weight_norm(model[0])
        else:
            getattr(torch.nn.utils.parametrizations, how)(model[0])
    model.eval()  # spectral_norm: no power iteration, the same weight in every forward
    with pytest.raises(UnsupportedModuleError, match=r"0 \(.*Linear\): its \['weight'\].*remove"):
        CaptureEngine().watch(model, name_filter="^0$")
    engine = CaptureEngine()
    with pytest.warns(UserWarning, match=r"computed from other parameters"):
        assert engine.watch(model) == ["2"]
    caps = collect(engine)
    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    with engine.batch():
        F.cross_entropy(model(x), y, reduction="sum").backward()
    ref = ref_grads(model, x, y)
    assert sorted(caps) == ["2"]
    for p, g in caps["2"].items():
        torch.testing.assert_close(g, ref[f"2.{p}"], rtol=1e-4, atol=1e-5)


def test_batch_validates_arguments():
    engine = CaptureEngine()
    with pytest.raises(ValueError, match="batch_size"):
        with engine.batch(batch_size=0):
            pass
    model = nn.Linear(3, 2)
    engine.watch(model)
    engine.add_consumer(lambda cap: None)
    with pytest.raises(ValueError, match="mask has 4 samples but the batch has 2"):
        with engine.batch(mask=torch.ones(4, dtype=torch.bool)):
            model(torch.randn(2, 3)).sum().backward()


def test_outputs_require_grad_with_frozen_parameters():
    """The store's param_grads=False pass: parameters frozen, per-sample grads still exact."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(7, 4), nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3)
    )
    x, y = torch.randint(0, 7, (4, 6)), torch.randint(0, 3, (4, 6))
    ref = ref_grads(model, x, y)
    for p in model.parameters():
        p.requires_grad_(False)
    engine = CaptureEngine()
    engine.watch(model)
    caps = collect(engine)
    with engine.batch(outputs_require_grad=True):
        out = model(x)
        F.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction="sum").backward()
    assert set(caps) == {"0", "1", "3"}
    for name, got in caps.items():
        for p, g in got.items():
            torch.testing.assert_close(g, ref[f"{name}.{p}"], rtol=1e-4, atol=1e-5)
    assert all(p.grad is None and not p.requires_grad for p in model.parameters())
    with engine.batch():  # without the opt-in a frozen model has nothing to differentiate
        assert not model(x).requires_grad


@pytest.mark.parametrize("kind", ["linear", "embedding", "hf_conv1d", "layernorm"])
def test_inplace_op_on_a_view_output_still_captured(kind):
    """[N, T, d] layers return a view; an in-place ReLU on it must not lose the capture."""
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    first, x = {
        "linear": (nn.Linear(4, 5), torch.randn(3, 2, 4)),
        "embedding": (nn.Embedding(9, 5), torch.randint(0, 9, (3, 2))),
        "hf_conv1d": (Conv1D(5, 4), torch.randn(3, 2, 4)),
        "layernorm": (nn.LayerNorm(5), torch.randn(3, 2, 5)),
    }[kind]
    model = nn.Sequential(first, nn.ReLU(inplace=True), nn.Linear(5, 3))
    y = torch.randint(0, 3, (3, 2))
    ref = ref_grads(model, x, y)
    engine = CaptureEngine()
    engine.watch(model)
    caps = collect(engine)
    with engine.batch():
        F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1), reduction="sum").backward()
    assert set(caps) == {"0", "2"}
    for name, got in caps.items():
        for p, g in got.items():
            torch.testing.assert_close(g, ref[f"{name}.{p}"], rtol=1e-4, atol=1e-5)


def test_forward_consumers_see_values_also_under_no_grad():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(5, 3)

    class Fwd:
        def __init__(self):
            self.seen = []

        def on_forward(self, name, module, inp, out):
            self.seen.append((name, inp.clone(), out.clone()))

    fwd = Fwd()
    engine = CaptureEngine()
    engine.watch(model)
    engine.add_consumer(fwd)
    with engine.batch(), torch.no_grad():
        out = model(x)
    assert [n for n, _, _ in fwd.seen] == ["0", "2"]
    torch.testing.assert_close(fwd.seen[0][1], x)
    torch.testing.assert_close(fwd.seen[1][2], out)
    model(x)  # outside a batch: nothing
    assert len(fwd.seen) == 2
    engine.remove_consumer(fwd)
    with engine.batch():
        model(x)
    assert len(fwd.seen) == 2


def test_batch_statistics_are_reported_and_eval_mode_matches_torch_func():
    """A BatchNorm in training mode makes every sample's output depend on the others: the
    captures of the modules that feed it were each sample's share of the batch loss's gradient
    (the convolution's 19-52% off the gradient of each sample's own loss on this batch) without
    a word. Now the first block warns, naming the layer and model.eval(); in eval mode the
    captures match torch.func."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(27, 4))
    x, y = torch.randn(6, 2, 5, 5), torch.randint(0, 4, (6,))
    engine = CaptureEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the BatchNorm's own parameters: not watched
        engine.watch(model)
    with pytest.warns(UserWarning, match=r"BatchNorm layers '1' \(BatchNorm2d\).*model\.eval"):
        with engine.batch():
            F.cross_entropy(model(x), y, reduction="sum").backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per engine
        with engine.batch():
            F.cross_entropy(model(x), y, reduction="sum").backward()
    engine.unwatch()
    model.eval()
    engine = CaptureEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.watch(model)
    caps = collect(engine)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # running statistics: per sample, nothing to report
        with engine.batch():
            F.cross_entropy(model(x), y, reduction="sum").backward()
    ref = ref_grads(model, x, y)
    assert set(caps) == {"0", "3"}
    for name, got in caps.items():
        for p, g in got.items():
            torch.testing.assert_close(g, ref[f"{name}.{p}"], rtol=1e-4, atol=1e-5)
    engine.unwatch()
    model[1] = nn.BatchNorm2d(3, track_running_stats=False).eval()  # batch statistics in eval
    engine = CaptureEngine()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine.watch(model)
    with pytest.warns(UserWarning, match="BatchNorm layers '1'"), engine.batch():
        F.cross_entropy(model(x), y, reduction="sum").backward()
    engine.unwatch()


def test_a_users_forward_hook_that_changes_the_output_does_not_change_the_capture():
    """A hook registered before watch() that returns a new output (``o * 2 + 0.1``: activation
    steering, a quantisation stub) ran before the capture's, which then took the gradient of
    the changed output as the module's: half the true per-sample gradient here, silently. The
    capture's hook now runs first, on the module's own output (attention modules too)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model[0].register_forward_hook(lambda module, inp, out: out * 2.0 + 0.1)
    attn = nn.MultiheadAttention(6, 2, batch_first=True)
    attn.register_forward_hook(lambda module, inp, out: (out[0] * 3.0, out[1]))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.mlp = attn, model

        def forward(self, x):
            return self.mlp(self.attn(x, x, x, need_weights=False)[0].mean(1))

    net = Net()
    x, y = torch.randn(5, 4, 6), torch.randint(0, 3, (5,))
    ref = ref_grads(net, x, y)
    engine = CaptureEngine()
    engine.watch(net)
    caps = collect(engine)
    with engine.batch():
        F.cross_entropy(net(x), y, reduction="sum").backward()
    engine.unwatch()
    assert set(caps) == {"attn", "attn.out_proj", "mlp.0", "mlp.2"}
    for name, got in caps.items():
        for p, g in got.items():
            torch.testing.assert_close(g, ref[f"{name}.{p}"], rtol=1e-4, atol=1e-5)


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(3, 2)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)  # its input needs no grad either
        self.unused = nn.Linear(3, 2)

    def forward(self, x):
        return self.used(self.frozen(x))


def test_a_watched_module_without_gradient_is_warned_about_once_naming_it():
    torch.manual_seed(0)
    model, x = _WithUnused(), torch.randn(4, 3)
    engine = CaptureEngine()
    assert engine.watch(model) == ["used", "frozen", "unused"]
    seen: list[str] = []
    grads: dict[str, torch.Tensor] = {}

    def consumer(cap):
        seen.append(cap.name)
        grads[cap.name] = cap.per_sample_grads_by_param()["weight"]

    engine.add_consumer(consumer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two backwards: still one warning
            with engine.batch():
                model(x).pow(2).sum().backward()
    engine.unwatch()
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1, messages
    assert "['frozen', 'unused'] received no gradient" in messages[0]
    assert "name_filter" in messages[0]
    assert seen == ["used", "used"]
    # what was captured is exact: torch.func per-sample gradients of the used layer
    params = {k: v.detach() for k, v in model.used.named_parameters()}

    def loss(p, xi):
        return functional_call(model.used, p, (model.frozen(xi[None]),)).pow(2).sum()

    ref = vmap(grad(loss), in_dims=(None, 0))(params, x)["weight"]
    torch.testing.assert_close(grads["used"], ref)


def test_the_framework_probe_leaves_out_a_module_without_gradient_without_warning():
    # the probe finds such modules out (the noise scale then watches the others): no warning
    from nnstat.integrations._probe import ModuleProbe

    model = _WithUnused()
    probe = ModuleProbe(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with probe:
            model(torch.randn(4, 3)).sum().backward()
    assert probe.keep() == ["used"]
