"""Outputs whose rows may be samples or a table the batch shares (the ``T == B`` ambiguity).

A module fed ``[T]`` position ids (nanoGPT's ``self.pos(torch.arange(T))``) or a ``[T, T]``
relative-position table sees an input whose dim 0 is ``T``; when ``T`` differs from the batch
size the engine knows it is shared and expands it (broadcast.py). When ``T`` equals the batch
size the shapes cannot tell it from one row per sample (a class-label embedding fed ``[B]``
labels), so the engine captures it as rows per sample and returns the output as a
:class:`SampleRows`, which watches the first uses: the broadcast of a shared table over the
batch refuses the module, naming the one-line fix (``self.pos(torch.arange(T)[None])``).

Example:
    >>> refused = []
    >>> g = BroadcastGuard("pos", 3, "the model input", lambda n, why: refused.append(n))
    >>> labels = check_rows(torch.zeros(3, 4), g)
    >>> _ = torch.ones(3, 4) + labels  # one row per sample: fine
    >>> _ = torch.ones(3, 3, 4) + check_rows(torch.zeros(3, 4), g)  # a table: refused
    >>> refused
    ['pos']
"""

from __future__ import annotations

from typing import Any

import torch

from nnstat.capture.layouts.broadcast import (
    COMBINE,
    INPLACE_COMBINE,
    PERMUTE,
    RESHAPE,
    ROWWISE,
    BroadcastGuard,
    axis_order,
    inserts_only,
)

__all__ = ["FIX", "SampleRows", "add_check_guard", "check_rows"]


class SampleRows(torch.Tensor):
    """A watched module's output taken as one row per sample although the input might be a
    table the batch shares (``[T]`` position ids or a ``[T, T]`` relative-position table with
    ``T`` equal to the batch size): the shapes alone cannot tell them apart, the first use can.

    Every op runs exactly as without nnstat. The tensor is followed through casts, rowwise ops
    and reshapes, tracking which axis holds the rows; an elementwise op that puts those rows on
    another axis than the batch axis of its result (``tok[B, T, d] + pos[T, d]``,
    ``scores[B, h, T, T] + bias[None]``) is the broadcast of a shared table, and the guard
    refuses the module (its per-sample gradients would be wrong). Any other op ends the check.

    Example:
        >>> g = BroadcastGuard("m", 2, "the model input", lambda n, why: None)
        >>> type(check_rows(torch.zeros(2, 3), g) * 2.0).__name__
        'SampleRows'
    """

    _nnstat_axis: int
    _nnstat_guards: tuple[BroadcastGuard, ...]

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            return _check(func, args, kwargs)


def check_rows(output: torch.Tensor, guard: BroadcastGuard) -> SampleRows:
    """``output`` as a :class:`SampleRows` whose rows (one per sample) lie along dim 0.

    Example:
        >>> g = BroadcastGuard("m", 2, "the model input", lambda n, why: None)
        >>> check_rows(torch.zeros(2, 3), g)._nnstat_axis
        0
    """
    return _rewrap(output, 0, (guard,))


def add_check_guard(t: SampleRows, guard: BroadcastGuard) -> SampleRows:
    """``t`` with one more guard: a watched module that computed it row by row from checked
    rows is refused along with them.

    Example:
        >>> g = BroadcastGuard("m", 2, "the model input", lambda n, why: None)
        >>> len(add_check_guard(check_rows(torch.zeros(2, 3), g), g)._nnstat_guards)
        2
    """
    return _rewrap(t, t._nnstat_axis, (*t._nnstat_guards, guard))


def _checked(args: tuple, kwargs: dict) -> list[SampleRows]:
    return [x for x in [*args, *kwargs.values()] if isinstance(x, SampleRows)]


def _check(func: Any, args: tuple, kwargs: dict) -> Any:
    found = _checked(args, kwargs)
    result = func(*args, **kwargs)
    if not found or not isinstance(result, torch.Tensor):
        return result
    name = getattr(func, "__name__", "")
    guards = tuple(g for t in found for g in t._nnstat_guards)
    first = found[0]
    if name in COMBINE or name in INPLACE_COMBINE:
        batch = guards[0].batch
        for t in found:
            axis = t._nnstat_axis + result.dim() - t.dim()
            if axis != 0 and result.dim() and result.shape[0] == batch:
                for g in t._nnstat_guards:
                    g.on_refuse(g.name, _AMBIGUOUS.format(g=g, op=name))
                return result
        alone = not any(
            isinstance(x, torch.Tensor) and x is not first and x.dim() >= first.dim()
            for x in [*args, *kwargs.values()]
        )
        if alone and result.shape == first.shape and result is not first:
            return _rewrap(result, first._nnstat_axis, guards)  # x * 0.5, x + bias: keep checking
        return result  # combined with data of its own rows: they are samples
    if name in ROWWISE and result.shape == first.shape and result is not first:
        return _rewrap(result, first._nnstat_axis, guards)
    if name in PERMUTE or name in RESHAPE or (name == "__getitem__" and inserts_only(args)):
        axis = _moved_axis(name, args, kwargs, first, result)
        if axis is not None and len(found) == 1 and args and args[0] is first:
            return _rewrap(result, axis, guards)
    return result  # anything else ends the check (a matmul, a sum, indexing, ...)


def _rewrap(result: torch.Tensor, axis: int, guards: tuple[BroadcastGuard, ...]) -> SampleRows:
    out = result.as_subclass(SampleRows)
    out._nnstat_axis, out._nnstat_guards = axis, guards
    return out


def _moved_axis(
    name: str, args: tuple, kwargs: dict, t: torch.Tensor, result: torch.Tensor
) -> int | None:
    """Where the rows' axis of ``t`` lands in ``result`` after a permute or reshape."""
    axis = t._nnstat_axis  # type: ignore[attr-defined]
    if name in PERMUTE:
        order = axis_order(name, args, kwargs, t.dim())
        return None if order is None else order.index(axis)
    # a reshape keeps the rows' axis where the elements before it still fill whole dimensions
    before, size = 1, t.shape[axis]
    for s in t.shape[:axis]:
        before *= s
    seen = 1
    for j, s in enumerate(result.shape):
        if seen == before and s == size:
            return j
        seen *= s
        if seen > before:
            return None
    return None


_AMBIGUOUS = (
    "{g.layout}, the batch size ({g.batch} samples, {g.source}), but the model broadcasts its "
    "output over the batch (in {op!r}): its input is shared by the whole batch ([T] position "
    "ids or a [T, T] relative-position table, with T equal to the batch size), so its rows "
    "are not samples and nnstat cannot capture it from this layout"
)

#: how to include such a module (the engine's warning ends with it)
FIX = (
    "give the shared input a batch dimension of 1, self.pos(torch.arange(T)[None]) or "
    "self.rel(buckets[None]), which nnstat expands to the batch"
)
