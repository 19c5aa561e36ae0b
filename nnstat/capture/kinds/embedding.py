"""``nn.Embedding``: its forward rows are one-hot tokens, kept as ``[N, T]`` indices (``-1``:
a position without gradient), so every product with them is a lookup or a scatter and the
``[N, T, V]`` one-hot rows are built only when asked for."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from nnstat.capture.kinds.base import Kind, Rows
from nnstat.capture.matrix import one_hot_rows, scaled, scatter_rows, token_rows


class EmbeddingKind(Kind):
    """``[D, V]``: the transpose of the ``[V, D]`` table (no bias)."""

    name = "embedding"
    modules: ClassVar[tuple[type, ...]] = (nn.Embedding,)
    dense = False
    tokens = True
    tie_transposed = True

    def unsupported(self, module: nn.Module) -> str | None:
        if module.scale_grad_by_freq:
            return (
                "scale_grad_by_freq scales by batch-wide counts, so per-sample gradients are "
                "undefined"
            )
        return None

    def dims(self, module: nn.Module) -> tuple[int, int]:
        return module.num_embeddings, module.embedding_dim

    def forward_rows(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The ``[N, T]`` long index tensor (``-1`` = no gradient)."""
        idx = x.detach().reshape(x.shape[0], -1).long()
        if module.padding_idx is not None:
            # torch gives the padding row a zero gradient: treat those positions as absent
            idx = idx.masked_fill(idx == module.padding_idx, -1)
        return idx

    def masked_rows(self, a: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return a.masked_fill(~keep.bool(), -1)

    def weight_of(self, module: nn.Module, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(1, 2)

    def weight_matrix(self, module: nn.Module, w: torch.Tensor) -> torch.Tensor:
        return w.transpose(1, 2)

    def forward(self, c: Rows) -> torch.Tensor:
        return one_hot_rows(c._a, c.d_in)

    def grad(self, c: Rows, b: torch.Tensor) -> torch.Tensor:
        out = b.new_zeros(c._a.shape[0], c.d_in, c.d_out)
        return scatter_rows(out, c._a, b).transpose(1, 2)

    def batch_grad(self, c: Rows) -> torch.Tensor:
        b = c._b_raw.reshape(-1, c._b_raw.shape[-1])
        g = b.new_zeros(1, c.d_in, c.d_out)  # every position as one sample of a batch of one
        g = scatter_rows(g, c._a.reshape(1, -1), b.unsqueeze(0))[0].T
        return scaled(g, c._scale)

    def sq_norm(self, c: Rows, b: torch.Tensor) -> torch.Tensor:
        a, t = c._a, b.shape[1]
        if t * t > c.d_in:
            return self.grad(c, b).square().sum((1, 2))
        same = (a.unsqueeze(2) == a.unsqueeze(1)) & (a >= 0).unsqueeze(2)
        return (same * torch.bmm(b, b.transpose(1, 2))).sum((1, 2))

    def sq_norm_parts(
        self, c: Rows, b: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # sq_norm's choice; the scattered per-sample gradients join the caller's foreach norm
        if b.shape[1] ** 2 > c.d_in:
            return [self.grad(c, b)], []
        return [], [self.sq_norm(c, b).sum()]

    def projected_rows(self, c: Rows, p_in: torch.Tensor) -> torch.Tensor:
        return token_rows(c._a, p_in)

    def projected_forward(self, c: Rows, proj: torch.Tensor) -> torch.Tensor:
        return token_rows(c._a.reshape(-1), proj)

    def forward_gram(self, c: Rows) -> torch.Tensor:
        return torch.diag(self.forward_sum(c))

    def forward_sq_sum(self, c: Rows) -> torch.Tensor:
        return self.forward_sum(c)  # one-hot: a² = a

    def forward_sum(self, c: Rows) -> torch.Tensor:
        """``[V]`` float32 count of each index over positions with a gradient.

        A scatter-add of 0/1 weights: no boolean-mask selection and no ``bincount`` (both read
        the device back: the selection's size, bincount's maximum on CUDA). Counts up to 2^24
        per batch are exact in float32, in any order of the additions.
        """
        idx = c._a.reshape(-1)
        valid = idx >= 0
        counts = torch.zeros(c.d_in, device=idx.device)
        return counts.index_add_(0, idx.clamp(min=0), valid.float())
