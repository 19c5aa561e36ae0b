"""Random batches and gradients for :func:`nnstat.noise_scale`.

Batches are drawn **with replacement** from the data: the samples are then i.i.d. draws from the
empirical distribution, which makes the two-batch estimators exactly unbiased for the gradient
``G`` and per-example covariance ``Sigma`` of the whole data set.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate

from nnstat.capture.reduction import MeanLossProbe
from nnstat.curvature.streamed import to_device

LossFn = Callable[[Any, Any], torch.Tensor]


class BatchSource:
    """Index-addressable ``(inputs, targets)`` pairs from a tuple, Dataset or DataLoader.

    Example:
        >>> src = BatchSource((torch.zeros(10, 3), torch.ones(10)))
        >>> x, y = src.batch(torch.tensor([0, 1, 1]))
        >>> tuple(x.shape), len(src)
        ((3, 3), 10)
    """

    def __init__(self, data: Any, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._tensors: tuple[Any, Any] | None = None
        self._dataset: Dataset | None = None
        self._collate: Callable[[list[Any]], Any] = default_collate
        if isinstance(data, DataLoader):
            self._collate = data.collate_fn or default_collate
            data = data.dataset
        if isinstance(data, IterableDataset):
            raise TypeError(
                "noise_scale needs random access to the data; an IterableDataset (or a DataLoader "
                "over one) cannot be sampled. Pass a map-style Dataset or an (inputs, targets) tuple"
            )
        if isinstance(data, TensorDataset):
            if len(data.tensors) != 2:
                raise ValueError(
                    f"a TensorDataset must hold (inputs, targets), got {len(data.tensors)} tensors"
                )
            data = tuple(data.tensors)
        if isinstance(data, (tuple, list)) and not isinstance(data, Dataset):
            if len(data) != 2:
                raise ValueError(f"data must be an (inputs, targets) pair, got {len(data)} items")
            self._tensors = (data[0], data[1])
            self._len = self._check_lengths(data[0], data[1])
        elif isinstance(data, Dataset):
            self._dataset = data
            try:
                self._len = len(data)  # type: ignore[arg-type]
            except TypeError as e:
                raise TypeError("the Dataset must define __len__ to be sampled") from e
        else:
            raise TypeError(
                "data must be a torch Dataset, a DataLoader or an (inputs, targets) tuple, got "
                f"{type(data).__name__}"
            )
        if self._len < 2:
            raise ValueError(f"data must hold at least 2 samples, got {self._len}")

    @staticmethod
    def _check_lengths(inputs: Any, targets: Any) -> int:
        def first_len(obj: Any) -> int:
            if isinstance(obj, torch.Tensor):
                return int(obj.shape[0])
            if isinstance(obj, Mapping):
                return first_len(next(iter(obj.values())))
            raise TypeError(
                f"tuple data must hold tensors (or dicts of tensors), got {type(obj).__name__}"
            )

        n_in, n_tg = first_len(inputs), first_len(targets)
        if n_in != n_tg:
            raise ValueError(f"inputs have {n_in} samples but targets have {n_tg}")
        return n_in

    def __len__(self) -> int:
        return self._len

    def batch(self, idx: torch.Tensor) -> tuple[Any, Any]:
        """The ``(inputs, targets)`` batch of the given sample indices, on the device."""
        return self._take(idx)

    def head(self, n: int) -> tuple[Any, Any]:
        """The batch of the first ``n`` samples (no index tensor, so nothing is read back)."""
        return self._take(slice(0, n))

    def _take(self, idx: torch.Tensor | slice) -> tuple[Any, Any]:
        if self._tensors is not None:
            x, y = (_index(t, idx) for t in self._tensors)
        else:
            assert self._dataset is not None
            # one read, not one per sample
            order = range(idx.stop)[idx] if isinstance(idx, slice) else idx.tolist()
            items = [self._dataset[i] for i in order]
            collated = self._collate(items)
            if not isinstance(collated, Sequence) or len(collated) != 2:
                raise ValueError(
                    "each dataset item must be an (input, target) pair so that "
                    "loss_fn(model(input), target) can be computed"
                )
            x, y = collated
        return to_device(x, self.device), to_device(y, self.device)


def _index(obj: Any, idx: torch.Tensor | slice) -> Any:
    if isinstance(obj, Mapping):
        return type(obj)({k: v[idx] for k, v in obj.items()})
    return obj[idx]


def batch_loss(model: nn.Module, loss_fn: LossFn, batch: tuple[Any, Any]) -> torch.Tensor:
    """``loss_fn(model(x), y)`` checked to be a finite scalar (the batch MEAN loss)."""
    x, y = batch
    out = model(**x) if isinstance(x, Mapping) else model(x)
    loss = loss_fn(out, y)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"loss_fn must return the batch mean loss as a scalar tensor, got {shape}; use "
            "reduction='mean'"
        )
    return loss  # finiteness: checked with the gradients, in one host read (`mean_grads`)


def check_mean_loss(model: nn.Module, loss_fn: LossFn, src: BatchSource) -> None:
    """Refuse a ``loss_fn`` that sums over the batch, read from the loss itself
    (`nnstat.capture.reduction.MeanLossProbe.made_by`) in a forward of the data's first 8
    samples: every estimator takes the gradient of a batch mean, and a sum scales
    ``trace_sigma`` and ``grad_sq_norm`` by the batch size squared (``b_simple`` would be
    unaffected, so nothing else shows it).

    Args:
        model: the network.
        loss_fn: ``loss_fn(model(inputs), targets)``.
        src: the data.

    Raises:
        ValueError: the loss is a sum over the batch.

    Example:
        >>> model, src = nn.Linear(2, 1), BatchSource((torch.randn(8, 2), torch.randn(8, 1)))
        >>> check_mean_loss(model, nn.functional.mse_loss, src)
    """
    n = min(len(src), 8)
    with MeanLossProbe() as probe:  # a forward only: no backward, nothing read back
        loss = batch_loss(model, loss_fn, src.head(n))
    made = probe.made_by(loss, n)
    if made is not None and made[0] == "sum":
        raise ValueError(
            f"loss_fn returns a sum over the batch ({made[1]}), but the noise scale needs the "
            "batch MEAN loss: trace_sigma and grad_sq_norm would come out scaled by the batch "
            "size squared. Use reduction='mean' (or divide the sum by the batch size)."
        )


def mean_grads(
    model: nn.Module, loss_fn: LossFn, batch: tuple[Any, Any], params: Sequence[nn.Parameter]
) -> list[torch.Tensor]:
    """Gradient of the batch-mean loss w.r.t. ``params`` (no ``.grad`` is touched)."""
    loss = batch_loss(model, loss_fn, batch)
    grads = torch.autograd.grad(loss, list(params), allow_unused=True)
    out = [
        torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params, strict=True)
    ]
    # one host read per batch, whatever the number of tensors: an inf-norm is NaN/Inf exactly
    # when its tensor holds one (on a GPU a read per tensor would stall every parameter)
    loss = loss.detach()
    views = [norm_view(g) for g in out]
    maxima = [m.to(loss.device, torch.float64) for m in torch._foreach_norm(views, math.inf)]
    if not bool(torch.isfinite(torch.stack([loss.double(), *maxima])).all()):
        if not math.isfinite(float(loss)):
            raise ValueError(f"loss_fn returned a non-finite loss ({float(loss)})")
        raise ValueError("the gradient contains NaN or Inf; check the model and loss_fn")
    return out


def sq_norms(grads: Sequence[torch.Tensor], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Per-tensor squared norms as a ``dtype`` vector, on the gradients' device (no host read).

    One ``torch._foreach_norm`` accumulating in ``dtype`` (a few kernels per dtype group on a
    GPU, instead of three per tensor), squared after. ``dtype=torch.float32`` is for the
    per-step paths: on a CPU a float64 norm of float32 tensors converts each tensor first.

    Example:
        >>> sq_norms([torch.tensor([3.0, 4.0]), torch.ones(2, 2)]).tolist()
        [25.0, 4.0]
    """
    if not grads:
        return torch.zeros(0, dtype=dtype)
    grads = [norm_view(g) for g in grads]
    return torch.stack(torch._foreach_norm(grads, 2, dtype=dtype)).square()


def norm_view(g: torch.Tensor) -> torch.Tensor:
    """A tensor with the norm of ``g``: ``g`` itself, or for a sparse gradient
    (``nn.Embedding(sparse=True)``), which the norm kernels do not take, its coalesced values.

    Example:
        >>> norm_view(torch.tensor([3.0, 0.0, 4.0]).to_sparse()).tolist()  # without the zero
        [3.0, 4.0]
    """
    return g.coalesce().values() if g.is_sparse else g


def norm_dtype(grads: Sequence[torch.Tensor]) -> torch.dtype:
    """float64 when a gradient is float64, else float32 (half-precision norms would lose the
    digits the two-batch difference needs; float32 ones keep them without a conversion).

    Example:
        >>> norm_dtype([torch.ones(2, dtype=torch.bfloat16)]), norm_dtype([torch.ones(2).double()])
        (torch.float32, torch.float64)
    """
    return torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32


def to_host(rows: Sequence[torch.Tensor]) -> np.ndarray:
    """Stack per-estimate device vectors and copy them to the host once (float64 numpy)."""
    return torch.stack(list(rows)).to("cpu", torch.float64).numpy()
