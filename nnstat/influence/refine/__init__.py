"""Influence refined by preconditioned conjugate gradient on exact curvature products.

K-FAC-family curvature (``ekfac``, ``kfac``) gives an approximate ``(H + λI)⁻¹``. Refinement uses
it not as the answer but as the preconditioner of a few conjugate-gradient steps on the *exact*
curvature of the mean training loss (the idea of ASTRA, Wang et al. 2025). For every query it
solves ``(P H Pᵀ + λI) y = P g_q`` in the space the store logs (``P``: the store's projections,
the identity for an unprojected store; ``P g_q`` is the query's row) and scores ``yᵀ P g_i``
against the stored rows, like the unrefined preconditioners, which approximate the same matrix.
(Solving in the full parameter space and projecting the solution was measured far worse: the
projection's error is amplified along the low-curvature directions the solution grows in.)

* ``H``: the Hessian (``curvature="hessian"``) or the Gauss-Newton matrix (``"ggn"``, positive
  semi-definite, for non-convex models whose Hessian is indefinite) of the mean loss over
  ``train_data``; a product lifts ``y`` to the parameters (``Pᵀ y``), applies ``H`` (batched over
  a block of queries, ``torch.func``) and projects back; one conjugate-gradient step is one
  streamed pass over ``train_data``.
* Preconditioner: the unrefined path's own (default EK-FAC, else K-FAC, else raw), with the
  same ``λ`` as the system.
* ``λ``: ``damping``, or by default the mean eigenvalue of ``H`` over the logged parameters,
  ``tr(P H Pᵀ) / n_params`` (Hutchinson's estimator in the logged space, 8 probes). The
  empirical-Fisher scale of the unrefined default is 10-250x smaller on confident models, and
  conjugate gradient then diverges from useful rankings in few steps. The block solver adds the
  probes to its first product, which needs no ``λ``: ``A = H + λI`` is formed after it, every
  block's first directions are the unrefined default's ``M(λ₀)⁻¹ row_q``, and its second pass
  adds ``M(λ)⁻¹ row_q`` next to the residuals' directions. So the default costs no pass (per-query
  CG spends one on it), and one step already holds the unrefined solution in its space.
* Block conjugate gradient (``solver="block"``, default): the queries of a block share one
  search space, each pass adding every query's preconditioned residual to it, so a block of 32
  explores 32 directions per pass (`krylov.block_cg`); ``solver="cg"``: one recurrence each.
* Start at ``y₀ = 0``: ``steps`` steps cost ``steps`` passes per block of queries; ``steps=0``
  returns the unrefined scores exactly. (Starting at the preconditioned gradient was worse at
  equal cost in 131 of 135 measured settings, so it is not offered.)

A conjugate-gradient step never increases the ``(P H Pᵀ + λI)``-norm error while that matrix is
positive definite. An indefinite direction under ``curvature="hessian"`` raises, naming the
queries and the fix. Under the defaults (``curvature=None``, ``damping=None``) ``λ`` is kept at
least ``DAMPING_RAISE`` x the Hessian's most negative curvature found along the search space:
the block solver raises it in place (`krylov.block_cg`'s ``shift``; blocks solved before are
solved again at the final ``λ``), per-query CG solves again (at most ``MAX_DAMPING_RAISES``
times). With a given damping an indefinite Hessian makes every query use the Gauss-Newton
matrix instead. Each with a warning, every pass counted, and the report saying so.

The modules, in reading order: ``config`` (`Refinement`, what is asked), ``system`` (the
logged system and what it is built from: curvature, query gradients, preconditioner, default
damping), ``solve`` (every block through `nnstat.influence.damped_solve`, the solve exact
influence shares), ``memory``/``plan`` (the budget and the plan that fits it), ``cost`` (passes,
products and an estimated time, stated before the first pass), ``run`` (`refine_queries`:
setup, plan, solve, report).

Example:
    >>> import torch
    >>> from nnstat.influence import ModuleSpec, TensorSource, compute_influence_all
    >>> _ = torch.manual_seed(0)
    >>> model = torch.nn.Linear(3, 2)
    >>> X, Y = torch.randn(40, 3), torch.randint(0, 2, (40,))
    >>> loss = torch.nn.functional.cross_entropy
    >>> def rows(x, y):  # unprojected per-sample gradients as a store would hold them
    ...     g = torch.func.vmap(torch.func.grad(lambda p, a, b: loss(
    ...         torch.func.functional_call(model, p, (a[None],)), b[None])), (None, 0, 0))(
    ...         dict(model.named_parameters()), x, y)
    ...     return torch.cat([g["weight"], g["bias"][..., None]], -1).flatten(1)
    >>> lay = [ModuleSpec("model", 0, 2, 4)]
    >>> train = TensorSource(rows(X, Y), layout=lay)
    >>> query = TensorSource(rows(X[:2], Y[:2]), layout=lay)
    >>> refine = Refinement(model, loss, (X, Y), query_data=(X[:2], Y[:2]), steps=3,
    ...                     damping=0.01, preconditioner="identity")
    >>> res = compute_influence_all(query, train, refine=refine, damping=0.01)
    >>> res.scores.shape, res.meta["refine"]["passes"]
    (torch.Size([2, 40]), 3)
"""

from __future__ import annotations

from .config import CURVATURES, FISHERS, REFINE_PRECONDITIONERS, SOLVERS, Refinement
from .run import refine_queries, refinement_plan
from .system import fit_fisher_statistics

__all__ = [
    "CURVATURES",
    "FISHERS",
    "REFINE_PRECONDITIONERS",
    "SOLVERS",
    "Refinement",
    "fit_fisher_statistics",
    "refine_queries",
    "refinement_plan",
]
