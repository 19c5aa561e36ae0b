"""`nnstat.influence.exact` against the explicit Hessian of a tiny MLP."""

from __future__ import annotations

import pytest
import torch
from _influence_ref import flat_grads, full_hessian, tiny_problem
from torch import nn

from nnstat.influence import exact


@pytest.fixture(scope="module")
def problem():
    model, train, query = tiny_problem(n_train=30, n_query=4)
    h = full_hessian(model, *train)
    lam = max(0.05, -torch.linalg.eigvalsh(h).min().item() + 0.05)
    g_t = flat_grads(model, *train)
    g_q = flat_grads(model, *query)
    expected = g_q @ torch.linalg.solve(h + lam * torch.eye(len(h), dtype=h.dtype), g_t.T)
    return model, train, query, lam, expected


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def test_cg_matches_explicit_hessian(problem):
    model, train, query, lam, expected = problem
    res = exact(model, nn.functional.cross_entropy, train, query, damping=lam, batch_size=8)
    assert res.scores.shape == (4, 30)
    assert _rel_err(res.scores, expected) < 1e-4
    assert res.meta["preconditioner"] == "exact-cg"


def test_sum_reduction_and_dataset_inputs_agree(problem):
    model, train, query, lam, expected = problem

    def loss_sum(out, y):
        return nn.functional.cross_entropy(out, y, reduction="sum")

    data = torch.utils.data.TensorDataset(*train)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*query), batch_size=3)
    res = exact(model, loss_sum, data, loader, damping=lam, loss_reduction="sum", batch_size=7)
    assert _rel_err(res.scores, expected) < 1e-4


def test_lissa_approximates_explicit_hessian(problem):
    model, train, query, _, _ = problem
    lam = 0.5  # a well-conditioned system so the Neumann series converges in a few hundred steps
    h = full_hessian(model, *train)
    g_t, g_q = flat_grads(model, *train), flat_grads(model, *query)
    expected = g_q @ torch.linalg.solve(h + lam * torch.eye(len(h), dtype=h.dtype), g_t.T)
    res = exact(
        model,
        nn.functional.cross_entropy,
        train,
        query,
        damping=lam,
        method="lissa",
        lissa_depth=2000,
        tol=1e-10,
    )
    assert _rel_err(res.scores, expected) < 1e-4


def test_exact_rejects_bad_arguments(problem):
    model, train, query, lam, _ = problem
    with pytest.raises(ValueError, match="loss_reduction"):
        exact(model, nn.functional.cross_entropy, train, query, lam, loss_reduction="none")
    with pytest.raises(ValueError, match="method"):
        exact(model, nn.functional.cross_entropy, train, query, lam, method="arnoldi")
    with pytest.raises(ValueError, match="damping"):
        exact(model, nn.functional.cross_entropy, train, query, float("nan"))
    with pytest.raises(TypeError, match="tuple of tensors"):
        exact(model, nn.functional.cross_entropy, [1, 2, 3], query, lam)
