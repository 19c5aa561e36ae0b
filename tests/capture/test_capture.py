"""Per-sample gradients of every supported module vs torch.func.vmap(grad(...))."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from nnstat.capture import CaptureEngine


def reference_grads(model, per_sample_loss, *batch):
    """{param name: [N, *shape]} via torch.func (independent of the hooks)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, *xs):
        xs1 = tuple(x.unsqueeze(0) for x in xs)
        return per_sample_loss(lambda *a: functional_call(model, p, a), *xs1)

    return vmap(grad(one), in_dims=(None, *([0] * len(batch))))(params, *batch)


def captured(model, run, **batch_kw):
    engine = CaptureEngine()
    engine.watch(model, **batch_kw.pop("watch", {}))
    caps = {}
    engine.add_consumer(lambda cap: caps.__setitem__(cap.name, cap))
    with engine.batch(**batch_kw):
        run()
    engine.unwatch()
    return caps


def assert_matches(caps, ref, rtol=1e-4, atol=1e-5):
    assert caps, "nothing was captured"
    for name, cap in caps.items():
        got = cap.per_sample_grads_by_param()
        for pname, g in got.items():
            key = f"{name}.{pname}" if name != "model" else pname
            torch.testing.assert_close(g, ref[key], rtol=rtol, atol=atol, msg=key)
        # squared norm and the matrix form agree with the parameter-shaped reference
        sq = sum(ref[f"{name}.{p}" if name != "model" else p].flatten(1).pow(2).sum(1) for p in got)
        torch.testing.assert_close(cap.per_sample_sq_norm(), sq, rtol=1e-4, atol=1e-5)


def ce_sum(f, x, y):
    out = f(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")


@pytest.mark.parametrize("bias", [True, False])
def test_linear_mlp(bias):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7, bias=bias), nn.Tanh(), nn.Linear(7, 3, bias=bias))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    caps = captured(model, lambda: ce_sum(model, x, y).backward())
    assert set(caps) == {"0", "2"}
    assert caps["0"].per_sample_grad().shape == (6, 7, 5 + bias)
    assert_matches(caps, reference_grads(model, ce_sum, x, y))


def test_linear_sequence_tokens_sum_into_sample_and_4d_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.GELU(), nn.Linear(6, 3))
    x, y = torch.randn(3, 2, 5, 4), torch.randint(0, 3, (3, 2, 5))
    caps = captured(model, lambda: ce_sum(model, x, y).backward())
    assert caps["0"].backward.shape == (3, 10, 6)
    assert_matches(caps, reference_grads(model, ce_sum, x, y))


def test_mask_excludes_positions():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    x, y = torch.randn(4, 5, 4), torch.randint(0, 3, (4, 5))
    mask = torch.rand(4, 5) > 0.4

    def masked(f, x, y, m):
        out = f(x)
        per_tok = F.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction="none")
        return (per_tok * m.reshape(-1)).sum()

    # the loss includes every position; the mask alone must remove the excluded ones
    caps = captured(model, lambda: ce_sum(model, x, y).backward(), mask=mask)
    assert_matches(caps, reference_grads(model, masked, x, y, mask.float()))
    assert caps["0"].num_positions == int(mask.sum())
    assert caps["0"].forward[~mask].abs().sum() == 0


def test_mean_reduction_rescales_by_batch_size():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    caps = captured(model, lambda: F.cross_entropy(model(x), y).backward(), loss_reduction="mean")
    assert_matches(caps, reference_grads(model, ce_sum, x, y))
    with pytest.raises(ValueError, match="valid: sum, mean"):
        with CaptureEngine().batch(loss_reduction="avg"):
            pass


CONV2D = [
    dict(kernel_size=3),
    dict(kernel_size=3, stride=2, padding=1),
    dict(kernel_size=(2, 3), dilation=2, padding=(1, 2)),
    dict(kernel_size=3, groups=2, padding=1),
    dict(kernel_size=3, groups=4, stride=(1, 2), bias=False),
    dict(kernel_size=3, padding="same", dilation=(1, 2)),
    dict(kernel_size=3, padding=1, padding_mode="reflect"),
    dict(kernel_size=3, padding=2, padding_mode="circular", stride=2),
]


