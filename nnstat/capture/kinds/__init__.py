"""Layer kinds: one module per kind of layer, each a :class:`Kind` registered by defining it.

Adding a kind is one module: subclass :class:`Kind` (name, the module classes, ``dims``, and
whatever differs from a linear layer's dense rows) and import it (here, for the built-in ones).

Example:
    >>> import torch
    >>> detect_kind(torch.nn.Conv2d(3, 4, 3)), detect_kind(torch.nn.ReLU())
    ('conv', None)
    >>> unsupported_reason(torch.nn.ReLU())
    'no per-sample gradient rule for this module type'
"""

from __future__ import annotations

import torch
from torch import nn

from nnstat.capture.kinds.base import REGISTRY, Kind, kind_named

# the built-in kinds register themselves when imported, in this order: the order of the kind
# lists in error messages
# isort: off
from nnstat.capture.kinds import linear, conv, conv1d, embedding, attention  # noqa: F401
from nnstat.capture.kinds import layernorm, rmsnorm  # noqa: F401

# isort: on

__all__ = [
    "REGISTRY",
    "Kind",
    "detect_kind",
    "kind_named",
    "supported_modules",
    "unsupported_reason",
]


def _matching(module: nn.Module) -> Kind | None:
    return next((k for k in REGISTRY.values() if k.matches(module)), None)


def detect_kind(module: nn.Module) -> Kind | None:
    """Return the capture kind of ``module`` or ``None`` when no kind supports it.

    Args:
        module: any module.

    Returns:
        The first registered kind that matches ``module`` and supports it, else None
        (:func:`unsupported_reason` says why).

    Example:
        >>> detect_kind(nn.Linear(2, 3)).name, detect_kind(nn.ReLU())
        ('linear', None)
    """
    kind = _matching(module)
    return kind if kind is not None and kind.unsupported(module) is None else None


def unsupported_reason(module: nn.Module) -> str:
    """Explain why ``module`` cannot be captured (used in errors and warnings).

    Args:
        module: a module :func:`detect_kind` returns None for.

    Returns:
        The matching kind's reason, or that no kind matches its type ("supported" when
        ``module`` can be captured).
    """
    kind = _matching(module)
    if kind is None and isinstance(module, torch.jit.ScriptModule):
        return (
            "a TorchScript module (torch.jit.script/trace) runs without Python hooks: watch "
            "the eager model (before scripting it)"
        )
    if kind is None:
        return "no per-sample gradient rule for this module type"
    return kind.unsupported(module) or "supported"


def supported_modules() -> str:
    """The module types some kind captures, for messages about the others.

    Returns:
        Their names in registration order, comma-separated.

    Example:
        >>> supported_modules().split(", ")[:2]
        ['Linear', 'Conv1d/Conv2d']
    """
    return ", ".join(k.label or "/".join(c.__name__ for c in k.modules) for k in REGISTRY.values())
