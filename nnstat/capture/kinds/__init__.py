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

from torch import nn

from nnstat.capture.kinds.base import REGISTRY, Kind, kind_named

# registration order: KINDS and the kind lists in error messages keep this order
# isort: off
from nnstat.capture.kinds.linear import LinearKind
from nnstat.capture.kinds.conv import ConvKind
from nnstat.capture.kinds.conv1d import HFConv1DKind, is_hf_conv1d
from nnstat.capture.kinds.embedding import EmbeddingKind
from nnstat.capture.kinds.attention import AttentionKind
from nnstat.capture.kinds.layernorm import LayerNormKind

# isort: on

__all__ = [
    "KINDS",
    "REGISTRY",
    "AttentionKind",
    "ConvKind",
    "EmbeddingKind",
    "HFConv1DKind",
    "Kind",
    "LayerNormKind",
    "LinearKind",
    "detect_kind",
    "is_hf_conv1d",
    "kind_named",
    "unsupported_reason",
]


#: the names of the built-in kinds; a store's meta.json names one per module
KINDS = tuple(REGISTRY)


def _matching(module: nn.Module) -> Kind | None:
    return next((k for k in REGISTRY.values() if k.matches(module)), None)


def detect_kind(module: nn.Module) -> Kind | None:
    """Return the capture kind of ``module`` or ``None`` when no kind supports it.

    Args:
        module: any module.

    Returns:
        The first registered kind that matches ``module`` and supports it, else None
        (:func:`unsupported_reason` says why).
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
    if kind is None:
        return "no per-sample gradient rule for this module type"
    return kind.unsupported(module) or "supported"
