"""``nnstat.noise_scale``: every reported number against exact values on known batches.

The batches are fixed (the sampler is replaced by a list of index draws), so the estimator's
output is a deterministic function of per-sample gradients, computed here by ``torch.func``:
``|G_b|^2`` of each chunk, the McCandlish two-batch solution per estimate, averaged over the
estimates, per parameter and for the model. ``big_batch`` is not a multiple of
``small_batch``: the short last chunk belongs to the big batch only.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
import nnstat.gradient_noise.estimate as estimate

B_SMALL, B_BIG, N_EST = 4, 10, 3


@pytest.fixture
def problem(monkeypatch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(40, 3)
    y = torch.randn(40, 2) + 1.0  # offset: a clear mean gradient
    g = torch.Generator().manual_seed(1)
    draws = [torch.randint(0, 40, (B_BIG,), generator=g) for _ in range(N_EST)]
    queue = list(draws)
    monkeypatch.setattr(estimate, "_draw", lambda gen, n, size: queue.pop(0))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def own_loss(p, xi, yi):
        return nn.functional.mse_loss(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(own_loss), in_dims=(None, 0, 0))(params, x, y)
    per = {k: v.reshape(40, -1).double() for k, v in per.items()}
    return model, x, y, draws, per


def _sq_mean(per: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, float]:
    """``|mean_{i in idx} g_i|^2`` per parameter."""
    return {k: float(v[idx].mean(0).pow(2).sum()) for k, v in per.items()}


def _solve(small: float, big: float, b: float, B: float) -> tuple[float, float]:
    """E|G_b|^2 = |G|^2 + tr/b at b and B, solved for (|G|^2, tr)."""
    return (B * big - b * small) / (B - b), (small - big) / (1 / b - 1 / B)


def _check(res, small: list[dict], big: list[dict], b: int, layers: dict[str, list[str]]):
    pairs = list(zip(small, big, strict=True))
    totals = [_solve(sum(s.values()), sum(g.values()), b, B_BIG) for s, g in pairs]
    assert res.grad_sq_norm == pytest.approx(sum(t[0] for t in totals) / N_EST, rel=1e-4)
    assert res.trace_sigma == pytest.approx(sum(t[1] for t in totals) / N_EST, rel=1e-4)
    assert res.estimates["grad_sq_norm"] == pytest.approx([t[0] for t in totals], rel=1e-4)
    assert res.estimates["trace_sigma"] == pytest.approx([t[1] for t in totals], rel=1e-4)
    assert res.b_simple == pytest.approx(res.trace_sigma / res.grad_sq_norm, rel=1e-9)
    assert set(res.per_layer) == set(layers)
    for name, keys in layers.items():
        per = [_solve(sum(s[k] for k in keys), sum(g[k] for k in keys), b, B_BIG) for s, g in pairs]
        layer = res.per_layer[name]
        assert layer.grad_sq_norm == pytest.approx(sum(p[0] for p in per) / N_EST, rel=1e-4)
        assert layer.trace_sigma == pytest.approx(sum(p[1] for p in per) / N_EST, rel=1e-4)


def test_two_batch_values_are_exact_with_a_short_last_chunk(problem):
    model, x, y, draws, per = problem
    res = nnstat.noise_scale(
        model, nn.functional.mse_loss, (x, y), small_batch=B_SMALL, big_batch=B_BIG,
        n_estimates=N_EST,
    )  # fmt: skip
    small, big = [], []
    for idx in draws:
        chunks = [idx[s : s + B_SMALL] for s in range(0, B_BIG - B_SMALL + 1, B_SMALL)]
        assert [len(c) for c in chunks] == [4, 4]  # the last 2 samples: big batch only
        sq = [_sq_mean(per, c) for c in chunks]
        small.append({k: sum(s[k] for s in sq) / len(sq) for k in per})
        big.append(_sq_mean(per, idx))
    _check(res, small, big, B_SMALL, {k: [k] for k in per})


def test_per_sample_values_are_exact(problem):
    model, x, y, draws, per = problem
    res = nnstat.noise_scale(
        model, nn.functional.mse_loss, (x, y), method="per_sample", big_batch=B_BIG,
        n_estimates=N_EST,
    )  # fmt: skip
    small = [{k: float(v[idx].pow(2).sum(1).mean()) for k, v in per.items()} for idx in draws]
    big = [_sq_mean(per, idx) for idx in draws]
    _check(res, small, big, 1, {m: [f"{m}.weight", f"{m}.bias"] for m in ("0", "2")})


def test_per_sample_streaming_leaves_frozen_parameters_out_of_both_sides():
    """A frozen layer has per-sample gradients (its input needs a gradient) but no .grad: it
    is left out, and one with a frozen weight beside a trainable bias is left out with a
    warning, so tr(Σ) and |G|² cover the same parameters (torch.func per-sample grads)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 6),
        nn.Tanh(),
        nn.Linear(6, 6),
        nn.Tanh(),
        nn.Linear(6, 5),
        nn.Tanh(),
        nn.Linear(5, 3),
    )
    model[2].requires_grad_(False)  # frozen between trainable layers
    model[4].weight.requires_grad_(False)  # frozen weight, trainable bias
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    gns = nnstat.NoiseScale()
    with pytest.warns(RuntimeWarning, match=r"\['4'\] have frozen"):
        assert gns.watch(model) == ["0", "6"]
    with gns.batch(loss_reduction="sum"):
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    gns.unwatch()

    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    g = torch.cat([per[k].flatten(1) for k in ("0.weight", "0.bias", "6.weight", "6.bias")], 1)
    g = g.double()
    n, small, big = len(g), g.pow(2).sum(1).mean(), g.mean(0).pow(2).sum()
    assert gns.trace_sigma == pytest.approx(((small - big) / (1 - 1 / n)).item(), rel=1e-4)
    assert gns.grad_sq_norm == pytest.approx(((n * big - small) / (n - 1)).item(), rel=1e-4)


