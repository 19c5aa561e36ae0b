"""Training dynamics between two snapshots: trust ratio and update ratio per layer.

The trust ratio (You et al., 2017, "Large Batch Training of Convolutional Networks") of a layer
is ``‖W_t‖₂ / ‖W_t − W_{t−1}‖₂``, computed with the *new* weights ``W_t``. The update ratio is
its inverse. A zero update gives an infinite trust ratio (update ratio 0); a zero layer with a
zero update gives NaN (0/0 is undefined).

Example:
    >>> import torch
    >>> from nnstat.netdict import NetDict
    >>> W0 = NetDict({"w": torch.tensor([3.0, 4.0])})
    >>> W1 = NetDict({"w": torch.tensor([3.0, 4.5])})
    >>> round(trust_ratio(W0, W1)["w"], 4), round((3.0**2 + 4.5**2) ** 0.5 / 0.5, 4)
    (10.8167, 10.8167)
"""

from __future__ import annotations

import torch

from nnstat.describe.ratios import ratio_from_norms
from nnstat.netdict.netdict import NetDict

__all__ = ["trust_ratio", "update_ratio"]


def _norm_pairs(W_prev: NetDict, W_curr: NetDict) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    if not isinstance(W_prev, NetDict) or not isinstance(W_curr, NetDict):
        raise TypeError("trust_ratio expects two NetDicts (e.g. from nnstat.get_weight)")
    if not len(W_curr):
        raise ValueError("trust_ratio of an empty NetDict")
    update = W_curr - W_prev  # raises naming the layers when the keys or shapes differ
    names = list(W_curr)
    w = torch.tensor(list(W_curr.layer_norms(2).values()), dtype=torch.float64)
    u = torch.tensor(list(update.layer_norms(2).values()), dtype=torch.float64)
    return names, w, u


def trust_ratio(W_prev: NetDict, W_curr: NetDict) -> dict[str, float]:
    """Per layer ``‖W_curr‖₂ / ‖W_curr − W_prev‖₂`` (``inf`` for a zero update).

    Args:
        W_prev: weights before the step (:func:`~nnstat.get_weight`).
        W_curr: weights after it, with the same keys.

    Returns:
        Layer name → ratio.

    Raises:
        TypeError: the arguments are not NetDicts.
        ValueError: an empty NetDict, or the two have different layers.

    Example:
        >>> W = NetDict({"w": torch.ones(2)})
        >>> trust_ratio(W, W)
        {'w': inf}
    """
    names, w, u = _norm_pairs(W_prev, W_curr)
    return dict(zip(names, ratio_from_norms(w, u).tolist(), strict=True))


def update_ratio(W_prev: NetDict, W_curr: NetDict) -> dict[str, float]:
    """Per layer ``‖W_curr − W_prev‖₂ / ‖W_curr‖₂``, the inverse of `trust_ratio`.

    Args:
        W_prev: weights before the step (:func:`~nnstat.get_weight`).
        W_curr: weights after it, with the same keys.

    Returns:
        Layer name → ratio.

    Raises:
        TypeError: the arguments are not NetDicts.
        ValueError: an empty NetDict, or the two have different layers.

    Example:
        >>> W = NetDict({"w": torch.ones(2)})
        >>> update_ratio(W, W * 2)
        {'w': 0.5}
    """
    names, w, u = _norm_pairs(W_prev, W_curr)
    return dict(zip(names, ratio_from_norms(u, w).tolist(), strict=True))
