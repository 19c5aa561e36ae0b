"""Per-step state of the recorder: iterations, their tensors, and the gradient hook."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Iteration:
    index: int
    names: list[str] = field(default_factory=list)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    roles: dict[str, str] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    edges: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Batch:
    step: int
    type_of_execution: str
    scheduled: bool
    active: bool
    decision: bool | None = None
    iterations: list[Iteration] = field(default_factory=list)
    current: Iteration | None = None
    kpis: dict[str, Any] = field(default_factory=dict)
    grad_order: list[tuple[int, str]] = field(default_factory=list)


class GradHook:
    """Tensor hook storing a registered tensor's gradient (summed over backward calls)."""

    __slots__ = ("batch", "it", "name")

    def __init__(self, batch: Batch, it: Iteration, name: str) -> None:
        self.batch, self.it, self.name = batch, it, name

    def __call__(self, grad: torch.Tensor) -> None:
        old = self.it.grads.get(self.name)
        self.it.grads[self.name] = grad.detach() if old is None else old + grad.detach()
        if old is None:
            self.batch.grad_order.append((self.it.index, self.name))
