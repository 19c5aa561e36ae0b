"""RMSNorm: ``y = w ∘ x̂`` with ``x̂ = x / sqrt(mean(x²) + eps)`` over the weight's dimensions.

As for LayerNorm (whose kind this extends), the gradient is elementwise, ``G_i = Σ_t b∘x̂``, not
a sum of outer products. Captured: ``torch.nn.RMSNorm`` (with ``elementwise_affine``) and
transformers' ``LlamaRMSNorm`` (``weight * x̂`` in the input dtype, ``x̂`` computed in float32
with ``variance_epsilon``). As for LayerNorm, the capture keeps the input; the per-sample
gradient is ``Σ_t r_t (b_t∘x_t)`` (``r``: each position's ``1/rms``, one read of the input)
without ``x̂``, which the forward stream recomputes when asked for it. Other RMSNorm classes
are left to the usual skip-with-a-warning: variants differ (Gemma's ``(1 + weight)``, T5's
without the cast), and a look-alike matched by name could be logged with the wrong ``x̂``.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn

from nnstat.capture.kinds.base import Rows
from nnstat.capture.kinds.layernorm import LayerNormKind

#: class names (any module path) captured with Llama's formula; checked for `variance_epsilon`
LLAMA_FORM = ("LlamaRMSNorm",)


class RMSNormKind(LayerNormKind):
    """``[D]``: the weight's gradient, flat over the weight's shape (RMSNorm has no bias)."""

    name = "rmsnorm"
    label = "RMSNorm/LlamaRMSNorm"
    modules: ClassVar[tuple[type, ...]] = (nn.RMSNorm,)  # torch >= 2.4

    def matches(self, module: nn.Module) -> bool:
        if isinstance(module, nn.RMSNorm):
            return True
        return type(module).__name__ in LLAMA_FORM and hasattr(module, "variance_epsilon")

    def unsupported(self, module: nn.Module) -> str | None:
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            return "RMSNorm without elementwise_affine has no parameters"
        if self.eps(module) is None:
            return (
                "nn.RMSNorm(eps=None) takes its epsilon from the input's dtype, which the "
                "capture does not keep: give eps explicitly (e.g. torch.finfo(dtype).eps)"
            )
        return None

    def dims(self, module: nn.Module) -> tuple[int, int]:
        """``(D, D)`` of the weight's shape."""
        d = module.weight.numel()
        return d, d

    def eps(self, module: nn.Module) -> float | None:
        """The module's epsilon (Llama's ``variance_epsilon``, torch's ``eps``)."""
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
        return None if eps is None else float(eps)

    def forward_rows(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The input ``[N, T, D]`` as it is: :meth:`normalised` makes ``x̂`` when needed."""
        return x.detach().float().reshape(x.shape[0], -1, module.weight.numel())

    def normalised(self, c: Rows, masked: bool = True) -> torch.Tensor:
        """A fresh ``[N, T, D]`` ``x̂`` of the capture's input, in float32 (Llama casts it to
        the input dtype before the product: a bfloat16 model's rows differ by that rounding);
        ``masked``: masked positions zeroed."""
        a = c._a
        xh = a * torch.rsqrt(a.square().mean(-1, keepdim=True) + self.eps(c.module))
        if masked and c._keep is not None:
            xh.mul_(c._keep.unsqueeze(-1))
        return xh

    def keep_forward_stats(self, x: torch.Tensor, output: torch.Tensor) -> None:
        """Nothing: RMSNorm's forward saves no mean and ``1/rms`` for the capture to reuse
        (:meth:`stats` computes ``1/rms`` from the input)."""

    def stats(self, c: Rows) -> tuple[torch.Tensor | None, torch.Tensor]:
        """No mean (RMSNorm does not centre) and each position's ``1/sqrt(mean(x²) + eps)``,
        ``[N, T]``, from one read of the input (a norm, not a squared copy)."""
        a = c._a
        ms = torch.linalg.vector_norm(a, dim=-1).square_().div_(a.shape[-1])
        return None, ms.add_(self.eps(c.module)).rsqrt_()

    def backward_rows(self, module: nn.Module, g: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        g = g.detach().float()
        nd = module.weight.dim()
        pos = tuple(g.shape[1 : g.dim() - nd])
        return g.reshape(g.shape[0], -1, module.weight.numel()), pos

    def grads_by_param(self, module: nn.Module, g: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"weight": g.reshape(g.shape[0], *module.weight.shape)}

    def logged_dims(self, module: nn.Module) -> tuple[int, int | None]:
        return math.prod(module.weight.shape), None
