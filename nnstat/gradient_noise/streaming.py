"""Streaming noise-scale tracker (exported as :class:`nnstat.NoiseScale`)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
from torch import nn

from nnstat.background.deferred import Deferred, InFlight, InOrder
from nnstat.background.transfer import HostBuffers, start_copy
from nnstat.capture.reduction import MeanLossProbe
from nnstat.describe import as_float
from nnstat.gradient_noise.ddp import DDPNoiseScaleState, register_noise_scale_hook
from nnstat.gradient_noise.maths import (
    SeparateAverages,
    check_batch_sizes,
    ratio_of_means,
    safe_ratio,
)
from nnstat.gradient_noise.microbatch import MicroBatchNorms, StagedPairs
from nnstat.gradient_noise.persample import PerSampleNorms, StagedNorms

Scalar = float | torch.Tensor
_TOTAL = ""  # key of the whole-model statistics; layers use their names


class _TrackedBatch:
    """``NoiseScale.batch()``: a plain context manager (no generator), as it runs every step."""

    __slots__ = ("tracker", "capture", "batch_size", "loss_reduction", "probe")

    def __init__(
        self,
        tracker: NoiseScale,
        capture: PerSampleNorms,
        batch_size: int | None,
        loss_reduction: str,
        probe: MeanLossProbe | None,
    ):
        self.tracker, self.capture, self.batch_size = tracker, capture, batch_size
        self.loss_reduction, self.probe = loss_reduction, probe

    def __enter__(self) -> None:
        self.capture.begin(self.batch_size, self.loss_reduction)
        if self.probe is not None:
            self.probe.__enter__()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.probe is not None:
            self.probe.__exit__(exc_type, exc, tb)
        if exc_type is not None:
            self.capture.abort()
            return
        staged = self.capture.end_staged()
        if self.probe is not None:
            self.tracker._checked.add(self.loss_reduction)
            _warn_mismatch(self.probe, self.loss_reduction, staged.n)
        self.tracker._queue(staged)


def _warn_mismatch(probe: MeanLossProbe, loss_reduction: str, n: int) -> None:
    """Warn when the loss of a ``NoiseScale.batch()`` block of ``n`` samples was reduced over
    the batch otherwise than ``loss_reduction`` says (called from ``_TrackedBatch.__exit__``:
    the warning points at the user's ``with gns.batch()``)."""
    if loss_reduction == "mean":
        what, actual, fix = probe.sum_over_batch(n), "a sum", "loss_reduction='sum'"
    else:
        what, actual, fix = probe.mean_over_batch(n), "a mean", "loss_reduction='mean'"
    if what is None:
        return
    warnings.warn(
        f"nnstat: the loss of this NoiseScale.batch() block is {actual} over its {n} samples "
        f"({what}), but batch() was given loss_reduction={loss_reduction!r}"
        f"{' (the default)' if loss_reduction == 'mean' else ''}: trace_sigma and "
        f"grad_sq_norm come out scaled by {n}^2 or 1/{n}^2 (b_simple is unaffected). Pass "
        f"batch({fix}).",
        stacklevel=3,
    )


class NoiseScale:
    """Streaming gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` for every training step.

    Each ``update`` turns one pair of squared gradient norms (batch sizes ``b_small < b_big``)
    into unbiased estimates of ``tr(Sigma)`` and ``|G|^2``; the two are averaged **separately**
    (EMA with ``beta``, or a sliding ``window``) and ``value`` is the ratio of the averages.
    Averaging the per-step ratios instead is biased and explodes whenever a noisy ``|G|^2``
    estimate comes close to zero.

    Feeds: ``update`` (norms you computed), ``update_grads`` (two gradient dicts), ``watch`` +
    ``batch()`` (per-sample norms from the capture engine: ``b_small = 1``),
    ``watch_microbatches`` (gradient accumulation's micro-batches vs their sum), or
    ``register_ddp`` (local vs all-reduced gradient under DDP).

    On a GPU ``batch()`` reads nothing back: its norms start for the host in one non-blocking
    copy (`nnstat.background.transfer`) and join the averages once they have arrived (checked
    at the next ``batch()``, without waiting). Reading a value (``value``, ``to_dict()``,
    ``n_updates``, ...) waits for every batch so far. ``as_provider()`` gives a Tracker each
    step's values without waiting: they are filled in when the Tracker delivers that step.

    A hooked feed's step (``batch()``, ``watch_microbatches``, ``register_ddp``) whose norms
    hold NaN/Inf (an overflow the GradScaler skips, a NaN in the loss or data) is left out with
    a ``RuntimeWarning`` when they arrive; NaN/Inf given to ``update`` raise (input).

    Args:
        beta: EMA factor of the two averages (default 0.99 when no ``window`` is given).
        window: average over the last ``window`` observations instead of an EMA.
        prefix: prefix of the keys of `to_dict` and `as_provider`.

    Raises:
        ValueError: both ``beta`` and ``window``, ``beta`` outside ``[0, 1)``, or a
            non-positive ``window``.

    Example:
        >>> gns = NoiseScale(beta=0.9)
        >>> gns.update(g_small_sq=1.0 + 4.0 / 2, g_big_sq=1.0 + 4.0 / 8, b_small=2, b_big=8)
        >>> gns.value
        4.0
        >>> gns.to_dict()["noise_scale/b_simple"]
        4.0
    """

    def __init__(
        self, beta: float | None = None, window: int | None = None, *, prefix: str = "noise_scale"
    ) -> None:
        if beta is not None and window is not None:
            raise ValueError("give either beta (EMA) or window (sliding mean), not both")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be a positive int, got {window!r}")
        if window is None:
            beta = 0.99 if beta is None else float(beta)
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.beta, self.window, self.prefix = beta, window, prefix
        self._n_updates = 0
        self._stats: dict[str, SeparateAverages] = {}
        self._inflight = InOrder()  # captured batches on their way (GPU)
        self._queued = 0  # captured batches queued so far (numbers them)
        self._buffers = HostBuffers(pin=True, minimum=256)
        self._capture: PerSampleNorms | None = None
        self._compiled = False  # the watched model is torch.compile'd: no function mode inside
        self._checked: set[str] = set()  # loss reductions a probe checked since watch()
        self._micro: list[MicroBatchNorms] = []  # watch_microbatches feeds

    # ----------------------------------------------------------------- feeding
    def update(
        self,
        g_small_sq: Scalar | Mapping[str, Scalar],
        g_big_sq: Scalar | Mapping[str, Scalar],
        b_small: float,
        b_big: float,
    ) -> None:
        """Add one observation: squared norms of the mean gradient at two batch sizes.

        Pass floats for the whole model, or dicts ``layer -> squared norm`` (same keys) to also
        track every layer; the model total is then the sum over the layers. Non-finite values
        raise (they are the caller's input, unlike a hooked feed's overflowed step, which is
        left out with a warning): skip the call for a step the GradScaler skips.

        Args:
            g_small_sq: ``|g|^2`` of the mean gradient over ``b_small`` samples.
            g_big_sq: ``|g|^2`` of the mean gradient over ``b_big`` samples.
            b_small: the small batch size.
            b_big: the big batch size (``> b_small``).

        Raises:
            ValueError: ``b_small >= b_big``, different keys, or a non-finite or negative norm.
            TypeError: one scalar and one dict.
        """
        check_batch_sizes(b_small, b_big)
        self._arrived(wait=True)  # captured batches first: the averages keep their order
        if isinstance(g_small_sq, Mapping) != isinstance(g_big_sq, Mapping):
            raise TypeError("g_small_sq and g_big_sq must both be scalars or both be dicts")
        if isinstance(g_small_sq, Mapping):
            assert isinstance(g_big_sq, Mapping)
            keys = list(g_small_sq)
            if len(keys) != len(g_big_sq) or any(k not in g_big_sq for k in keys):
                raise ValueError(
                    f"layer keys differ: {sorted(set(g_small_sq) ^ set(g_big_sq))} are in only one"
                )
            small = [as_float(g_small_sq[k]) for k in keys]
            big = [as_float(g_big_sq[k]) for k in keys]
            keys.append(_TOTAL)
            small.append(sum(small))
            big.append(sum(big))
        else:
            keys, small, big = [_TOTAL], [as_float(g_small_sq)], [as_float(g_big_sq)]
        self._add(keys, small, big, b_small, b_big)

    def _add(
        self, keys: list[str], small: list[float], big: list[float], b_small: float, b_big: float
    ) -> None:
        """``update`` after its input checks: plain float lists, the total's key last."""
        # one C-level pass for the common all-valid case (NaN/Inf survive the sum); the loop
        # names the offender (and is the authority when a huge but finite sum overflowed)
        if not (math.isfinite(sum(small) + sum(big)) and min(small) >= 0 and min(big) >= 0):
            for k, s, b in zip(keys, small, big, strict=True):
                if not (math.isfinite(s) and math.isfinite(b)) or s < 0 or b < 0:
                    where = "" if k == _TOTAL else f" of layer {k!r}"
                    raise ValueError(
                        f"squared norms{where} must be finite and >= 0, got g_small_sq={s}, "
                        f"g_big_sq={b}"
                    )
        # the two-batch solution of McCandlish et al. (appendix A), inlined: this runs per step
        c_g = 1.0 / (b_big - b_small)
        c_t = 1.0 / (1.0 / b_small - 1.0 / b_big)
        for k, s, b in zip(keys, small, big, strict=True):
            avg = self._stats.get(k)
            if avg is None:
                avg = self._stats[k] = SeparateAverages(self.beta, self.window)
            avg.add((s - b) * c_t, (b_big * b - b_small * s) * c_g)
        self._n_updates += 1

    def update_grads(
        self,
        small_grads: Mapping[str, torch.Tensor],
        big_grads: Mapping[str, torch.Tensor],
        b_small: float,
        b_big: float,
    ) -> None:
        """Add one observation from two gradient dicts (e.g. micro-batch vs accumulated).

        Both are mean gradients (of mean losses) over ``b_small`` and ``b_big`` samples, keyed by
        parameter name, e.g. ``{n: p.grad.clone() for n, p in model.named_parameters()}``.
        Raises ``ValueError`` for different names or shapes; otherwise as `update`.
        """
        if set(small_grads) != set(big_grads):
            raise ValueError(f"parameter names differ: {sorted(set(small_grads) ^ set(big_grads))}")
        for k in small_grads:
            if small_grads[k].shape != big_grads[k].shape:
                raise ValueError(
                    f"{k}: shapes differ, {tuple(small_grads[k].shape)} vs "
                    f"{tuple(big_grads[k].shape)}"
                )
        sq = {k: small_grads[k].detach().double().pow(2).sum() for k in small_grads}
        bq = {k: big_grads[k].detach().double().pow(2).sum() for k in big_grads}
        self.update(sq, bq, b_small, b_big)

    def watch(
        self, model: nn.Module, name_filter: str | None = None, type_filter: Any = None
    ) -> list[str]:
        """Hook ``model`` through the capture engine for per-sample norms (``b_small = 1``).

        Then wrap each backward in ``with gns.batch(): ...`` (a loss that is the batch mean;
        ``gns.batch(loss_reduction="sum")`` for a sum over the batch).

        Args:
            model: the network.
            name_filter: regex of module names to watch; ``None``: all supported.
            type_filter: module classes to watch.

        Returns the names of the watched modules; ``RuntimeError`` if it already watches one.
        """

        if self._capture is not None:
            raise RuntimeError("this NoiseScale already watches a model; call unwatch() first")
        self._capture = PerSampleNorms(model, name_filter=name_filter, type_filter=type_filter)
        self._compiled, self._checked = hasattr(model, "_orig_mod"), set()
        return list(self._capture.names)

    def batch(
        self, batch_size: int | None = None, loss_reduction: str = "mean"
    ) -> AbstractContextManager[None]:
        """Capture one backward of the watched model and update the estimate from it.

        ``loss_reduction``: how the loss of the block reduced over its samples, ``"mean"``
        (the default) or ``"sum"``; the estimates are those of the mean gradient either way.
        The first block of each reduction after ``watch`` checks the loss (a
        ``MeanLossProbe``) and warns when it was a sum where ``"mean"`` was given, or the
        reverse (``trace_sigma`` and ``grad_sq_norm`` would be off by ``N^2``).

        Args:
            batch_size: the loss's batch size; ``None``: each module's batch dimension.
            loss_reduction: ``"mean"`` or ``"sum"``.

        Raises:
            RuntimeError: no watched model (call `watch` first).
            ValueError: an unknown ``loss_reduction``; at the block's end, a ``batch_size``
                other than the samples the watched modules saw. (A batch whose norms hold NaN/Inf is
                left out with a ``RuntimeWarning`` when they arrive: a later read or
                ``batch()`` on a GPU.)

        Example (training loop)::

            gns = nnstat.NoiseScale(beta=0.99); gns.watch(model)
            for x, y in loader:
                with gns.batch():
                    loss_fn(model(x), y).backward()
                opt.step(); opt.zero_grad()
        """
        if self._capture is None:
            raise RuntimeError("call watch(model) before batch()")
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        check = not self._compiled and loss_reduction not in self._checked
        probe = MeanLossProbe() if check else None
        return _TrackedBatch(self, self._capture, batch_size, loss_reduction, probe)

    def _add_captured(self, names: list[str], small: list[float], big: list[float], n: int) -> None:
        # floats, per layer, finite (checked by the capture): skip update()'s input conversion
        check_batch_sizes(1, n)
        small.append(sum(small))
        big.append(sum(big))
        self._add([*names, _TOTAL], small, big, 1, n)

    def watch_microbatches(
        self,
        model: nn.Module,
        micro_batch_size: int | None = None,
        accumulation: str = "mean",
        ranks: int = 1,
    ) -> MicroBatchNorms:
        """Feed this tracker from gradient accumulation: one observation per optimizer step.

        Each ``backward()`` of ``model`` is one micro-batch (``B_small`` = its samples, its loss
        their mean); ``end_step()`` of the returned `MicroBatchNorms`, called once the step's
        gradients are final (before clipping), adds ``mean_k |g_k|^2`` against the accumulated
        gradient's ``|G|^2`` (``B_big`` = all the step's samples), per module. Nothing beyond
        one multi-tensor norm per micro-batch runs, and nothing is read back inside the step.
        A step whose gradients hold NaN/Inf (one the GradScaler skips) is left out, with a
        ``RuntimeWarning`` when its norms arrive.

        Args:
            model: the network (every parameter that requires a gradient).
            micro_batch_size: samples per micro-batch (or pass it to ``end_step``).
            accumulation: ``"mean"``: micro-batch losses divided by their number (Lightning;
                HF for a model whose loss ignores ``num_items_in_batch``); ``"sum"``: added as
                they are; ``"items"``: each micro-batch's summed loss divided by the step's
                samples (HF's ``num_items_in_batch``). They differ for unequal micro-batches.
            ranks: DDP processes the step's ``.grad`` averages over (accumulating under
                ``no_sync()``; ``B_big`` = ranks x all micro-batches' samples).

        Returns:
            The `MicroBatchNorms` (``close()`` removes its hooks; `unwatch` does too).

        Example::

            micro = gns.watch_microbatches(model, micro_batch_size=8)
            for step in range(steps):
                for x, y in micro_batches(4):
                    (loss_fn(model(x), y) / 4).backward()
                micro.end_step()
                opt.step(); opt.zero_grad()
        """
        micro = MicroBatchNorms(model, self.add_staged, micro_batch_size, accumulation, ranks)
        self._micro.append(micro)
        return micro

    def add_staged(self, staged: StagedPairs) -> None:
        """Add an observation whose squared norms are still on the device (`StagedPairs`, from
        `watch_microbatches` or the DDP hook): its one copy to the host starts now; it joins
        the averages once arrived, in order with the other feeds."""
        self._queue(staged)

    def _queue(self, staged: StagedNorms | StagedPairs) -> None:
        """A captured batch: its one copy to the host starts now, it joins the averages once
        it has arrived (at once on CPU)."""
        self._queued += 1
        copy = start_copy([staged.values], self._buffers)
        self._inflight.append(InFlight(copy, staged, number=self._queued))
        self._arrived(wait=False)

    def _arrived(self, wait: bool, upto: Deferred | None = None) -> None:
        """Add the captured batches that have reached the host, in order; with `wait` every
        one (up to the one `upto` waits for, when given), waiting for its copy."""
        self._inflight.drain(
            self._complete,
            wait,
            upto,
            note=lambda e: f"(noise-scale batch {e.number}, read after its batch())",
        )

    def _complete(self, entry: InFlight) -> None:
        (values,) = entry.copy.wait()
        # either kind leaves a step with NaN/Inf norms out, with a warning (`finite_step`)
        if isinstance(entry.work, StagedNorms):
            if (norms := entry.work.resolve(values.tolist())) is not None:
                self._add_captured(*norms)
        elif (pairs := entry.work.resolve(values.tolist())) is not None:
            names, small, big, b_small, b_big = pairs
            check_batch_sizes(b_small, b_big)
            if names:  # per layer, plus the model's total
                small, big = [*small, sum(small)], [*big, sum(big)]
            self._add([*names, _TOTAL], small, big, b_small, b_big)
        for snapshot in entry.handles:
            snapshot.set(self._to_dict())

    def unwatch(self) -> None:
        """Remove the capture and micro-batch hooks (the model is left exactly as before)."""
        if self._capture is not None:
            self._capture.close()
            self._capture = None
        for micro in self._micro:
            micro.close()
        self._micro = []

    def register_ddp(
        self, ddp_model: nn.Module, local_batch_size: int, process_group: Any = None
    ) -> DDPNoiseScaleState:
        """Register a DDP communication hook feeding this tracker every synchronised backward.

        ``b_small`` is ``local_batch_size`` (samples per rank), ``b_big`` the global batch; the
        loss must be the mean over the rank's samples. With gradient accumulation under
        ``no_sync()``, average the micro-batch losses (divide each by their number) and pass
        the samples per rank per optimizer step. Whole-model values only (no per-layer split).
        The returned state's ``local_batch_size`` can be changed between steps, and ranks may
        differ (a smaller last batch on one rank): the ranks' sizes are all-reduced with the
        gradients, and the step is taken at their harmonic mean ``H`` and ``world x H``, which
        keeps both estimates unbiased (DDP averages the ranks' mean gradients equally).

        Args:
            ddp_model: the ``DistributedDataParallel`` model.
            local_batch_size: samples per rank per optimizer step.
            process_group: the group to all-reduce over; ``None``: the default group.

        Example::

            ddp_model = torch.nn.parallel.DistributedDataParallel(model)
            gns = nnstat.NoiseScale(beta=0.95)
            gns.register_ddp(ddp_model, local_batch_size=32)
        """

        return register_noise_scale_hook(ddp_model, self, local_batch_size, process_group)

    # ----------------------------------------------------------------- reading
    @property
    def n_updates(self) -> int:
        """Observations averaged so far (waits for captured batches on their way)."""
        self._arrived(wait=True)
        return self._n_updates

    @property
    def n_observed(self) -> int:
        """Observations so far, counting captured batches still on their way (waits for
        none: whether there is anything to report yet, e.g. for a provider)."""
        return self._n_updates + len(self._inflight)

    def _means(self, key: str = _TOTAL) -> tuple[float, float]:
        if key not in self._stats:
            return math.nan, math.nan
        return self._stats[key].means()

    def _value(self) -> float:
        trace, g_sq = self._means()
        return math.nan if math.isnan(g_sq) else safe_ratio(trace, g_sq)

    @property
    def value(self) -> float:
        """``B_simple`` (``nan`` before the first update, ``inf`` while ``|G|^2 <= 0``)."""
        self._arrived(wait=True)
        return self._value()

    @property
    def grad_sq_norm(self) -> float:
        """Averaged unbiased estimate of ``|G|^2``."""
        self._arrived(wait=True)
        return self._means()[1]

    @property
    def trace_sigma(self) -> float:
        """Averaged unbiased estimate of ``tr(Sigma)``."""
        self._arrived(wait=True)
        return self._means()[0]

    def _layer_values(self) -> dict[str, float]:
        return {k: safe_ratio(*self._means(k)) for k in self._stats if k != _TOTAL}

    def layer_values(self) -> dict[str, float]:
        """``B_simple`` per layer (only when updates carried per-layer dicts)."""
        self._arrived(wait=True)
        return self._layer_values()

    def _interval(self) -> tuple[float, float]:
        avg = self._stats.get(_TOTAL)
        if avg is None or avg.window is None or len(avg.nums) < 2:
            return math.nan, math.nan
        stats = ratio_of_means(np.asarray(avg.nums), np.asarray(avg.dens), n_boot=200)
        return stats.interval

    @property
    def interval(self) -> tuple[float, float]:
        """95% bootstrap interval of ``value`` over the window (``nan`` in EMA mode)."""
        self._arrived(wait=True)
        return self._interval()

    def layer_estimates(self) -> dict[str, tuple[float, float]]:
        """Averaged ``(grad_sq_norm, trace_sigma)`` per layer."""
        self._arrived(wait=True)
        return {k: self._means(k)[::-1] for k in self._stats if k != _TOTAL}

    def _to_dict(self) -> dict[str, float]:
        p = self.prefix
        trace, g_sq = self._means()
        out = {f"{p}/b_simple": self._value(), f"{p}/grad_sq_norm": g_sq, f"{p}/trace_sigma": trace}
        if self.window is not None:
            out[f"{p}/low"], out[f"{p}/high"] = self._interval()
        for k, v in self._layer_values().items():
            out[f"{p}/{k}/b_simple"] = v
        return out

    def to_dict(self) -> dict[str, float]:
        """Flat metrics: ``noise_scale/b_simple``, ``noise_scale/grad_sq_norm``,
        ``noise_scale/<layer>/b_simple``, ..."""
        self._arrived(wait=True)
        return self._to_dict()

    def _provide(self) -> Mapping[str, float]:
        if not self._inflight:
            return self._to_dict()
        # the values as of the last batch, filled in when it arrives (no wait here)
        entry = self._inflight[-1]

        def settle() -> None:
            if self._inflight.holds(snapshot):
                self._arrived(wait=True, upto=snapshot)

        missing = f"noise-scale update {entry.number} failed (raised before): no value"
        snapshot = Deferred(settle, missing)
        entry.handles.append(snapshot)
        return snapshot

    def as_provider(self) -> Callable[[], Mapping[str, float]]:
        """A callable returning :meth:`to_dict`'s values, for ``Tracker.add_provider``.

        It does not wait for batches still on their way from a GPU: it returns a mapping that
        fills in (with the values as of that call) when first read, e.g. when the Tracker
        hands that step to its sinks.
        """
        return self._provide

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (floats and lists only)."""
        return {
            "version": 1,
            "beta": self.beta,
            "window": self.window,
            "n_updates": self.n_updates,  # waits for batches on their way
            "stats": {k: v.state() for k, v in self._stats.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; the averaging mode must match this tracker's."""
        expected = {"version", "beta", "window", "n_updates", "stats"}
        if set(state) != expected:
            raise ValueError(
                f"bad NoiseScale state keys {sorted(state)}; expected {sorted(expected)}"
            )
        if state["version"] != 1:
            raise ValueError(f"unsupported NoiseScale state version {state['version']!r}")
        if state["beta"] != self.beta or state["window"] != self.window:
            raise ValueError(
                f"state was saved with beta={state['beta']}, window={state['window']}; this "
                f"tracker has beta={self.beta}, window={self.window}"
            )
        stats = {}
        for k, v in state["stats"].items():
            avg = SeparateAverages(self.beta, self.window)
            avg.load(v)
            stats[k] = avg
        self._stats = stats
        self._arrived(wait=True)  # batches captured before are overwritten, not left to land
        self._n_updates = int(state["n_updates"])
