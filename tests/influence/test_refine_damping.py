"""A refined solve has one damping: the call's and ``Refinement(damping=)`` may not disagree."""

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.influence import Refinement, compute_influence_all, compute_self_influence

LOSS = nn.functional.cross_entropy


def _store(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(14, 3), torch.randint(0, 3, (14,))
    run = nnstat.init(project="p", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "none"})
    nnstat.watch(model)
    with run(data_id=list(range(12))):
        LOSS(model(x[:12]), y[:12], reduction="sum").backward()
    model.zero_grad()
    nnstat.finalize()
    nnstat.eval()
    with run(data_id=["q0", "q1"]):
        LOSS(model(x[12:]), y[12:], reduction="sum").backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return model, (x[:12], y[:12]), (x[12:], y[12:]), nnstat.GradientStore(tmp_path / "p"), log


def _exact(model, train, query, lam):
    """g_qᵀ (H + λI)⁻¹ g_i in float64, H the Hessian of the mean training loss."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()
    m64 = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()

    def loss(v, x, y):
        parts = torch.split(v, [s.numel() for s in shapes])
        params = {n: t.view(s) for n, t, s in zip(names, parts, shapes, strict=True)}
        return LOSS(functional_call(m64, params, (x.double(),)), y, reduction="sum")

    h = torch.autograd.functional.hessian(lambda v: loss(v, *train) / len(train[1]), flat)
    per = vmap(grad(lambda v, x, y: loss(v, x[None], y[None])), in_dims=(None, 0, 0))
    gq, gt = per(flat, *query).numpy(), per(flat, *train).numpy()
    return gq @ np.linalg.solve(h.numpy() + lam * np.eye(len(h)), gt.T)


def test_differing_dampings_are_refused_and_the_call_damping_is_solved(tmp_path):
    model, train, query, store, log = _store(tmp_path)
    kw = dict(query_data=query, steps=60, solver="cg", curvature="hessian", progress=False)
    both = Refinement(model, LOSS, train, damping=3.0, **kw)
    with pytest.raises(ValueError, match=r"damping=2.0 was passed with Refinement\(damping=3.0\)"):
        compute_influence_all(log, store, refine=both, damping=2.0, progress=False)
    with pytest.raises(ValueError, match=r"Refinement\(damping=3.0\)"):
        compute_self_influence(log, store, refine=both, damping=2.0, progress=False)
    # the same value twice, or one of them, is the direct solve at that damping
    for refine, damping in ((Refinement(model, LOSS, train, **kw), 2.0), (both, 3.0)):
        res = compute_influence_all(log, store, refine=refine, damping=damping, progress=False)
        want = _exact(model, train, query, damping)
        np.testing.assert_allclose(res.scores.numpy(), want, rtol=1e-4, atol=1e-5 * abs(want).max())
        assert res.meta["damping"] == damping