@pytest.mark.parametrize("kw", CONV2D)
def test_conv2d_variants(kw):
    torch.manual_seed(0)
    conv = nn.Conv2d(4, 8, **kw)
    model = nn.Sequential(conv, nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))
    x, y = torch.randn(5, 4, 7, 9), torch.randint(0, 3, (5,))
    model(x)  # materialise the lazy layer
    caps = captured(model, lambda: ce_sum(model, x, y).backward())
    assert set(caps) == {"0", "3"}
    assert_matches(caps, reference_grads(model, ce_sum, x, y))


@pytest.mark.parametrize(
    "kw",
    [
        dict(kernel_size=3),
        dict(kernel_size=3, stride=2, padding=2, dilation=2),
        dict(kernel_size=2, groups=2, bias=False),
        dict(kernel_size=4, padding="same", padding_mode="replicate"),
    ],
)
def test_conv1d_variants(kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(4, 6, **kw), nn.Tanh(), nn.Flatten(), nn.LazyLinear(3))
    x, y = torch.randn(5, 4, 11), torch.randint(0, 3, (5,))
    model(x)
    caps = captured(model, lambda: ce_sum(model, x, y).backward())
    assert_matches(caps, reference_grads(model, ce_sum, x, y))


@pytest.mark.parametrize("conv", [nn.Conv1d(3, 4, 3), nn.Conv2d(3, 4, 3)], ids=["1d", "2d"])
def test_an_unbatched_conv_input_is_refused_naming_the_fix(conv):
    """torch accepts ``[C, *spatial]``; the capture failed inside ``F.unfold`` or with an
    IndexError, naming neither the layer nor the fix."""
    engine = CaptureEngine()
    engine.watch(nn.Sequential(conv))
    engine.add_consumer(lambda cap: cap.per_sample_grad())
    x = torch.randn(3, 10) if isinstance(conv, nn.Conv1d) else torch.randn(3, 6, 6)
    with pytest.raises(ValueError, match=r"Conv[12]d: expected a batched input .*x\[None\]"):
        with engine.batch():
            conv(x).sum().backward()
    engine.unwatch()


def test_hf_conv1d_gpt2_style():
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    model = nn.Sequential(Conv1D(12, 5), nn.GELU(), Conv1D(3, 12))  # Conv1D(nf, nx)
    x, y = torch.randn(4, 6, 5), torch.randint(0, 3, (4, 6))
    caps = captured(model, lambda: ce_sum(model, x, y).backward())
    assert {c.kind for c in caps.values()} == {"conv1d_hf"}
    assert caps["0"].per_sample_grad().shape == (4, 12, 6)  # [N, nf, nx + 1]
    assert_matches(caps, reference_grads(model, ce_sum, x, y))


@pytest.mark.parametrize("vocab,t", [(1000, 6), (5, 12)])  # gram trick, then materialised
def test_embedding_sq_norm_uses_both_paths(vocab, t):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, 3), nn.Linear(3, 2))
    x, y = torch.randint(0, vocab, (3, t)), torch.randint(0, 2, (3, t))
    caps = captured(model, lambda: ce_sum(model, x, y).backward())
    assert_matches(caps, reference_grads(model, ce_sum, x, y))


@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_repeated_indices_and_padding(padding_idx):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=padding_idx), nn.Linear(4, 3))
    x = torch.tensor([[1, 1, 1, 2], [0, 3, 0, 3], [5, 0, 9, 9]])
    y = torch.randint(0, 3, (3, 4))
    caps = captured(model, lambda: ce_sum(model, x, y).backward())
    ref = reference_grads(model, ce_sum, x, y)
    assert_matches(caps, ref)
    if padding_idx is not None:
        assert caps["0"].per_sample_grads_by_param()["weight"][:, 0].abs().sum() == 0
        assert ref["0.weight"][:, 0].abs().sum() == 0


