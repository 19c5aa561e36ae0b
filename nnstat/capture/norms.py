"""Per-sample squared gradient norms of many captures at once, in as few kernels as possible.

The noise-scale tracker needs ``sum_i ||g_i||^2`` of every watched layer on every step; for
one-position layers (``[N, d]`` rows) ``||g_i||^2 = ||a_i||^2 ||b_i||^2 (+ ||b_i||^2`` for the
bias), so each stream is read once for its row norms and the products are taken on ``[N]``
values for all layers in one ``_foreach_mul``. Layers over a sequence give the sum over the
samples directly: the two Grams' dot (0-d) or the per-sample matrices (their norms join the
caller's one foreach norm), whichever takes fewer multiply-adds.

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

__all__ = ["sq_norm_factors", "sq_norm_sums"]


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


def sq_norm_sums(
    caps: Sequence[Any],
) -> list[tuple[list[torch.Tensor], list[torch.Tensor], float]]:
    """:meth:`ModuleCapture.sq_norm_parts` of each capture, the one-position ones through
    :func:`sq_norm_factors` (their row scalings in one kernel).

    ``Σ_i ‖G_i‖² = c · (Σ_k ‖tensors[k]‖²_F + Σ values)`` for each ``(tensors, values, c)``:
    a caller takes every capture's tensors' norms in one ``torch._foreach_norm`` and reads
    them with the 0-d values in one vector (the noise scale's per-step path: no ``[N]``
    per-sample values, no mean, no scaling kernel per module).

    Args:
        caps: :class:`~nnstat.capture.ModuleCapture` objects of one batch.

    Returns:
        One ``(tensors, values, c)`` per capture, in order.

    Example:
        >>> import torch, nnstat
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))
        >>> engine = nnstat.CaptureEngine(); _ = engine.watch(model); caps = []
        >>> engine.add_consumer(caps.append)
        >>> with engine.batch():
        ...     model(torch.randn(5, 2, 64)).sum().backward()
        >>> # wide: the Grams' dot and the bias's sum; narrow: G_i and Σ_t b_t
        >>> [(len(t), len(v)) for t, v, _ in sq_norm_sums(caps)]
        [(0, 2), (2, 0)]
    """
    factors = sq_norm_factors(caps)
    return [
        cap.sq_norm_parts() if f is None else (f[0], [], f[1])
        for cap, f in zip(caps, factors, strict=True)
    ]
