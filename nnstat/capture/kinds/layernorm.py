"""``nn.LayerNorm`` (with ``elementwise_affine``): rows are the normalised input ``x̂`` and the
output gradient ``b``, and ``G_i = [Σ_t b∘x̂, Σ_t b]`` (weight then bias) is elementwise, not a
sum of outer products: no K-FAC, and its projection is ``G_i @ Pᵀ`` on the flat gradient.

The capture keeps the module's input ``x`` as it came (a view, no copy, when it is float32) and
``x̂`` is recomputed where a product needs it (one ``layer_norm`` kernel reading ``x``): the
per-sample gradient then makes ONE ``[N, T, D]`` temporary, ``x̂``, multiplied by ``b`` in
place and summed over positions (keeping ``x̂`` beside the input and forming ``b∘x̂`` would
make two: GPT-2 small has 25 LayerNorms of 12.6 MB each at batch 8 x 512)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from nnstat.capture.kinds.base import Kind, Rows
from nnstat.capture.matrix import scaled


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

    def forward_rows(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The input ``[N, T, D]`` as it is: :meth:`normalised` makes ``x̂`` when needed."""
        return x.detach().float().reshape(x.shape[0], -1, math.prod(module.normalized_shape))

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

    def grad(self, c: Rows, b: torch.Tensor) -> torch.Tensor:
        # x̂ is the one [N, T, D] temporary: b∘x̂ is formed in it, then summed over positions
        w = self.normalised(c, masked=False).mul_(b).sum(1)
        return torch.cat([w, b.sum(1)], dim=1) if self.has_bias(c.module) else w

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
