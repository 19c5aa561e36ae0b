"""The exact reference of `influence_quality.py`: explicitly built float64 curvature.

`Explicit` builds the Hessian of the mean training loss (``jacrev`` of its gradient), the
per-example gradients and, on first use, the Gauss-Newton matrix; `reference_system` picks the
damping and solve the reference uses (λ = wd where ``H + wd·I`` is positive definite, or singular
only along flat directions no gradient has a part in; else a damping past the most negative
eigenvalue).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

CE = nn.functional.cross_entropy


def _f64(x: torch.Tensor) -> torch.Tensor:
    return x.double() if x.is_floating_point() else x


class Explicit:
    """Float64 Hessian, Gauss-Newton matrix and per-example gradients of the mean loss.

    ``loss_fn`` must be a cross-entropy averaged over the examples and over the positions of
    each example's output (``[n, C]`` or ``[n, T, C]`` logits): the GGN's output Hessian is
    that of the softmax. The GGN is built on first use (``ggn``), one column per parameter
    from Gauss-Newton-vector products.
    """

    def __init__(self, model: nn.Module, train, query, loss_fn=CE) -> None:
        m64 = copy.deepcopy(model).double()
        names = [n for n, _ in m64.named_parameters()]
        shapes = [p.shape for _, p in m64.named_parameters()]
        sizes = [p.numel() for _, p in m64.named_parameters()]
        theta = torch.cat([p.detach().reshape(-1) for p in m64.parameters()])

        def outputs(flat, x):
            parts = torch.split(flat, sizes)
            p = {n: t.view(s) for n, t, s in zip(names, parts, shapes, strict=True)}
            return functional_call(m64, p, (x,))

        def loss(flat, x, y):
            return loss_fn(outputs(flat, x), y)

        x, y = _f64(train[0]), train[1]
        self.hessian = jacrev(grad(loss), chunk_size=128)(theta, x, y)
        self.hessian = (self.hessian + self.hessian.T) / 2

        def one(flat, xi, yi):
            return loss(flat, xi[None], yi[None])

        per = vmap(grad(one), in_dims=(None, 0, 0))
        self.g_train = per(theta, x, y)
        self.g_query = per(theta, _f64(query[0]), query[1])
        self.evals, self.evecs = torch.linalg.eigh(self.hessian)
        self._ggn_args = (outputs, theta, x)
        self._ggn: torch.Tensor | None = None

    def _ggn_columns(self, vectors: torch.Tensor) -> torch.Tensor:
        """``G v`` for each row ``v``: ``Jᵀ (diag p − p pᵀ) J v / (n T)``."""
        outputs, theta, x = self._ggn_args
        if not hasattr(self, "_prob"):
            out = outputs(theta, x).detach()
            self._prob = torch.softmax(out, -1)
            self._positions = out[..., 0].numel()  # n x T: the mean's denominator
        prob = self._prob

        def column(v):
            jv = torch.func.jvp(lambda f: outputs(f, x), (theta,), (v,))[1]
            hjv = prob * jv - prob * (prob * jv).sum(-1, keepdim=True)
            return torch.func.vjp(lambda f: outputs(f, x), theta)[1](hjv)[0]

        return torch.cat([vmap(column)(vectors[i : i + 128]) for i in range(0, len(vectors), 128)])

    @property
    def ggn(self) -> torch.Tensor:
        if self._ggn is None:
            theta = self._ggn_args[1]
            g = self._ggn_columns(torch.eye(len(theta), dtype=theta.dtype)) / self._positions
            self._ggn = (g + g.T) / 2
        return self._ggn

    def ggn_mean_eigenvalue(self, probes: int = 0) -> float:
        """``tr(G) / P``: exact, or Hutchinson's estimate with ``probes`` Rademacher vectors
        when the GGN has not been built (``probes > 0``)."""
        if self._ggn is not None or probes <= 0:
            return float(torch.diagonal(self.ggn).mean())
        theta = self._ggn_args[1]
        gen = torch.Generator().manual_seed(0)
        v = torch.randint(0, 2, (probes, len(theta)), generator=gen).to(theta.dtype) * 2 - 1
        gv = self._ggn_columns(v) / self._positions
        return float((v * gv).sum(1).mean()) / len(theta)

    def scores(self, matrix: torch.Tensor, damping: float) -> torch.Tensor:
        a = matrix + damping * torch.eye(len(matrix), dtype=matrix.dtype)
        return (self.g_query @ torch.linalg.solve(a, self.g_train.T)).float()

    def flat_directions(self, damping: float, tol: float) -> torch.Tensor:
        """Eigenvectors of ``H + λI`` with ``|eigenvalue| <= tol``: ``[P, k]``."""
        return self.evecs[:, (self.evals + damping).abs() <= tol]

    def restricted_scores(self, keep: torch.Tensor, damping: float, tol: float) -> torch.Tensor:
        """``g_qᵀ (H_SS + λI)⁺ g_i`` on the parameters ``keep`` (bool ``[P]``) alone: the exact
        influence of a method that sees only those (eigenvalues up to ``tol`` left out)."""
        h = self.hessian[keep][:, keep]
        e, u = torch.linalg.eigh(h + damping * torch.eye(len(h), dtype=h.dtype))
        u = u[:, e > tol]
        gq, gi = self.g_query[:, keep] @ u, self.g_train[:, keep] @ u
        return ((gq / e[e > tol]) @ gi.T).float()

    def pinv_scores(self, damping: float, tol: float) -> torch.Tensor:
        """``g_qᵀ (H + λI)⁺ g_i`` over the eigenvalues above ``tol`` (the flat directions left
        out; meaningful where every gradient is orthogonal to them and none is below -tol)."""
        e = self.evals + damping
        keep = e > tol
        u = self.evecs[:, keep]
        return (((self.g_query @ u) / e[keep]) @ (u.T @ self.g_train.T)).float()


def module_mask(model: nn.Module, types) -> torch.Tensor:
    """Per parameter entry, in ``named_parameters`` order: is it a parameter of a module of
    class ``types``."""
    owned = {
        id(p) for m in model.modules() if isinstance(m, types) for p in m.parameters(recurse=False)
    }
    return torch.cat([torch.full((p.numel(),), id(p) in owned) for p in model.parameters()])


def symmetry_check(ex: Explicit, damping: float, tol: float) -> dict[str, Any]:
    """How flat directions of ``H + λI`` relate to the gradients: the largest share of a
    training or query gradient's squared norm that lies in them (0 for exact symmetries)."""
    u = ex.flat_directions(damping, tol)
    out: dict[str, Any] = {"flat_directions": u.shape[1], "tol": tol}
    for side, g in (("train", ex.g_train), ("query", ex.g_query)):
        share = (g @ u).square().sum(1) / g.square().sum(1).clamp_min(1e-300)
        out[f"max_gradient_share_{side}"] = float(share.max()) if u.shape[1] else 0.0
    return out


