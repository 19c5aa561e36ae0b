"""Curvature products streamed over a training set, batch by batch, on the model's device.

`StreamedCurvature` is one pass over the data per product, with the vectors in chunks and, for
refinement, lifted from and projected back to the logged space within each batch (so at most
one chunk of full parameter vectors exists at once). `LossFnCurvature` evaluates
``loss_fn(model(x), y)`` by ``torch.func``, `BatchLossCurvature` a ``batch_loss(batch)`` by
double backward (`products`' maths for both).

Example:
    >>> import torch
    >>> from nnstat.curvature.products import FunctionalLoss, ParamLayout
    >>> model = torch.nn.Linear(2, 1, bias=False)
    >>> x, y = torch.randn(8, 2, dtype=torch.float64), torch.randn(8, 1, dtype=torch.float64)
    >>> loss = FunctionalLoss(model, lambda o, t: ((o - t) ** 2).mean(), ["weight"],
    ...                       torch.float64, loss_reduction="mean")
    >>> curv = LossFnCurvature(loss, ParamLayout(["weight"], [(1, 2)]), (x, y), "hessian", 3)
    >>> torch.allclose(curv.product(torch.eye(2, dtype=torch.float64), chunk=1), 2 * x.T @ x / 8)
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from nnstat.curvature.products import (
    KINDS,
    Batch,
    FunctionalLoss,
    ParamLayout,
    batch_len,
    check_loss_through,
    ggn_apply,
    ggn_graph,
    graph_hvp,
    iter_batches,
    looks_reduced_by,
    map_tensors,
    output_logits,
    slice_batch,
    sum_weight,
    twice_differentiable,
)


def to_device(batch: Any, device: torch.device | None) -> Any:
    """``batch`` with its tensors (in dicts, lists, tuples) on ``device`` (``None``: as it is);
    a pinned CPU tensor is copied without waiting.

    Example:
        >>> to_device({"x": torch.zeros(2), "n": 3}, torch.device("cpu"))["x"].device.type
        'cpu'
    """
    if device is None:
        return batch
    return map_tensors(
        batch, lambda t: t.to(device, non_blocking=t.is_pinned()) if t.device != device else t
    )


Transform = Callable[[torch.Tensor], torch.Tensor]


class StreamedCurvature:
    """A curvature of the mean loss over ``data`` whose product is one pass over it: counts the
    passes and checks every pass sees the same examples. Batches are moved to ``device`` (the
    model's) one at a time as the pass reaches them.

    A product is computed batch by batch: `prepare` builds what one batch's products share (its
    data on the device, an autograd graph), `apply` multiplies a chunk of vectors by it.
    `product` with ``lift``/``project`` takes vectors of another space (refinement's logged
    rows): each chunk is lifted to the parameters, multiplied and projected back within the
    batch, so no more than ``chunk`` full parameter vectors exist at once."""

    def __init__(self, kind: str, device: torch.device | None = None) -> None:
        if kind not in KINDS:
            raise ValueError(f"curvature must be one of {list(KINDS)}, got {kind!r}")
        self.kind = kind
        self.device = device
        self.n_train: int | None = None
        self.passes = 0
        #: keep every batch's prepared state (its gradient graph) for the next products: data
        #: held in memory, small models (exact influence, the Hessian noise scale)
        self.keep = False
        self._kept: list[tuple[int, Any]] | None = None

    def data_batches(self) -> Iterator[Any]:
        """The training data's batches as they come (not yet on the device)."""
        raise NotImplementedError

    def batch_len(self, batch: Any) -> int:
        return batch_len(batch)

    def prepare(self, batch: Any) -> Any:
        """What one batch's products share (the batch on the device, its graph)."""
        raise NotImplementedError

    def apply(self, state: Any, v: torch.Tensor) -> list[torch.Tensor]:
        """``kind``'s product of the batch of ``state`` (its share of the summed loss) with flat
        vectors ``[c, P]``, as one ``[c, *shape]`` tensor per entry of the layout (no flat
        copy: ``project`` reads them as they are)."""
        raise NotImplementedError

    def batch_product(
        self,
        state: Any,
        v: torch.Tensor,
        lift: Transform | None = None,
        project: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One chunk on one batch: ``project(apply(state, lift(v)))`` (flat without
        ``project``)."""
        full = v if lift is None else lift(v)
        with torch.enable_grad(), twice_differentiable():
            parts = self.apply(state, full)
        del full
        if project is not None:
            return project(parts)
        return torch.cat([t.reshape(len(v), -1) for t in parts], 1)

    def product(
        self,
        v: torch.Tensor,
        lift: Transform | None = None,
        project: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
        chunk: int | None = None,
    ) -> torch.Tensor:
        """``kind``'s product with the vectors ``[k, ·]``: one pass over the data, ``chunk``
        vectors at a time within each batch (default: all ``k``), each lifted to the
        parameters by ``lift`` and projected back by ``project`` (default: none)."""
        k = len(v)
        chunk = k if not chunk else max(1, min(chunk, k))
        out: torch.Tensor | None = None
        seen = 0
        for n, state in self.prepared():
            for lo in range(0, k, chunk):
                part = self.batch_product(state, v[lo : lo + chunk], lift, project)
                if out is None:
                    out = part.new_zeros(k, *part.shape[1:])
                out[lo : lo + chunk] += part.to(out.dtype)
                del part
            del state
            seen += n
        return self._finish(out, seen)

    def prepared(self) -> Iterator[tuple[int, Any]]:
        """``(examples, state)`` of every batch, `prepare`'d as the pass reaches it (or kept
        from the first pass, with `keep`)."""
        if self._kept is not None:
            yield from self._kept
            return
        kept: list[tuple[int, Any]] | None = [] if self.keep else None
        for batch in self.data_batches():
            n = self.batch_len(batch)
            with torch.enable_grad(), twice_differentiable():
                state = self.prepare(batch)
            if kept is not None:
                kept.append((n, state))
            yield n, state
            del state
        self._kept = kept

    def batch_count(self) -> int | None:
        """Training batches per pass where the data's length says so, else ``None``."""
        try:
            return len(self.data)  # type: ignore[attr-defined]
        except TypeError:
            return None

    def loss_of(self, batch: Any) -> torch.Tensor:
        """The loss of ``batch`` (as the data yields it) as the products see it."""
        raise NotImplementedError

    def check_reduction(self, reduction: str, name: str, examples: int = 8) -> None:
        """Refuse a loss that reduces a batch otherwise than ``reduction`` declares, on the first
        ``examples`` of the first batch: their loss as one batch against the mean of their own
        losses (`products.looks_reduced_by`; no gradient). A sum declared a mean scales the
        curvature by the batch size against the preconditioner and the rows, and the rankings
        change with no other sign.

        Args:
            reduction: the declared ``"mean"`` or ``"sum"``.
            name: the loss's argument name, for the message.
            examples: how many examples of the first batch to compare.

        Raises:
            ValueError: the loss reduces otherwise, naming the fix.
        """
        batch = self.first_batch()
        batch = slice_batch(batch, 0, examples, self.batch_len(batch))
        n = self.batch_len(batch)
        with torch.no_grad():
            losses = [self.loss_of(batch)]
            losses += [self.loss_of(slice_batch(batch, i, i + 1, n)) for i in range(n)]
        whole, *singles = torch.stack([t.reshape(()) for t in losses]).tolist()  # one read
        found = looks_reduced_by(whole, singles)
        if found is None or found == reduction:
            return
        mean = sum(singles) / n
        raise ValueError(
            f"{name} reduces a batch by its {found}, but loss_reduction={reduction!r}: on the "
            f"first {n} training examples it gives {whole:.4g} for the batch and {mean:.4g} on "
            f"average for each alone ({whole / mean:.3g} x). Pass loss_reduction={found!r}, or "
            f"a {name} that takes the batch's {reduction} (e.g. cross_entropy(..., "
            f"reduction={reduction!r}))"
        )

    def first_batch(self) -> Any:
        """The first batch of the data (for measuring what a product costs)."""
        for batch in self.data_batches():
            return batch
        raise ValueError("refinement needs training data: train_data is empty")

    def _finish(self, total: torch.Tensor | None, seen: int) -> torch.Tensor:
        """``total / n``: a pass's summed products as those of the mean loss."""
        if total is None or seen == 0:
            raise ValueError("refinement needs training data: train_data is empty")
        if self.n_train is not None and seen != self.n_train:
            raise ValueError(
                f"train_data yielded {seen} examples in one pass and {self.n_train} in another: "
                "refinement iterates it once per step, so it must not change (a DataLoader with "
                "a sampler that drops or repeats examples?)"
            )
        self.n_train = seen
        self.passes += 1
        return total / seen


