"""Hessian-weighted noise scale ``B_noise = tr(H Sigma) / (G^T H G)`` via ``torch.func``.

Exact for the sample it is given: per-sample gradients by ``vmap(grad)``, Hessian-vector
products by reverse-over-reverse ``grad(<grad, v>)``. Cost is about ``n`` HVPs, so this is for small
models; ``B_simple`` is the practical proxy elsewhere (it equals ``B_noise`` when the Hessian is
a multiple of the identity, and McCandlish et al. find the two track each other in practice).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from nnstat.gradient_noise.batches import LossFn


@dataclass(frozen=True)
class HessianNoiseScale:
    """``b_noise = trace_h_sigma / g_h_g`` on ``n_samples`` samples."""

    b_noise: float
    trace_h_sigma: float
    g_h_g: float
    n_samples: int


def hessian_noise_scale(
    model: nn.Module,
    loss_fn: LossFn,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk: int = 64,
) -> HessianNoiseScale:
    """``tr(H Sigma) / G^T H G`` with ``G``, ``Sigma`` and ``H`` of the mean loss on this data.

    ``Sigma`` is the per-example gradient covariance (normalised by ``n``) and ``H`` the
    Hessian of the mean loss, both over all trainable parameters.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> m = nn.Linear(3, 1, bias=False)
        >>> x, y = torch.randn(64, 3), torch.randn(64, 1)
        >>> r = hessian_noise_scale(m, nn.functional.mse_loss, x, y)
        >>> r.b_noise > 0
        True
    """
    if not isinstance(inputs, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError("the Hessian noise scale needs tensor inputs and targets")
    n = int(inputs.shape[0])
    if n < 2:
        raise ValueError(f"the Hessian noise scale needs at least 2 samples, got {n}")
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    params = {k: p.detach() for k, p in model.named_parameters() if p.requires_grad}
    frozen = {k: p.detach() for k, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def mean_loss(ps: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(functional_call(model, ({**ps, **frozen}, buffers), (x,)), y)

    def one_loss(ps: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return mean_loss(ps, x.unsqueeze(0), y.unsqueeze(0))

    per_sample = vmap(grad(one_loss), in_dims=(None, 0, 0))(params, inputs, targets)
    flat = torch.cat([per_sample[k].reshape(n, -1) for k in names], dim=1).double()
    g_mean = flat.mean(dim=0)
    dev = flat - g_mean

    def unflatten(v: torch.Tensor) -> dict[str, torch.Tensor]:
        out, i = {}, 0
        for k in names:
            size = params[k].numel()
            out[k] = v[i : i + size].reshape(params[k].shape).to(params[k].dtype)
            i += size
        return out

    grad_fn = grad(lambda ps: mean_loss(ps, inputs, targets))

    def hvp(v: torch.Tensor) -> torch.Tensor:
        # reverse-over-reverse: d/dθ <∇L(θ), v>; forward-over-reverse trips over ZeroTensors in
        # some losses' backward formulas
        vd = unflatten(v)
        out = grad(lambda ps: sum((grad_fn(ps)[k] * vd[k]).sum() for k in names))(params)
        return torch.cat([out[k].reshape(-1) for k in names]).double()

    g_h_g = float(g_mean @ hvp(g_mean))
    quad = torch.zeros((), dtype=torch.float64)
    for start in range(0, n, chunk):
        block = dev[start : start + chunk]
        quad = quad + (block * vmap(hvp)(block)).sum()
    trace_h_sigma = float(quad) / n
    if g_h_g <= 0:
        warnings.warn(
            f"G^T H G = {g_h_g:.3g} <= 0 (non-convex region or pure noise); b_noise is inf",
            RuntimeWarning,
            stacklevel=2,
        )
        b_noise = math.inf
    else:
        b_noise = trace_h_sigma / g_h_g
    return HessianNoiseScale(b_noise, trace_h_sigma, g_h_g, n)
