"""Per-sample squared gradient norms from the capture engine, for ``B_small = 1`` estimates.

No hooks of our own: the capture engine reduces each sample's squared gradient norm during
backward (no per-sample gradient is kept) and we read the batch gradient from ``.grad``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from nnstat.distributed import rank_world


class PerSampleNorms:
    """Collect ``mean_i |g_i|^2`` and ``|G_B|^2`` per watched module for each captured batch.

    ``last`` is ``(small, big, n)`` after a batch: dicts ``module name -> float`` with the mean
    per-sample squared norm and the squared norm of the batch's mean gradient, and the batch
    size ``n``. The batch gradient is ``.grad`` after backward minus ``.grad`` before, so
    gradient accumulation across batches does not disturb it.
    """

    def __init__(self, model: nn.Module, name_filter: str | None = None, type_filter: Any = None):
        from nnstat.capture.engine import CaptureEngine

        self.engine = CaptureEngine()
        self.names = self.engine.watch(model, name_filter=name_filter, type_filter=type_filter)
        if not self.names:
            raise ValueError("the capture engine found no supported module to watch in the model")
        modules = self.engine.watched  # name -> module (the root module is named "model")
        self.params: dict[str, list[nn.Parameter]] = {
            n: [p for p in modules[n].parameters(recurse=False) if p.requires_grad]
            for n in self.names
        }
        self._flat = [(i, p) for i, n in enumerate(self.names) for p in self.params[n]]
        self.engine.add_consumer(self)
        self._sq: dict[str, torch.Tensor] = {}
        # under torch.distributed, DDP/FSDP have averaged .grad over ranks by the time we read
        # it: the batch gradient then comes from the captures (this rank's samples only)
        self._local_big = False
        self._big: dict[str, torch.Tensor] = {}
        self.last: tuple[dict[str, float], dict[str, float], int] = ({}, {}, 0)

    def covered_parameters(self) -> set[int]:
        """ids of the parameters whose gradients the estimate covers."""
        return {id(p) for ps in self.params.values() for p in ps}

    def on_capture(self, cap: Any) -> None:
        if cap.name in self._sq:
            raise RuntimeError(
                f"module {cap.name!r} was captured twice in one backward (a shared module?); "
                "per-sample squared norms of its two uses cannot be added, exclude it with "
                "name_filter"
            )
        self._sq[cap.name] = cap.per_sample_sq_norm()
        if self._local_big:
            self._big[cap.name] = batch_grad_sq(cap)

    @contextmanager
    def batch(self, batch_size: int | None = None) -> Iterator[None]:
        self._sq, self._big = {}, {}
        self._local_big = rank_world()[1] > 1
        # flat (module index, parameter) list and .grad snapshots: this runs every training step,
        # and after zero_grad(set_to_none=True) every snapshot is None (nothing to clone)
        flat = () if self._local_big else self._flat
        before = [None if p.grad is None else p.grad.detach().clone() for _, p in flat]
        with self.engine.batch(batch_size=batch_size, loss_reduction="mean"):
            yield
        captured, self._sq = self._sq, {}
        local_big, self._big = self._big, {}
        if not captured:
            raise RuntimeError("no watched module took part in the backward of this batch")
        sq = list(captured.values())
        n = int(sq[0].shape[0])
        if any(int(s.shape[0]) != n for s in sq):
            sizes = {int(s.shape[0]) for s in sq}
            raise RuntimeError(f"modules saw different batch sizes {sorted(sizes)}")
        if n < 2:
            raise ValueError(f"per-sample noise scale needs a batch of at least 2 samples, got {n}")
        # Reductions stay in the gradients' dtype (no float64 copies of large weights: that
        # alone tripled the step time of a 1024-wide MLP) and come back in one .tolist(): this
        # runs every training step, so Python and per-op overhead matter.
        names = list(captured)
        m = len(names)
        small_t = torch.stack(sq).mean(1)
        if small_t.dtype != torch.float32:
            small_t = small_t.float()
        if local_big:
            big_t = torch.stack([local_big[k] for k in names]).float().cpu() / (n * n)
            values = torch.cat([small_t.cpu(), big_t]).tolist()
            small_l, big_l = values[:m], values[m:]
        else:
            pos = {k: i for i, k in enumerate(names)}
            grads, owner = [], []
            for (i, p), old in zip(flat, before, strict=True):
                j = pos.get(self.names[i])
                if j is not None and p.grad is not None:
                    grads.append(p.grad.detach() if old is None else p.grad.detach() - old)
                    owner.append(j)
            parts = [small_t]
            if grads:
                norms = torch.stack(torch._foreach_norm(grads))
                parts.append(norms if norms.dtype == torch.float32 else norms.float())
            cat = torch.cat(parts) if len(parts) > 1 else parts[0]
            values = (cat if cat.device.type == "cpu" else cat.cpu()).tolist()
            small_l = values[:m]
            big_l = [0.0] * m
            # the norms come back unsquared: one fewer kernel, squared here in double
            for j, v in zip(owner, values[m:], strict=True):
                big_l[j] += v * v
        for k, s_, b_ in zip(names, small_l, big_l, strict=True):
            if not (math.isfinite(s_) and math.isfinite(b_)):
                raise ValueError(f"gradient norms of {k!r} contain NaN or Inf")
        self.last = (
            dict(zip(names, small_l, strict=True)),
            dict(zip(names, big_l, strict=True)),
            n,
        )

    def close(self) -> None:
        self.engine.unwatch()


def batch_grad_sq(cap: Any) -> torch.Tensor:
    """``|sum_i G_i|^2`` of one module from its capture (the batch gradient without ``.grad``).

    Example:
        >>> from nnstat.capture import CaptureEngine
        >>> m = nn.Linear(2, 1); e = CaptureEngine(); _ = e.watch(m); out = {}
        >>> e.add_consumer(lambda c: out.update(sq=batch_grad_sq(c)))
        >>> with e.batch(): m(torch.ones(3, 2)).sum().backward()
        >>> round(float(out["sq"]), 4)  # weight grad [3, 3], bias grad 3
        27.0
    """
    b = cap.backward
    if cap.kind == "layernorm":
        g = cap.per_sample_grad().sum(0)
    elif cap.kind == "embedding":
        idx, rows = cap.indices.reshape(-1), b.reshape(-1, b.shape[-1])
        keep = idx >= 0
        g = b.new_zeros(cap.d_in, b.shape[-1]).index_add_(0, idx[keep], rows[keep])
    else:
        a = cap.forward
        g = b.reshape(-1, b.shape[-1]).T @ a.reshape(-1, a.shape[-1])
    return g.double().pow(2).sum()
