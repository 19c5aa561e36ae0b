"""Independent references for the influence tests: torch.func per-sample gradients and explicit
Hessians/Fishers of a tiny MLP (a few hundred parameters)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from nnstat.influence import ModuleSpec

D_IN, D_HID, D_OUT = 5, 12, 3


def tiny_problem(n_train: int = 40, n_query: int = 6, seed: int = 0, train_steps: int = 60):
    """A trained 5-12-3 MLP (111 parameters) with train and query data, all float64."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, D_OUT)).double()
    x = torch.randn(n_train + n_query, D_IN, dtype=torch.float64)
    w = torch.randn(D_IN, D_OUT, dtype=torch.float64)
    y = (x @ w + 0.5 * torch.randn(len(x), D_OUT, dtype=torch.float64)).argmax(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(train_steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[:n_train]), y[:n_train]).backward()
        opt.step()
    return model, (x[:n_train], y[:n_train]), (x[n_train:], y[n_train:])


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def per_sample_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """{param name: [n, *shape]} gradients of each example's own loss (torch.func reference)."""

    def loss(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    return vmap(grad(loss), in_dims=(None, 0, 0))(params_of(model), x, y)


def flat_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[n, P] per-sample gradients in named_parameters order."""
    g = per_sample_grads(model, x, y)
    return torch.cat([g[k].reshape(len(x), -1) for k, _ in model.named_parameters()], dim=1)


def layer_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict:
    """{layer: [n, d_out, d_in + 1]} per-sample gradients of the Linears "0" and "2" (bias last)."""
    g = per_sample_grads(model, x, y)
    return {
        name: torch.cat([g[f"{name}.weight"], g[f"{name}.bias"].unsqueeze(-1)], dim=-1)
        for name in ("0", "2")
    }


def store_rows(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[n, row_width] rows in the store layout: per Linear, [d_out, d_in + 1] (bias last), row-major."""
    return torch.cat([g.reshape(len(x), -1) for g in layer_grads(model, x, y).values()], dim=1)


def store_layout() -> list[ModuleSpec]:
    first = D_HID * (D_IN + 1)
    return [
        ModuleSpec("0", 0, D_HID, D_IN + 1),
        ModuleSpec("2", first, D_OUT, D_HID + 1),
    ]


def full_hessian(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Hessian of the MEAN loss w.r.t. all parameters flattened, via autograd.functional."""
    names = [k for k, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])

    def f(flat):
        parts = torch.split(flat, sizes)
        p = {n: t.view(s) for n, t, s in zip(names, parts, shapes, strict=True)}
        return nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    return torch.autograd.functional.hessian(f, theta, vectorize=True)


def mode_scores(q: np.ndarray, t: np.ndarray, m: np.ndarray, mode: str) -> np.ndarray:
    """Scores ``[n_q, n_t]`` of queries ``q`` and training rows ``t`` under the metric ``m``
    (the preconditioner's inverse curvature) from the definitions of each mode: ``dot``
    ``qᵀMt``, ``relatif`` over ``√(tᵀMt)``, ``cosine`` over both norms, ``l2`` minus the squared
    M-distance."""
    dot = q @ m @ t.T
    qn, tn = np.einsum("ij,jk,ik->i", q, m, q), np.einsum("ij,jk,ik->i", t, m, t)
    if mode == "dot":
        return dot
    if mode == "relatif":
        return dot / np.sqrt(tn)[None]
    if mode == "cosine":
        return dot / np.sqrt(qn)[:, None] / np.sqrt(tn)[None]
    return -(qn[:, None] - 2 * dot + tn[None])
