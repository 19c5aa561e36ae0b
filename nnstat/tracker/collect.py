"""What a logged step reads: the tensors of each tracked group (weights, gradients, each
optimizer state), taken from the model and its optimizer at the step.

FSDP1 flat per-rank slices become DTensors of the whole (reduced, never gathered); a parameter
without a gradient is left out of ``grad/`` (its name returned, for the Tracker's warning).

Example:
    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> names = ["weight", "bias"]; params = [model.weight, model.bias]
    >>> out, missing = collect(model, names, params, None, ("weight", "grad"), None, False)
    >>> [g for g, _, _ in out], missing
    (['weight'], ['weight', 'bias'])
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nnstat.distributed import fsdp1_grad, fsdp1_shards, fsdp1_whole
from nnstat.netdict import layer_state_keys

__all__ = ["collect", "state_keys_of"]

Groups = list[tuple[str, list[str], list[torch.Tensor]]]


def state_keys_of(
    optimizer: Any, params: list[torch.Tensor], state_keys: tuple[str, ...] | None
) -> tuple[str, ...]:
    """The optimizer state keys logged: `state_keys`, or every per-parameter state tensor."""
    if state_keys is not None:
        return state_keys
    return tuple(layer_state_keys(optimizer, params))


def collect(
    model: nn.Module,
    names: Sequence[str],
    params: list[torch.Tensor],
    optimizer: Any,
    groups: Sequence[str],
    state_keys: tuple[str, ...] | None,
    fsdp1: bool,
    weights: bool = True,
) -> tuple[Groups, list[str]]:
    """``(group, names, tensors)`` of every group but updates (no weights unless `weights`),
    and the names of the parameters that have no gradient (left out of ``grad``)."""
    out: Groups = []
    missing: list[str] = []
    # FSDP1: flat per-rank slices become DTensors of the whole (reduced, never gathered)
    shards = fsdp1_shards(model) if fsdp1 else {}
    if weights and "weight" in groups:
        out.append(("weight", list(names), [fsdp1_whole(p.detach(), p, shards) for p in params]))
    if "grad" in groups:
        grads = [fsdp1_grad(p, shards) for p in params]
        missing = [n for n, g in zip(names, grads, strict=True) if g is None]
        kept = [(n, g.detach()) for n, g in zip(names, grads, strict=True) if g is not None]
        if kept:
            out.append(("grad", [n for n, _ in kept], [g for _, g in kept]))
    if "optimizer" in groups:
        for key in state_keys_of(optimizer, params, state_keys):
            key_names, tensors = [], []
            for n, p in zip(names, params, strict=True):
                v = optimizer.state.get(p, {}).get(key)
                if v is None and id(p) in shards and p.numel() == 0:
                    v = p.detach()  # FSDP1: no slice of this parameter on this rank
                if isinstance(v, torch.Tensor):
                    key_names.append(n)
                    tensors.append(fsdp1_whole(v.detach(), p, shards))
            if key_names:
                out.append((key, key_names, tensors))
    return out, missing