#: flat directions of ``H + wd·I``: |eigenvalue| ≤ FLAT_TOL × the largest eigenvalue
FLAT_TOL = 1e-6


def reference_system(ex: Explicit, wd: float) -> dict[str, Any]:
    """Which damping and solve the exact reference uses.

    ``H + wd·I`` (the Hessian of the training objective) positive definite: λ = wd, solved.
    Positive semi-definite, its null space holding no part of any gradient (the flat directions
    of continuous symmetries, e.g. rotations inside a transformer): λ = wd, pseudo-inverse.
    Otherwise (indefinite: not a minimum): the heuristic λ ≥ 1.5 × |most negative eigenvalue|,
    the rule refinement's default damping follows.
    """
    lam_min = float(ex.evals.min())
    lam_heur = max(0.1 * float(ex.evals.clamp_min(0).mean()), -1.5 * lam_min, 1e-4)
    out: dict[str, Any] = {"lambda_heuristic": lam_heur, "kind": "solve", "lambda": lam_heur}
    if lam_min + wd > 1e-3 * wd:
        return {**out, "lambda": wd}
    tol = FLAT_TOL * float(ex.evals.max())
    check = symmetry_check(ex, wd, tol)
    out["flat"] = check
    orthogonal = max(check["max_gradient_share_train"], check["max_gradient_share_query"]) < 1e-6
    if lam_min + wd >= -tol and check["flat_directions"] and orthogonal:
        return {**out, "kind": "pinv", "lambda": wd, "tol": tol}
    out["negative_eigenvalues"] = int((ex.evals + wd < -tol).sum())
    return out
