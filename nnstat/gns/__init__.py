"""Deprecated name of :mod:`nnstat.gradient_noise` (noise_scale, NoiseScale and the noise-scale estimators).

``import nnstat.gns`` and ``from nnstat.gns import X`` keep working with one
``DeprecationWarning``; import from ``nnstat.gradient_noise`` instead. Only the package's public names
are forwarded: its former private submodules moved with it.

Example:
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore", DeprecationWarning)
    ...     from nnstat.gns import __name__ as _  # the alias resolves
    >>> import nnstat.gradient_noise
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_NEW = "nnstat.gradient_noise"


warnings.warn(
    f"{__name__} was renamed {_NEW}; import from {_NEW} (the old name will be removed)",
    DeprecationWarning,
    stacklevel=2,  # the importer (warnings skips importlib's own frames)
)
_target = importlib.import_module(_NEW)
__all__ = list(getattr(_target, "__all__", []))


def __getattr__(name: str) -> Any:
    return getattr(_target, name)


def __dir__() -> list[str]:
    return sorted(set(dir(_target)))
