"""Matrix-form row helpers shared by the capture and its layer kinds: one-hot rows kept as
token indices, scatters at indices, Gram-based squared norms, the mean-loss rescaling."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def one_hot_rows(idx: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., width]`` float32 one-hot rows of indices ``idx`` (``-1``: a zero row): an
    embedding's forward rows in matrix form.

    Example:
        >>> one_hot_rows(torch.tensor([2, -1]), 3)
        tensor([[0., 0., 1.],
                [0., 0., 0.]])
    """
    return F.one_hot(idx.clamp(min=0), width).float() * (idx >= 0).unsqueeze(-1)


def token_rows(idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``one_hot_rows(idx, V) @ p.T`` (``p`` ``[r, V]``) as a lookup: the rows of the one-hot
    matrix are never built (``[N, T, V]``: GBs for a GPT-2 vocabulary). The values are the
    product's, bit for bit: each output is one ``p`` entry times 1 plus exact zeros.

    Example:
        >>> p = torch.randn(2, 3)
        >>> bool(torch.equal(token_rows(torch.tensor([2, -1]), p),
        ...                  one_hot_rows(torch.tensor([2, -1]), 3) @ p.T))
        True
    """
    return F.embedding(idx.clamp(min=0), p.T) * (idx >= 0).unsqueeze(-1)


def gram_sq_norms(a: torch.Tensor, b: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """``[N]`` squared norms of ``G_i = Σ_t b_t [a_t, 1]ᵀ`` (ones column when `bias`: adds the
    sum of ``b``'s Gram) as one batched dot of the two ``[N, T, T]`` Grams.

    Example:
        >>> a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
        >>> g = torch.cat([b.transpose(1, 2) @ a, b.sum(1).unsqueeze(-1)], -1)
        >>> bool(torch.allclose(gram_sq_norms(a, b, bias=True), g.square().sum((1, 2))))
        True
    """
    n = a.shape[0]
    gram_a = torch.bmm(a, a.transpose(1, 2)).view(n, 1, -1)
    gram_b = torch.bmm(b, b.transpose(1, 2)).view(n, -1, 1)
    sq = torch.bmm(gram_a, gram_b).view(n)
    return sq.add_(gram_b.view(n, -1).sum(1)) if bias else sq


def gram_is_cheaper(t: int, d_in: int, d_out: int) -> bool:
    """Whether the Grams take fewer multiply-adds than forming ``G_i`` ``[d_out, d_in]`` over
    `t` positions: ``t² (d_in + d_out)`` against ``t d_in d_out`` per sample (the Grams' dot and
    the matrices' squares are the smaller terms of each). Wide layers over few positions take
    the Grams; at GPT-2 small's T = 512 every layer wider than ``2·512`` on one side does.

    Args:
        t: positions per sample.
        d_in: the matrix form's input side (bias column included).
        d_out: its output side.

    Returns:
        True when the Grams are the cheaper way to the squared norms.

    Example:
        >>> gram_is_cheaper(512, 769, 3072), gram_is_cheaper(512, 769, 768)
        (True, False)
    """
    return t * (d_in + d_out) < d_in * d_out


def gram_sq_norm_sum(a: torch.Tensor, b: torch.Tensor, bias: bool = False) -> list[torch.Tensor]:
    """0-d values adding to ``Σ_i ‖G_i‖²`` (:func:`gram_sq_norms` summed over the samples):
    one dot of the two ``[N, T, T]`` Grams over every sample at once, and with `bias` the sum
    of ``b``'s Gram (the ones column's ``Σ_{t,s} b_t·b_s``), left for the caller to add: no
    ``[N]`` values, no in-place add, one kernel per term.

    Args:
        a: ``[N, T, d_in]`` forward rows (no ones column).
        b: ``[N, T, d_out]`` output gradients (zero where a position is masked).
        bias: the matrix form ends with the ones column.

    Returns:
        The dot, and with `bias` the sum of ``b``'s Gram (0-d tensors).

    Example:
        >>> a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
        >>> bool(torch.allclose(sum(gram_sq_norm_sum(a, b, True)), gram_sq_norms(a, b, True).sum()))
        True
    """
    gram_a = torch.bmm(a, a.transpose(1, 2))
    gram_b = torch.bmm(b, b.transpose(1, 2))
    out = [torch.dot(gram_a.view(-1), gram_b.view(-1))]
    return [*out, gram_b.sum()] if bias else out


def scatter_rows(
    out: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, alpha: float = 1.0
) -> torch.Tensor:
    """``out[i, idx[i, t]] += alpha * rows[i, t]`` in place (any strides) for ``out`` ``[N, R,
    C]``, ``idx`` ``[N, T]`` (``-1``: adds zeros, not a boolean selection, a host sync on a GPU).

    Example:
        >>> out = torch.zeros(1, 3, 2)
        >>> scatter_rows(out, torch.tensor([[2, -1, 2]]), torch.ones(1, 3, 2))[0].tolist()
        [[0.0, 0.0], [0.0, 0.0], [2.0, 2.0]]
    """
    n, t = idx.shape
    src = torch.where((idx >= 0).unsqueeze(-1), rows if alpha == 1.0 else rows * alpha, 0.0)
    sample = torch.arange(n, device=idx.device).unsqueeze(1).expand(n, t)
    return out.index_put_(
        (sample.reshape(-1), idx.clamp(min=0).reshape(-1)), src.reshape(n * t, -1), True
    )


def scaled(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """``rows * scale``, in place on `rows` (a fresh product) unless ``scale == 1``."""
    return rows if scale == 1.0 else rows.mul_(scale)


def rows_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for ``[N, T, d]`` rows: the one GEMM ``matmul`` folds them into, viewed back
    (``matmul`` adds an ``_unsafe_view`` op per call, a dispatch per module per batch)."""
    if x.dim() != 3 or not x.is_contiguous():
        return x @ w  # matmul decides how to fold (or batch) rows it cannot view
    n, t, d = x.shape
    return torch.mm(x.view(n * t, d), w).view(n, t, w.shape[1])
