"""Exact curvature-vector products of a training loss: Hessian and Gauss-Newton (GGN).

The one home of these products (and of the per-example gradient helpers they need), shared by
exact influence, influence refinement and the Hessian-weighted noise scale. The Fisher of
softmax cross-entropy is its GGN; its sampled-label K-FAC/EK-FAC statistics are in
``fisher.py``. Products are batched over ``k`` vectors (a leading ``[k]``); ``streamed.py``
accumulates them over a training set in one pass. Two evaluations, one per way a loss is given:

* a functional loss ``loss_fn(model(x), y)`` on ``(inputs, targets)`` batches (`FunctionalLoss`):
  ``torch.func``, the Hessian forward-over-reverse, the GGN by ``jvp``/``vjp``, vmapped over
  the vectors, no graph kept between batches;
* a loss with an autograd graph (``batch_loss(batch)`` on any batch format, or a gradient graph
  kept across products, `graph_hvp`; the GGN by `ggn_graph` and `ggn_apply`): double backward,
  reverse-over-reverse (forward-over-reverse trips over ZeroTensors in some losses' backward
  formulas).

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1, bias=False)
    >>> x, y = torch.randn(8, 2, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    >>> def mse(out, target):
    ...     return ((out - target) ** 2).mean()
    >>> loss = FunctionalLoss(model, mse, ["weight"], torch.float64, loss_reduction="mean")
    >>> hv = loss.hvp({"weight": torch.eye(2, dtype=torch.float64)[:, None]}, x, y, 1.0)
    >>> torch.allclose(hv["weight"][:, 0], 2 * x.T @ x / 8)
    True
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, grad, jvp, vjp, vmap

Batch = tuple[torch.Tensor, torch.Tensor]
Params = dict[str, torch.Tensor]
KINDS = ("hessian", "ggn")


# ----------------------------------------------------------------------------- data
def iter_batches(data: Any, batch_size: int, dtype: torch.dtype) -> Iterator[Batch]:
    """Yield ``(inputs, targets)`` batches of ``data`` (a tuple of tensors, Dataset or DataLoader),
    floating tensors cast to ``dtype``; a DataLoader is iterated afresh on every call.

    Example:
        >>> import torch
        >>> X, Y = torch.zeros(5, 2), torch.zeros(5, dtype=torch.long)
        >>> [len(x) for x, _ in iter_batches((X, Y), 2, torch.float64)]
        [2, 2, 1]
    """
    if isinstance(data, (tuple, list)) and len(data) == 2 and isinstance(data[0], torch.Tensor):
        x, y = data
        if len(x) != len(y):
            raise ValueError(f"inputs have {len(x)} rows but targets {len(y)}")
        loader: Any = (
            (x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, len(x), batch_size)
        )
    elif isinstance(data, torch.utils.data.DataLoader):
        loader = data
    elif isinstance(data, torch.utils.data.Dataset):
        loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=False)
    else:
        raise TypeError(
            f"data must be an (inputs, targets) tuple of tensors, a Dataset or a DataLoader, "
            f"got {type(data).__name__}"
        )
    for batch in loader:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError("each batch must be an (inputs, targets) pair")
        bx, by = batch  # not x, y: the generator above reads those lazily
        yield (
            bx.to(dtype) if bx.is_floating_point() else bx,
            by.to(dtype) if by.is_floating_point() else by,
        )


def batch_len(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (dicts, tuples, nested).

    Example:
        >>> batch_len({"input_ids": torch.zeros(3, 5), "labels": torch.zeros(3, 5)})
        3
    """
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"cannot find a batch dimension in {type(batch).__name__}")
    for v in values:
        try:
            return batch_len(v)
        except TypeError:
            continue
    raise TypeError(f"cannot find a batch dimension in {type(batch).__name__}")


