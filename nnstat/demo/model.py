"""The demo's model and training loop, shared by the demo's run (`nnstat.demo.train`) and the
counterfactual check's retrainings (`nnstat.demo.attribution`).

Example:
    >>> from types import SimpleNamespace
    >>> import torch
    >>> cfg = SimpleNamespace(hidden=8, epochs=1, batch_size=4)
    >>> model = make_model(cfg)
    >>> opt = torch.optim.AdamW(model.parameters())
    >>> _ = fit(model, opt, torch.randn(10, 64), torch.randint(0, 10, (10,)), cfg)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["make_model", "fit"]


def make_model(cfg: Any) -> nn.Module:
    """The demo's 64-h-h-10 MLP, initialised from torch's global random state."""
    return nn.Sequential(
        nn.Linear(64, cfg.hidden),
        nn.ReLU(),
        nn.Linear(cfg.hidden, cfg.hidden),
        nn.ReLU(),
        nn.Linear(cfg.hidden, 10),
    )


def fit(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    X: torch.Tensor,
    y: torch.Tensor,
    cfg: Any,
    *,
    epochs: int | None = None,
    generator: torch.Generator | None = None,
    before_step: Callable[[int, bool], None] | None = None,
    after_step: Callable[[], Any] | None = None,
    after_epoch: Callable[[int, float], None] | None = None,
) -> nn.Module:
    """The demo's training loop: ``epochs`` (default ``cfg.epochs``) of mini-batches of
    ``cfg.batch_size`` in a random order drawn from ``generator`` (torch's global random state
    when None). ``before_step(epoch, last_batch_of_epoch)`` runs after backward, before the
    optimiser step; ``after_step()`` after it; ``after_epoch(epoch, mean_loss)`` per epoch.
    The demo's run and the counterfactual retrainings both train with it."""
    n = len(X)
    for epoch in range(cfg.epochs if epochs is None else epochs):
        perm = torch.randperm(n, generator=generator)
        total = 0.0
        for i in range(0, n, cfg.batch_size):
            idx = perm[i : i + cfg.batch_size]
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.cross_entropy(model(X[idx]), y[idx])
            loss.backward()
            if before_step is not None:
                before_step(epoch, i + cfg.batch_size >= n)
            opt.step()
            if after_step is not None:
                after_step()
            total += loss.detach().item() * len(idx)
        if after_epoch is not None:
            after_epoch(epoch, total / n)
    return model
