"""nnstat.netdict: a network's tensors by layer name, and the getters that build them.

`NetDict` maps parameter names (``model.named_parameters()`` order) to tensors with
whole-network arithmetic and `describe` / `describe_layers`; `get_weight`, `get_grad`,
`get_optimizer_state`, `get_update` build one from a model or optimizer; `trust_ratio` and
`update_ratio` compare two.

Example:
    >>> import torch
    >>> from nnstat.netdict import get_weight
    >>> W = get_weight(torch.nn.Linear(3, 2))
    >>> list(W)
    ['weight', 'bias']
"""

from nnstat.netdict.dynamics import trust_ratio, update_ratio
from nnstat.netdict.getters import (
    UnknownStateKeyError,
    compute_stats,
    get_grad,
    get_optimizer_state,
    get_update,
    get_weight,
    layer_state_keys,
    optimizer_state_keys,
)
from nnstat.netdict.netdict import NetDict, SameParams, select_names

__all__ = [
    "NetDict",
    "SameParams",
    "UnknownStateKeyError",
    "compute_stats",
    "get_grad",
    "get_optimizer_state",
    "get_update",
    "get_weight",
    "layer_state_keys",
    "optimizer_state_keys",
    "select_names",
    "trust_ratio",
    "update_ratio",
]
