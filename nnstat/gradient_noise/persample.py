"""Per-sample squared gradient norms from the capture engine, for ``B_small = 1`` estimates.

No hooks of our own: the capture engine reduces each sample's squared gradient norm during
backward (no per-sample gradient is kept) and we read the batch gradient from ``.grad``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nnstat.capture.capture import ModuleCapture, modules_by_size
from nnstat.capture.norms import sq_norm_sums
from nnstat.distributed import rank_world
from nnstat.gradient_noise.batches import norm_view
from nnstat.gradient_noise.maths import finite_step


@dataclass(eq=False)
class StagedNorms:
    """A captured batch whose squared norms are still on the device: `values` is the one
    vector to read back; `resolve` turns its values into ``(names, small, big, n)``.

    A batch whose norms hold NaN/Inf is left out with a warning where a training loop feeds
    it (`nnstat.NoiseScale.batch`: a step the GradScaler skips for an overflow), by the check
    every hooked feed shares (`nnstat.gradient_noise.maths.finite_step`), and refused with
    ``strict`` where it is a measurement of its own (`nnstat.noise_scale`: bad data or weights).

    Example:
        >>> s = StagedNorms(["0"], 4, torch.tensor([3.0, 2.0]), lambda v: (v[:1], v[1:]))
        >>> s.resolve(s.values.tolist())
        (['0'], [3.0], [2.0], 4)
    """

    names: list[str]
    n: int
    values: torch.Tensor
    combine: Callable[[list[float]], tuple[list[float], list[float]]]

    def resolve(
        self, values: list[float], strict: bool = False
    ) -> tuple[list[str], list[float], list[float], int] | None:
        """``(module names, mean_i |g_i|^2, |G_B|^2, n)`` from the host values of `values`.

        Args:
            values: `values` read back to the host, as floats.
            strict: raise for non-finite norms instead of leaving the batch out.

        Returns:
            The batch's norms, or ``None`` (not ``strict``) when it is left out with a
            ``RuntimeWarning``: a NaN/Inf value (a mixed-precision overflow, or a NaN from the
            loss or the data).

        Raises:
            ValueError: with ``strict``, a non-finite loss (given to `PerSampleNorms.check_loss`)
                or non-finite norms, naming the first module that holds them.
        """
        if not strict and not finite_step(values):
            return None
        small, big = self.combine(values)
        if not math.isfinite(sum(small) + sum(big)):  # all >= 0: NaN/Inf survive the sum
            for k, s_, b_ in zip(self.names, small, big, strict=True):
                if not (math.isfinite(s_) and math.isfinite(b_)):
                    raise ValueError(
                        f"gradient norms of {k!r} contain NaN or Inf: check the data, the "
                        "model's weights and the loss's gradient (e.g. sqrt or log at 0)"
                    )
        return self.names, small, big, self.n


class PerSampleNorms:
    """Collect ``mean_i |g_i|^2`` and ``|G_B|^2`` per watched module for each captured batch.

    ``last`` is ``(small, big, n)`` after a batch: dicts ``module name -> float`` with the mean
    per-sample squared norm and the squared norm of the batch's mean gradient, and the batch
    size ``n``. The batch gradient is ``.grad`` after backward minus ``.grad`` before, so
    gradient accumulation across batches does not disturb it. ``loss_reduction`` says how the
    batch's loss reduced over its samples: ``"mean"`` (each sample's gradient is the engine's
    output gradient times ``n``, ``.grad`` is the mean gradient) or ``"sum"`` (each sample's
    gradient is taken as it is, ``.grad / n`` is the mean gradient).
    """

    def __init__(self, model: nn.Module, name_filter: str | None = None, type_filter: Any = None):
        from nnstat.capture.engine import CaptureEngine

        self.engine = CaptureEngine()
        names = self.engine.watch(model, name_filter=name_filter, type_filter=type_filter)
        modules = self.engine.watched  # name -> module (the root module is named "model")
        # the batch gradient is read from .grad, which frozen parameters do not have: a module
        # whose per-sample norms would count them (all or some of its parameters frozen) would
        # make the two sides of the estimate disagree; its captures are ignored
        self.names, partly = trainable_modules(names, modules)
        if partly:
            warnings.warn(
                f"per-sample noise scale: modules {partly} have frozen (requires_grad=False) "
                "and trainable parameters; their per-sample norms would count the frozen ones, "
                "so they are left out of the estimate (freeze or unfreeze them whole)",
                RuntimeWarning,
                stacklevel=3,
            )
        if not self.names:
            raise ValueError(
                "the capture engine found no supported module with trainable parameters to "
                "watch in the model (modules whose parameters have requires_grad=False are "
                "left out)"
            )
        self._kept = set(self.names)
        self.params: dict[str, list[nn.Parameter]] = {
            n: [p for p in modules[n].parameters(recurse=False) if p.requires_grad]
            for n in self.names
        }
        self._flat = [(i, p) for i, n in enumerate(self.names) for p in self.params[n]]
        self._owner = [i for i, _ in self._flat]
        self.engine.add_consumer(self)
        self._caps: list[ModuleCapture] = []  # this batch's captures, reduced at its end
        self._seen: set[str] = set()
        self._local_big = False  # under DDP/FSDP: batch gradient from the captures
        self._before: list[torch.Tensor | None] = []
        self._accumulating = False  # .grad held values before this batch
        self._sum = False  # this batch's loss is a sum over its samples
        self._batch_size: int | None = None  # the batch size this batch was told
        self._loss: torch.Tensor | None = None  # checked in the batch's one host read
        self.last: tuple[dict[str, float], dict[str, float], int] = ({}, {}, 0)

    def covered_parameters(self) -> set[int]:
        """ids of the parameters whose gradients the estimate covers."""
        return {id(p) for ps in self.params.values() for p in ps}

    def on_backward(self, caps: list[ModuleCapture]) -> None:
        caps = [cap for cap in caps if cap.name in self._kept]
        for cap in caps:
            if cap.name in self._seen:
                raise RuntimeError(
                    f"module {cap.name!r} was captured twice in one batch (a shared module or a "
                    "second backward?); per-sample squared norms of its two uses cannot be "
                    "added, exclude it with name_filter"
                )
            self._seen.add(cap.name)
        # reduced once per batch in batch(): all modules' norms then share one foreach kernel
        self._caps.extend(caps)

    @contextmanager
    def batch(self, batch_size: int | None = None, loss_reduction: str = "mean") -> Iterator[None]:
        """Capture one backward; ``last`` then holds its per-module values."""
        self.begin(batch_size, loss_reduction)
        try:
            yield
        except BaseException:
            self.abort()
            raise
        names, small, big, n = self.end()
        self.last = (dict(zip(names, small, strict=True)), dict(zip(names, big, strict=True)), n)

    def begin(self, batch_size: int | None = None, loss_reduction: str = "mean") -> None:
        """Open a batch (``batch()`` without a generator: the tracker calls this every step)."""
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self._sum = loss_reduction == "sum"
        self._batch_size = batch_size
        self._caps, self._seen, self._loss = [], set(), None
        self._local_big = rank_world()[1] > 1
        # .grad snapshots so gradient accumulation does not disturb the batch gradient; after
        # zero_grad(set_to_none=True) every snapshot is None (nothing to clone)
        self._before = [] if self._local_big else [p.grad for _, p in self._flat]
        self._accumulating = any(g is not None for g in self._before)
        if self._accumulating:
            self._before = [None if g is None else g.detach().clone() for g in self._before]
        # the batch size tells the engine how to expand an input the batch shares ([1, T])
        samples = "input" if batch_size is None else batch_size
        self.engine._begin(batch_size, None, loss_reduction, False, samples)

    def check_loss(self, loss: torch.Tensor) -> None:
        """Refuse this batch at its end if ``loss`` (a scalar) is NaN/Inf: it is read with the
        norms, in the batch's one host read, and named before them (a NaN loss makes NaN norms)."""
        self._loss = loss.detach()

    def abort(self) -> None:
        """Close a batch whose block raised: nothing is reduced."""
        self.engine._abort()
        self._caps = []

    def end(self) -> tuple[list[str], list[float], list[float], int]:
        """Close the batch: ``(module names, mean_i |g_i|^2, |G_B|^2, n)`` per module, read
        back at once (a measurement: NaN/Inf norms or loss raise, see `StagedNorms.resolve`)."""
        staged = self.end_staged()
        resolved = staged.resolve(staged.values.tolist(), strict=True)
        assert resolved is not None  # strict: raises rather than leaving the batch out
        return resolved

    def end_staged(self) -> StagedNorms:
        """Close the batch, its norms left on the device (`StagedNorms`: one vector to read)."""
        self.engine._end()
        caps, self._caps = self._caps, []
        if not caps:
            raise RuntimeError("no watched module took part in the backward of this batch")
        n = caps[0].num_samples
        if any(c.num_samples != n for c in caps):
            seen = modules_by_size((c.name, c.num_samples) for c in caps)
            raise RuntimeError(
                f"watched modules saw different batch sizes in one batch ({seen}); a module "
                "fed an input the batch shares is expanded when the batch size is known: pass "
                "batch(batch_size=N), or leave the module out with name_filter"
            )
        if self._batch_size is not None and self._batch_size != n:
            # the mean loss's per-sample gradients would be scaled by batch_size / n: |G|^2
            # and tr(Sigma) off, often |G|^2 < 0
            raise ValueError(
                f"batch(batch_size={self._batch_size}) but the watched modules saw {n} samples "
                "in this block: pass the block's number of samples, or batch_size=None (each "
                "module's batch dimension)"
            )
        if n < 2:
            raise ValueError(
                f"per-sample noise scale needs a batch of at least 2 samples, got {n}: for a "
                "last batch smaller than that, use DataLoader(..., drop_last=True) or run that "
                "step outside gns.batch()"
            )
        flat = () if self._local_big else self._flat
        values, combine = self._stage(caps, n, flat, self._before, self._local_big)
        return StagedNorms([c.name for c in caps], n, values, combine)

    def _stage(
        self,
        caps: list[ModuleCapture],
        n: int,
        flat: Sequence[tuple[int, nn.Parameter]],
        before: list[torch.Tensor | None],
        local_big: bool,
    ) -> tuple[torch.Tensor, Callable[[list[float]], tuple[list[float], list[float]]]]:
        """Mean per-sample and batch-gradient squared norms per module: the device vector to
        read (once) and the function of its values that gives them.

        This runs every training step, and on small models each kernel launch costs about as
        much as the arithmetic: the per-sample norms of one-position layers and every gradient
        norm go through ONE ``torch._foreach_norm`` (in the tensors' own dtype: no float64
        copies of large weights) into one vector; squares and sums happen in Python floats on
        a handful of values once it is on the host.
        """
        norm_in: list[torch.Tensor] = []  # tensors whose Frobenius norms are needed
        scalars: list[torch.Tensor] = []  # 0-d values that add to a module's sum as they are
        # per module: c times (the squares of norm_in[i:j] plus scalars[k:m])
        spans: list[tuple[int, int, int, int, float]] = []
        for tensors, values, c in sq_norm_sums(caps):
            i, k = len(norm_in), len(scalars)
            spans.append((i, i + len(tensors), k, k + len(values), c / n))
            norm_in.extend(tensors)
            scalars.extend(values)
        owner: list[int] = []
        n_factors = len(norm_in)
        if local_big:
            # DDP/FSDP averaged .grad over ranks already: this rank's batch gradient instead
            scalars.extend(batch_grad_sq(cap) / (n * n) for cap in caps)
        elif len(caps) == len(self.names) and not self._accumulating:
            # every watched module captured (in watch order), no accumulation: the per-step
            # case, with the parameter -> module map precomputed
            grads = [p.grad for _, p in flat]
            owner = self._owner
            if any(g is None for g in grads):
                owner = [j for j, g in zip(owner, grads, strict=True) if g is not None]
                grads = [g for g in grads if g is not None]
            norm_in.extend(grads)
        else:
            pos = {c.name: j for j, c in enumerate(caps)}
            for (i, p), old in zip(flat, before, strict=True):
                j = pos.get(self.names[i])
                if j is not None and p.grad is not None:
                    norm_in.append(p.grad if old is None else p.grad - old)
                    owner.append(j)
        loss = [] if self._loss is None else [self._loss.to(torch.float64)]
        norm_in = [norm_view(g) for g in norm_in]  # a sparse .grad: its coalesced values
        with torch.no_grad():  # .grad may carry a graph (create_graph=True): build none
            parts = [*(torch._foreach_norm(norm_in) if norm_in else ()), *scalars, *loss]
            vector = torch.stack(parts)
        n_norms, n_caps, summed, has_loss = len(norm_in), len(caps), self._sum, bool(loss)

        def combine(values: list[float]) -> tuple[list[float], list[float]]:
            values = list(values)
            if has_loss and not math.isfinite(value := values.pop()):
                raise ValueError(f"loss_fn returned a non-finite loss ({value})")
            norms, rest = values[:n_norms], values[n_norms:]
            small = [
                c * (sum(v * v for v in norms[i:j]) + sum(rest[k:m])) for i, j, k, m, c in spans
            ]
            if local_big:
                return small, rest[len(rest) - n_caps :]
            big = [0.0] * n_caps
            for j, v in zip(owner, norms[n_factors:], strict=True):
                big[j] += v * v
            if summed:  # .grad is the sum of the samples' gradients: n times their mean
                big = [v / (n * n) for v in big]
            return small, big

        return vector, combine

    def close(self) -> None:
        self.engine.unwatch()


def trainable_modules(
    names: Sequence[str], modules: Mapping[str, nn.Module]
) -> tuple[list[str], list[str]]:
    """The watched modules whose parameters all train, and those with frozen and trainable
    parameters mixed (modules with every parameter frozen are in neither).

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 1))
        >>> _ = m[0].requires_grad_(False), m[1].weight.requires_grad_(False)
        >>> trainable_modules(["0", "1", "2"], {"0": m[0], "1": m[1], "2": m[2]})
        (['2'], ['1'])
    """
    kept, partly = [], []
    for n in names:
        flags = {p.requires_grad for p in modules[n].parameters(recurse=False)}
        if flags == {True}:
            kept.append(n)
        elif flags == {True, False}:
            partly.append(n)
    return kept, partly


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
    return cap.batch_grad().double().pow(2).sum()
