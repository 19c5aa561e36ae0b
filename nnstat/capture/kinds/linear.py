"""``nn.Linear``: ``y = x Wᵀ + b``; its rows are its inputs and output gradients as they come."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from nnstat.capture.kinds.base import Kind


class LinearKind(Kind):
    """``[d_out, d_in(+1)]``, the weight's own layout (bias = last column)."""

    name = "linear"
    modules: ClassVar[tuple[type, ...]] = (nn.Linear,)
    plain = True
    tie_transposed = False

    def dims(self, module: nn.Module) -> tuple[int, int]:
        # from the attributes, not the live tensor: under FSDP1 (use_orig_params)
        # module.weight is a flat local slice outside forward
        return module.in_features + self.has_bias(module), module.out_features

    def weight_of(self, module: nn.Module, w: torch.Tensor) -> torch.Tensor:
        return w.reshape(w.shape[0], module.out_features, module.in_features)

    def weight_matrix(self, module: nn.Module, w: torch.Tensor) -> torch.Tensor:
        return w.reshape(w.shape[0], w.shape[1], -1)
