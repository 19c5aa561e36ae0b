"""``nn.MultiheadAttention`` (kind "attention"): per-sample gradients of ``in_proj`` and
``out_proj``.

The module computes with its bare ``in_proj_weight`` and never calls ``out_proj.forward``, so
no module hook sees the projections. The engine hooks the attention module itself: its inputs
(``query``, ``key``, ``value`` and the masks) and the gradient of its output. From those the
attention is recomputed and its backward taken by hand (softmax attention has a closed-form
backward), which gives the rows of both projections in the usual matrix form:

* ``out_proj``: inputs ``O`` (the heads' concatenated outputs) and output gradients ``dY``;
* ``in_proj`` (``[3E, E]``, bias ``[3E]``, like an ``nn.Linear(E, 3E)``): inputs ``x`` and
  output gradients ``[dQ, dK, dV]``. Self-attention (``query is key is value``) has one row
  per position; with a separate ``key``/``value`` each one's positions are rows of their own,
  zero outside their third of the output.

``batch_first`` True or False and unbatched ``[L, E]`` inputs are read as the module reads
them. Refused with the reason (:func:`unsupported_reason`): separate ``q/k/v_proj_weight``
(``kdim``/``vdim`` other than ``embed_dim``), ``add_bias_kv``, ``add_zero_attn``; attention
dropout in training mode is refused when it runs (its random mask cannot be replayed).

Example:
    >>> import torch
    >>> mha = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    >>> x = torch.randn(3, 5, 4)
    >>> call = attention_call(mha, (x, x, x), {"need_weights": False})
    >>> (a, b), (o, g) = attention_rows(mha, call, torch.ones(3, 5, 4))
    >>> tuple(a.shape), tuple(b.shape), tuple(o.shape)
    ((3, 5, 4), (3, 5, 12), (3, 5, 4))
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from nnstat.capture.kinds.base import Kind

__all__ = [
    "AttentionCall",
    "AttentionKind",
    "attention_call",
    "attention_rows",
    "unsupported_reason",
]

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


@dataclass(frozen=True)
class AttentionCall:
    """One call of an ``nn.MultiheadAttention``, batch first and detached: ``query``
    ``[N, L, E]``, ``key``/``value`` ``[N, S, E]``, ``mask`` additive (``[L, S]``,
    ``[N, H, L, S]`` or None), ``causal`` (a causal mask the module applied itself),
    ``batch_first`` / ``unbatched`` (how its output gradient is laid out)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    mask: torch.Tensor | None
    causal: bool
    batch_first: bool
    unbatched: bool


def unsupported_reason(module: nn.MultiheadAttention) -> str | None:
    """Why the module's projections cannot be captured, or None when they can.

    Example:
        >>> unsupported_reason(nn.MultiheadAttention(4, 2)) is None
        True
        >>> unsupported_reason(nn.MultiheadAttention(4, 2, add_bias_kv=True))[:12]
        'add_bias_kv='
    """
    if not module._qkv_same_embed_dim:
        return (
            "kdim/vdim differ from embed_dim (separate q/k/v_proj_weight), which has no "
            "per-sample gradient rule; use kdim=vdim=embed_dim"
        )
    if module.bias_k is not None:
        return "add_bias_kv=True (learned key/value biases) has no per-sample gradient rule"
    if module.add_zero_attn:
        return "add_zero_attn=True has no per-sample gradient rule"
    return None


def attention_call(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> AttentionCall:
    """The inputs of one ``module(*args, **kwargs)`` call, as :class:`AttentionCall`."""
    bound = _SIGNATURE.bind(module, *args, **kwargs)
    bound.apply_defaults()
    a = bound.arguments
    query, key, value = a["query"], a["key"], a["value"]
    unbatched = query.dim() == 2
    same_k, same_v = key is query, value is key
    q, k, v = (t.detach() for t in (query, key, value))
    if unbatched:
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    elif not module.batch_first:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if same_k:  # keep identity: self-attention has one row per position (see attention_rows)
        k = q
    if same_v:
        v = k
    n, length, source = q.shape[0], q.shape[1], k.shape[1]
    heads = module.num_heads
    padding, attn_mask = a["key_padding_mask"], a["attn_mask"]
    causal = bool(a["is_causal"]) and padding is None and not a["need_weights"]
    mask = None
    if causal:
        attn_mask = None  # the module then ignores the mask and applies its own causal one
    if attn_mask is not None:
        mask = _additive(attn_mask.detach(), q.dtype)
        if mask.dim() == 3:  # [N * H, L, S]
            mask = mask.reshape(n, heads, length, source)
    if padding is not None:
        pad = _additive(padding.detach(), q.dtype).reshape(n, 1, 1, source)
        mask = pad if mask is None else mask + pad
    return AttentionCall(q, k, v, mask, causal, module.batch_first, unbatched)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: not attended) as the additive float mask the module uses."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
            mask, float("-inf")
        )
    return mask.to(dtype)


