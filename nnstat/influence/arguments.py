"""Validation of the scoring calls' numeric arguments (damping, counts), one message each.

The scoring calls refuse a bad argument before any row is read, whatever the preconditioner:
``identity`` ignores the damping, but a NaN or a string passed there is still a caller's
mistake, and a float ``top_k`` would otherwise fail deep inside ``torch.topk``.

Example:
    >>> check_damping(1)
    1.0
    >>> check_count("top_k", 3)
    3
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from .modes import check_mode


def check_damping(damping: Any) -> float:
    """``damping`` as a float, refused unless it is a finite real number ``>= 0``.

    A string or a bool is refused, not converted (``"0.1"`` or ``True`` is a mistake).

    Args:
        damping: the damping ``λ`` a caller passed (``None`` is the caller's to handle).

    Returns:
        ``damping`` as a float.

    Raises:
        ValueError: ``damping`` is not a finite real number ``>= 0``.

    Example:
        >>> import torch
        >>> check_damping(0), check_damping(torch.tensor(0.5))
        (0.0, 0.5)
    """
    value = math.nan  # a string or a bool is refused, not converted
    if not isinstance(damping, (bool, str, bytes)):
        try:  # a Python or numpy number, or a one-element tensor
            value = float(damping)
        except (TypeError, ValueError, RuntimeError):
            pass
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"damping must be a finite number >= 0 (or None for the default), got {damping!r}"
        )
    return value


def check_count(name: str, value: Any) -> int:
    """``value`` as an int, refused unless it is an integer ``>= 1`` (``top_k``, ``batch_size``).

    Args:
        name: the argument's name, for the message.
        value: what the caller passed.

    Returns:
        ``value`` as an int.

    Raises:
        ValueError: ``value`` is not an integer ``>= 1`` (a bool or a float is refused).

    Example:
        >>> check_count("batch_size", 64)
        64
    """
    integral = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not integral or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


def check_scoring_args(
    damping: Any, top_k: Any = None, batch_size: Any = None, mode: str | None = None
) -> None:
    """Refuse a bad ``damping``, ``top_k``, ``batch_size`` or ``mode`` (each may be ``None``).

    Args:
        damping: see `check_damping`.
        top_k: see `check_count`.
        batch_size: see `check_count`.
        mode: see `nnstat.influence.modes.check_mode`.

    Raises:
        ValueError: naming the first bad argument.

    Example:
        >>> check_scoring_args(None, top_k=5)
    """
    if mode is not None:
        check_mode(mode)
    if damping is not None:
        check_damping(damping)
    for name, value in (("top_k", top_k), ("batch_size", batch_size)):
        if value is not None:
            check_count(name, value)