class LossFnCurvature(StreamedCurvature):
    """Products of a `FunctionalLoss`'s mean over ``(inputs, targets)`` data, by ``torch.func``,
    on flat vectors of ``layout`` (its names: the loss's ``theta``)."""

    def __init__(
        self,
        loss: FunctionalLoss,
        layout: ParamLayout,
        data: Any,
        kind: str,
        batch_size: int = 256,
    ) -> None:
        theta = next(iter(loss.theta.values()))
        super().__init__(kind, theta.device)
        if loss.reduction is None:
            raise ValueError("a streamed curvature needs the loss's loss_reduction")
        self.loss = loss
        self.reduction: str = loss.reduction
        self.layout = layout
        self.data = data
        self.batch_size = batch_size
        self.dtype = loss.dtype or theta.dtype

    def batches(self, data: Any) -> Iterator[Batch]:
        for x, y in iter_batches(data, self.batch_size, self.dtype):
            yield to_device(x, self.device), to_device(y, self.device)

    def data_batches(self) -> Iterator[Any]:
        return iter_batches(self.data, self.batch_size, self.dtype)

    def batch_len(self, batch: Any) -> int:
        return len(batch[0])

    def batch_count(self) -> int | None:
        data = self.data
        if isinstance(data, torch.utils.data.DataLoader):
            return super().batch_count()
        try:
            n = len(data[0]) if isinstance(data, (tuple, list)) else len(data)
        except TypeError:  # an iterable dataset
            return None
        return -(-n // self.batch_size)

    def loss_of(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return self.loss.loss(self.loss.theta, to_device(x, self.device), to_device(y, self.device))

    def example_grads(self, data: Any) -> Iterator[torch.Tensor]:
        """``[b, P]`` gradients of each example's own loss, batch by batch."""
        for x, y in self.batches(data):
            yield self.layout.from_dict(self.loss.example_grads(x, y), len(x))

    def prepare(self, batch: Any) -> Any:
        x, y = batch
        return (
            to_device(x, self.device),
            to_device(y, self.device),
            sum_weight(len(x), self.reduction),
        )

    def apply(self, state: Any, v: torch.Tensor) -> list[torch.Tensor]:
        x, y, w = state
        one = self.loss.hvp if self.kind == "hessian" else self.loss.ggn_vp
        res = one(self.layout.to_dict(v), x, y, w)
        return [res[n] for n in self.layout.names]


class BatchLossCurvature(StreamedCurvature):
    """Products of the mean of ``batch_loss(batch)`` (any batch format, computed by calling
    ``model``) over ``data``, by double backward, on flat vectors of ``layout`` (names of the
    model's parameters). The GGN splits the loss at the output of the last module call to finish
    inside ``batch_loss`` (the model itself, or e.g. ``self.net`` in a Lightning
    ``training_step``; its ``.logits`` for HF outputs), checked on the first batch. Batches are
    moved to the model's device before ``batch_loss`` sees them. ``params``: the tensors
    ``batch_loss`` differentiates (default: the model's parameters named by ``layout``)."""

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        batch_loss: Callable[[Any], torch.Tensor],
        data: Any,
        kind: str,
        loss_reduction: str = "mean",
        params: Sequence[torch.Tensor] | None = None,
    ) -> None:
        if params is None:
            by_name = dict(model.named_parameters())
            params = [by_name[n] for n in layout.names]
        self.params = list(params)
        super().__init__(kind, self.params[0].device if self.params else None)
        self.model = model
        self.layout = layout
        self.batch_loss = batch_loss
        self.data = data
        self.reduction = loss_reduction
        self._checked = False

    def data_batches(self) -> Iterator[Any]:
        return iter(self.data)

    def loss_of(self, batch: Any) -> torch.Tensor:
        return self.batch_loss(to_device(batch, self.device))

    def prepare(self, batch: Any) -> Any:
        batch = to_device(batch, self.device)
        w = sum_weight(batch_len(batch), self.reduction)
        if self.kind == "hessian":
            loss = w * self.batch_loss(batch)
            # a parameter the loss does not use (a watched module unused in the forward): a
            # zero gradient, which `graph_hvp` leaves out of the products
            return torch.autograd.grad(
                loss, self.params, create_graph=True, allow_unused=True, materialize_grads=True
            )
        seen: list[Any] = []
        handles = [
            m.register_forward_hook(lambda m, a, out: seen.append(out))
            for m in self.model.modules()
        ]
        try:
            loss = w * self.batch_loss(batch)
        finally:
            for h in handles:
                h.remove()
        if not seen:
            raise ValueError("curvature='ggn': batch_loss never called the model")
        z = output_logits(seen[-1])
        seen.clear()  # the other modules' outputs: the graph keeps what it needs
        gz = torch.autograd.grad(loss, z, create_graph=True)[0]
        if not self._checked:
            check_loss_through(loss, z, gz, self.params)
            self._checked = True
        return (z, gz, *ggn_graph(z, self.params))

    def apply(self, state: Any, v: torch.Tensor) -> list[torch.Tensor]:
        vs = [t.to(p.dtype) for t, p in zip(self.layout.split(v), self.params, strict=True)]
        if self.kind == "hessian":
            hv = graph_hvp(state, self.params, vs)
        else:
            z, gz, u, jtu = state
            hv = ggn_apply(z, gz, u, jtu, self.params, vs)
        return [h.to(v.dtype) for h in hv]


def kept_curvature(
    loss: FunctionalLoss, layout: ParamLayout, batches: Sequence[Batch], kind: str = "hessian"
) -> BatchLossCurvature:
    """The curvature ``kind`` of ``loss``'s mean over ``batches`` (held in memory) with every
    batch's gradient graph built on the first product and kept (`StreamedCurvature.keep`): each
    product is then one reverse pass per batch, batched over its vectors. For small models
    (exact influence, the Hessian noise scale).

    Args:
        loss: the loss as a function of its parameters ``loss.theta`` (its ``reduction`` set).
        layout: the flat layout of ``loss.theta``'s names.
        batches: ``(inputs, targets)`` batches, held in memory.
        kind: ``"hessian"`` or ``"ggn"``.

    Returns:
        A `BatchLossCurvature` whose ``product(v [k, P])`` is the curvature of the mean loss.

    Example:
        >>> from nnstat.curvature.products import FunctionalLoss, ParamLayout
        >>> model = torch.nn.Linear(2, 1, bias=False)
        >>> x = torch.randn(8, 2, dtype=torch.float64)
        >>> y = torch.randn(8, 1, dtype=torch.float64)
        >>> loss = FunctionalLoss(model, lambda o, t: ((o - t) ** 2).mean(), ["weight"],
        ...                       torch.float64, loss_reduction="mean")
        >>> curv = kept_curvature(loss, ParamLayout(["weight"], [(1, 2)]), [(x[:5], y[:5]), (x[5:], y[5:])])
        >>> h = curv.product(torch.eye(2, dtype=torch.float64))
        >>> torch.allclose(h, 2 * x.T @ x / 8), torch.equal(curv.product(torch.eye(2, dtype=torch.float64)), h)
        (True, True)
    """
    params = [loss.theta[n].detach().requires_grad_(True) for n in layout.names]
    by_name = dict(zip(layout.names, params, strict=True))
    curv = BatchLossCurvature(
        loss.model,
        layout,
        lambda batch: loss.loss(by_name, *batch),
        batches,
        kind,
        loss.reduction or "mean",
        params=params,
    )
    curv.keep = True
    return curv
