"""Deprecated name of :mod:`nnstat.curvature` (Mean, Covariance, KFAC, EKFAC, the collector and RunConfig).

``import nnstat.statistics`` and ``from nnstat.statistics import X`` keep working with one
``DeprecationWarning``; import from ``nnstat.curvature`` instead. Only the package's public names
are forwarded: its former private submodules moved with it. ``RunConfig``, which this package
used to hold, is forwarded to its new home :mod:`nnstat.run.config` (import it from
``nnstat`` or ``nnstat.run``).

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     from nnstat.statistics import __name__ as _  # the alias resolves
    >>> import nnstat.curvature
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_NEW = "nnstat.curvature"
#: names the old package held that now live elsewhere than ``_NEW``
_MOVED = {"RunConfig": "nnstat.run.config"}


warnings.warn(
    f"{__name__} was renamed {_NEW}; import from {_NEW} (the old name will be removed)",
    DeprecationWarning,
    stacklevel=2,  # the importer (warnings skips importlib's own frames)
)
_target = importlib.import_module(_NEW)
__all__ = sorted([*getattr(_target, "__all__", []), *_MOVED])


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(_MOVED[name]), name)
    return getattr(_target, name)


def __dir__() -> list[str]:
    return sorted({*dir(_target), *_MOVED})
