"""Guards of the Tracker against silent misuse, and how it raises several collected errors.

`check_owned` refuses an optimizer built from other tensors (and warns when it holds only some
of the tracked parameters); `first_error` raises the first of several errors (sinks, flushes)
with the others named in its notes and printed, so none is lost.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> check_owned(["weight"], [model.weight], torch.optim.SGD(model.parameters(), lr=0.1))
    >>> str(first_error([("a failed", ValueError("x"))], "all done"))
    'x'
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["check_owned", "first_error"]


def check_owned(names: list[str], params: list[torch.Tensor], optimizer: Any) -> None:
    """Raise if `optimizer` holds none of the trainable `params`, warn if only some."""
    groups = getattr(optimizer, "param_groups", None)
    if not isinstance(groups, (list, tuple)):
        return  # not a torch-style optimizer: nothing to compare with
    owned = {id(p) for g in groups if isinstance(g, Mapping) for p in g.get("params", ())}
    trainable = [n for n, p in zip(names, params, strict=True) if p.requires_grad]
    missing = [
        n for n, p in zip(names, params, strict=True) if p.requires_grad and id(p) not in owned
    ]
    if not missing:
        return
    shown = f"{missing[:5]}{' ...' if len(missing) > 5 else ''}"
    if len(missing) == len(trainable):
        raise ValueError(
            f"Tracker: the optimizer holds none of the {len(trainable)} trainable parameters "
            f"tracked ({shown}): it was built from other tensors (another instance or a copy of "
            "the model, or master weights), so its states cannot be matched to these layers. "
            "Pass the optimizer built from this model's parameters (model.parameters() of this "
            "very instance), or optimizer=None to track weights, gradients and updates without "
            "optimizer states."
        )
    warnings.warn(
        f"Tracker: the optimizer does not hold {len(missing)} of the {len(trainable)} trainable "
        f"parameters tracked: {shown}. They get no optimizer statistics, and their update is "
        "zero (trust ratio inf) unless something else changes them. Track only what this "
        "optimizer updates (include=/exclude=), or build it from all of them.",
        stacklevel=3,
    )


def first_error(errors: list[tuple[str, BaseException]], outcome: str) -> BaseException:
    """The first of several collected errors, annotated; the others' tracebacks go to stderr
    (printed, so none is lost) and are named in its notes."""
    (what, first), rest = errors[0], errors[1:]
    _note(first, f"({what}; {outcome})")
    for other_what, other in rest:
        _note(first, f"also: {other_what}: {type(other).__name__}: {other}")
        print(f"nnstat: {other_what} (raised after: {first!r}):", file=sys.stderr)
        traceback.print_exception(type(other), other, other.__traceback__, file=sys.stderr)
    return first


def _note(error: BaseException, text: str) -> None:
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(text)
