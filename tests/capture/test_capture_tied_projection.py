"""Projected rows of a tied weight (an embedding tied to the output head, GPT-2 style), which
the capture projects module by module, the embedding's one-hot token rows as a lookup of the
projection, without building them: equal to the projection of ``torch.func`` per-sample
gradients of the shared weight (both uses), and bit for bit equal to the projection of the
capture's dense matrices (one-hot rows and all), masked positions included."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat

V, D, T, N, R_OUT, R_IN = 13, 6, 5, 4, 3, 2


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        return self.lm_head(x + torch.tanh(self.mid(x)))


def _loss(logits: torch.Tensor) -> torch.Tensor:
    return logits.square().sum() / 7 + logits[..., 0].sum()


def _head_capture(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None = None):
    engine = nnstat.CaptureEngine()
    assert engine.watch(model) == ["mid", "lm_head"]  # wte is captured under lm_head
    caps = {}
    engine.add_consumer(lambda c: caps.update({c.name: c}))
    with engine.batch(mask=mask):
        _loss(model(ids)).backward()
    engine.unwatch()
    return caps["lm_head"]


def test_tied_rows_equal_projected_per_sample_gradients_of_the_shared_weight():
    torch.manual_seed(0)
    model = TiedLM().double()
    ids = torch.randint(0, V, (N, T), generator=torch.Generator().manual_seed(1))
    p_out = torch.randn(R_OUT, V, dtype=torch.float64)
    p_in = torch.randn(R_IN, D, dtype=torch.float64)
    cap = _head_capture(model, ids)

    params = {k: v.detach() for k, v in model.named_parameters()}  # the tied weight once
    per_sample = vmap(
        grad(lambda p, x: _loss(functional_call(model, p, (x[None],)))), in_dims=(None, 0)
    )(params, ids)[
        "wte.weight"
    ]  # [N, V, D]: lm_head's orientation, both uses summed
    want = (p_out @ per_sample @ p_in.T).reshape(N, -1)

    # captures hold float32 rows (whatever the model's dtype): float32 accuracy
    tol = dict(rtol=1e-5, atol=1e-5 * want.abs().max().item())
    torch.testing.assert_close(cap.project(p_in, p_out).double(), want, **tol)
    # written into the columns of a wider row buffer, as the store does
    buf = torch.zeros(N, 3 + R_OUT * R_IN + 2)
    got = cap.project(p_in, p_out, out=buf[:, 3 : 3 + R_OUT * R_IN])
    torch.testing.assert_close(got.double(), want, **tol)
    assert buf[:, :3].eq(0).all() and buf[:, -2:].eq(0).all()


def test_tied_rows_are_the_projection_of_the_dense_one_hot_matrices():
    torch.manual_seed(0)
    model = TiedLM()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (N, T), generator=g)
    mask = (torch.rand(N, T, generator=g) > 0.4).float()  # masked tokens: index -1
    p_out, p_in = torch.randn(R_OUT, V), torch.randn(R_IN, D)
    cap = _head_capture(model, ids, mask)
    rows = cap.project(p_in, p_out)
    # the capture's matrices, built densely: [N, 2T, D] inputs, [N, 2T, V] output gradients
    # whose first half is the embedding's one-hot tokens (watch order: wte, then lm_head)
    a, b = cap.forward, cap.backward
    assert a.shape == (N, 2 * T, D) and b.shape == (N, 2 * T, V)
    assert torch.equal(b[:, :T].sum(-1), mask)  # one-hot rows, zero where masked
    # the reference in float64: the part-by-part GEMMs and the dense one are blocked
    # differently by the BLAS, so their float32 results may differ in the last bit
    a64, b64, po64, pi64 = a.double(), b.double(), p_out.double(), p_in.double()
    dense = torch.bmm((b64 @ po64.T).transpose(1, 2), a64 @ pi64.T).reshape(N, -1)
    torch.testing.assert_close(rows.double(), dense, rtol=1e-5, atol=1e-5 * dense.abs().max())


class TiedInput(nn.Module):
    """A HF ``Conv1D`` (``W`` ``[nx, nf]`` = ``[V, D]``) on dense V-wide features, tied to the
    embedding: the merged capture's token side is its input side (the transposed orientation)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.pytorch_utils import Conv1D as HFConv1D

        class Conv1D(HFConv1D):  # without a bias: a tie shares every parameter
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x @ self.weight

        self.wte = nn.Embedding(V, D)
        self.proj = Conv1D(D, V)  # Conv1D(nf, nx)
        self.proj.register_parameter("bias", None)
        self.proj.weight = self.wte.weight
        self.out = nn.Linear(D, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        feats = torch.nn.functional.softmax(torch.linspace(-1, 1, V).expand(*ids.shape, V), -1)
        return self.out(torch.tanh(self.wte(ids) + self.proj(feats * ids.unsqueeze(-1))))


def _tied_capture(model: nn.Module, ids: torch.Tensor, owner: str, mask=None):
    engine = nnstat.CaptureEngine()
    engine.watch(model)
    caps = {}
    engine.add_consumer(lambda c: caps.update({c.name: c}))
    with engine.batch(mask=mask):
        _loss(model(ids)).backward()
    engine.unwatch()
    model.zero_grad(set_to_none=True)
    return caps[owner]


@pytest.mark.parametrize("model_cls, owner", [(TiedLM, "lm_head"), (TiedInput, "proj")])
def test_tied_per_sample_gradients_and_norms_from_the_parts_equal_the_dense_matrices(
    model_cls, owner
):
    # the merged capture forms G_i module by module (a GEMM, or a scatter of the rows beside a
    # token side) instead of from the one-hot rows and their concatenation: the same matrix
    torch.manual_seed(0)
    model = model_cls()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (N, T), generator=g)
    mask = (torch.rand(N, T, generator=g) > 0.3).float()
    for m in (None, mask):
        cap = _tied_capture(model, ids, owner, m)
        got, norms = cap.per_sample_grad(), cap.per_sample_sq_norm()
        dense = torch.bmm(cap.backward.transpose(1, 2), cap.forward)  # the joined matrices
        assert got.shape == dense.shape == (N, cap.d_out, cap.d_in)
        torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-6)
        want = dense.square().sum((1, 2))
        torch.testing.assert_close(norms, want, rtol=1e-5, atol=1e-6)
        # both ways to the norms, whichever per_sample_sq_norm picks: the two sides' Grams
        # (blocks between token parts, token and dense parts, dense parts) or the matrices
        torch.testing.assert_close(cap.gram_sq_norm(), want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(cap.matrix_sq_norm(), want, rtol=1e-5, atol=1e-6)
        # summed over the samples (the noise scale's per-step path): the Gram blocks' dots
        total = want.double().sum()
        blocks = sum(v.double() for v in cap.gram_sq_norm_sum())
        torch.testing.assert_close(blocks, total, rtol=1e-5, atol=1e-6)
        tensors, values, c = cap.sq_norm_parts()
        parts = c * (sum(t.double().square().sum() for t in tensors) + sum(values))
        torch.testing.assert_close(parts.double(), total, rtol=1e-5, atol=1e-6)
        # the batch gradient, use by use over all positions at once
        torch.testing.assert_close(cap.batch_grad(), dense.sum(0), rtol=1e-5, atol=1e-6)
    # and, unmasked, the shared weight's per-sample gradients of both uses (torch.func)
    cap = _tied_capture(model, ids, owner)
    params = {k: v.detach() for k, v in model.named_parameters()}
    want = vmap(grad(lambda p, x: _loss(functional_call(model, p, (x[None],)))), in_dims=(None, 0))(
        params, ids
    )["wte.weight"]
    got = cap.per_sample_grads_by_param()["weight"]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item())