def test_per_sample_streaming_reads_a_sparse_embedding_gradient():
    """nn.Embedding(sparse=True): the batch gradient's norm comes from the sparse .grad (its
    coalesced values), equal to the dense embedding's per torch.func per-sample gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 3))
    x, y = torch.randint(0, 10, (6, 3)), torch.randint(0, 3, (6,))
    gns = nnstat.NoiseScale()
    gns.watch(model)
    with gns.batch():
        nn.functional.cross_entropy(model(x), y).backward()
    gns.unwatch()
    assert model[0].weight.grad.is_sparse

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    model[0].sparse = False  # torch.func differentiates the same lookup densely
    per = vmap(grad(loss), in_dims=(None, 0, 0))(
        {k: p.detach() for k, p in model.named_parameters()}, x, y
    )
    g = torch.cat([v.flatten(1) for v in per.values()], 1).double()
    n, small, big = len(g), g.pow(2).sum(1).mean(), g.mean(0).pow(2).sum()
    assert gns.trace_sigma == pytest.approx(((small - big) / (1 - 1 / n)).item(), rel=1e-4)
    assert gns.grad_sq_norm == pytest.approx(((n * big - small) / (n - 1)).item(), rel=1e-4)


@pytest.mark.parametrize("method", ["two_batch", "fit"])
def test_one_shot_estimators_read_sparse_embedding_gradients(method):
    """The batch-gradient estimators on nn.Embedding(sparse=True) equal those of the same
    model with a dense lookup (same weights, same batches)."""
    import copy

    torch.manual_seed(0)
    sparse = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 3))
    dense = copy.deepcopy(sparse)
    dense[0].sparse = False
    data = (torch.randint(0, 10, (64, 3)), torch.randint(0, 3, (64,)))
    got, ref = (
        nnstat.noise_scale(
            m, nn.functional.cross_entropy, data, small_batch=4, big_batch=16, n_estimates=4,
            method=method,
        )  # fmt: skip
        for m in (sparse, dense)
    )
    assert got.trace_sigma == pytest.approx(ref.trace_sigma, rel=1e-5)
    assert got.grad_sq_norm == pytest.approx(ref.grad_sq_norm, rel=1e-5)
