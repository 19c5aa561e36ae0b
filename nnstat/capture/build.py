"""Building a :class:`ModuleCapture` from a module's hooked calls (the capture engine's helpers).

Split from ``engine.py``: the hooks there collect ``(input, output gradient, batch context)``
per module call; these functions turn one backward's calls into the capture consumers receive
(``path_edges`` finds a watched module's place in its model, to notice it was replaced;
``create_graph_refusal`` says why a double backward is not captured).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch
from torch import nn

from nnstat.capture.capture import ModuleCapture
from nnstat.capture.kinds import Kind, kind_named

LOSS_REDUCTIONS = ("sum", "mean")


@dataclass(frozen=True)
class BatchContext:
    batch_size: int | None
    mask: torch.Tensor | None
    loss_reduction: str
    outputs_require_grad: bool = False
    samples: int | str | None = None  # the block's sample count, "input", or None: unknown


@dataclass
class Watched:
    name: str
    module: nn.Module
    kind: Kind
    # the nn.MultiheadAttention whose hook delivers this module's rows (its out_proj)
    via: nn.Module | None = None
    # the module it shares its parameters with, whose capture takes its rows (tied.py)
    tied_to: nn.Module | None = None
    # fixed per module, so computed once at watch time instead of per backward
    dims: tuple[int, int] = (0, 0)
    bias: bool = False

    def __post_init__(self) -> None:
        self.kind = kind_named(self.kind)  # a registered kind, also when given by name
        self.dims = self.kind.dims(self.module)
        # the implicit ones column exists only for kinds with a matrix-form bias
        self.bias = self.kind.dense and self.kind.has_bias(self.module)


def check_batch_args(batch_size: int | None, loss_reduction: str) -> None:
    if loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"unknown loss_reduction {loss_reduction!r}; valid: {', '.join(LOSS_REDUCTIONS)}"
        )
    if batch_size is not None and (not isinstance(batch_size, int) or batch_size <= 0):
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")


def build_capture(
    w: Watched, calls: list[tuple[torch.Tensor, torch.Tensor, BatchContext]]
) -> ModuleCapture:
    if len(calls) == 1 and calls[0][2].mask is None and w.kind.plain:
        return _build_plain(w, *calls[0])
    return _build_capture_general(w, calls)


def _build_capture_general(
    w: Watched, calls: list[tuple[torch.Tensor, torch.Tensor, BatchContext]]
) -> ModuleCapture:
    a_parts, b_parts, keep_parts, positions = [], [], [], 0
    n = None
    # the mean-loss factor is left to the capture (applied to what is computed from b, not to
    # b's [N, T, d_out] itself) when every call has the same one
    scales = {_scale(ctx, b_rows) for _, b_rows, ctx in calls}
    common = scales.pop() if len(scales) == 1 else None
    for x, g, ctx in calls:
        if x.dim() < 1:
            raise ValueError(f"{type(w.module).__name__}: input has no batch dimension")
        a = w.kind.forward_rows(w.module, x)
        b, pos_shape = w.kind.backward_rows(w.module, g)
        if n is None:
            n = b.shape[0]
        elif b.shape[0] != n:
            raise ValueError(
                f"{w.name}: called with batch sizes {n} and {b.shape[0]} in one backward"
            )
        if a.shape[1] != b.shape[1]:
            raise ValueError(
                f"{w.name} ({type(w.module).__name__}): input has {a.shape[1]} positions but "
                f"the output gradient has {b.shape[1]}"
            )
        if common is None and ctx.loss_reduction == "mean":
            b = b * float(ctx.batch_size or n)
        keep = _row_mask(w, ctx.mask, n, pos_shape, b.shape[1])
        if keep is not None:
            b = b * keep.unsqueeze(-1)
            a = w.kind.masked_rows(a, keep)
            positions = positions + keep.sum()  # left on the device (read if asked for)
        else:
            positions += n * a.shape[1]
        a_parts.append(a)
        b_parts.append(b)
        keep_parts.append(keep)
    if all(k is None for k in keep_parts):
        keep = None
    else:
        keep = torch.cat(
            [
                b.new_ones(b.shape[:2]) if k is None else k
                for k, b in zip(keep_parts, b_parts, strict=True)
            ],
            1,
        )
    a = a_parts[0] if len(a_parts) == 1 else torch.cat(a_parts, dim=1)
    b = b_parts[0] if len(b_parts) == 1 else torch.cat(b_parts, dim=1)
    scale = 1.0 if common is None else common
    return ModuleCapture(w.name, w.module, w.kind, a, b, positions, keep, w.dims, w.bias, scale)


def _scale(ctx: BatchContext, g: torch.Tensor) -> float:
    """The factor a mean-reduced loss's output gradients are multiplied by (1 for a sum)."""
    return float(ctx.batch_size or g.shape[0]) if ctx.loss_reduction == "mean" else 1.0


def _build_plain(w: Watched, x: torch.Tensor, g: torch.Tensor, ctx: BatchContext) -> ModuleCapture:
    """The common case (one call, no mask, linear rows) with the fewest tensor ops: same
    result as the general path, which costs a dozen Python calls per module per step."""
    xs, gs = x.shape, g.shape
    n = gs[0]
    if len(xs) < 2 or xs[0] != n:
        return _build_capture_general(w, [(x, g, ctx)])  # raises the general path's error
    # x and g are already detached (hooks); float() only when needed (it is a no-op call else)
    if x.dtype != torch.float32:
        x = x.float()
    if g.dtype != torch.float32:
        g = g.float()
    if len(xs) == 2 and len(gs) == 2:  # [N, d]: one position (ModuleCapture views it lazily)
        a, b, t = x, g, 1
    else:
        a, b = x.reshape(n, -1, xs[-1]), g.reshape(n, -1, gs[-1])
        t = a.shape[1]
        if t != b.shape[1]:
            return _build_capture_general(w, [(x, g, ctx)])
    scale = _scale(ctx, g)
    return ModuleCapture._plain(w.name, w.module, w.kind, a, b, n, n * t, w.dims, w.bias, scale)


