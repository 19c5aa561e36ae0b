"""Iterates before convergence: block CG after a damping raise, refinement's first steps.

Converged solutions hide what an iterate is made of: any preconditioner, any bookkeeping of the
shifted products reaches the same ``A⁻¹b`` once the space is full. These tests stop early and
compare against explicit matrices: the reported residual against ``‖b − (A+δI)x‖/‖b‖``, and
refinement's scores against a preconditioned-CG recurrence written out here with the same ``λ``
in ``M`` and ``A``.
"""

from __future__ import annotations

import pytest
import torch
from torch.func import functional_call, grad, hessian, vmap

from nnstat.influence import ModuleSpec, Refinement, TensorSource, compute_influence_all
from nnstat.influence.krylov import block_cg

D = torch.float64


def _spd(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=D))
    return q @ torch.diag(torch.logspace(-1, 1, n, dtype=D)) @ q.T


@pytest.mark.parametrize("raise_at", [1, 2])
def test_block_cg_residual_after_a_shift_is_the_true_residual(raise_at):
    n, delta = 12, 0.7
    a = _spd(n, 0)
    rhs = torch.randn(2, n, generator=torch.Generator().manual_seed(1), dtype=D)
    scale = torch.linspace(0.5, 2.0, n, dtype=D)  # a diagonal preconditioner (not A's inverse)
    state = {"calls": 0, "shift": 0.0}
    directions = []

    def matvec(v):
        return v @ a + state["shift"] * v

    def precondition(r):
        z = r * scale
        directions.append(z)
        return z

    def shift(mu):
        state["calls"] += 1
        if state["calls"] == raise_at:
            state["shift"] += delta
            # the step's directions were taken from the residual before the shift (the solver
            # reads μ and the new directions' count together): they are taken again after it
            directions.pop()
            return delta
        return 0.0

    x, info = block_cg(matvec, precondition, rhs, steps=3, shift=shift)
    assert state["shift"] == delta and info["passes"] == 3  # 6 directions of 12: not full
    true = (rhs - x @ (a + delta * torch.eye(n, dtype=D))).norm(dim=1) / rhs.norm(dim=1)
    assert true.min() > 1e-6  # not converged: the residual says something
    torch.testing.assert_close(info["residual"], true, rtol=1e-8, atol=1e-12)
    # Galerkin: the true residual is orthogonal to the search space (the directions added)
    basis = torch.linalg.qr(torch.cat(directions).T).Q
    r = rhs - x @ (a + delta * torch.eye(n, dtype=D))
    assert (r @ basis).abs().max() < 1e-10 * rhs.norm()


def _problem():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    x = torch.randn(30, 3, dtype=D)
    y = torch.randint(0, 2, (30,))
    loss = torch.nn.functional.cross_entropy
    params = {k: v.detach() for k, v in model.named_parameters()}

    def rows(xs, ys):  # per-sample gradients in the store's row layout: [W | b] per output
        g = vmap(
            grad(lambda p, a, b: loss(functional_call(model, p, (a[None],)), b[None])),
            (None, 0, 0),
        )(params, xs, ys)
        return torch.cat([g["weight"], g["bias"][..., None]], -1).flatten(1)

    def mean_loss(theta):
        wb = theta.reshape(2, 4)
        p = {"weight": wb[:, :3], "bias": wb[:, 3]}
        return loss(functional_call(model, p, (x,)), y)

    theta = torch.cat([params["weight"], params["bias"][:, None]], 1).flatten()
    h = hessian(mean_loss)(theta)
    return model, loss, x, y, rows(x, y), rows(x[:2], y[:2]), h


def _pcg(a: torch.Tensor, m_inv: torch.Tensor, b: torch.Tensor, steps: int) -> torch.Tensor:
    """Textbook preconditioned CG from x = 0, one right-hand side."""
    x = torch.zeros_like(b)
    r = b.clone()
    z = m_inv @ r
    p = z.clone()
    for _ in range(steps):
        ap = a @ p
        alpha = (r @ z) / (p @ ap)
        x = x + alpha * p
        r_new = r - alpha * ap
        z_new = m_inv @ r_new
        p = z_new + (r_new @ z_new) / (r @ z) * p
        r, z = r_new, z_new
    return x


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("solver", ["cg", "block"])
def test_refinement_iterate_is_preconditioned_cg_with_one_damping(steps, solver):
    model, loss, x, y, train_rows, query_rows, h = _problem()
    f_raw = train_rows.T @ train_rows / len(train_rows)  # the "raw" preconditioner's curvature
    lam = float(torch.linalg.eigvalsh(f_raw).mean())  # 10x the raw default: they differ
    eye = torch.eye(8, dtype=D)
    a, m_inv = h + lam * eye, torch.linalg.inv(f_raw + lam * eye)
    ref = torch.stack([_pcg(a, m_inv, q, steps) for q in query_rows])
    exact = torch.linalg.solve(a, query_rows.T).T
    assert (ref - exact).norm() > 1e-3 * exact.norm()  # an iterate, not the solution
    lay = [ModuleSpec("model", 0, 2, 4)]
    refine = Refinement(
        model, loss, (x, y), steps=steps, damping=lam, preconditioner="raw",
        curvature="hessian", solver=solver, query_batch=1 if solver == "block" else 32,
        dtype=D, progress=False,
    )  # fmt: skip
    res = compute_influence_all(
        TensorSource(query_rows.float(), layout=lay),
        TensorSource(train_rows.float(), layout=lay),
        refine=refine,
        damping=lam,
    )
    assert res.meta["refine"]["damping"] == pytest.approx(lam)
    want = ref @ train_rows.T
    torch.testing.assert_close(res.scores.double(), want, rtol=2e-4, atol=2e-4 * want.abs().max())
