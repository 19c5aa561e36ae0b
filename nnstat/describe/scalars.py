"""A statistic's value on the host: a Python number, or a 0-d tensor read back once.

One home for the conversion, so that every host read of a single value (a KPI, a noise-scale
measurement) goes through one function that a host-read ledger can watch.

Example:
    >>> import torch
    >>> as_float(torch.tensor(2.5, requires_grad=True)), as_float(3)
    (2.5, 3.0)
"""

from __future__ import annotations

import torch


def as_float(value: float | torch.Tensor) -> float:
    """``float(value)``, detaching a tensor first (a 0-d or one-element tensor)."""
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
