"""Guards of the Tracker against silent misuse, and how it raises several collected errors.

`check_owned` refuses an optimizer built from other tensors (and warns when it holds only some
of the tracked parameters); `REPLACED_FIX` words the refusal of a module replaced afterwards
(`nnstat.netdict.SameParams`); `StepOrder` counts ``optimizer.step()`` calls and warns (once) when
``tracker.step()`` comes before it; `first_error` raises the first of several errors (sinks, flushes)
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
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from nnstat.distributed import clean_name

__all__ = ["REPLACED_FIX", "StepOrder", "check_owned", "first_error"]

#: `nnstat.netdict.SameParams`'s owner, fix and name map for the Tracker: a tracked module
#: replaced after construction is refused at the next logged step
REPLACED_FIX = (
    "Tracker",
    "Build a new Tracker after changing the model (tracker.close(); nnstat.Tracker(model, "
    "optimizer, ...)), and a new optimizer if it holds the old parameters.",
    clean_name,
)


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


class StepOrder:
    """Counts the optimizer's steps (a step post-hook) to tell whether ``optimizer.step()`` ran
    between two calls of ``tracker.step()``.

    The hook is removed by `close`, or when `owner` (the Tracker) is collected: framework
    callbacks build one Tracker per logged step and never close it, and hooks must not pile up
    on the optimizer.

    Args:
        owner: the Tracker whose lifetime the hook follows.
        optimizer: the optimizer to count (``None``: unknown; every step counts as stepped).

    Example:
        >>> import torch
        >>> p = torch.nn.Parameter(torch.ones(1)); opt = torch.optim.SGD([p], lr=0.1)
        >>> owner = torch.nn.Module(); order = StepOrder(owner, opt)
        >>> p.grad = torch.ones(1); opt.step(); order.stepped(0, has_update=True)
        True
        >>> order.close(); opt._optimizer_step_post_hooks
        OrderedDict()
    """

    def __init__(self, owner: Any, optimizer: torch.optim.Optimizer | None) -> None:
        self.count = 0
        self._seen = 0
        self._warned = False
        self._remove: weakref.finalize | None = None
        if optimizer is not None:
            ref = weakref.ref(self)

            def count_step(opt: Any, args: Any, kwargs: Any) -> None:
                order = ref()
                if order is not None:
                    order.count += 1

            handle = optimizer.register_step_post_hook(count_step)
            self._remove = weakref.finalize(owner, handle.remove)
            self._remove.atexit = False

    def mark(self) -> None:
        """Count "no optimizer.step() since" from now."""
        self._seen = self.count

    def close(self) -> None:
        """Remove the hook (once)."""
        if self._remove is not None:
            self._remove()

    def stepped(self, call: int, has_update: bool) -> bool:
        """Whether ``optimizer.step()`` ran since the previous call (True when unknown); warns
        once when not (`call`: the Tracker's call number; `has_update`: it tracks updates)."""
        if self._remove is None or not self._remove.alive:
            return True
        stepped = self.count != self._seen
        self._seen = self.count
        if not stepped and not self._warned:
            self._warned = True
            since = "the Tracker was created" if call == 0 else "the previous tracker.step()"
            dropped = (
                " There is no update to measure: update/, trust_ratio/ and update_ratio/ are "
                "left out of such steps (rather than logged as a zero update, trust ratio inf)."
                if has_update
                else ""
            )
            warnings.warn(
                f"Tracker.step() (call {call}): optimizer.step() has not run since {since}."
                f"{dropped} Call tracker.step() once per iteration, after optimizer.step() "
                "(called before it, every statistic lags one step behind). A step skipped on "
                "purpose (torch.amp.GradScaler after inf/NaN gradients) also shows up here; "
                "then nothing is wrong. Warned once per Tracker.",
                stacklevel=3,
            )
        return stepped


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