def slice_batch(batch: Any, lo: int, hi: int, n: int | None = None) -> Any:
    """The examples ``lo:hi`` of a batch of ``n`` (default `batch_len`): every tensor whose
    first dimension is ``n`` sliced, in dicts, lists and tuples; anything else as it is.

    Args:
        batch: a tensor, or dicts, lists and tuples of them (and of other values).
        lo: the first example.
        hi: one past the last example.
        n: the batch's size (default: `batch_len`).

    Returns:
        The batch of examples ``lo:hi``, in ``batch``'s structure.

    Example:
        >>> b = slice_batch({"x": torch.arange(6).reshape(3, 2), "scale": torch.ones(())}, 1, 2)
        >>> b["x"].tolist(), b["scale"].shape
        ([[2, 3]], torch.Size([]))
    """
    n = batch_len(batch) if n is None else n
    return map_tensors(batch, lambda t: t[lo:hi] if t.dim() and t.shape[0] == n else t)


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor in it (in dicts, lists, tuples and
    namedtuples, which keep their types); anything else as it is.

    Example:
        >>> map_tensors({"x": torch.zeros(2), "n": 3}, lambda t: t + 1)
        {'x': tensor([1., 1.]), 'n': 3}
    """
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return type(batch)({k: map_tensors(v, fn) for k, v in batch.items()})  # type: ignore
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(map_tensors(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def looks_reduced_by(whole: float, singles: Sequence[float]) -> str | None:
    """How a batch loss ``whole`` reduces its examples' own losses ``singles`` (each a batch of
    one, where a mean and a sum agree): ``"sum"`` where it is nearer (in ratio) ``n`` x their
    mean than their mean, else ``"mean"``; ``None`` where losses that are not all positive
    and finite, or one example, say nothing.

    Example:
        >>> looks_reduced_by(10.0, [2.0, 3.0, 5.0]), looks_reduced_by(3.4, [2.0, 3.0, 5.0])
        ('sum', 'mean')
    """
    n = len(singles)
    mean = sum(singles) / max(n, 1)
    if n < 2 or not (0 < whole < math.inf and 0 < mean < math.inf):
        return None
    ratio = math.log(whole / mean)
    return "sum" if abs(ratio - math.log(n)) < abs(ratio) else "mean"


def sum_weight(batch_size: int, loss_reduction: str) -> float:
    """Weight of a batch loss in the *sum* of the examples' losses (a streamed pass divides by
    the count once, so the data is read once per product, never once more to count it)."""
    return float(batch_size) if loss_reduction == "mean" else 1.0


def twice_differentiable() -> Any:
    """Attention through the math kernel: the fused CPU/flash kernels have no second derivative."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def output_logits(out: Any) -> torch.Tensor:
    """The tensor of a model's output the loss is computed from (``.logits`` of HF outputs)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, Mapping):
        logits = out.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise ValueError(
            f"curvature='ggn' needs the model to return a tensor or an output with .logits, got "
            f"{type(out).__name__}"
        )
    return logits


class ParamLayout:
    """Named parameters laid end to end in one flat vector ``[..., P]`` (in ``names`` order).

    Example:
        >>> layout = ParamLayout(["w", "b"], [(2, 3), (2,)])
        >>> v = torch.arange(16.0).reshape(2, 8)
        >>> {k: tuple(t.shape) for k, t in layout.to_dict(v).items()}
        {'w': (2, 2, 3), 'b': (2, 2)}
        >>> torch.equal(layout.from_dict(layout.to_dict(v), 2), v)
        True
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]]) -> None:
        self.names = list(names)
        self.shapes = [torch.Size(s) for s in shapes]
        self.offsets: list[int] = []
        offset = 0
        for shape in self.shapes:
            self.offsets.append(offset)
            offset += math.prod(shape)
        self.size = offset

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat [..., P]`` in the parameters' shapes, leading dimensions kept, one per
        entry of ``names`` (a parameter shared by two logged modules appears twice)."""
        lead = flat.shape[:-1]
        return [
            flat[..., off : off + shape.numel()].reshape(*lead, *shape)
            for shape, off in zip(self.shapes, self.offsets, strict=True)
        ]

    def to_dict(self, flat: torch.Tensor) -> Params:
        """`split` by name (a name listed twice: its last entry)."""
        return dict(zip(self.names, self.split(flat), strict=True))

    def from_dict(self, tensors: Mapping[str, torch.Tensor], lead: int) -> torch.Tensor:
        """``[lead, P]`` from tensors with a leading ``[lead]`` in the parameters' shapes."""
        return torch.cat([tensors[n].reshape(lead, -1) for n in self.names], dim=1)