def _row_mask(
    w: Watched, mask: torch.Tensor | None, n: int, pos_shape: tuple, rows: int
) -> torch.Tensor | None:
    """Mask per matrix row ``[N, rows]`` (float 0/1), or None when the mask does not apply."""
    if mask is None:
        return None
    if mask.shape[0] != n:
        raise ValueError(f"{w.name}: mask has {mask.shape[0]} samples but the batch has {n}")
    m = mask.to(device=mask.device, dtype=torch.float32)
    if m.dim() == 1:
        return m.unsqueeze(1).expand(n, rows)
    if tuple(m.shape[1:]) != tuple(pos_shape):
        return None  # e.g. a head after pooling: its positions are not the mask's positions
    m = m.reshape(n, -1)
    if m.shape[1] != rows:  # grouped conv: one row per (location, group)
        m = m.repeat_interleave(rows // m.shape[1], dim=1)
    return m


def hook_target(output: torch.Tensor) -> torch.Tensor:
    """The tensor whose gradient equals the output's, robust to later in-place ops.

    A layer applied to ``[N, T, d]`` returns a view of a 2-D result; an in-place op on that view
    (``ReLU(inplace=True)``) rewrites the view's history so a hook on the view never fires,
    while a hook on its base still does.
    """
    base = output._base if output._is_view() else None
    if (
        base is not None
        and base.requires_grad
        and base.numel() == output.numel()
        and base.is_contiguous()
        and output.is_contiguous()
        and output.data_ptr() == base.data_ptr()
    ):
        return base
    return output


def reshaped(hook: Callable[[torch.Tensor], None], shape: torch.Size, grad: torch.Tensor) -> None:
    hook(grad.reshape(shape))


def first_tensor(args: tuple, kwargs: Mapping[str, Any]) -> torch.Tensor | None:
    """The first tensor of a call's arguments: positional ones first, then keyword ones in call
    order, looking inside lists, tuples, dicts (a batch dict passed as one argument) and
    dataclass instances (their fields in order)."""
    todo: list[Any] = [*args, *kwargs.values()]
    while todo:
        x = todo.pop(0)
        if isinstance(x, torch.Tensor):
            return x
        if isinstance(x, Mapping):
            todo[:0] = list(x.values())
        elif isinstance(x, list | tuple):
            todo[:0] = list(x)
        elif is_dataclass(x) and not isinstance(x, type):
            todo[:0] = [getattr(x, f.name) for f in fields(x)]
    return None


def warn_without_gradient(names: Iterable[str], warned: set[str], stacklevel: int = 2) -> None:
    """Warn once per module (``warned``: the names warned about so far, updated) that watched
    modules ``names`` received no gradient: the engine hands their consumers nothing for that
    backward, and a gradient store keeps zeros for them. One warning for the engine and the
    store alike (the store passes its engine's ``warned``), so a user reads it once.

    Example:
        >>> import warnings
        >>> warned = set()
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     warn_without_gradient(["head"], warned); warn_without_gradient(["head"], warned)
        >>> len(seen), warned
        (1, {'head'})
    """
    new = [n for n in names if n not in warned]
    if not new:
        return
    warned.update(new)
    warnings.warn(
        f"watched modules {new} received no gradient in a backward (they did not take part in "
        "the loss, or neither their parameters nor their inputs require grad): no capture "
        "reached the consumers for them, and a gradient store keeps their per-sample gradients "
        "as zeros. If that is expected, watch with a name_filter that excludes them",
        stacklevel=stacklevel + 1,
    )


def path_edges(
    model: nn.Module, name: str
) -> dict[tuple[int, str], tuple[nn.Module, str, nn.Module, str]]:
    """The ``(parent, key, child, path)`` steps from ``model`` down to its submodule ``name``
    (``"model"``: the root itself, no step), keyed by ``(id(parent), key)``.

    Example:
        >>> net = nn.Sequential(nn.Sequential(nn.Linear(1, 1)))
        >>> [(key, path) for _, key, _, path in path_edges(net, "0.0").values()]
        [('0', '0'), ('0', '0.0')]
    """
    edges = {}
    parent, path = model, []
    for key in [] if name == "model" else name.split("."):
        child = parent._modules[key]
        path.append(key)
        edges[(id(parent), key)] = (parent, key, child, ".".join(path))
        parent = child
    return edges


def create_graph_refusal(name: str) -> str:
    """The engine's refusal of a ``create_graph=True`` backward reaching watched module ``name``."""
    # such a backward builds a graph through the gradient (gradient penalty, MAML, an input-
    # gradient regulariser): a later backward of a loss holding that gradient reaches the
    # weights through it, not through the layer's output, so no capture of either backward is
    # a product of layer inputs and output gradients; capturing it would be silently wrong
    return (
        "nnstat capture: a backward with create_graph=True (or under torch.func.grad/vjp) "
        f"reached watched module {name!r} inside a capture block (engine.batch, run(...), "
        "NoiseScale.batch, the Recorder). The "
        "per-sample gradients of a loss that differentiates through a gradient (a gradient "
        "penalty, a double backward) are not products of layer inputs and output gradients. "
        "Fix: compute the create_graph (or torch.func) gradient outside the block, or capture "
        "the loss without the gradient term (a separate logging pass)."
    )
