"""Hessian-weighted noise scale ``B_noise = tr(H Sigma) / (G^T H G)``, exact on small models.

Exact for the sample it is given: per-sample gradients by ``vmap(grad)``, Hessian-vector
products by reverse-over-reverse double backward on the gradient graph, built once
(`nnstat.curvature.streamed.kept_curvature`, the curvature operator exact influence uses). Cost is about ``n`` HVPs, so this is for small
models; ``B_simple`` is the practical proxy elsewhere (it equals ``B_noise`` when the Hessian is
a multiple of the identity, and McCandlish et al. find the two track each other in practice).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from nnstat.curvature.products import FunctionalLoss, ParamLayout
from nnstat.curvature.streamed import kept_curvature
from nnstat.gradient_noise.batches import LossFn


@dataclass(frozen=True)
class HessianNoiseScale:
    """``b_noise = trace_h_sigma / g_h_g`` on ``n_samples`` samples.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> x, y = torch.randn(32, 3), torch.randn(32, 1)
        >>> r = hessian_noise_scale(nn.Linear(3, 1), nn.functional.mse_loss, x, y)
        >>> r.n_samples, abs(r.b_noise - r.trace_h_sigma / r.g_h_g) < 1e-9 * r.b_noise
        (32, True)
    """

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

    Args:
        model: the model (its trainable parameters).
        loss_fn: ``loss_fn(outputs, targets)`` -> the batch's mean loss.
        inputs: ``[n, ...]``.
        targets: ``[n, ...]``.
        chunk: vectors per Hessian-vector product.

    Returns:
        `HessianNoiseScale` (``b_noise`` is ``inf`` with a warning where ``GᵀHG <= 0``).

    Raises:
        TypeError: inputs or targets that are not tensors.
        ValueError: fewer than 2 samples, or a loss that is not a scalar.

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
    loss = FunctionalLoss(model, loss_fn, names, loss_reduction="mean")
    layout = ParamLayout(names, [loss.theta[k].shape for k in names])
    flat = layout.from_dict(loss.example_grads(inputs, targets), n).double()
    g_mean = flat.mean(dim=0)
    dev = flat - g_mean
    # H v for float64 rows [k, P], in the parameters' dtype on one gradient graph built once
    hvp = kept_curvature(loss, layout, [(inputs, targets)]).product
    g_h_g_t = g_mean @ hvp(g_mean[None])[0]
    quad = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start in range(0, n, chunk):
        block = dev[start : start + chunk]
        quad = quad + (block * hvp(block)).sum()
    g_h_g, quad_sum = torch.stack([g_h_g_t, quad]).tolist()  # the one host read
    trace_h_sigma = quad_sum / n
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