def test_tied_norms_take_the_grams_for_a_wide_head_over_few_positions():
    # GPT-2's shape in small: a vocabulary much wider than the positions, where the Grams
    # ([N, 2T, 2T]) cost a fraction of the [N, V, D] per-sample matrices
    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, V, (N, 2), generator=torch.Generator().manual_seed(7))
    cap = _tied_capture(model, ids, "lm_head")
    calls = []
    cap.matrix_sq_norm = lambda: calls.append("matrix")  # must not be taken
    norms = cap.per_sample_sq_norm()
    dense = torch.bmm(cap.backward.transpose(1, 2), cap.forward).square().sum((1, 2))
    assert calls == []
    torch.testing.assert_close(norms, dense, rtol=1e-5, atol=1e-6)


def test_tied_norms_and_batch_gradient_build_no_token_sized_tensor():
    # nothing as large as the one-hot token rows [N, T, V] is built after the backward: the
    # old capture formed them (and their [N, 2T, V] concatenation) for every norm
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Largest(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.size = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and not func.is_view:  # views build nothing
                    self.size = max(self.size, t.numel())
            return out

    torch.manual_seed(0)
    model = TiedLM()
    ids = torch.randint(0, V, (N, 2), generator=torch.Generator().manual_seed(8))
    cap = _tied_capture(model, ids, "lm_head")
    with Largest() as seen:
        cap.per_sample_sq_norm()
        cap.batch_grad()
    assert 0 < seen.size < N * 2 * V, seen.size
