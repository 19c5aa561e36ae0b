"""``nn.Conv1d`` / ``nn.Conv2d``: forward rows are the unfolded input patches (one position per
output location), so ``G_i = Σ_t b_t a_tᵀ`` over locations; a grouped conv is a Kronecker
product with one position per (location, group)."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from nnstat.capture.kinds.base import Kind


def _unfold(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """Unfold conv input to patches ``[N, L, C_in*k]`` (channel-major, like ``weight.flatten(1)``)."""
    one_d = isinstance(module, nn.Conv1d)
    if one_d:
        x = x.unsqueeze(2)
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    pad = list(module._reversed_padding_repeated_twice)  # [left, right, top, bottom]
    if one_d:
        pad = [pad[0], pad[1], 0, 0]
    unfold_pad = (0, 0)
    if mode == "constant" and pad[0] == pad[1] and pad[2] == pad[3]:
        unfold_pad, pad = (pad[2], pad[0]), [0, 0, 0, 0]  # let unfold pad: no copy of x
    if any(pad):
        x = F.pad(x, pad, mode=mode)
    ks = (1, *module.kernel_size) if one_d else module.kernel_size
    st = (1, *module.stride) if one_d else module.stride
    dl = (1, *module.dilation) if one_d else module.dilation
    cols = F.unfold(x, kernel_size=ks, dilation=dl, padding=unfold_pad, stride=st)
    return cols.transpose(1, 2)


def _weight_shape(module: nn.Module) -> tuple[int, ...]:
    """The weight's shape from the module's attributes, not the live tensor: under FSDP1
    (``use_orig_params``) ``module.weight`` is a flat local slice outside forward."""
    return (module.out_channels, module.in_channels // module.groups, *module.kernel_size)


class ConvKind(Kind):
    """``[C_out, C_in/groups·k(+1)]``: the weight flattened after its first dimension."""

    name = "conv"
    modules: ClassVar[tuple[type, ...]] = (nn.Conv1d, nn.Conv2d)

    def dims(self, module: nn.Module) -> tuple[int, int]:
        return math.prod(_weight_shape(module)[1:]) + self.has_bias(module), module.out_channels

    def forward_rows(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        batched = 3 if isinstance(module, nn.Conv1d) else 4
        if x.dim() != batched:  # torch accepts an unbatched [C, *spatial]: no sample dimension
            shape = "[N, C, L]" if batched == 3 else "[N, C, H, W]"
            raise ValueError(
                f"{type(module).__name__}: expected a batched input {shape}, got "
                f"{tuple(x.shape)}; an unbatched input has no sample dimension: give it one "
                "(x[None], or a batch of inputs)"
            )
        n = x.shape[0]
        cols = _unfold(module, x.detach().float())
        g = module.groups
        return cols.reshape(n, cols.shape[1] * g, cols.shape[2] // g)

    def backward_rows(self, module: nn.Module, g: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        n = g.shape[0]
        g = g.detach().float()
        c_out, groups = g.shape[1], module.groups
        spatial = tuple(g.shape[2:])
        b = g.reshape(n, c_out, -1).transpose(1, 2)
        if groups == 1:
            return b, spatial
        # grouped conv as a Kronecker product: one position per (location, group), with the
        # output channels of other groups zeroed, so G = Σ b̃ ãᵀ stays an outer-product sum
        b = b.reshape(n, b.shape[1], groups, c_out // groups)
        eye = torch.eye(groups, dtype=b.dtype, device=b.device)
        b = torch.einsum("nljc,jk->nljkc", b, eye).reshape(n, -1, c_out)
        return b, spatial

    def weight_of(self, module: nn.Module, w: torch.Tensor) -> torch.Tensor:
        return w.reshape(w.shape[0], *_weight_shape(module))

    def weight_matrix(self, module: nn.Module, w: torch.Tensor) -> torch.Tensor:
        return w.reshape(w.shape[0], w.shape[1], -1)
