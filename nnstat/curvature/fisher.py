"""K-FAC/EK-FAC statistics of a Fisher refit from ``(inputs, targets)`` data.

The statistics a run's ``statistics.safetensors`` holds, collected again with chosen output
gradients: the real targets' loss (the empirical Fisher), every class weighted by its
probability (the true Fisher of softmax cross-entropy, i.e. its Gauss-Newton matrix), or
targets sampled from the model's prediction. Influence refinement preconditions with them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nnstat.curvature.collector import StatisticsCollector
from nnstat.curvature.products import iter_batches, watch_modules

FISHERS = ("empirical", "true", "sampled")
# statistics that average output-gradient terms (scaled by the class count under fisher="true")
_BACKWARD_KEYS = (
    "/backward/covariance",
    "/backward/eigenvalues",
    "/ekfac/eigenvalues",
    "/grad/covariance",
)


def _class_logits(outputs: Any, targets: Any) -> torch.Tensor:
    if (
        not isinstance(outputs, torch.Tensor)
        or not outputs.is_floating_point()
        or not isinstance(targets, torch.Tensor)
        or targets.is_floating_point()
        or tuple(targets.shape) != tuple(outputs.shape[:-1])
    ):
        raise ValueError(
            "fisher='true'/'sampled' needs class logits [..., C] and integer targets [...] "
            "(softmax cross-entropy); use fisher='empirical' or 'store' for other losses"
        )
    return outputs


def _class_gradient(p: torch.Tensor, c: int | None, gen: torch.Generator) -> torch.Tensor:
    """Output gradient on the logits for class ``c`` weighted by ``√p_c`` (``√p_c (p − e_c)``),
    or (``c=None``) for one class drawn from ``p`` (``p − e_drawn``)."""
    n_classes = p.shape[-1]
    if c is not None:
        onehot = torch.zeros_like(p)
        onehot[..., c] = 1
        return p[..., c : c + 1].sqrt() * (p - onehot)
    drawn = torch.multinomial(p.reshape(-1, n_classes), 1, generator=gen)
    onehot = torch.zeros_like(p).reshape(-1, n_classes)
    onehot.scatter_(1, drawn, 1.0)
    return p - onehot.reshape(p.shape)


def fisher_statistics(
    model: nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    data: Any,
    module_names: list[str],
    preset: str = "ekfac",
    *,
    fisher: str = "empirical",
    samples: int = 1,
    batch_size: int = 256,
    loss_reduction: str = "mean",
) -> dict[str, torch.Tensor]:
    """K-FAC/EK-FAC statistics (``preset``) of the modules ``module_names`` from ``data``.

    ``fisher`` says with which output gradients: ``"empirical"`` the real targets' loss,
    ``"true"`` every class ``c`` weighted by ``p_c`` (``g = √p_c (p − e_c)`` on the logits, an
    exact expectation: the true Fisher of softmax cross-entropy), ``"sampled"`` ``samples``
    targets drawn from ``p``. Keys as in a run's ``statistics.safetensors``. The model's
    ``.grad`` is restored afterwards.

    Example:
        >>> import torch
        >>> m = torch.nn.Linear(3, 4)
        >>> data = (torch.randn(16, 3), torch.randint(0, 4, (16,)))
        >>> stats = fisher_statistics(m, torch.nn.functional.cross_entropy, data, ["model"],
        ...                           "kfac", fisher="true")
        >>> sorted(stats)
        ['model/backward/covariance', 'model/forward/covariance']
    """
    if fisher not in FISHERS:
        raise ValueError(f"fisher must be one of {list(FISHERS)}, got {fisher!r}")
    from nnstat.capture import CaptureEngine

    engine = CaptureEngine()
    watch_modules(engine, model, module_names)
    collector = StatisticsCollector(preset)
    engine.add_consumer(collector)
    saved = {p: p.grad for p in model.parameters()}
    gen = torch.Generator().manual_seed(0)
    n_classes = 1
    try:
        for _ in collector.passes:
            for x, y in iter_batches(data, batch_size, torch.float32):
                if fisher == "empirical":
                    with engine.batch(loss_reduction=loss_reduction):
                        loss_fn(model(x), y).backward()
                    continue
                draws = samples if fisher == "sampled" else None
                c = 0
                while c < (draws or n_classes):
                    with engine.batch(loss_reduction="sum"):
                        logits = _class_logits(model(x), y)
                        p = torch.softmax(logits.detach().float(), -1)
                        n_classes = p.shape[-1]
                        g = _class_gradient(p, c if draws is None else None, gen)
                        logits.backward(g.to(logits.dtype))
                    c += 1
            collector.finalize()
    finally:
        engine.unwatch()
        for p, g in saved.items():
            p.grad = g
    state = collector.state_dict()
    if fisher == "true":
        # C backward passes per batch were averaged as C·N samples: the expectation is a sum
        for key in state:
            if key.endswith(_BACKWARD_KEYS):
                state[key] = state[key] * n_classes
    return state
