"""The default curvature of self-influence on a query log, against the explicit EK-FAC formula.

A query log made after an ``ekfac`` statistics pass carries the pass's EK-FAC factor (K-FAC
eigenbases and eigenvalues corrected on the training gradients). Without ``train``, the
self-influence of the log's rows must use that stored factor: not K-FAC, and not eigenvalues
refitted on the query rows themselves (which are not training data).
"""

from __future__ import annotations

import pytest
import torch
from _influence_ref import layer_grads
from torch import nn

import nnstat
from nnstat.influence import compute_self_influence

N_TRAIN, BATCH, N_QUERY = 24, 8, 5


def _grads(model, data):
    """{layer: [n, d_out, d_in + 1]} float64 per-sample gradients (torch.func reference)."""
    return {k: v.double() for k, v in layer_grads(model, *data).items()}


def _kfac_factors(model, x, y):
    """{layer: (S, A)} from layer inputs and output gradients of the summed loss."""
    z0 = model[0](x).detach().requires_grad_(True)
    h = torch.tanh(z0)
    z2 = model[2](h)
    b0, b2 = torch.autograd.grad(nn.functional.cross_entropy(z2, y, reduction="sum"), [z0, z2])
    ones = torch.ones(len(x), 1)
    return {
        name: (
            b.double().T @ b.double() / len(x),
            a.detach().double().T @ a.detach().double() / len(x),
        )
        for name, a, b in (("0", torch.cat([x, ones], 1), b0), ("2", torch.cat([h, ones], 1), b2))
    }


@pytest.fixture(scope="module")
def ekfac_query_log(tmp_path_factory):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x, y = torch.randn(N_TRAIN, 4), torch.randint(0, 3, (N_TRAIN,))
    # queries from another distribution: their own corrected eigenvalues differ from training's
    xq, yq = 3.0 * torch.randn(N_QUERY, 4) + 1.0, torch.randint(0, 3, (N_QUERY,))
    run = nnstat.init(project="ekfac_default", root_dir=tmp_path_factory.mktemp("runs"))
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "ekfac"})
    nnstat.watch(model)
    for _ in run.schedule():  # the factors pass, then the eigenvalues pass (with rows)
        for start in range(0, N_TRAIN, BATCH):
            sl = slice(start, start + BATCH)
            with run(data_id=list(range(start, start + BATCH))):
                nn.functional.cross_entropy(model(x[sl]), y[sl], reduction="sum").backward()
            model.zero_grad()
    nnstat.eval()
    with run(data_id=[f"q{i}" for i in range(N_QUERY)]):
        nn.functional.cross_entropy(model(xq), yq, reduction="sum").backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return model, (x, y), (xq, yq), log


def _explicit_self_influence(model, train, query, stats, damping=None):
    """g_q^T (Q diag(Lambda) Q^T + lambda I)^-1 g_q per module, dense in float64: Q the stored
    eigenbases (checked to diagonalise the explicit K-FAC factors), Lambda = mean over the
    training samples of (Q_S^T G_i Q_A)^2 from torch.func gradients, lambda = `damping` or
    0.1 x mean(Lambda) per module."""
    gt, gq = _grads(model, train), _grads(model, query)
    factors = _kfac_factors(model, *train)
    scores, dampings = torch.zeros(len(query[0]), dtype=torch.float64), {}
    for name in ("0", "2"):
        qs = stats[f"{name}/backward/eigenvectors"].double()
        qa = stats[f"{name}/forward/eigenvectors"].double()
        s, a = factors[name]
        for q, f in ((qs, s), (qa, a)):
            rot = q.T @ f @ q
            assert (rot - torch.diag(rot.diagonal())).abs().max() < 1e-4 * f.abs().max()
        lam = ((qs.T @ gt[name] @ qa) ** 2).mean(0)  # [d_out, d_in + 1]
        dampings[name] = damping if damping is not None else 0.1 * lam.mean().item()
        basis = torch.kron(qs, qa)  # acts on row-major vec(G)
        h = basis @ torch.diag(lam.flatten()) @ basis.T
        g = gq[name].flatten(1)
        eye = torch.eye(len(h), dtype=h.dtype)
        scores += (g * torch.linalg.solve(h + dampings[name] * eye, g.T).T).sum(1)
    return scores, dampings


@pytest.mark.parametrize("damping", [1e-2, None])
def test_query_log_self_influence_defaults_to_the_stored_ekfac(ekfac_query_log, damping):
    model, train, query, log = ekfac_query_log
    stats = log.statistics() if callable(log.statistics) else log.statistics
    assert {"0/ekfac/eigenvalues", "2/ekfac/eigenvalues"} <= set(stats)
    res = compute_self_influence(log, damping=damping, progress=False)
    assert res.meta["preconditioner"] == "ekfac"
    assert res.ids == [f"q{i}" for i in range(N_QUERY)]
    want, dampings = _explicit_self_influence(model, train, query, stats, damping)
    torch.testing.assert_close(res.scores.double(), want, rtol=1e-3, atol=0)
    assert res.meta["module_damping"] == pytest.approx(dampings, rel=1e-4)
    # the other candidates give other numbers: the comparison above has power
    for other in ("kfac", "raw"):
        alt = compute_self_influence(log, preconditioner=other, damping=damping, progress=False)
        assert not torch.allclose(alt.scores.double(), want, rtol=0.05, atol=0), other
