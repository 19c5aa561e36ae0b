"""Exact influence on an indefinite ``H + λI``: found from the Ritz values the solvers' own
coefficients give, within a bounded number of passes, then refused or damped by refinement's
rule. References: an explicit indefinite matrix, and an untrained tanh MLP's explicit Hessian
and its eigendecomposition (``torch.autograd.functional.hessian``)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from _influence_ref import flat_grads, full_hessian, tiny_problem
from torch import nn

from nnstat.influence import exact
from nnstat.influence.krylov import block_cg, lanczos_ritz, lissa, preconditioned_cg

D = torch.float64
streamed_mod = importlib.import_module("nnstat.curvature.streamed")  # the products


def _matrix(evals: list[float], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(len(evals), len(evals), generator=g, dtype=D))
    return q @ torch.diag(torch.tensor(evals, dtype=D)) @ q.T


def test_lanczos_ritz_values_of_cg_coefficients_are_the_eigenvalues_once_the_space_is_full():
    a = _matrix([0.5 + 0.25 * i for i in range(12)])
    b = torch.randn(2, 12, generator=torch.Generator().manual_seed(1), dtype=D)
    _, info = preconditioned_cg(lambda v: v @ a, None, b, 12, tol=0)
    for row in range(2):
        ritz = lanczos_ritz(info["alphas"][:, row], info["betas"][:, row])
        torch.testing.assert_close(ritz, torch.linalg.eigvalsh(a), rtol=1e-6, atol=1e-8)
    # after fewer steps: inside [λ_min, λ_max] (interlacing), the extremes approached first
    _, info = preconditioned_cg(lambda v: v @ a, None, b, 4, tol=0)
    ritz = lanczos_ritz(info["alphas"][:, 0], info["betas"][:, 0])
    assert 0.5 - 1e-12 <= ritz.min() and ritz.max() <= 0.5 + 0.25 * 11 + 1e-12


@pytest.mark.parametrize("solver", ["block", "cg"])
def test_an_explicit_indefinite_matrix_is_refused_with_a_ritz_value_above_its_minimum(solver):
    """One negative eigenvalue among 20: both solvers stop within the dimension's steps, and the
    curvature they report is a Ritz value: negative, and no lower than λ_min."""
    evals = [-0.3] + [0.5 + 0.2 * i for i in range(19)]
    a = _matrix(evals)
    b = torch.randn(3, 20, generator=torch.Generator().manual_seed(2), dtype=D)
    calls = []

    def matvec(v):
        calls.append(len(v))
        return v @ a

    with pytest.raises(ValueError, match="not positive definite") as e:
        if solver == "block":
            block_cg(matvec, lambda r: r, b, steps=10)
        else:
            preconditioned_cg(matvec, None, b, steps=40)
    curvature = min(e.value.curvature)
    assert -0.3 - 1e-9 <= curvature < 0
    assert len(calls) <= (7 if solver == "block" else 20)  # 3 per pass: 20 in 7 passes


def _mlp():
    model, train, query = tiny_problem(n_train=30, n_query=4, train_steps=0)  # untrained
    h = full_hessian(model, *train)
    return model, train, query, h, torch.linalg.eigvalsh(h)


@pytest.mark.parametrize("solver", ["block", "cg"])
def test_exact_refuses_an_indefinite_system_within_bounded_passes(solver, monkeypatch):
    model, train, query, h, evals = _mlp()
    lam_min = float(evals[0])
    assert lam_min < -0.02  # the untrained tanh MLP's Hessian is indefinite
    lam = -lam_min / 3  # H + λI keeps a negative eigenvalue
    passes = []
    hvp = streamed_mod.graph_hvp
    monkeypatch.setattr(streamed_mod, "graph_hvp", lambda *a: passes.append(1) or hvp(*a))
    with pytest.raises(ValueError, match="not positive definite") as e:
        exact(model, nn.functional.cross_entropy, train, query, lam, solver=solver, batch_size=30)
    msg = str(e.value)
    assert f"damping {lam:.3g}" in msg and "indefinite='damp'" in msg
    theta = float(msg.split("the Hessian has curvature ")[1].split(" ")[0])
    assert lam_min - 1e-3 <= theta < -lam  # a Ritz value of H: above λ_min, below -λ
    need = float(msg.split("Pass damping >= ")[1].split(" ")[0])
    assert need == pytest.approx(1.5 * -theta, rel=1e-2)
    dim = len(h)
    bound = math.ceil(dim / 4) + 2 if solver == "block" else min(2 * dim, 1000)
    assert len(passes) <= bound  # one batch of 30: a product is one graph_hvp call


def test_exact_damps_an_indefinite_system_by_refinements_rule():
    """indefinite='damp': λ raised in place to 1.5 x the Hessian's most negative Ritz value;
    the whole space explored, that is λ_min itself, and the scores are the explicit solve at
    the final λ."""
    model, train, query, h, evals = _mlp()
    lam_min = float(evals[0])
    with pytest.warns(UserWarning, match="raised from"):
        res = exact(
            model, nn.functional.cross_entropy, train, query, -lam_min / 3, indefinite="damp"
        )
    lam = res.meta["damping"]
    assert res.meta["damping_asked"] == pytest.approx(-lam_min / 3)
    assert "raised from" in res.meta["damping_rule"] and lam > -lam_min
    assert lam == pytest.approx(-1.5 * lam_min, rel=1e-6)
    g_t, g_q = flat_grads(model, *train), flat_grads(model, *query)
    ref = g_q @ torch.linalg.solve(h + lam * torch.eye(len(h), dtype=D), g_t.T)
    assert ((res.scores.double() - ref).norm() / ref.norm()).item() < 1e-5


def test_exact_stops_at_max_iter_and_says_so():
    model, train, query, h, evals = _mlp()
    lam = -float(evals[0]) + 1e-3  # definite, badly conditioned: not solved in 5 steps
    with pytest.warns(UserWarning, match="stopped after 5 passes"):
        res = exact(model, nn.functional.cross_entropy, train, query, lam, solver="cg", max_iter=5)
    assert res.meta["passes"] == 5 and res.meta["max_residual"] > 1e-6


def test_lissa_refuses_an_explicit_indefinite_matrix_with_its_negative_curvature():
    """The Neumann series diverges along a negative eigenvalue: stopped long before its depth,
    the curvature it reports is negative and no lower than λ_min (a Rayleigh quotient)."""
    evals = [-0.3] + [0.5 + 0.2 * i for i in range(19)]
    a = _matrix(evals)
    b = torch.randn(3, 20, generator=torch.Generator().manual_seed(2), dtype=D)
    calls = []

    def matvec(v):
        calls.append(len(v))
        return v @ a

    with pytest.raises(ValueError, match="not positive definite") as e:
        lissa(matvec, b, scale=1.1 * max(abs(x) for x in evals), depth=5000)
    assert len(calls) < 200
    assert all(-0.3 - 1e-9 <= c <= 0 for c in e.value.curvature)
    assert min(e.value.curvature) < -0.2  # the growing direction dominates when it is stopped


def test_exact_lissa_refuses_an_indefinite_system_like_conjugate_gradient(monkeypatch):
    model, train, query, h, evals = _mlp()
    lam_min = float(evals[0])
    lam = -lam_min / 3  # H + λI keeps a negative eigenvalue
    passes = []
    hvp = streamed_mod.graph_hvp
    monkeypatch.setattr(streamed_mod, "graph_hvp", lambda *a: passes.append(1) or hvp(*a))
    with pytest.raises(ValueError, match="not positive definite") as e:
        exact(model, nn.functional.cross_entropy, train, query, lam, method="lissa",
              batch_size=30, lissa_depth=1000)  # fmt: skip
    msg = str(e.value)
    assert f"damping {lam:.3g}" in msg and "indefinite='damp'" in msg and "LiSSA" in msg
    theta = float(msg.split("the Hessian has curvature ")[1].split(" ")[0])
    assert lam_min - 1e-3 <= theta < -lam
    assert len(passes) < 200  # power iteration's 30, then the series until it grows


def test_exact_lissa_damps_an_indefinite_system_and_matches_the_explicit_solve():
    model, train, query, h, evals = _mlp()
    lam_min = float(evals[0])
    with pytest.warns(UserWarning, match="raised from"):
        res = exact(model, nn.functional.cross_entropy, train, query, -lam_min / 3,
                    method="lissa", indefinite="damp")  # fmt: skip
    lam = res.meta["damping"]
    assert lam > -lam_min and "raised from" in res.meta["damping_rule"]
    assert torch.isfinite(res.scores).all()
    g_t, g_q = flat_grads(model, *train), flat_grads(model, *query)
    ref = g_q @ torch.linalg.solve(h + lam * torch.eye(len(h), dtype=D), g_t.T)
    assert ((res.scores.double() - ref).norm() / ref.norm()).item() < 1e-5
