"""Module activations for the recorder, through the one capture engine (no hooks of our own).

For each watched module the recorder gets two nodes: ``"<module>:input"`` (forward: the layer
input in the engine's matrix form, without the bias column) and ``"<module>:output"`` (gradient:
the gradient of the batch loss w.r.t. the module output, i.e. the engine's per-sample-loss
gradient divided back by N for a mean loss). Edges: input -> output and parameter -> output.
"""

from __future__ import annotations

from typing import Any

import torch


class ActivationConsumer:
    """Capture-engine consumer that files module inputs / output gradients into a recorder batch.

    Example:
        >>> rec.track_activations(model)  # doctest: +SKIP
    """

    def __init__(
        self, recorder: Any, prefix: str, loss_reduction: str, batch_size: int | None
    ) -> None:
        self.recorder = recorder
        self.prefix = prefix
        self.loss_reduction = loss_reduction
        self.batch_size = batch_size

    def on_capture(self, cap: Any) -> None:
        b = self.recorder._batch
        if b is None or not b.active:
            return
        it = b.current or (b.iterations[-1] if b.iterations else None)
        if it is None:
            self.recorder.start_iteration()
            it = b.current
        fwd = None
        if not cap.kind.tokens:  # one-hot rows would be large and say little
            fwd = cap.forward
            if cap.kind.dense and cap.kind.has_bias(cap.module):
                fwd = fwd[..., :-1]
        grad = cap.backward
        if self.loss_reduction == "mean":
            grad = grad / float(self.batch_size or cap.num_samples)
        src, dst = f"{cap.name}:input", f"{cap.name}:output"
        for name, value, g in ((src, fwd, None), (dst, None, grad)):
            if name in it.tensors:
                raise ValueError(f"activation node {name!r} already registered in this iteration")
            it.names.append(name)
            it.tensors[name] = value
            it.roles[name] = "intermediate"
            if g is not None:
                it.grads[name] = g
                b.grad_order.append((it.index, name))
        it.edges.append((src, dst))
        module_prefix = self.prefix + ("" if cap.name == "model" else f"{cap.name}.")
        for pname, _ in cap.module.named_parameters(recurse=False):
            full = f"{module_prefix}{pname}"
            if full in self.recorder._params:
                it.edges.append((full, dst))


def attach_engine(
    recorder: Any,
    model: torch.nn.Module,
    name_filter: str | None,
    type_filter: Any,
    prefix: str,
    loss_reduction: str,
    batch_size: int | None,
) -> tuple[Any, list[str]]:
    """A `CaptureEngine` watching ``model`` that feeds ``recorder``; returns it and the names."""
    from nnstat.capture import CaptureEngine

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"track_activations needs an nn.Module, got {type(model).__name__}")
    if loss_reduction not in ("sum", "mean"):
        raise ValueError(f"loss_reduction must be 'sum' or 'mean', got {loss_reduction!r}")
    engine = CaptureEngine()
    names = engine.watch(model, name_filter=name_filter, type_filter=type_filter)
    engine.add_consumer(ActivationConsumer(recorder, prefix, loss_reduction, batch_size))
    return engine, names
