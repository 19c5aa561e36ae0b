"""RMSNorm: ``y = w ∘ x̂`` with ``x̂ = x / sqrt(mean(x²) + eps)`` over the weight's dimensions.

As for LayerNorm (whose kind this extends), the gradient is elementwise, ``G_i = Σ_t b∘x̂``, not
a sum of outer products. Captured: ``torch.nn.RMSNorm`` (with ``elementwise_affine``) and
transformers' ``LlamaRMSNorm`` (``weight * x̂`` in the input dtype, ``x̂`` computed in float32
with ``variance_epsilon``). Other RMSNorm classes are left to the usual skip-with-a-warning:
variants differ (Gemma's ``(1 + weight)``, T5's without the cast), and a look-alike matched by
name could be logged with the wrong ``x̂``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from nnstat.capture.kinds.layernorm import LayerNormKind

#: class names (any module path) captured with Llama's formula; checked for `variance_epsilon`
LLAMA_FORM = ("LlamaRMSNorm",)


class RMSNormKind(LayerNormKind):
    """``[D]``: the weight's gradient, flat over the weight's shape (RMSNorm has no bias)."""

    name = "rmsnorm"
    modules: ClassVar[tuple[type, ...]] = (nn.RMSNorm,)  # torch >= 2.4

    def matches(self, module: nn.Module) -> bool:
        if isinstance(module, nn.RMSNorm):
            return True
        return type(module).__name__ in LLAMA_FORM and hasattr(module, "variance_epsilon")

    def unsupported(self, module: nn.Module) -> str | None:
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            return "RMSNorm without elementwise_affine has no parameters"
        return None

    def dims(self, module: nn.Module) -> tuple[int, int]:
        """``(D, D)`` of the weight's shape."""
        d = module.weight.numel()
        return d, d

    def eps(self, module: nn.Module, dtype: torch.dtype) -> float:
        """The module's epsilon (``nn.RMSNorm(eps=None)``: the input dtype's machine epsilon)."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        return torch.finfo(dtype).eps if eps is None else float(eps)

    def forward_rows(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        d = module.weight.numel()
        xf = x.detach().float().reshape(x.shape[0], -1, d)
        xh = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps(module, x.dtype))
        # Llama multiplies the weight by x̂ cast back to the input dtype: its gradient sees that
        return xh.to(x.dtype).float()

    def backward_rows(self, module: nn.Module, g: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        g = g.detach().float()
        nd = module.weight.dim()
        pos = tuple(g.shape[1 : g.dim() - nd])
        return g.reshape(g.shape[0], -1, module.weight.numel()), pos

    def grads_by_param(self, module: nn.Module, g: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": g.reshape(g.shape[0], *module.weight.shape)}

    def logged_dims(self, module: nn.Module) -> tuple[int, int | None]:
        return math.prod(module.weight.shape), None