# ----------------------------------------------------------------------------- autograd graphs
def batched_grad(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """``[∂(Σ outputs·v_k)/∂inputs for every k]`` stacked: ``vs`` carry a leading ``[k]``."""
    k = len(vs[0])
    try:
        grads = torch.autograd.grad(
            outputs,
            inputs,
            grad_outputs=vs,
            is_grads_batched=True,
            retain_graph=True,
            allow_unused=True,
        )
        # an input the outputs do not depend on: zeros with the [k] (materialize_grads=True
        # would give them without it)
        return [
            x.new_zeros((k, *x.shape)) if g is None else g
            for g, x in zip(grads, inputs, strict=True)
        ]
    except RuntimeError:  # an operator without a batching rule: one vector at a time
        rows = [
            torch.autograd.grad(
                outputs,
                inputs,
                [t[i] for t in vs],
                retain_graph=True,
                allow_unused=True,
                materialize_grads=True,
            )
            for i in range(k)
        ]
        return [torch.stack([r[j] for r in rows]) for j in range(len(inputs))]


def graph_hvp(
    grads: Sequence[torch.Tensor], params: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """Hessian-vector products ``H v_k`` from a loss's gradient graph (``grads`` =
    ``autograd.grad(loss, params, create_graph=True)``, kept: products reuse it), one reverse
    pass batched over the ``k`` vectors ``vs`` (one ``[k, *p.shape]`` per parameter).

    Example:
        >>> w = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> g = torch.autograd.grad((w**3).sum(), [w], create_graph=True)
        >>> graph_hvp(g, [w], [torch.eye(2)])[0]  # H = diag(6 w)
        tensor([[ 6.,  0.],
                [ 0., 12.]])
    """
    # a gradient that does not depend on the parameters (a loss linear in them) adds nothing
    live = [(g, v) for g, v in zip(grads, vs, strict=True) if g.requires_grad]
    if not live:
        return [v.new_zeros(v.shape[:1] + p.shape) for p, v in zip(params, vs, strict=True)]
    return batched_grad([g for g, _ in live], params, [v for _, v in live])


def ggn_graph(z: torch.Tensor, params: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """``(u, Jᵀu)`` with ``J = ∂z/∂params`` built with ``create_graph`` (linear in ``u``): the
    part of the GGN product that does not depend on the vectors, built once per batch
    (`ggn_apply` multiplies)."""
    u = torch.zeros_like(z, requires_grad=True)
    # a parameter ``z`` does not depend on (unused in the forward) gets a zero that `ggn_apply`
    # leaves out
    jtu = torch.autograd.grad(
        z, params, grad_outputs=u, create_graph=True, allow_unused=True, materialize_grads=True
    )
    return u, list(jtu)


def ggn_apply(
    z: torch.Tensor,
    gz: torch.Tensor,
    u: torch.Tensor,
    jtu: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
) -> list[torch.Tensor]:
    """``Jᵀ H_L J v_k`` from `ggn_graph`'s ``(u, Jᵀu)``: ``J v`` is the derivative of
    ``u ↦ Jᵀu`` in direction ``v``, ``H_L`` the derivative of ``gz = ∂loss/∂z``."""
    live = [(t, v) for t, v in zip(jtu, vs, strict=True) if t.requires_grad]
    if not live:
        return [v.new_zeros(v.shape[:1] + p.shape) for p, v in zip(params, vs, strict=True)]
    jv = batched_grad([t for t, _ in live], [u], [v for _, v in live])[0]  # [k, *z.shape]
    hjv = batched_grad([gz], [z], [jv])[0]
    return batched_grad([z], params, [hjv])


def check_loss_through(
    loss: torch.Tensor, z: torch.Tensor, gz: torch.Tensor, params: Sequence[torch.Tensor]
) -> None:
    """The GGN splits the loss at ``z``: refuse a loss whose gradient does not flow through
    ``z`` alone (several model calls, a regulariser on the weights)."""
    direct = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
    via = torch.autograd.grad(z, params, gz.detach(), retain_graph=True, allow_unused=True)
    for a, b in zip(direct, via, strict=True):
        a = torch.zeros(()) if a is None else a
        b = torch.zeros(()) if b is None else b
        if not torch.allclose(a, b, rtol=1e-4, atol=1e-6 * float(a.abs().max()) + 1e-12):
            raise ValueError(
                "curvature='ggn': the loss depends on the parameters other than through "
                "the model's last output (several model calls, or a regulariser?); use "
                "curvature='hessian', or loss_fn(outputs, targets) with (inputs, targets)"
            )


# ----------------------------------------------------------------------------- torch.func
def _vmapped(one: Callable[[Params], Params], vs: Params) -> Params:
    """``one`` over the leading ``[k]`` of ``vs``, through the twice-differentiable kernels."""
    try:
        with twice_differentiable():
            return vmap(one)(vs)
    except RuntimeError:
        # an operator without a batching rule: one vector at a time is the same product
        k = len(next(iter(vs.values())))
        with twice_differentiable():
            res = [one({n: t[i] for n, t in vs.items()}) for i in range(k)]
        return {n: torch.stack([r[n] for r in res]) for n in res[0]}


class FunctionalLoss:
    """``loss_fn(model(x), y)`` as a function of the parameters ``names`` (``theta``); the
    model's other parameters and its buffers held fixed (``rest``). With ``dtype``, floating
    parameters and buffers are cast to it, so ``functional_call`` does not mix precisions.
    With ``loss_reduction``, a loss that is not a scalar is refused naming it."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        names: Sequence[str],
        dtype: torch.dtype | None = None,
        loss_reduction: str | None = None,
    ) -> None:
        def cast(t: torch.Tensor) -> torch.Tensor:
            return t if dtype is None or not t.is_floating_point() else t.to(dtype)

        wanted = set(names)
        self.model = model
        self.loss_fn = loss_fn
        self.reduction = loss_reduction
        self.dtype = dtype
        # model order (the tree torch.func compares products' tangents with)
        self.theta = {n: cast(p.detach()) for n, p in model.named_parameters() if n in wanted}
        self.rest = {n: cast(p.detach()) for n, p in model.named_parameters() if n not in wanted}
        self.rest.update({n: cast(b) for n, b in model.named_buffers()})

    def outputs(self, params: Mapping[str, torch.Tensor], x: Any) -> Any:
        return functional_call(self.model, {**params, **self.rest}, (x,))

    def loss(self, params: Mapping[str, torch.Tensor], x: Any, y: Any) -> torch.Tensor:
        loss = self.loss_fn(self.outputs(params, x), y)
        if self.reduction is not None and loss.dim() != 0:
            raise ValueError(
                f"loss_fn must return a scalar batch loss (reduced as loss_reduction="
                f"{self.reduction!r}), got shape {tuple(loss.shape)}"
            )
        return loss

    def example_grads(self, x: Any, y: Any) -> Params:
        """``[b, *p.shape]`` gradients of each example's own loss (``vmap(grad)``)."""

        def one(params: Params, xi: Any, yi: Any) -> torch.Tensor:
            return self.loss(params, xi.unsqueeze(0), yi.unsqueeze(0))

        return vmap(grad(one), in_dims=(None, 0, 0))(self.theta, x, y)

    def hvp(self, vs: Params, x: Any, y: Any, w: float) -> Params:
        """``H v_k`` of ``w · loss`` on one batch, forward-over-reverse, vmapped over ``vs``."""
        g = grad(lambda p: w * self.loss(p, x, y))
        return _vmapped(lambda v: jvp(g, (self.theta,), (v,))[1], vs)

    def ggn_vp(self, vs: Params, x: Any, y: Any, w: float) -> Params:
        """``Jᵀ H_L J v_k`` of ``w · loss`` on one batch (``J``: of the model's outputs)."""
        theta = self.theta
        out, pullback = vjp(lambda p: self.outputs(p, x), theta)
        out = out.detach()
        lgrad = grad(lambda o: w * self.loss_fn(o, y))

        def one(v: Params) -> Params:
            ju = jvp(lambda p: self.outputs(p, x), (theta,), (v,))[1]
            hju = jvp(lgrad, (out,), (ju,))[1]
            return pullback(hju)[0]

        return _vmapped(one, vs)


# ----------------------------------------------------------------------------- capture
def watch_modules(engine: Any, model: nn.Module, names: list[str]) -> None:
    """Watch exactly the modules ``names`` (``"model"`` is the engine's name for a watched root
    module)."""
    if names == ["model"]:
        engine.watch(model)
    else:
        engine.watch(model, name_filter="^(" + "|".join(map(re.escape, names)) + ")$")


def captured_example_grads(
    model: nn.Module,
    modules: list[str],
    batch_loss: Callable[[Any], torch.Tensor],
    data: Any,
    loss_reduction: str,
    params: Sequence[torch.Tensor],
) -> list[tuple[int, list[tuple[str, torch.Tensor]]]]:
    """Per batch of ``data``: its size and each watched module's per-example gradients in matrix
    form (``ModuleCapture.per_sample_grad``, the same the gradient store holds), from the
    capture engine. The ``.grad`` of ``params`` is restored afterwards."""
    from nnstat.capture import CaptureEngine

    engine = CaptureEngine()
    caps: list[tuple[str, torch.Tensor]] = []
    watch_modules(engine, model, modules)
    engine.add_consumer(lambda cap: caps.append((cap.name, cap.per_sample_grad().detach())))
    saved = {p: p.grad for p in params}
    out = []
    try:
        for batch in data:
            caps.clear()
            n = batch_len(batch)
            # samples=n: a shared module (a position embedding) is expanded to the batch, so
            # its rows are each example's own gradient rather than the batch's sum
            with engine.batch(loss_reduction=loss_reduction, samples=n):
                batch_loss(batch).backward()
            out.append((n, list(caps)))
    finally:
        engine.unwatch()
        for p, g in saved.items():
            p.grad = g
    return out
