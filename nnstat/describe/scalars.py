"""A statistic's value on the host: a Python number, or a 0-d tensor read back once.

One home for the conversion, so that every host read of a single value (a KPI, a noise-scale
measurement) goes through one function that a host-read ledger can watch; and one rule for what
a sink logs as a scalar (`metric_scalar`), so JSON Lines, TensorBoard and W&B agree.

Example:
    >>> import torch
    >>> as_float(torch.tensor(2.5, requires_grad=True)), as_float(3)
    (2.5, 3.0)
"""

from __future__ import annotations

import numbers
from typing import Any

import torch


def as_float(value: float | torch.Tensor) -> float:
    """``float(value)``, detaching a tensor first (a 0-d or one-element tensor).

    Example:
        >>> as_float(torch.tensor([0.5], requires_grad=True)), as_float(3)
        (0.5, 3.0)
    """
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)


def metric_scalar(value: Any) -> int | float | None:
    """A logged metric's value as the Python number every sink writes, ``None`` when it is not
    a scalar (the sink refuses it, naming the key).

    ``bool`` (Python's or NumPy's, a one-element bool tensor) is ``0``/``1``, a real number a
    ``float``; a one-element tensor or array gives the number it holds, by the same rules.
    Complex numbers, strings, several elements: ``None``.

    Args:
        value: one value of a metrics dict.

    Returns:
        ``int`` for a bool, ``float`` for another real number, else ``None``.

    Example:
        >>> import numpy as np
        >>> metric_scalar(True), metric_scalar(np.bool_(False)), metric_scalar(torch.tensor([2.5]))
        (1, 0, 2.5)
        >>> metric_scalar("text") is None and metric_scalar(1 + 2j) is None
        True
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    held = held_item(value)
    return None if held is None else metric_scalar(held)


def held_item(value: Any) -> Any:
    """The Python value a one-element tensor or array (or a NumPy scalar) holds, else ``None``.

    Example:
        >>> held_item(torch.tensor([[1 + 2j]])), held_item(torch.zeros(2)), held_item(3.0)
        ((1+2j), None, None)
    """
    # torch and numpy scalars (numpy's bool is no numbers.Real) without importing numpy's types
    if not hasattr(value, "item"):
        return None
    numel = getattr(value, "numel", None)
    size = numel() if callable(numel) else getattr(value, "size", None)
    return value.item() if size == 1 else None
