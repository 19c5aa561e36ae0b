"""``nn.LayerNorm`` (with ``elementwise_affine``): rows are the normalised input ``x̂`` and the
output gradient ``b``, and ``G_i = [Σ_t b∘x̂, Σ_t b]`` (weight then bias) is elementwise, not a
sum of outer products: no K-FAC, and its projection is ``G_i @ Pᵀ`` on the flat gradient.

The capture keeps the module's input ``x`` as it came (a view, no copy, when it is float32).
The per-sample gradient does not form ``x̂``: with ``x̂_t = (x_t - μ_t) r_t`` (``μ``, ``r``: each
position's mean and ``1/std``), ``Σ_t b_t∘x̂_t = Σ_t r_t (b_t∘x_t) - Σ_t μ_t r_t b_t``. It makes
ONE ``[N, T, D]`` temporary, ``b∘x``, and reduces it and ``b`` over positions with two batched
products (the rows ``μr`` and ``1`` give the centring and the bias in one read of ``b``): five
passes over ``[N, T, D]`` tensors (read ``x`` and ``b``, write and read ``b∘x``, read ``b``),
where forming ``x̂`` took seven. ``μ`` and ``r`` are the ones autograd saved for the layer's
own backward, taken in the forward hook when the output is ``layer_norm``'s result from the
very input the capture keeps, in float32 or float64, and no saved-tensor hooks are active
(activation checkpointing, offloading: unpacking there would recompute or copy); otherwise
they are computed in float32, one more read of ``x``. GPT-2 small has 25 LayerNorms of
12.6 MB per pass at batch 8 x 512.
Rounding: the two sums are ``|μ|/σ`` times their difference, so the float32 error grows with
``|μ|/σ`` as forming ``x̂`` does (``x - μ`` carries ``μ``'s rounding), about 10x larger
(2e-7 of the largest entry at ``|μ|/σ ~ 0``, 7e-6 at 13, 3e-4 at 1000, against 1e-7, 8e-7,
4e-5, over 64 positions of 768 features).
The forward stream (:meth:`LayerNormKind.normalised`) still makes ``x̂`` when asked for it."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from nnstat.capture.kinds.base import Kind, Rows
from nnstat.capture.matrix import scaled

#: the attribute by which a detached input, then its rows, carry autograd's mean and 1/std
STATS = "_nnstat_norm_stats"


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are active (activation checkpointing, offloading): then a
    saved tensor is not read in the forward (True too for a torch that cannot tell)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:  # a torch without the getter cannot tell: compute the statistics
        return True
    try:
        return top(False) is not None
    except (TypeError, RuntimeError):  # another signature, or a stack it cannot read: as above
        return True


class LayerNormKind(Kind):
    """``[D(+D)]``: the weight's gradient then the bias's, flat over the normalised shape."""

    name = "layernorm"
    modules: ClassVar[tuple[type, ...]] = (nn.LayerNorm,)
    outer = False
    dense = False

    def unsupported(self, module: nn.Module) -> str | None:
        if not module.elementwise_affine:
            return "LayerNorm without elementwise_affine has no parameters"
        return None

    def dims(self, module: nn.Module) -> tuple[int, int]:
        """``(D, D)`` of the normalised shape."""
        d = math.prod(tuple(module.normalized_shape))
        return d, d

    def logged_dims(self, module: nn.Module) -> tuple[int, int | None]:
        return self.dims(module)[0] * (1 + self.has_bias(module)), None

    def keep_forward_stats(self, x: torch.Tensor, output: torch.Tensor) -> None:
        """Keep autograd's saved mean and ``1/std`` of ``x`` by ``x`` when ``output`` is
        ``layer_norm``'s result from ``x`` itself (same storage, shape and strides: not a
        subclass's transformed input, not autocast's copy), they are float32 or float64 and no
        saved-tensor hooks are active: no kernel (see the module docstring)."""
        node = output.grad_fn
        if type(node).__name__ != "NativeLayerNormBackward0" or type(x) is not torch.Tensor:
            return  # another op made the output, or a subclass input (its own storage rules)
        if saved_tensor_hooks_active():
            return
        saved = node._saved_input
        where = (saved.data_ptr(), saved.shape, saved.stride(), saved.dtype)
        if type(saved) is not torch.Tensor or where != (x.data_ptr(), x.shape, x.stride(), x.dtype):
            return
        stats = (node._saved_result1, node._saved_result2)
        if all(s.dtype in (torch.float32, torch.float64) for s in stats):
            # not a 16-bit mean (a bfloat16 layer on the CPU saves them so): the rows are float32
            setattr(x, STATS, stats)

    def forward_rows(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The input ``[N, T, D]`` as it is: :meth:`normalised` makes ``x̂`` when needed (with
        the call's saved mean and ``1/std`` ``[N, T]`` when the forward hook kept them)."""
        a = x.detach().float().reshape(x.shape[0], -1, math.prod(module.normalized_shape))
        saved = getattr(x, STATS, None)
        if saved is not None:
            setattr(a, STATS, tuple(s.reshape(a.shape[:2]) for s in saved))
        return a

    def masked_rows(self, a: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Unchanged: the capture's ``keep`` masks ``x̂`` (:meth:`normalised`), and masked rows
        have ``b = 0``, which the gradient's product drops."""
        return a

    def normalised(self, c: Rows, masked: bool = True) -> torch.Tensor:
        """A fresh ``[N, T, D]`` ``x̂`` of the capture's input (LayerNorm over the flattened
        normalised shape: the same elements' mean and variance); ``masked``: masked positions
        zeroed (the forward stream; the gradient's product needs no mask)."""
        xh = F.layer_norm(c._a, (c._a.shape[-1],), None, None, c.module.eps)
        if masked and c._keep is not None:
            xh.mul_(c._keep.unsqueeze(-1))
        return xh

    def backward_rows(self, module: nn.Module, g: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        g = g.detach().float()
        nd = len(module.normalized_shape)
        pos = tuple(g.shape[1 : g.dim() - nd])
        return g.reshape(g.shape[0], -1, math.prod(tuple(module.normalized_shape))), pos

    def grads_by_param(self, module: nn.Module, g: torch.Tensor) -> dict[str, torch.Tensor]:
        n, shape = g.shape[0], tuple(module.normalized_shape)
        d = math.prod(shape)
        out = {"weight": g[:, :d].reshape(n, *shape)}
        if self.has_bias(module):
            out["bias"] = g[:, d:].reshape(n, *shape)
        return out

    def matrix_from_params(
        self, module: nn.Module, params: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        w = params["weight"]
        n = w.shape[0]
        parts = [w.reshape(n, -1)] + (
            [params["bias"].reshape(n, -1)] if self.has_bias(module) else []
        )
        return torch.cat(parts, dim=1)

    def per_sample_grad(self, c: Rows) -> torch.Tensor:
        # the mean-loss factor on the sums, not on b [N, T, D]
        return scaled(self.grad(c, c._b_raw), c._scale)

    def stats(self, c: Rows) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Each position's mean and ``1/sqrt(var + eps)``, ``[N, T]`` each, not to be written
        in place: autograd's own when the forward hook kept them (no kernel), else from one
        read of the input (the biased variance, as ``layer_norm`` uses)."""
        saved = getattr(c._a, STATS, None)
        if saved is not None:
            return saved[0].float(), saved[1].float()
        var, mean = torch.var_mean(c._a, dim=-1, correction=0)
        return mean, var.add_(c.module.eps).rsqrt_()

    def grad(self, c: Rows, b: torch.Tensor) -> torch.Tensor:
        # Σ_t b∘x̂ = Σ_t r (b∘x) - Σ_t μ r b without x̂: b∘x is the one [N, T, D] temporary
        mean, rstd = self.stats(c)
        prod = torch.mul(c._a, b)
        n, t, d = prod.shape
        r = rstd.unsqueeze(1)  # [N, 1, T]
        if not self.has_bias(c.module):
            if mean is None:  # RMSNorm: no centring, no bias
                return torch.bmm(r, prod).view(n, d)
            lhs = torch.mul(mean, rstd).unsqueeze(1)
        else:  # the rows applied to b in one batched product: μr (the centring), then 1
            lhs = rstd.new_ones(n, 2, t)
            if mean is None:
                lhs[:, 0].zero_()
            else:
                torch.mul(mean, rstd, out=lhs[:, 0])
        out = torch.bmm(lhs, b)  # [N, 1 or 2, D]: Σ μ r b (, Σ b)
        out[:, :1].baddbmm_(r, prod, beta=-1)  # Σ r (b∘x) - Σ μ r b: the weight's, in place
        return out.view(n, -1)  # weight then bias

    # the forward stream is x̂ (masked positions zero), made from the input when asked for
    def forward(self, c: Rows) -> torch.Tensor:
        return self.normalised(c)

    def forward_gram(self, c: Rows) -> torch.Tensor:
        a = self.normalised(c).reshape(-1, c._a.shape[-1])
        return a.T @ a

    def forward_sq_sum(self, c: Rows) -> torch.Tensor:
        return self.normalised(c).square_().sum((0, 1))

    def forward_sum(self, c: Rows) -> torch.Tensor:
        return self.normalised(c).sum((0, 1))

    def projected_forward(self, c: Rows, proj: torch.Tensor) -> torch.Tensor:
        return self.normalised(c).reshape(-1, c._a.shape[-1]) @ proj.T

    def batch_grad(self, c: Rows) -> torch.Tensor:
        return self.per_sample_grad(c).sum(0)

    def sq_norm(self, c: Rows, b: torch.Tensor) -> torch.Tensor:
        return self.grad(c, b).square().sum(1)