def attention_rows(
    module: nn.MultiheadAttention, call: AttentionCall, grad: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``((x, [dQ, dK, dV]), (O, dY))``: the matrix-form rows of ``in_proj`` and of
    ``out_proj`` for one call, given ``grad``, the gradient of the module's output.

    Computed in float64 for float64 inputs, else float32 (autocast off).
    """
    with torch.autocast(grad.device.type, enabled=False):
        return _rows(module, call, grad)


def _rows(
    module: nn.MultiheadAttention, call: AttentionCall, grad: torch.Tensor
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    dtype = torch.float64 if call.query.dtype == torch.float64 else torch.float32
    if call.unbatched:
        grad = grad.unsqueeze(0)
    elif not call.batch_first:
        grad = grad.transpose(0, 1)
    dy = grad.detach().to(dtype)
    xq = call.query.to(dtype)
    xk = xq if call.key is call.query else call.key.to(dtype)
    xv = xk if call.value is call.key else call.value.to(dtype)
    weight = module.in_proj_weight.detach().to(dtype)
    bias = module.in_proj_bias
    bq = bk = bv = None
    if bias is not None:
        bq, bk, bv = bias.detach().to(dtype).chunk(3)
    wq, wk, wv = weight.chunk(3)
    heads = module.num_heads
    q = _split(F.linear(xq, wq, bq), heads)  # [N, H, L, d]
    k = _split(F.linear(xk, wk, bk), heads)  # [N, H, S, d]
    v = _split(F.linear(xv, wv, bv), heads)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-1, -2)) * scale
    if call.mask is not None:
        scores = scores + call.mask.to(dtype)
    if call.causal:
        length, source = scores.shape[-2:]
        above = torch.ones(length, source, dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(above, float("-inf"))
    p = scores.softmax(-1)  # [N, H, L, S]
    o = _merge(p @ v)  # [N, L, E]: what out_proj received
    do = _split(dy @ module.out_proj.weight.detach().to(dtype), heads)
    dv = p.transpose(-1, -2) @ do
    dp = do @ v.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))  # the softmax's backward
    dq = _merge(ds @ k) * scale
    dk = _merge(ds.transpose(-1, -2) @ q) * scale
    dv = _merge(dv)
    if xk is xq and xv is xq:  # self-attention: each position is one row of the packed [3E]
        return (xq, torch.cat([dq, dk, dv], -1)), (o, dy)
    zq, zk = torch.zeros_like(dq), torch.zeros_like(dk)
    if xv is xk:  # one key/value source: its rows carry [0, dK, dV]
        a = torch.cat([xq, xk], 1)
        b = torch.cat([torch.cat([dq, zq, zq], -1), torch.cat([zk, dk, dv], -1)], 1)
        return (a, b), (o, dy)
    a = torch.cat([xq, xk, xv], 1)
    rows = [torch.cat([dq, zq, zq], -1), torch.cat([zk, dk, zk], -1), torch.cat([zk, zk, dv], -1)]
    return (a, torch.cat(rows, 1)), (o, dy)


def _split(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[N, L, E]`` to ``[N, H, L, E / H]``."""
    n, length, e = x.shape
    return x.reshape(n, length, heads, e // heads).transpose(1, 2)


def _merge(x: torch.Tensor) -> torch.Tensor:
    """``[N, H, L, d]`` to ``[N, L, H * d]``."""
    n, h, length, d = x.shape
    return x.transpose(1, 2).reshape(n, length, h * d)


class AttentionKind(Kind):
    """Its packed ``in_proj``, ``[3E, E(+1)]`` like an ``nn.Linear(E, 3E)`` (bias = last
    column), with rows from :func:`attention_rows`; its ``out_proj`` is a "linear" whose rows
    come from the same place."""

    name = "attention"
    modules: ClassVar[tuple[type, ...]] = (nn.MultiheadAttention,)
    params = ("in_proj_weight", "in_proj_bias")
    plain = True

    def unsupported(self, module: nn.Module) -> str | None:
        return unsupported_reason(module)

    def dims(self, module: nn.Module) -> tuple[int, int]:
        return module.embed_dim + self.has_bias(module), 3 * module.embed_dim
