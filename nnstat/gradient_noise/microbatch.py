"""Noise scale from gradient accumulation's micro-batches: norms of gradients that exist anyway.

With ``K`` micro-batches of ``b`` samples per optimizer step, each micro-batch's backward adds its
own gradient ``g_k`` to ``.grad``; ``g_k`` is a mean gradient over ``b`` samples and the
accumulated ``.grad`` the mean over ``K b``. ``mean_k |g_k|^2`` and ``|.grad|^2`` are then the
two squared norms of McCandlish et al.'s two-batch estimator (``B_small = b``,
``B_big = K b``), with no extra forward, backward or per-sample work.

`MicroBatchNorms` takes ``g_k`` from a hook on every parameter (the gradient a backward brings,
before it is added to ``.grad``; a parameter whose ``.grad`` is still empty keeps that gradient
as its ``.grad``, read at the end of the backward), reduces each micro-batch to squared norms
with one multi-tensor norm (`nnstat.gradient_noise.batches.sq_norms`, accumulating in float32
for float32 and half-precision gradients) at the end of its backward, and at the optimizer step stages every micro-batch's norms and the accumulated
gradient's in one device vector (`StagedPairs`) for one non-blocking copy to the host: nothing
is read back inside the step.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nnstat.gradient_noise.batches import norm_dtype, sq_norms
from nnstat.gradient_noise.maths import finite_step
from nnstat.netdict import SameParams

__all__ = ["MicroBatchNorms", "Pairs", "StagedPairs", "integral", "pair_sizes", "step_sizes"]

#: ``(layer names, |G_small|^2 per layer, |G_big|^2 per layer, b_small, b_big)``; no names: the
#: two lists hold the whole model's value only
Pairs = tuple[list[str], list[float], list[float], float, float]


@dataclass(eq=False)
class StagedPairs:
    """An observation at two batch sizes whose squared norms are still on the device: `values`
    is the one vector to read back; `resolve` turns its host values into `Pairs` (``None``: the
    observation is dropped, with a warning saying why).

    Every feed of two-batch norms (gradient accumulation's micro-batches, the DDP hook) stages
    one of these; a step with non-finite norms is dropped by
    `nnstat.gradient_noise.maths.finite_step` (the check the per-sample feed's `StagedNorms`
    shares), on the values the tracker reads anyway: the step itself reads nothing.

    Example:
        >>> s = StagedPairs(torch.tensor([3.0, 2.0]), lambda v: ([], v[:1], v[1:], 1, 4))
        >>> s.resolve(s.values.tolist())
        ([], [3.0], [2.0], 1, 4)
    """

    values: torch.Tensor
    combine: Callable[[list[float]], Pairs | None]

    def resolve(self, values: list[float]) -> Pairs | None:
        """`Pairs` from the host values of `values`.

        Args:
            values: `values` read back to the host, as floats.

        Returns:
            The observation, or ``None`` when it is dropped with a ``RuntimeWarning``: a
            non-finite norm (NaN/Inf gradients, e.g. a mixed-precision overflow that the
            GradScaler skips: not a gradient the optimizer applies), or what `combine` refuses.
        """
        return self.combine(values) if finite_step(values) else None


def module_names(names: list[str]) -> tuple[list[str], list[int]]:
    """The owning module of each parameter name (its prefix; a root parameter names itself):
    the distinct modules in order, and each parameter's index into them.

    Example:
        >>> module_names(["0.weight", "0.bias", "2.weight", "scale"])
        (['0', '2', 'scale'], [0, 0, 1, 2])
    """
    index: dict[str, int] = {}
    owner = [index.setdefault(n.rpartition(".")[0] or n, len(index)) for n in names]
    return list(index), owner


class MicroBatchNorms:
    """Squared norms of each micro-batch's gradient and of the accumulated gradient.

    Every ``backward()`` of the model counts as one micro-batch; `end_step` (gradients final,
    before clipping and the optimizer step) hands the step's observation to ``sink`` (e.g.
    `nnstat.NoiseScale.add_staged`). Built by `nnstat.NoiseScale.watch_microbatches`.

    Args:
        model: the network; every parameter that requires a gradient is covered.
        sink: receives each step's `StagedPairs`.
        micro_batch_size: samples per micro-batch (``b``; each micro-batch's loss a mean over
            them); can be given per step to `end_step` instead.
        accumulation: how the micro-batch losses add up to the step's: ``"mean"`` (each divided
            by the number of micro-batches, as HF's Trainer and Lightning do: ``.grad`` is the
            step's mean gradient) or ``"sum"`` (``.grad`` is the sum of the micro-batch means).
            Only ``grad_sq_norm`` and ``trace_sigma`` depend on it, not ``b_simple``; or
            ``"items"``: each micro-batch's loss is the sum over its samples divided by the
            step's total (HF's ``num_items_in_batch``), so ``.grad`` is the mean over all the
            step's samples. The three differ only for micro-batches of unequal sizes.
        ranks: processes whose gradients ``.grad`` averages at the step (DDP with
            accumulation under ``no_sync()``: each rank's micro-batches are its own, the step's
            ``.grad`` the all-reduced one, ``B_big = ranks x K x b``); 1 without DDP.

    Raises:
        ValueError: no parameter requires a gradient, a bad ``micro_batch_size`` or ``ranks``,
            or an unknown ``accumulation``.

    Example:
        >>> model, seen = nn.Sequential(nn.Linear(3, 1)), []
        >>> micro = MicroBatchNorms(model, seen.append, micro_batch_size=4)
        >>> for _ in range(2):
        ...     model(torch.randn(4, 3)).pow(2).mean().div(2).backward()
        >>> micro.end_step(), seen[0].resolve(seen[0].values.tolist())[0]
        (True, ['0'])
        >>> micro.close()
    """

    def __init__(
        self,
        model: nn.Module,
        sink: Callable[[StagedPairs], None],
        micro_batch_size: int | None = None,
        accumulation: str = "mean",
        ranks: int = 1,
    ) -> None:
        if accumulation not in ("mean", "sum", "items"):
            raise ValueError(f"accumulation must be 'mean', 'sum' or 'items', got {accumulation!r}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no parameter that requires a gradient")
        self.micro_batch_size = _batch_size(micro_batch_size, allow_none=True)
        self.sink, self.accumulation = sink, accumulation
        if not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be a positive int (processes averaged), got {ranks!r}")
        self.ranks = ranks
        self.params = [p for _, p in named]
        # end_step checks that the model's parameters are still these (the hooked ones)
        self._same = SameParams(
            model,
            [n for n, _ in named],
            self.params,
            "NoiseScale.watch_microbatches",
            "Watch again after changing the model (gns.unwatch(); gns.watch_microbatches(model, "
            "...)).",
        )
        self.names, self._owner = module_names([n for n, _ in named])
        self._fresh: list[int] = []  # parameters whose .grad this backward creates
        self._stash: list[tuple[int, torch.Tensor]] = []  # the others: the gradient it adds
        self._micro: list[tuple[list[int], torch.Tensor]] = []  # per micro-batch: which, norms
        self._dirty: tuple[list[int], torch.Tensor] | None = None  # .grad left from before
        self._in_backward = False
        self._handles = [
            p.register_hook(functools.partial(self._on_grad, i)) for i, p in enumerate(self.params)
        ]

    @property
    def pending(self) -> int:
        """Micro-batches seen since the last `end_step` (counting a backward still running)."""
        return len(self._micro) + self._in_backward

    def _on_grad(self, i: int, grad: torch.Tensor) -> None:
        if not self._in_backward:
            # the first gradient of this backward: no .grad has been added to yet, so what
            # holds values now was there before it; the end of the backward reduces its norms
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
            if not self._micro:
                self._check_cleared()
        if self.params[i].grad is None:
            self._fresh.append(i)
        else:
            self._stash.append((i, grad))

    def _check_cleared(self) -> None:
        """The step's first micro-batch: stage the norms of gradients left from before (none
        after ``zero_grad()``: no kernel), which would make ``.grad`` more than the step's sum."""
        left = [(i, p.grad) for i, p in enumerate(self.params) if p.grad is not None]
        if left:
            with torch.no_grad():
                grads = [g for _, g in left]
                self._dirty = ([i for i, _ in left], sq_norms(grads, norm_dtype(grads)))

    def _backward_done(self) -> None:
        fresh, stash = self._fresh, self._stash
        self._fresh, self._stash, self._in_backward = [], [], False
        grads = [self.params[i].grad for i in fresh] + [g for _, g in stash]
        if any(g is None for g in grads):
            return  # gradients that never reached .grad (torch.autograd.grad): no micro-batch
        with torch.no_grad():  # .grad may carry a graph (create_graph=True): build none
            self._micro.append((fresh + [i for i, _ in stash], sq_norms(grads, norm_dtype(grads))))

    def discard(self) -> None:
        """Drop the micro-batches seen since the last `end_step` (e.g. gradients clipped
        before they could be measured)."""
        self._micro, self._dirty = [], None

    def end_step(
        self, micro_batch_size: int | Sequence[int] | None = None, divisor: int | None = None
    ) -> bool:
        """The step's gradients are final (before clipping): stage its observation for the sink.

        Micro-batches of unequal sizes (a smaller last one, ``drop_last=False``) need their
        sizes, one per backward in order. The observation's two batch sizes are then those at
        which ``E|g|^2 = |G|^2 + tr(Sigma)/B`` holds for its two squared norms: the harmonic
        mean ``H`` of the sizes for the micro-batches' mean, and for the step's gradient
        ``K x H`` (``accumulation="mean"``/``"sum"``: micro-batches weighted equally) or the
        step's samples (``"items"``); times ``ranks`` under DDP (other ranks assumed to have
        the same sizes). A single size for unequal micro-batches biases ``trace_sigma``.

        A loop that divides each loss by a fixed number of micro-batches even when the step
        ran fewer (Lightning's ``accumulate_grad_batches`` at the end of an epoch) passes that
        number as ``divisor``: ``.grad`` is then ``k/divisor`` times the mean gradient, and
        without it ``trace_sigma`` and ``grad_sq_norm`` would be ``(k/divisor)^2`` too small.

        Args:
            micro_batch_size: samples per micro-batch (an int), or the size of each of the
                step's micro-batches (a sequence, one per backward); ``None``: the
                constructor's.
            divisor: with ``accumulation="mean"``, the number each micro-batch's loss was
                divided by; ``None``: the step's number of micro-batches.

        Returns:
            Whether an observation was staged (``False`` with fewer than 2 micro-batches: one
            batch size only; nothing is kept).

        Raises:
            ValueError: no micro-batch size given anywhere, one below 1, a sequence whose
                length is not the step's number of micro-batches, or a ``divisor`` below the
                step's micro-batches or without ``accumulation="mean"``.

        Example:
            >>> model, seen = nn.Linear(3, 1), []
            >>> micro = MicroBatchNorms(model, seen.append)
            >>> for b in (4, 2):  # a smaller last micro-batch
            ...     model(torch.randn(b, 3)).pow(2).mean().div(2).backward()
            >>> micro.end_step([4, 2]), seen[0].resolve(seen[0].values.tolist())[3:]
            (True, (2.6666666666666665, 5.333333333333333))
            >>> micro.close()
        """
        micro, dirty = self._micro, self._dirty
        self.discard()
        self._same.check()
        k = len(micro)
        if k < 2:
            return False
        sizes = step_sizes(micro_batch_size or self.micro_batch_size, k)
        if divisor is not None and (self.accumulation != "mean" or divisor < k):
            raise ValueError(
                f"divisor={divisor!r} needs accumulation='mean' (got {self.accumulation!r}) and "
                f"at least the step's {k} micro-batches: it is what each micro-batch's mean "
                "loss was divided by"
            )
        present = [(i, p.grad) for i, p in enumerate(self.params) if p.grad is not None]
        with torch.no_grad():
            grads = [g for _, g in present]
            parts = [norms for _, norms in micro] + [sq_norms(grads, norm_dtype(grads))]
            if dirty is not None:
                parts.append(dirty[1])
            values = torch.cat([t.to(parts[-1].device) for t in parts])
        which = [idx for idx, _ in micro] + [[i for i, _ in present]]
        # g_k = weight x micro-batch k's mean gradient, as its backward brings it
        weights = {
            "mean": [1.0 / (divisor or k)] * k,
            "sum": [1.0] * k,
            "items": [b / sum(sizes) for b in sizes],
        }[self.accumulation]
        combine = functools.partial(self._combine, which, dirty is not None, sizes, weights)
        self.sink(StagedPairs(values, combine))
        return True

    def _combine(
        self,
        which: list[list[int]],
        dirty: bool,
        sizes: list[int],
        weights: list[float],
        v: list[float],
    ) -> Pairs | None:
        n, k = len(self.names), len(sizes)
        small, big = [0.0] * n, [0.0] * n
        pos = 0
        for m, idx in enumerate(which):
            into, unweight = (big, 1.0) if m == k else (small, 1.0 / weights[m] ** 2)
            for i in idx:
                into[self._owner[i]] += v[pos] * unweight
                pos += 1
        if dirty and any(x != 0 for x in v[pos:]):
            warnings.warn(
                "nnstat: the gradients held values before this optimizer step's first "
                "micro-batch, so .grad is not the sum of its micro-batches: the step is left "
                "out of the noise scale. Clear them (optimizer.zero_grad()) after each step.",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        seen = sorted({self._owner[i] for i in which[-1]})
        total = sum(weights)
        # mean_k |mean gradient of micro-batch k|^2 and |mean gradient of the step|^2
        small_sq = [small[j] / k for j in seen]
        big_sq = [big[j] / (total * total) for j in seen]
        b_small, b_big = pair_sizes(sizes, weights)
        return [self.names[j] for j in seen], small_sq, big_sq, b_small, self.ranks * b_big

    def close(self) -> None:
        """Remove the hooks (the model is left as before)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.discard()


def step_sizes(value: int | Sequence[int] | None, k: int) -> list[int]:
    """The sizes of a step's ``k`` micro-batches: ``value`` for each (an int), or a sequence
    of ``k`` sizes as given.

    Raises:
        ValueError: a size below 1 or missing, or a sequence of another length than ``k``.

    Example:
        >>> step_sizes(8, 3), step_sizes([8, 8, 4], 3)
        ([8, 8, 8], [8, 8, 4])
    """
    if isinstance(value, Sequence) and not isinstance(value, str):
        sizes = [_batch_size(v, allow_none=False) for v in value]
        if len(sizes) != k:
            raise ValueError(
                f"micro_batch_size holds {len(sizes)} sizes but the step had {k} micro-batches "
                "(backward passes); pass one size per micro-batch, in order"
            )
        return sizes  # type: ignore[return-value]
    return [_batch_size(value, allow_none=False)] * k  # type: ignore[list-item]


def pair_sizes(sizes: Sequence[int], weights: Sequence[float]) -> tuple[float, float]:
    """The two batch sizes of a step whose micro-batch ``m`` has ``sizes[m]`` samples and
    enters the step's gradient with weight ``weights[m]`` (``g = sum_m w_m g_m``): with
    ``E|g_m|^2 = |G|^2 + tr(Sigma)/b_m``, the micro-batches' mean squared norm has the
    harmonic mean of the sizes, the step's normalised gradient ``(sum w)^2 / sum(w^2/b)``.

    Example:
        >>> pair_sizes([8, 8], [0.5, 0.5]), pair_sizes([8, 8, 4], [0.25, 0.25, 0.5])
        ((8, 16), (6.0, 12.8))
    """
    k = len(sizes)
    if len(set(sizes)) == 1 and len(set(weights)) == 1:
        return sizes[0], k * sizes[0]  # exact integers for the common case
    small = k / sum(1.0 / b for b in sizes)
    big = sum(weights) ** 2 / sum(w * w / b for w, b in zip(weights, sizes, strict=True))
    return small, big


def integral(size: float) -> float:
    """A batch size computed in floating point (a harmonic mean of sizes read back from the
    device), as the integer it is when it is one up to rounding (equal sizes: ``1/(1/3)``
    through float32 is not 3.0), else as it is.

    Example:
        >>> integral(1 / (1 / 3 + 1e-9)), integral(2.6666666666666665)
        (3, 2.6666666666666665)
    """
    near = round(size)
    return near if near >= 1 and abs(size - near) <= 1e-6 * size else size


def _batch_size(value: int | None, allow_none: bool) -> int | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(
            f"micro_batch_size must be a positive int (samples per micro-batch), got {value!r}; "
            "pass it to watch_microbatches() or end_step()"
        )
    return value
