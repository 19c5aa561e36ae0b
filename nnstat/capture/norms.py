"""Per-sample squared gradient norms of many captures at once, in as few kernels as possible.

The noise-scale tracker needs ``sum_i ||g_i||^2`` of every watched layer on every step; for
one-position layers (``[N, d]`` rows) ``||g_i||^2 = ||a_i||^2 ||b_i||^2 (+ ||b_i||^2`` for the
bias), so each stream is read once for its row norms and the products are taken on ``[N]``
values for all layers in one ``_foreach_mul``.

Example:
    >>> import torch, nnstat
    >>> lin = torch.nn.Linear(3, 2)
    >>> engine = nnstat.CaptureEngine(); _ = engine.watch(lin); caps = []
    >>> engine.add_consumer(caps.append)
    >>> with engine.batch():
    ...     lin(torch.randn(4, 3)).sum().backward()
    >>> len(sq_norm_factors(caps))
    1
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["sq_norm_factors"]


def sq_norm_factors(
    caps: Sequence[Any],
) -> list[tuple[list[torch.Tensor], float] | None]:
    """:meth:`ModuleCapture.sq_norm_factors` of each capture, the row scalings in one kernel.

    `caps` are :class:`~nnstat.capture.ModuleCapture` objects (typed loosely: that module imports
    this one, and imports point one way).

    Example:
        >>> import torch, nnstat
        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
        >>> engine = nnstat.CaptureEngine(); _ = engine.watch(model); caps = []
        >>> engine.add_consumer(caps.append)
        >>> with engine.batch():
        ...     model(torch.randn(5, 3)).sum().backward()
        >>> [len(f[0]) for f in sq_norm_factors(caps)]  # |a_i||b_i| and |b_i| (bias) per layer
        [2, 2]
    """
    rows = [c for c in caps if c._is_plain_row()]
    if not rows:
        return [None] * len(caps)
    # rows along the last dim ([N, d] or [N, 1, d]); each stream is read once, the products are
    # on [N] values (scaling b itself would read it three times: slower on wide layers)
    na = [torch.linalg.vector_norm(c._x2 if c._x2 is not None else c._a3, dim=-1) for c in rows]
    nb = [torch.linalg.vector_norm(c._g2 if c._g2 is not None else c._b3, dim=-1) for c in rows]
    factors = [
        ([t, b] if c._bias else [t], c._scale * c._scale)
        for t, b, c in zip(torch._foreach_mul(nb, na), nb, rows, strict=True)
    ]
    if len(rows) == len(caps):  # every module (an MLP): the per-step case
        return factors
    it = iter(factors)
    return [next(it) if c._is_plain_row() else None for c in caps]
