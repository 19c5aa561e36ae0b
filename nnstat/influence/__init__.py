"""nnstat.influence: training-data attribution from a gradient store.

Convention: ``score(q, i) = g_qᵀ (H + λI)⁻¹ g_i`` with ``g`` the gradient of each example's own
loss and ``H`` the curvature of the **mean** training loss (λ on that scale). Positive = helpful.
Koh & Liang's ``I_up,loss`` is the negative of this score.

Example:
    >>> import torch
    >>> from nnstat.influence import TensorSource, compute_influence_all
    >>> res = compute_influence_all(TensorSource(torch.randn(2, 4)), TensorSource(torch.randn(9, 4)))
    >>> res.scores.shape
    torch.Size([2, 9])
"""

from __future__ import annotations

from .cache import clear_cache
from .counterfactual import CounterfactualResult, counterfactual
from .exact import exact
from .krylov import block_cg, preconditioned_cg
from .lds import LDSProtocol, lds, lds_per_query, run_lds_protocol, subset_masks
from .precondition import PRECONDITIONERS, Preconditioner
from .refine import CURVATURES, Refinement, refinement_plan
from .result import InfluenceResult, SelfInfluenceResult, TopKInfluence
from .row_layout import ModuleSpec
from .score import MODES, compute_influence_all, compute_self_influence
from .sources import TensorSource, as_source

__all__ = [
    "CURVATURES",
    "CounterfactualResult",
    "MODES",
    "PRECONDITIONERS",
    "InfluenceResult",
    "LDSProtocol",
    "ModuleSpec",
    "Preconditioner",
    "Refinement",
    "SelfInfluenceResult",
    "TensorSource",
    "TopKInfluence",
    "as_source",
    "block_cg",
    "clear_cache",
    "compute_influence_all",
    "compute_self_influence",
    "counterfactual",
    "exact",
    "lds",
    "lds_per_query",
    "preconditioned_cg",
    "refinement_plan",
    "subset_masks",
    "run_lds_protocol",
]
