"""Ratios of norms with the conventions nnstat reports: ``x/0 = inf`` for ``x > 0``, ``0/0 = nan``.

The trust ratio and the update ratio (`nnstat.trust_ratio`) are taken from the same per-layer
norms in a Tracker's weight/update pass and in `nnstat.netdict.dynamics`; this is their one
division.
"""

from __future__ import annotations

import torch

__all__ = ["ratio_from_norms"]


def ratio_from_norms(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """Element-wise ``numerator / denominator`` with ``x/0 = inf`` for ``x > 0`` and ``0/0 = nan``.

    Example:
        >>> ratio_from_norms(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 4.0])).tolist()
        [inf, nan, 0.5]
    """
    return numerator.to(torch.float64) / denominator.to(torch.float64)