@pytest.mark.parametrize("shape,bias", [((6,), True), ((6,), False), ((3, 4), True)])
def test_layernorm_affine(shape, bias):
    torch.manual_seed(0)
    ln = nn.LayerNorm(shape, bias=bias)
    with torch.no_grad():
        ln.weight.normal_()
        if bias:
            ln.bias.normal_()
    model = nn.Sequential(
        ln, nn.Flatten(-len(shape)), nn.Linear(int(torch.tensor(shape).prod()), 3)
    )
    x = torch.randn(4, 5, *shape)
    y = torch.randint(0, 3, (4, 5))
    caps = captured(model, lambda: ce_sum(model, x, y).backward())
    assert caps["0"].kind == "layernorm"
    assert_matches(caps, reference_grads(model, ce_sum, x, y))


def test_layernorm_with_a_mask_forward_stream_and_per_sample_grads():
    """The capture keeps LayerNorm's input and makes x̂ when asked: the forward stream (and
    its sums) is x̂ with masked positions zero, and the per-sample gradients of a masked
    batch equal torch.func's of each sample's masked loss."""
    torch.manual_seed(1)
    ln = nn.LayerNorm((3, 4))
    with torch.no_grad():
        ln.weight.normal_(), ln.bias.normal_()
    x, mask = torch.randn(4, 5, 3, 4), (torch.rand(4, 5) > 0.4).float()
    engine, caps = CaptureEngine(), []
    engine.watch(ln)
    engine.add_consumer(caps.append)
    with engine.batch(mask=mask):
        (ln(x).square().sum((2, 3)) * mask).sum().backward()
    (c,) = caps
    ref = F.layer_norm(x, (3, 4)).reshape(4, 5, 12) * mask[..., None]
    torch.testing.assert_close(c.forward, ref)
    flat = ref.reshape(-1, 12)
    torch.testing.assert_close(c.forward_gram(), flat.T @ flat, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c.forward_sum(), flat.sum(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(c.forward_sq_sum(), flat.square().sum(0), rtol=1e-5, atol=1e-5)
    params = {k: v.detach() for k, v in ln.named_parameters()}

    def loss(p, xi, mi):
        return (functional_call(ln, p, (xi,)).square().sum((1, 2)) * mi).sum()

    g = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, mask)
    got = c.per_sample_grads_by_param()
    torch.testing.assert_close(got["weight"], g["weight"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got["bias"], g["bias"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("hook_api", ["private", "public fallback"])
def test_module_called_twice_and_inplace_relu(hook_api, monkeypatch):
    if hook_api == "public fallback":  # as on a torch without the private registration method
        from nnstat.capture import engine as engine_module

        monkeypatch.setattr(engine_module, "_REGISTER_HOOK_DICT", "_no_such_method")
    torch.manual_seed(0)

    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.act = nn.ReLU(inplace=True)
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.act(self.fc(self.act(self.fc(x)))))

    model = Shared()
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))
    calls = []
    engine = CaptureEngine()
    engine.watch(model)
    engine.add_consumer(calls.append)
    with engine.batch():
        ce_sum(model, x, y).backward()
    assert sorted(c.name for c in calls) == ["fc", "head"]  # once per module per backward
    assert_matches({c.name: c for c in calls}, reference_grads(model, ce_sum, x, y))
    # a user's own hook on a watched output (public API either way) still runs, and so do ours
    seen = []
    engine = CaptureEngine()
    engine.watch(model)
    engine.add_consumer(calls.append)

    def users_hook(module, inputs, out):
        out.register_hook(lambda g: seen.append(tuple(g.shape)))

    handle = model.head.register_forward_hook(users_hook)
    calls.clear()
    with engine.batch():
        ce_sum(model, x, y).backward()
    handle.remove()
    engine.unwatch()
    assert seen == [(5, 2)] and sorted(c.name for c in calls) == ["fc", "head"]
    assert_matches({c.name: c for c in calls}, reference_grads(model, ce_sum, x, y))


def test_projection_matches_explicit_product():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(9, 5), nn.Linear(5, 6), nn.LayerNorm(6), nn.Linear(6, 3, bias=False)
    )
    x, y = torch.randint(0, 9, (4, 7)), torch.randint(0, 3, (4, 7))
    caps = captured(model, lambda: ce_sum(model, x, y).backward())
    for cap in caps.values():
        g = cap.per_sample_grad()
        if cap.is_kronecker:
            p_in, p_out = torch.randn(3, cap.d_in), torch.randn(2, cap.d_out)
            want = (p_out @ g @ p_in.T).reshape(len(g), -1)
            torch.testing.assert_close(cap.project(p_in, p_out), want, rtol=1e-4, atol=1e-4)
            with pytest.raises(ValueError, match=r"p_in must have shape \[r, "):
                cap.project(torch.randn(3, cap.d_in + 1), p_out)
        else:
            p = torch.randn(4, g.shape[1])
            torch.testing.assert_close(cap.project(p), g @ p.T, rtol=1e-4, atol=1e-4)


