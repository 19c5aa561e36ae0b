"""HuggingFace/GPT-2 ``Conv1D``: ``y = x @ W + b`` with ``W`` ``(nx, nf)``, a linear layer whose
weight is stored transposed. Detected by class name and attributes: transformers is never
imported."""

from __future__ import annotations

import torch
from torch import nn

from nnstat.capture.kinds.base import Kind


def is_hf_conv1d(module: nn.Module) -> bool:
    """True for HuggingFace/GPT-2 style ``Conv1D`` (``y = x @ W + b``, ``W.shape == (nx, nf)``).

    Example:
        >>> is_hf_conv1d(torch.nn.Linear(2, 2))
        False
    """
    w = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and isinstance(w, torch.Tensor)
        and w.dim() == 2
        and w.shape[1] == module.nf
    )


class HFConv1DKind(Kind):
    """``[nf, nx(+1)]``: the transpose of its ``(nx, nf)`` weight (bias = last column)."""

    name = "conv1d_hf"
    label = "transformers' Conv1D"
    plain = True
    tie_transposed = True

    def matches(self, module: nn.Module) -> bool:
        return is_hf_conv1d(module)

    def dims(self, module: nn.Module) -> tuple[int, int]:
        return module.weight.shape[0] + self.has_bias(module), module.weight.shape[1]

    def weight_of(self, module: nn.Module, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(1, 2)

    def weight_matrix(self, module: nn.Module, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(1, 2)
