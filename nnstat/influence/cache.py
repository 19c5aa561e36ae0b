"""Fitted preconditioners reused across calls, and the default choice from what a run collected.

A fit (eigendecompositions, a pass over the training rows) is cached per training source and
kind; the damped inverses inside it are keyed by damping (see `Preconditioner`).

Example:
    >>> import torch
    >>> from nnstat.influence.sources import TensorSource
    >>> src = TensorSource(torch.randn(8, 4))
    >>> fitted(src, "raw") is fitted(src, "raw")
    True
"""

from __future__ import annotations

from collections import OrderedDict

from .precondition import Preconditioner, stored_ekfac_factor, without_statistics
from .sources import RowSource

#: fitted preconditioners by (source fingerprint, kind), least recently used first
_CACHE: OrderedDict[tuple, Preconditioner] = OrderedDict()
#: how many `_CACHE` keeps
CACHE_LIMIT = 8


def fitted(source: RowSource, kind: str, batch_size: int = 4096) -> Preconditioner:
    """A preconditioner for ``source``, reused across calls (its inverses are keyed by damping).

    Example:
        >>> import torch
        >>> from nnstat.influence.sources import TensorSource
        >>> src = TensorSource(torch.randn(8, 4))
        >>> fitted(src, "raw") is fitted(src, "raw")
        True
    """
    key = (source.fingerprint, kind)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        return _CACHE[key]
    pre = Preconditioner.fit(source, kind, batch_size)
    _CACHE[key] = pre
    while len(_CACHE) > CACHE_LIMIT:
        _CACHE.popitem(last=False)
    return pre


def clear_cache() -> None:
    """Forget every fitted preconditioner (e.g. after appending rows to an in-memory log).

    Example:
        >>> import torch
        >>> from nnstat.influence.sources import TensorSource
        >>> src = TensorSource(torch.randn(8, 4))
        >>> first = fitted(src, "raw")
        >>> clear_cache()
        >>> fitted(src, "raw") is first  # fitted again
        False
    """
    _CACHE.clear()


def has_kfac_statistics(source: RowSource) -> bool:
    """True when the statistics pass saved both K-FAC factors of every Kronecker module."""
    stats = source.statistics()
    missing = without_statistics(source.layout, stats)  # fitted from their (zero) rows
    kron = [m for m in source.layout if m.kronecker and m.name not in missing]
    return bool(kron) and all(
        any(f"{m.name}/{side}/{stat}" in stats for stat in ("covariance", "projected_covariance"))
        for m in kron
        for side in ("forward", "backward")
    )


def has_stored_ekfac(source: RowSource) -> bool:
    """True when every Kronecker module has a usable EK-FAC factor in the saved statistics."""
    stats, projections = source.statistics(), source.projections()
    missing = without_statistics(source.layout, stats)
    kron = [m for m in source.layout if m.kronecker and m.name not in missing]
    return bool(kron) and all(stored_ekfac_factor(m, stats, projections) for m in kron)


def default_preconditioner(source: RowSource) -> str:
    """``ekfac`` when the run collected K-FAC statistics for every Kronecker module, else ``raw``.

    Example:
        >>> import torch
        >>> from nnstat.influence.sources import TensorSource
        >>> default_preconditioner(TensorSource(torch.zeros(2, 3)))
        'raw'
    """
    return "ekfac" if has_kfac_statistics(source) else "raw"
