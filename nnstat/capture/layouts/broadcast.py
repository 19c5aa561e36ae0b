"""Modules whose input is shared by the whole batch (position embeddings).

GPT-2's position embedding sees ``[1, T]`` ids, nanoGPT's ``torch.arange(T)`` (``[T]``, no
batch dimension), a T5-style relative bias a ``[T, T]`` table. Autograd sums a broadcast
tensor's gradient over the batch *before* it reaches the module that produced it, so that
module's hooks only ever see the batch total. The engine therefore hands the rest of the model
the module's output expanded to ``[B, ...]`` (a ``[1, ...]`` output's dim 0 becomes the batch;
an output without a batch dimension gets a leading one): autograd then delivers the per-sample
output gradient ``[B, ...]`` at the expansion, and with the input treated as shared by every
sample the per-sample weight gradient of sample ``i`` is exact.

Expanding is only harmless where the model would have broadcast that output over the batch
anyway. The expanded output is a :class:`BroadcastOutput`, a tensor subclass whose
``__torch_function__`` checks every op that reads it:

* an elementwise op that combines it with a tensor of batch ``B`` (``inputs_embeds + wpe``)
  gives the very values the unexpanded output would have: the op runs and returns a plain
  tensor (from here on nothing differs from the model without nnstat);
* an elementwise op without such a partner (a dtype cast, ``x * 0.5``, ``x + bias``, a
  LayerNorm), a reshape (``view``, ``unsqueeze``, ``x[None]``) or an axis permutation that keeps
  the batch in front (``permute``, ``transpose``) keeps the result tracked (its unexpanded
  counterpart is computed beside it); a watched module that returns such a result is captured
  per sample too;
* any other op (a sum over the batch, ``cat``, ``matmul``, indexing, dropout that draws a mask,
  an in-place write into it) runs on the **unexpanded** output, exactly as without nnstat, and
  the module is left out of capture (``on_refuse``): its expanded gradient would miss that use.

Metadata reads (``shape``, ``dtype``, ``size()``) answer for the unexpanded output, so model
code that inspects it behaves as it would without nnstat.

Example:
    >>> import torch
    >>> w = torch.randn(1, 3, requires_grad=True)
    >>> refused = []
    >>> guard = BroadcastGuard("pos", 4, "the model input", lambda n, why: refused.append(n))
    >>> pos = expand(w * 1.0, guard)
    >>> h = torch.randn(4, 3) + pos  # broadcast over the batch: a plain [4, 3] tensor
    >>> type(h).__name__, tuple(pos.shape), refused
    ('Tensor', (1, 3), [])
    >>> _ = pos.sum()  # not a broadcast over the batch: computed unexpanded, "pos" refused
    >>> refused
    ['pos']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["BroadcastGuard", "BroadcastOutput", "add_guard", "expand", "per_sample_rows"]

# elementwise ops that combine their tensor operands by broadcasting (out-of-place)
COMBINE = frozenset("""
    add sub subtract mul multiply div divide true_divide where addcmul addcdiv lerp maximum
    minimum __add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__
    """.split())
# the same, in place into a tensor that is not the tracked one (BERT: ``emb += pos``)
INPLACE_COMBINE = frozenset(
    {"__iadd__", "add_", "__isub__", "sub_", "__imul__", "mul_", "__itruediv__", "div_", "copy_"}
)
# writes that are not checked: refused
_INPLACE_OTHER = frozenset("""
    __setitem__ __ior__ __iand__ __ixor__ __ilshift__ __irshift__ __imod__ __ifloordiv__
    __ipow__ __imatmul__
    """.split())
# ops that only reshape the values (each sample's row alike); ``x[None]`` is checked apart
RESHAPE = frozenset({"view", "reshape", "unsqueeze", "flatten", "unflatten", "view_as"})
# ops that move axes (a [T, T, heads] relative-position table turned [heads, T, T])
PERMUTE = frozenset({"permute", "transpose", "swapaxes", "swapdims"})
# ops that map each sample's row to the same result row (the batch axis stays axis 0)
ROWWISE = frozenset("""
    to type type_as float half bfloat16 double contiguous clone dropout layer_norm gelu relu
    silu tanh sigmoid neg __neg__
    """.split())


#: how a shared output looks, for messages: ``[1, T]`` ids, or ids without a batch dimension
SLOT_LAYOUT = (
    "its output has batch size 1 (an input shared by the whole batch, e.g. position ids of "
    "shape [1, T])"
)


class BroadcastGuard:
    """One expansion: the module's name, the batch size ``B`` it was expanded to, where ``B``
    came from (for messages) and ``on_refuse(name, why)``, called when a use is not a broadcast.
    ``layout`` says what the module saw (messages start with it).

    Example:
        >>> BroadcastGuard("wpe", 3, "data_id", lambda n, why: None).batch
        3
    """

    __slots__ = ("batch", "layout", "name", "on_refuse", "source")

    def __init__(
        self,
        name: str,
        batch: int,
        source: str,
        on_refuse: Callable[[str, str], None],
        layout: str = SLOT_LAYOUT,
    ) -> None:
        self.name, self.batch, self.source, self.on_refuse = name, batch, source, on_refuse
        self.layout = layout

    def refuse(self, op: str, detail: str = "") -> None:
        self.on_refuse(
            self.name,
            f"{self.layout} and the model uses it in {op!r}{detail}, not only broadcast over "
            f"the batch of {self.batch} samples ({self.source}), so its per-sample gradients "
            "are not defined",
        )


class BroadcastOutput(torch.Tensor):
    """A watched module's ``[1, ...]`` output expanded to the batch, checked at every use.

    Built by :func:`expand`; see the module docstring for what each kind of use does.

    Example:
        >>> g = BroadcastGuard("m", 2, "the model input", lambda n, why: None)
        >>> t = expand(torch.ones(1, 2), g)
        >>> (t + torch.zeros(2, 2)).shape
        torch.Size([2, 2])
    """

    _nnstat_orig: torch.Tensor
    _nnstat_guards: tuple[BroadcastGuard, ...]

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            return _dispatch(func, args, kwargs)


def expand(output: torch.Tensor, guard: BroadcastGuard, slot: bool = True) -> BroadcastOutput:
    """``output`` expanded to ``[guard.batch, ...]`` as a :class:`BroadcastOutput`: its dim 0
    of size 1 becomes the batch (``slot``, ``[1, T]`` ids), or (``slot=False``, ``[T]`` ids with
    no batch dimension) a new leading batch dimension is added.

    The caller hooks the plain expanded tensor (``result._nnstat_expanded``) for its gradient.

    Example:
        >>> g = BroadcastGuard("m", 3, "the model input", lambda n, why: None)
        >>> tuple(expand(torch.zeros(1, 5), g)._nnstat_expanded.shape)
        (3, 5)
        >>> tuple(expand(torch.zeros(4, 5), g, slot=False)._nnstat_expanded.shape)
        (3, 4, 5)
    """
    if slot:
        expanded = output.expand(guard.batch, *output.shape[1:])
    else:
        expanded = output.unsqueeze(0).expand(guard.batch, *output.shape)
    return _wrap(expanded, output, (guard,))


def add_guard(t: BroadcastOutput, guard: BroadcastGuard) -> BroadcastOutput:
    """``t`` rewrapped with one more guard (a watched module it went through row by row: its
    per-sample gradients are as good as ``t``'s, so a refused use later leaves it out too).

    Example:
        >>> g = BroadcastGuard("m", 2, "the model input", lambda n, why: None)
        >>> len(add_guard(expand(torch.zeros(1, 3), g), g)._nnstat_guards)
        2
    """
    return _wrap(t._nnstat_expanded, t._nnstat_orig, (*t._nnstat_guards, guard))


def per_sample_rows(orig: tuple[int, ...], batch: int, shape: tuple[int, ...]) -> bool:
    """True when ``shape`` is ``[batch, *rows]`` with ``orig`` either ``rows`` (no batch
    dimension) or ``[1, *rows]``: one copy of the shared tensor per sample.

    Example:
        >>> per_sample_rows((1, 4), 3, (3, 4)), per_sample_rows((4,), 3, (3, 4))
        (True, True)
        >>> per_sample_rows((2, 4), 3, (3, 4))
        False
    """
    if not shape or shape[0] != batch:
        return False
    rows = tuple(shape[1:])
    return tuple(orig) == rows or tuple(orig) == (1, *rows)


def _wrap(
    expanded: torch.Tensor, orig: torch.Tensor, guards: tuple[BroadcastGuard, ...]
) -> BroadcastOutput:
    out = expanded.as_subclass(BroadcastOutput)
    out._nnstat_orig = orig
    out._nnstat_guards = guards
    out._nnstat_expanded = expanded  # type: ignore[attr-defined]
    return out


def _tracked(args: tuple, kwargs: dict) -> list[BroadcastOutput]:
    found: list[BroadcastOutput] = []
    todo: list[Any] = [*args, *kwargs.values()]
    while todo:
        x = todo.pop()
        if isinstance(x, BroadcastOutput):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
    return found


def _unexpanded(x: Any) -> Any:
    if isinstance(x, BroadcastOutput):
        return x._nnstat_orig
    if isinstance(x, (list, tuple)):
        return type(x)(_unexpanded(v) for v in x)
    return x


@dataclass
class _Use:
    """One call that reads tracked tensors: ``func(*args, **kwargs)``, its name, the tracked
    tensors ``found`` among the arguments, their guards and the batch they were expanded to."""

    func: Any
    name: str
    args: tuple
    kwargs: dict
    found: list[BroadcastOutput]

    def __post_init__(self) -> None:
        self.guards = tuple(g for t in self.found for g in t._nnstat_guards)
        self.batch = self.guards[0].batch

    def run(self) -> Any:
        """The call on the expanded tensors."""
        return self.func(*self.args, **self.kwargs)

    def original(self) -> Any:
        """The call as the model makes it without nnstat: every tracked tensor unexpanded."""
        kwargs = {k: _unexpanded(v) for k, v in self.kwargs.items()}
        return self.func(*_unexpanded(self.args), **kwargs)

    def refuse(self, detail: str = "") -> None:
        """Every guard's module left out of capture: this use is not a broadcast."""
        for g in self.guards:
            g.refuse(self.name, detail)


def _dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    found = _tracked(args, kwargs)
    name = getattr(func, "__name__", repr(func))
    if not found:
        return func(*args, **kwargs)
    use = _Use(func, name, args, kwargs, found)
    if "out" in kwargs:
        use.refuse(" with out=")
        return use.original()
    if (
        name in INPLACE_COMBINE
        or name in _INPLACE_OTHER
        or (name.endswith("_") and not name.endswith("__"))
    ):
        target = args[0] if args else None
        if (
            name in INPLACE_COMBINE
            and isinstance(target, torch.Tensor)
            and not isinstance(target, BroadcastOutput)
            and all(t.dim() == target.dim() for t in found)
            and target.shape[0] == use.batch
        ):
            # the target already holds every sample's row: it receives the same values
            return use.run()
        use.refuse(" (in place)")
        return use.original()
    if name in COMBINE:
        return _combine(use)
    if name in ROWWISE:
        return _rowwise(use)
    if name in RESHAPE or (name == "__getitem__" and inserts_only(args)):
        return _reshape(use)
    if name in PERMUTE:
        return _permute(use)
    if name == "detach":  # no gradient flows through it: nothing to check
        return use.original()
    result = use.original()
    if _holds_tensor(result):
        use.refuse()
    return result  # a metadata read (shape, dtype, ...): the unexpanded output's answer


def _combine(use: _Use) -> Any:
    try:
        result = use.run()
        shapes = [
            x._nnstat_orig.shape if isinstance(x, BroadcastOutput) else x.shape
            for x in [*use.args, *use.kwargs.values()]
            if isinstance(x, torch.Tensor)
        ]
        ref = tuple(torch.broadcast_shapes(*shapes))
    except (RuntimeError, TypeError, ValueError) as e:
        use.refuse(f" (expanded, it fails: {e})")
        return use.original()
    # the batch dimension of every expanded operand must land on the result's dim 0 (an
    # operand with more leading dimensions would broadcast it against another axis)
    if (
        isinstance(result, torch.Tensor)
        and result.dim()
        and all(t.dim() == result.dim() for t in use.found)
        and result.shape[0] == use.batch
    ):
        shape = tuple(result.shape)
        if shape == ref:  # a partner of batch B: the values the model computes without nnstat
            return result
        if per_sample_rows(ref, use.batch, shape):  # still one shared row for every sample
            return _wrap(result, use.original(), use.guards)
    use.refuse()
    return use.original()


def _rowwise(use: _Use) -> Any:
    if use.name == "dropout" and _dropout_active(use.args, use.kwargs):
        # B independent masks where the model draws one: other values, so not ours to expand
        use.refuse(" (training mode, p > 0)")
        return use.original()
    result = use.run()
    if any(result is t for t in use.found):  # .to() that changes nothing returns its input
        return result
    if isinstance(result, torch.Tensor) and result.dim() == use.found[0].dim():
        orig = use.original()
        if isinstance(orig, torch.Tensor) and per_sample_rows(orig.shape, use.batch, result.shape):
            return _wrap(result, orig, use.guards)
    use.refuse()
    return use.original()


def _reshape(use: _Use) -> Any:
    """A view of the shared tensor's values in another shape (``view``, ``unsqueeze``,
    ``pos[None]``): each sample's row is reshaped alike. A leading dimension of size 1 in the
    model's result is its batch slot, so ``pos[None]`` of a ``[T, d]`` output stays ``[B, T, d]``
    and broadcasts against ``[B, T, d]`` as the model's ``[1, T, d]`` does."""
    orig = use.original()
    t = use.args[0] if use.args else None
    if (
        len(use.found) == 1
        and t is use.found[0]
        and isinstance(orig, torch.Tensor)
        and orig.numel() == t._nnstat_orig.numel()
    ):
        shape = tuple(orig.shape)
        rows = shape[1:] if shape and shape[0] == 1 else shape
        return _wrap(t._nnstat_expanded.reshape(use.batch, *rows), orig, use.guards)
    use.refuse()
    return orig


def _permute(use: _Use) -> Any:
    """``permute`` / ``transpose`` of the shared tensor (a ``[T, T, heads]`` relative-position
    table turned ``[heads, T, T]``): the same axes move in every sample's row; a batch slot of
    size 1 must stay in front."""
    orig = use.original()
    t = use.args[0] if use.args else None
    if len(use.found) == 1 and t is use.found[0] and isinstance(orig, torch.Tensor):
        lead = t.dim() - t._nnstat_orig.dim()  # 1: the model's tensor has no batch dimension
        order = axis_order(use.name, use.args, use.kwargs, t._nnstat_orig.dim())
        if order is not None and (lead or order[0] == 0):
            order = [0, *(d + 1 for d in order)] if lead else order
            result = t._nnstat_expanded.permute(order)
            if per_sample_rows(orig.shape, use.batch, tuple(result.shape)):
                return _wrap(result, orig, use.guards)
    use.refuse()
    return orig


def axis_order(name: str, args: tuple, kwargs: dict, ndim: int) -> list[int] | None:
    """The permutation ``permute``/``transpose`` apply to a tensor of ``ndim`` dimensions."""
    try:
        if name == "permute":
            dims = kwargs.get("dims", args[1:])
            if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
                dims = dims[0]
            order = [int(d) % ndim for d in dims]
            return order if sorted(order) == list(range(ndim)) else None
        a = int(kwargs.get("dim0", args[1] if len(args) > 1 else 0)) % ndim
        b = int(kwargs.get("dim1", args[2] if len(args) > 2 else 0)) % ndim
    except (IndexError, TypeError, ValueError, ZeroDivisionError):
        return None
    order = list(range(ndim))
    order[a], order[b] = order[b], order[a]
    return order


def inserts_only(args: tuple) -> bool:
    """``x[None]``, ``x[:, None]``, ``x[..., None, :]``: indexing that only adds dimensions."""
    index = args[1] if len(args) > 1 else ()
    items = index if isinstance(index, tuple) else (index,)
    return all(
        i is None or i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in items
    )


def _dropout_active(args: tuple, kwargs: dict) -> bool:
    p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
    training = kwargs.get("training", args[2] if len(args) > 2 else True)
    return bool(training) and float(p) > 0


def _holds_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (list, tuple)):
        return any(_holds_tensor(v) for v in x)
    return False
