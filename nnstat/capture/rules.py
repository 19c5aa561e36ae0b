"""Per-module-kind identities that turn a layer's input and output gradient into matrix form.

Every supported kind is reduced to the same shape of data so that per-sample gradients,
projections, squared norms and K-FAC factors share one code path:

* ``A``: ``[N, T, d_in]`` float32 "forward" rows (conv: unfolded patches; the bias's column of
  ones stays implicit until someone asks for it, see ``ModuleCapture``), and ``B``: ``[N, T, d_out]`` float32 "backward" rows, so that the
  per-sample weight gradient (in ``[d_out, d_in]`` layout) is ``G_i = Σ_t b_t a_tᵀ``.
* Embedding keeps integer indices instead of one-hot rows (``-1`` marks an excluded position).
* LayerNorm keeps the normalised input ``x̂`` and gives ``G_i = [Σ_t b∘x̂, Σ_t b]``.
* ``nn.MultiheadAttention`` ("attention") is its packed ``in_proj`` (``[3E, E]`` and bias, an
  ``nn.Linear(E, 3E)`` in matrix form) with rows built by ``attention.py``; its ``out_proj``
  is a "linear" whose rows come from the same place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nnstat.capture import attention

OUTER_KINDS = ("linear", "conv", "conv1d_hf", "embedding", "attention")
#: every kind a rule supports (:func:`detect_kind`); a store's meta.json names one per module
KINDS = (*OUTER_KINDS, "layernorm")
#: kinds whose matrix form ends with the bias column (a column of ones in the forward rows)
BIAS_KINDS = ("linear", "conv", "conv1d_hf", "attention")
#: kinds whose forward and backward rows are already ``[N, ..., d]`` matrices (no unfolding)
ROW_KINDS = ("linear", "conv1d_hf", "attention")


def is_hf_conv1d(module: nn.Module) -> bool:
    """True for HuggingFace/GPT-2 style ``Conv1D`` (``y = x @ W + b``, ``W.shape == (nx, nf)``).

    Detected by class name and attributes so transformers is never imported.
    """
    w = getattr(module, "weight", None)
    return (
        type(module).__name__ == "Conv1D"
        and isinstance(getattr(module, "nf", None), int)
        and isinstance(w, torch.Tensor)
        and w.dim() == 2
        and w.shape[1] == module.nf
    )


def detect_kind(module: nn.Module) -> str | None:
    """Return the capture kind of ``module`` or ``None`` when no rule supports it."""
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, (nn.Conv1d, nn.Conv2d)):
        return "conv"
    if isinstance(module, nn.Embedding):
        return None if module.scale_grad_by_freq else "embedding"
    if isinstance(module, nn.LayerNorm):
        return "layernorm" if module.elementwise_affine else None
    if is_hf_conv1d(module):
        return "conv1d_hf"
    if isinstance(module, nn.MultiheadAttention):
        return "attention" if attention.unsupported_reason(module) is None else None
    return None


def unsupported_reason(module: nn.Module) -> str:
    """Explain why ``module`` cannot be captured (used in errors and warnings)."""
    if isinstance(module, nn.MultiheadAttention):
        return attention.unsupported_reason(module) or "supported"
    if isinstance(module, nn.Embedding) and module.scale_grad_by_freq:
        return (
            "scale_grad_by_freq scales by batch-wide counts, so per-sample gradients are undefined"
        )
    if isinstance(module, nn.LayerNorm) and not module.elementwise_affine:
        return "LayerNorm without elementwise_affine has no parameters"
    return "no per-sample gradient rule for this module type"


def has_bias(module: nn.Module) -> bool:
    if isinstance(module, nn.MultiheadAttention):
        return module.in_proj_bias is not None
    return isinstance(getattr(module, "bias", None), torch.Tensor)


def _conv_unfold(module: nn.Conv1d | nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
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


def forward_rows(kind: str, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Matrix-form forward rows ``[N, T, d_in]`` of one module call (no bias column).

    For embedding the result is the ``[N, T]`` long index tensor (``-1`` = no gradient).
    """
    if x.dim() < 1:
        raise ValueError(f"{type(module).__name__}: input has no batch dimension")
    n = x.shape[0]
    if kind in ROW_KINDS:
        if x.dim() < 2:
            raise ValueError(
                f"{type(module).__name__}: expected input [N, ..., d_in], got {tuple(x.shape)}"
            )
        return x.detach().float().reshape(n, -1, x.shape[-1])
    if kind == "conv":
        cols = _conv_unfold(module, x.detach().float())
        g = module.groups
        return cols.reshape(n, cols.shape[1] * g, cols.shape[2] // g)
    if kind == "embedding":
        idx = x.detach().reshape(n, -1).long()
        if module.padding_idx is not None:
            # torch gives the padding row a zero gradient: treat those positions as absent
            idx = idx.masked_fill(idx == module.padding_idx, -1)
        return idx
    if kind == "layernorm":
        shape = tuple(module.normalized_shape)
        d = 1
        for s in shape:
            d *= s
        xh = F.layer_norm(x.detach().float(), shape, None, None, module.eps)
        return xh.reshape(n, -1, d)
    raise ValueError(f"unknown capture kind {kind!r}")


def backward_rows(kind: str, module: nn.Module, g: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """Matrix-form output gradients ``[N, T, d_out]`` and the positional shape of the output."""
    n = g.shape[0]
    g = g.detach().float()
    if kind in (*ROW_KINDS, "embedding"):
        return g.reshape(n, -1, g.shape[-1]), tuple(g.shape[1:-1])
    if kind == "conv":
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
    if kind == "layernorm":
        nd = len(module.normalized_shape)
        pos = tuple(g.shape[1 : g.dim() - nd])
        return g.reshape(n, -1, _numel(tuple(module.normalized_shape))), pos
    raise ValueError(f"unknown capture kind {kind!r}")


def _numel(shape: tuple) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _weight_shape(module: nn.Module) -> tuple[int, ...]:
    """Linear/conv weight shape from the module's attributes, not the live tensor: under FSDP1
    (``use_orig_params``) ``module.weight`` is a flat local slice outside forward."""
    if isinstance(module, nn.Linear):
        return (module.out_features, module.in_features)
    if isinstance(module, nn.modules.conv._ConvNd):
        return (module.out_channels, module.in_channels // module.groups, *module.kernel_size)
    return tuple(module.weight.shape)


def dims(kind: str, module: nn.Module) -> tuple[int, int]:
    """``(d_in(+1), d_out)`` of the matrix form (layernorm: ``(D, D)`` of the normalised shape)."""
    bias = int(has_bias(module))
    if kind == "linear":
        return module.in_features + bias, module.out_features
    if kind == "conv1d_hf":
        return module.weight.shape[0] + bias, module.weight.shape[1]
    if kind == "attention":
        return module.embed_dim + bias, 3 * module.embed_dim
    if kind == "conv":
        return _numel(_weight_shape(module)[1:]) + bias, module.out_channels
    if kind == "embedding":
        return module.num_embeddings, module.embedding_dim
    if kind == "layernorm":
        d = _numel(tuple(module.normalized_shape))
        return d, d
    raise ValueError(f"unknown capture kind {kind!r}")


def grads_by_param(kind: str, module: nn.Module, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """Split a matrix-form per-sample gradient into ``{param_name: [N, *param.shape]}``."""
    n = g.shape[0]
    out: dict[str, torch.Tensor] = {}
    bias = has_bias(module)
    if kind == "layernorm":
        shape = tuple(module.normalized_shape)
        d = _numel(shape)
        out["weight"] = g[:, :d].reshape(n, *shape)
        if bias:
            out["bias"] = g[:, d:].reshape(n, *shape)
        return out
    if kind == "embedding":
        out["weight"] = g.transpose(1, 2)
        return out
    w = g[..., :-1] if bias else g
    if kind == "attention":
        out["in_proj_weight"] = w
        if bias:
            out["in_proj_bias"] = g[..., -1]
        return out
    if kind == "conv1d_hf":
        out["weight"] = w.transpose(1, 2)
    else:
        out["weight"] = w.reshape(n, *_weight_shape(module))
    if bias:
        out["bias"] = g[..., -1]
    return out


def matrix_from_params(
    kind: str, module: nn.Module, params: dict[str, torch.Tensor]
) -> torch.Tensor:
    """Inverse of `grads_by_param`: ``{param_name: [N, *param.shape]}`` to the matrix form.

    ``[N, d_out, d_in(+1)]`` for outer-product kinds (bias = last column), ``[N, D(+D)]`` for
    layernorm (weight then bias) — the layout of `ModuleCapture.per_sample_grad` and of a
    gradient store's rows before projection.

    Example:
        >>> lin = torch.nn.Linear(3, 2)
        >>> g = torch.randn(4, 2, 4)
        >>> torch.equal(matrix_from_params("linear", lin, grads_by_param("linear", lin, g)), g)
        True
    """
    bias = has_bias(module)
    if kind == "attention":
        w = params["in_proj_weight"]
        return torch.cat([w, params["in_proj_bias"].unsqueeze(-1)], dim=-1) if bias else w
    w = params["weight"]
    n = w.shape[0]
    if kind == "layernorm":
        parts = [w.reshape(n, -1)] + ([params["bias"].reshape(n, -1)] if bias else [])
        return torch.cat(parts, dim=1)
    if kind == "embedding":
        return w.transpose(1, 2)
    if kind == "conv1d_hf":
        w = w.transpose(1, 2)
    else:
        w = w.reshape(n, w.shape[1], -1)
    return torch.cat([w, params["bias"].unsqueeze(-1)], dim=-1) if bias else w
