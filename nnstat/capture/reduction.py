"""Was a loss a mean or a sum over the batch? Read from the loss itself, not the gradients.

Consumers of per-sample gradients need to know how the loss reduced over the batch: with a
mean, the backward's output gradients are ``1/N`` of each sample's own; with a sum they are
each sample's own. The gradients alone cannot tell: the per-sample gradients always add up to
the parameters' ``.grad``, whatever the reduction, so a loss ``1/N`` smaller is
indistinguishable from a mean. What can tell is the loss itself. :class:`MeanLossProbe` is a
``TorchFunctionMode`` active during one block: it notes every scalar made by a mean or a sum
over a batch-sized first dimension (``torch.mean``/``Tensor.mean``, ``torch.sum``/
``Tensor.sum`` and the ``torch.nn.functional`` losses with ``reduction="mean"``/
``"batchmean"``/``"sum"``) and hooks its gradient. After the backward, that gradient
``c = dL/d(scalar)`` says with which weight each sample's term reached the loss: ``c / N`` for
a mean, ``c`` for a sum. A weight well below 1 (``|c| <= N / 2`` for a mean: typically
``c = 1``, the mean *is* the loss) is a batch mean; a weight near 1 (a sum with
``|c| > 1 / sqrt(N)``, the geometric middle between a mean's ``1/N`` and a sum's 1) is a batch
sum. ``c = N`` on a mean is a sum written as ``mean * N``.

Used by the Run (``nnstat.run``) and the streaming noise scale (``NoiseScale.batch``), both of
which take the reduction as an argument and warn when the loss says otherwise.

Example:
    >>> import torch
    >>> x = torch.randn(8, 3, requires_grad=True)
    >>> with MeanLossProbe() as probe:
    ...     x.pow(2).mean().backward()
    >>> probe.mean_over_batch(8), probe.sum_over_batch(8)
    ('mean', None)
"""

from __future__ import annotations

import inspect
import math
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

_MEANS = {torch.mean, torch.Tensor.mean, torch.nanmean, torch.Tensor.nanmean}
_SUMS = {torch.sum, torch.Tensor.sum, torch.nansum, torch.Tensor.nansum}
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


def _reduction(func: Any, args: tuple, kwargs: dict) -> tuple[str, str, torch.Tensor] | None:
    """``("mean" | "sum", how, reduced tensor)`` when ``func(*args, **kwargs)`` reduces its
    whole input to a scalar by a mean or a sum."""
    if func in _MEANS or func in _SUMS:
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor):
            return None
        return ("mean", "mean", x) if func in _MEANS else ("sum", "sum", x)
    if func not in _LOSSES:
        return None
    bound = inspect.signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    reduction = a.get("reduction", "mean")
    if a.get("size_average") is not None or a.get("reduce") is not None:
        from torch.nn import _reduction

        reduction = _reduction.legacy_get_string(a.get("size_average"), a.get("reduce"))
    if reduction not in ("mean", "batchmean", "sum"):
        return None
    x = next((v for v in a.values() if isinstance(v, torch.Tensor)), None)
    if x is None:
        return None
    kind = "sum" if reduction == "sum" else "mean"
    return kind, f"{func.__name__}(reduction={reduction!r})", x


class MeanLossProbe(TorchFunctionMode):
    """Records the scalar means and sums made inside the ``with`` block and the gradient each
    receives.

    Costs Python dispatch on every torch call inside the block: use it on one block per pass.
    """

    def __init__(self, declared: str = "sum") -> None:
        super().__init__()
        #: the reduction the caller was told the loss uses (its warnings depend on it)
        self.declared = declared
        # (what, first dimension of the averaged tensor, gradients the scalar received)
        self.means: list[tuple[str, int, list[float]]] = []
        self.sums: list[tuple[str, int, list[float]]] = []
        # every such scalar (weakly: an id could be reused), its kind, what and first dimension
        self._scalars: list[tuple[weakref.ref, str, str, int]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # a meta scalar has no gradient value to read: nothing to tell (op-counting runs)
        if (
            isinstance(out, torch.Tensor)
            and out.dim() == 0
            and out.requires_grad
            and not out.is_meta
        ):
            found = _reduction(func, args, kwargs)
            if found is not None and found[2].dim() >= 1 and found[2].numel() > 1:
                grads: list[float] = []
                seen = self.means if found[0] == "mean" else self.sums
                seen.append((found[1], int(found[2].shape[0]), grads))
                self._scalars.append((weakref.ref(out), found[0], found[1], found[2].shape[0]))
                out.register_hook(lambda g, grads=grads: grads.append(float(g)))
        return out

    def made_by(self, loss: torch.Tensor, n: int) -> tuple[str, str] | None:
        """``("mean" | "sum", what)`` when ``loss`` itself is the scalar of a mean or a sum over
        a batch of ``n`` samples (its first dimension a multiple of ``n``), else ``None``. Read
        from the forward alone (no backward, no host read), so it sees only a loss returned
        as that reduction made it (``x.sum()``, ``reduction="sum"``), not one scaled after.

        Example:
            >>> x = torch.randn(8, 3, requires_grad=True)
            >>> with MeanLossProbe() as probe:
            ...     summed, halved = x.pow(2).sum(), x.pow(2).sum() / 8
            >>> probe.made_by(summed, 8), probe.made_by(halved, 8)
            (('sum', 'sum'), None)
        """
        if n < 2:
            return None
        for ref, kind, what, rows in self._scalars:
            if ref() is loss and rows % n == 0:
                return kind, what
        return None

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

    def mean_over_positions(self, n: int) -> tuple[str, int] | None:
        """``(what, rows)`` when :meth:`mean_over_batch` found a mean over ``rows``, a multiple
        of the ``n`` samples larger than ``n``: the positions of every sample (tokens of
        ``logits.view(-1, V)``), so each sample's term weighs ``1 / rows`` (``1 / counted``
        with ``ignore_index``), not ``1 / n``; else ``None``."""
        what = self.mean_over_batch(n)
        if what is None:
            return None
        rows = next(r for w, r, g in self.means if w == what and g and r % n == 0)
        return (what, rows) if rows > n else None

    def sum_over_batch(self, n: int) -> str | None:
        """What summed over the batch of ``n`` samples and reached the loss with a weight
        ``|c| > 1 / sqrt(n)`` per sample's term, when nothing averaged over the batch
        (:meth:`mean_over_batch` is ``None``), else ``None``."""
        if n < 2 or self.mean_over_batch(n) is not None:
            return None
        for what, rows, grads in self.sums:
            c = sum(grads)
            if grads and rows % n == 0 and abs(c) * math.sqrt(n) > 1:
                return what
        return None
