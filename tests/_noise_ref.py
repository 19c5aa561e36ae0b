"""The exact gradient noise of a small data set, for tests of noise-scale estimators: per-sample
gradients by torch.func, independent of nnstat."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap


def squared_error(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The mean squared error of one sample's output."""
    return (out - target).pow(2).mean()


def population_noise(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = squared_error,
) -> tuple[float, float]:
    """``|G|^2`` and ``tr(Sigma)`` of the empirical distribution of ``(x, y)`` (samples drawn
    with replacement: ``Sigma`` divides by ``n``) under ``loss(model(x_i), y_i)``, from every
    sample's gradient of every parameter (float64 sums)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return loss(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([v.reshape(len(x), -1) for v in g.values()], 1).double()
    mean = flat.mean(0)
    return float(mean @ mean), float((flat - mean).pow(2).sum(1).mean())
