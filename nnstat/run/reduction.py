"""Is the loss of a ``run(...)`` block a mean over the batch? (checked once per pass).

The store's rows are per-sample gradients of **each sample's own loss**. With the default
``loss_reduction="sum"`` the Run takes the backward's output gradients as they are, so a loss
that averages over the batch makes every row ``g_i / N`` (and a short last batch
``g_i / N_last``): influence scores come out scaled per batch, silently.

The gradients alone cannot tell: the captured per-sample gradients always add up to the
parameters' ``.grad``, whatever the reduction, so a loss that is ``1/N`` smaller is
indistinguishable from a mean. What can tell is the loss itself. :class:`MeanLossProbe` is a
``TorchFunctionMode`` active during one block: it notes every scalar made by a mean over a
batch-sized first dimension (``torch.mean``/``Tensor.mean`` and the ``torch.nn.functional``
losses with ``reduction="mean"``/``"batchmean"``) and hooks its gradient. After the backward,
that gradient ``c = dL/d(mean)`` says how the loss used the mean: ``c = N`` is a sum written
as ``mean * N`` (fine); ``|c| <= N / 2`` (typically ``c = 1``, the mean *is* the loss) means
each sample's term reached the loss with weight ``c / N``, well below 1.

Example:
    >>> import torch
    >>> x = torch.randn(8, 3, requires_grad=True)
    >>> with MeanLossProbe() as probe:
    ...     x.pow(2).mean().backward()
    >>> probe.mean_over_batch(8)
    'mean'
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MEANS = {torch.mean, torch.Tensor.mean, torch.nanmean, torch.Tensor.nanmean}
_LOSSES = {
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
    F.cosine_embedding_loss,
    F.cross_entropy,
    F.gaussian_nll_loss,
    F.hinge_embedding_loss,
    F.huber_loss,
    F.kl_div,
    F.l1_loss,
    F.margin_ranking_loss,
    F.mse_loss,
    F.multi_margin_loss,
    F.multilabel_margin_loss,
    F.multilabel_soft_margin_loss,
    F.nll_loss,
    F.poisson_nll_loss,
    F.smooth_l1_loss,
    F.soft_margin_loss,
    F.triplet_margin_loss,
}


def _mean_reduction(func: Any, args: tuple, kwargs: dict) -> tuple[str, torch.Tensor] | None:
    """``(how, averaged tensor)`` when ``func(*args, **kwargs)`` averages over its input."""
    if func in _MEANS:
        x = args[0] if args else kwargs.get("input")
        return ("mean", x) if isinstance(x, torch.Tensor) else None
    if func not in _LOSSES:
        return None
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    reduction = a.get("reduction", "mean")
    if a.get("size_average") is not None or a.get("reduce") is not None:
        from torch.nn import _reduction

        reduction = _reduction.legacy_get_string(a.get("size_average"), a.get("reduce"))
    if reduction not in ("mean", "batchmean"):
        return None
    x = next((v for v in a.values() if isinstance(v, torch.Tensor)), None)
    return (f"{func.__name__}(reduction={reduction!r})", x) if x is not None else None


class MeanLossProbe(TorchFunctionMode):
    """Records the scalar means made inside the ``with`` block and the gradient each receives.

    Costs Python dispatch on every torch call inside the block: use it on one block per pass.
    """

    def __init__(self) -> None:
        super().__init__()
        # (what, first dimension of the averaged tensor, gradients the scalar received)
        self.means: list[tuple[str, int, list[float]]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor) and out.dim() == 0 and out.requires_grad:
            found = _mean_reduction(func, args, kwargs)
            if found is not None and found[1].dim() >= 1 and found[1].numel() > 1:
                grads: list[float] = []
                self.means.append((found[0], int(found[1].shape[0]), grads))
                out.register_hook(lambda g, grads=grads: grads.append(float(g)))
        return out

    def mean_over_batch(self, n: int) -> str | None:
        """What averaged over the batch of ``n`` samples and reached the loss with a weight
        ``|c| <= n / 2`` (see the module docstring), else ``None``."""
        if n < 2:
            return None
        for what, rows, grads in self.means:
            c = sum(grads)
            if grads and rows % n == 0 and c != 0 and abs(c) * 2 <= n:
                return what
        return None


def reduction_probe(
    active: bool, model: Any, first_block: bool, loss_reduction: str, warned_once: set[str]
) -> MeanLossProbe | None:
    """A :class:`MeanLossProbe` for the first block (``first_block``) of a pass or eval log
    that captures anything (``active``) under ``loss_reduction="sum"``; ``None`` once the user
    was warned (``"mean loss"`` in ``warned_once``) or for a ``torch.compile``d ``model`` (no
    function mode inside)."""
    compiled = hasattr(model, "_orig_mod")
    if (
        not active
        or compiled
        or not first_block
        or loss_reduction != "sum"
        or "mean loss" in warned_once
    ):
        return None
    return MeanLossProbe()


def warn_mean_loss(probe: MeanLossProbe, n: int, warned_once: set[str]) -> None:
    """Warn (once: ``"mean loss"`` joins ``warned_once``) when ``probe`` saw the loss of a block
    of ``n`` samples use a mean over the batch (call it from ``Run.__call__``: the warning
    points at the user's ``with run(...)``)."""
    what = probe.mean_over_batch(n)
    if what is None:
        return
    warned_once.add("mean loss")
    warnings.warn(
        f"nnstat: the loss of this run(...) block is a mean over its {n} samples ({what}), "
        "but the run's loss_reduction is 'sum' (the default): every stored gradient is its "
        "sample's gradient divided by the batch size (and a short last batch by its own "
        "size). Compute each sample's own loss summed (e.g. cross_entropy(..., "
        "reduction='sum')), or setup({'loss_reduction': 'mean'}) for a mean over the batch.",
        stacklevel=4,
    )