def test_gram_trick_sq_norm_and_projection_with_mask_and_bias():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 3))
    x, y = torch.randn(4, 3, 24), torch.randint(0, 3, (4, 3))
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)

    def masked(f, x, y, m):
        out = f(x)
        per_tok = F.cross_entropy(out.reshape(-1, 3), y.reshape(-1), reduction="none")
        return (per_tok * m.reshape(-1)).sum()

    caps = captured(model, lambda: ce_sum(model, x, y).backward(), mask=mask)
    cap = caps["0"]
    assert 3 * (cap.d_in + cap.d_out) < cap.d_in * cap.d_out  # the Gram path is taken
    assert_matches(caps, reference_grads(model, masked, x, y, mask.float()))
    g = cap.per_sample_grad()
    p_in, p_out = torch.randn(5, cap.d_in), torch.randn(4, cap.d_out)
    want = (p_out @ g @ p_in.T).reshape(4, -1)
    torch.testing.assert_close(cap.project(p_in, p_out), want, rtol=1e-4, atol=1e-4)
    a = cap.forward.reshape(-1, cap.d_in)
    torch.testing.assert_close(cap.forward_gram(), a.T @ a)
    assert cap.forward[..., -1].sum() == mask.sum()  # the bias column is 0 on masked rows


def test_grouped_conv_mask_over_output_positions():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 6, 3, groups=2, padding=1, stride=2))
    x = torch.randn(3, 4, 6, 5)
    mask = torch.rand(3, 3, 3) > 0.4

    def masked(f, x, m):
        return (f(x).square() * m.unsqueeze(1)).sum()

    caps = captured(model, lambda: model(x).square().sum().backward(), mask=mask)
    assert caps["0"].num_positions == int(mask.sum()) * 2  # one row per (location, group)
    assert_matches(caps, reference_grads(model, masked, x, mask.float()))


def test_embedding_padding_on_the_gram_path_of_sq_norms():
    """T^2 <= V takes the Gram identity sum_{t,s} [a_t = a_s] b_t.b_s; padded positions (-1)
    must not pair with each other although their output gradients are not zero."""
    torch.manual_seed(0)
    pad = 7
    model = nn.Sequential(nn.Embedding(64, 4, padding_idx=pad), nn.Linear(4, 3))
    x = torch.tensor([[pad, 0, pad, 5, 5, pad], [0, 0, pad, pad, 9, 9], [3, 4, 5, 6, 8, 0]])
    y = torch.randint(0, 3, (3, 6))
    caps = captured(model, lambda: ce_sum(model, x, y).backward())
    cap = caps["0"]
    assert 6 * 6 <= cap.d_in  # T^2 <= V: the Gram branch is the one taken
    assert (cap.backward[x == pad].abs().sum(-1) > 0).all()  # padded outputs carry gradient
    ref = reference_grads(model, ce_sum, x, y)["0.weight"]  # [N, V, D] via torch.func
    assert ref[:, pad].abs().sum() == 0
    torch.testing.assert_close(cap.per_sample_sq_norm(), ref.pow(2).sum((1, 2)), rtol=1e-5, atol=0)
    torch.testing.assert_close(cap.per_sample_grad(), ref.transpose(1, 2), rtol=1e-5, atol=1e-6)
