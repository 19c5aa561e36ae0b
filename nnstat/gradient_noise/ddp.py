"""Noise scale for free under DDP: local gradient (per-rank batch) vs all-reduced gradient.

A communication hook replaces DDP's default all-reduce: it appends the squared norm of the
rank's local gradient bucket and the inverse of the rank's batch size to the bucket and averages
them in the same collective, so every rank gets ``mean_r |G_r|^2``, ``|G|^2`` of the averaged
gradient and ``mean_r 1/b_r`` with no extra communication round and no read back: the values
are staged on the device for the tracker's one non-blocking copy.

Ranks of unequal batch sizes ``b_r`` (a smaller last batch, ``drop_last=False``): DDP averages
the ranks' mean gradients equally, ``G = mean_r G_r``, so with ``E|G_r|^2 = |G|^2 + tr/b_r``

    E mean_r |G_r|^2 = |G|^2 + tr(Sigma) / H,   E |G|^2 = |G|^2 + tr(Sigma) / (R H)

with ``H = 1 / mean_r(1/b_r)`` the harmonic mean of the ranks' sizes: ``B_small = H`` and
``B_big = R H`` keep both estimates unbiased (`pair_sizes`), on every rank alike.

Losses summed over items and divided by the global count (HF's ``num_items_in_batch`` with
``average_tokens_across_devices``): rank r's gradient is ``w_r g_r`` with ``g_r`` the mean over
its ``n_r`` items and ``w_r = n_r / mean_r n_r``, so ``E mean_r |w_r g_r|^2 = m |G|^2 +
tr / mean(n)`` with ``m = mean(n^2) / mean(n)^2``, and ``E |G|^2 = |G|^2 + tr / (R mean(n))``.
Each rank packs ``(n_r, n_r^2, n_r)`` (``local_items``, left on the device) where a mean loss
packs ``(1, 1, 1/b_r)``: the local norm is divided by ``m``, ``B_small = mean(n^2) / mean(n)``
and ``B_big = R mean(n)`` items (`_whole_model`).

DDP takes one communication hook per model and has no way to remove it: the state is kept on
the model (`registered_state`), so registering again re-points the same hook at a new tracker,
and `DDPNoiseScaleState.detach` turns it back into DDP's plain averaging.
"""

import functools
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nnstat.distributed import is_distributed
from nnstat.gradient_noise.batches import norm_dtype, sq_norms
from nnstat.gradient_noise.microbatch import StagedPairs, integral

#: attribute of a DDP model holding the `DDPNoiseScaleState` of its noise-scale hook
STATE_ATTR = "_nnstat_noise_scale_state"


class StagedUpdates(Protocol):
    """What the hook feeds: `nnstat.NoiseScale.add_staged` (squared norms at two batch sizes,
    still on the device)."""

    def add_staged(self, staged: StagedPairs) -> None: ...


@dataclass
class DDPNoiseScaleState:
    """State of :func:`noise_scale_comm_hook`; set ``local_batch_size`` if it changes.

    ``local_batch_size`` is the number of samples this rank's synchronised gradient averages
    (the loss must be their mean; DDP averages gradients across ranks); ranks may differ, the
    hook all-reduces their sizes with the gradients. ``local_items``: set instead when each
    rank's loss is its items' SUM divided by the global count (times the world size: HF's
    ``num_items_in_batch`` with ``average_tokens_across_devices``): this rank's item count (an
    int, or a tensor left on the device); the sizes are then counted in items. The buckets' squared norms are summed on
    the device and staged at the last bucket: the hook reads nothing back.

    Example:
        >>> staged = []
        >>> class Feed:  # what the hook feeds: anything with add_staged
        ...     add_staged = staged.append
        >>> state = DDPNoiseScaleState(Feed(), local_batch_size=32)
        >>> state.local_batch_size, state.process_group  # None: the default process group
        (32, None)
        >>> state.detach()  # from now on the hook only averages the gradients, as DDP does
        >>> state.tracker is None
        True
    """

    tracker: StagedUpdates | None
    local_batch_size: int
    process_group: Any = None
    local_items: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _sums: torch.Tensor | None = None  # (local, global) squared norms of the buckets so far
    _done: int = 0
    _total: int | None = None

    def _bucket_done(self, sums: torch.Tensor) -> None:
        with self._lock:
            self._sums = sums if self._sums is None else self._sums + sums
            self._done += 1
            if self._total is None or self._done < self._total:
                return
            staged, self._sums, buckets = self._sums, None, self._total
            self._done, self._total = 0, None
        if self.tracker is None:
            return
        world = dist.get_world_size(self.process_group)
        self.tracker.add_staged(
            StagedPairs(staged, functools.partial(_whole_model, world, buckets))
        )

    def detach(self) -> None:
        """Stop feeding the tracker: the hook then averages the gradients as DDP's default
        all-reduce does (DDP cannot remove a communication hook)."""
        self.tracker = None
        with self._lock:
            self._sums, self._done, self._total = None, 0, None


def noise_scale_comm_hook(
    state: DDPNoiseScaleState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average gradients (as DDP does) and feed ``state.tracker``.

    Example::

        state = DDPNoiseScaleState(nnstat.NoiseScale(beta=0.9), local_batch_size=32)
        ddp_model.register_comm_hook(state, noise_scale_comm_hook)
    """
    group = state.process_group
    world = dist.get_world_size(group)
    buf = bucket.buffer()
    if state.tracker is None:  # detached: DDP's own averaging
        fut = dist.all_reduce(buf.div_(world), group=group, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    # Half-precision buckets are reduced in float32 so the appended squared norm keeps its range.
    comm_dtype = buf.dtype if buf.dtype in (torch.float32, torch.float64) else torch.float32
    # [gradients, |G_r|^2, u_r, u_r^2, u_r^2/b_r]: the ranks' sizes and loss weights travel in
    # the same collective (filled from the host or copied on the device, nothing read back), so
    # unequal per-rank batches are known on every rank
    packed = torch.ones(buf.numel() + 4, dtype=comm_dtype, device=buf.device)
    packed[:-4].copy_(buf.reshape(-1))
    # one multi-tensor norm per bucket (float32 accumulation for float32 and half buckets)
    packed[-4:-3].copy_(sq_norms([buf.detach()], norm_dtype([buf])))
    pack_sizes(packed[-3:], state.local_batch_size, state.local_items)
    packed.div_(world)
    if bucket.is_last():
        with state._lock:
            state._total = bucket.index() + 1
    fut = dist.all_reduce(packed, group=group, async_op=True).get_future()

    def finish(f: torch.futures.Future[Any]) -> torch.Tensor:
        reduced = f.value()[0]
        grads = reduced[:-4]
        # (mean_r |G_r|^2, |G|^2, mean_r u_r, mean_r u_r^2, mean_r u_r^2/b_r) of this bucket,
        # left on the device
        big = sq_norms([grads], norm_dtype([grads]))
        state._bucket_done(torch.cat([reduced[-4:-3].to(big.dtype), big, reduced[-3:]]).double())
        return grads.to(buf.dtype).reshape(buf.shape)

    return fut.then(finish)


def pack_sizes(tail: torch.Tensor, batch_size: int, items: Any) -> None:
    """Fill ``tail`` (3 values, on the device) with this rank's ``(u, u^2, u^2/b)``: ``(1, 1,
    1/b)`` for a mean loss over ``batch_size`` samples, ``(n, n^2, n)`` for a loss summed over
    ``items`` (``n``; a tensor stays on the device: nothing is read back) and divided by the
    global count. Averaged over the ranks they give the sizes and the local norm's weight
    (`_whole_model`).

    Example:
        >>> tail = torch.zeros(3); pack_sizes(tail, 4, None); tail.tolist()
        [1.0, 1.0, 0.25]
        >>> pack_sizes(tail, 4, torch.tensor(6)); tail.tolist()
        [6.0, 36.0, 6.0]
    """
    if items is None:
        tail[:2].fill_(1.0)
        tail[2:].fill_(1.0 / batch_size)
        return
    n = torch.as_tensor(items, device=tail.device).to(tail.dtype).reshape(1)
    tail.copy_(torch.cat([n, n * n, n]))


def register_noise_scale_hook(
    ddp_model: Any, tracker: StagedUpdates, local_batch_size: int, process_group: Any = None
) -> DDPNoiseScaleState:
    """Register :func:`noise_scale_comm_hook` on a ``DistributedDataParallel`` model.

    A model that already carries this hook (an earlier registration, e.g. a second
    ``trainer.train()``) keeps it: its state is re-pointed at ``tracker``.

    Args:
        ddp_model: the ``DistributedDataParallel`` model.
        tracker: what the hook feeds (`nnstat.NoiseScale`, or anything with ``add_staged``).
        local_batch_size: samples per rank behind each synchronised gradient (this rank's: other
            ranks may have others; set ``state.local_batch_size`` when it changes).
        process_group: the group to all-reduce over; ``None``: the default group.

    Returns:
        The hook's `DDPNoiseScaleState`.

    Raises:
        RuntimeError: torch.distributed not initialised, or the model already has another
            communication hook (DDP takes one).
        TypeError: not a ``DistributedDataParallel`` model.
        ValueError: ``local_batch_size`` below 1 or fewer than 2 processes.

    Example::

        state = register_noise_scale_hook(ddp_model, nnstat.NoiseScale(), local_batch_size=32)

    Outside ``torch.distributed`` it is refused:

        >>> register_noise_scale_hook(torch.nn.Linear(2, 1), None, local_batch_size=32)
        Traceback (most recent call last):
        RuntimeError: torch.distributed is not initialised; call init_process_group first
    """
    if not is_distributed():
        raise RuntimeError("torch.distributed is not initialised; call init_process_group first")
    if not hasattr(ddp_model, "register_comm_hook"):
        raise TypeError("register_ddp needs a torch.nn.parallel.DistributedDataParallel model")
    if int(local_batch_size) < 1:
        raise ValueError(f"local_batch_size must be >= 1, got {local_batch_size}")
    if dist.get_world_size(process_group) < 2:
        raise ValueError(
            "the DDP noise scale needs at least 2 processes (b_big = world size x per-rank batch "
            "must exceed b_small)"
        )
    state = registered_state(ddp_model)
    if state is not None:
        if state.process_group is not process_group:
            raise RuntimeError(
                "this DDP model's noise-scale hook all-reduces over another process group; DDP "
                "takes one communication hook, so pass the group it was registered with"
            )
        state.tracker, state.local_batch_size = tracker, int(local_batch_size)
        return state
    if getattr(ddp_model, "_comm_hooks", None):
        raise RuntimeError(
            "this DDP model already has a communication hook (DDP takes one); the noise scale's "
            "hook replaces DDP's all-reduce, so it cannot be added: register it instead of the "
            "other hook, or use the per-sample noise scale (NoiseScale.watch)"
        )
    state = DDPNoiseScaleState(tracker, int(local_batch_size), process_group)
    try:
        ddp_model.register_comm_hook(state, noise_scale_comm_hook)
    except RuntimeError as e:  # a built-in hook (register_builtin_comm_hook) is not listed
        raise RuntimeError(
            f"could not register the noise scale's DDP communication hook ({e}); DDP takes one "
            "hook per model: drop the other one, or use the per-sample noise scale"
        ) from e
    setattr(ddp_model, STATE_ATTR, state)
    return state


def registered_state(ddp_model: Any) -> DDPNoiseScaleState | None:
    """The state of the noise-scale hook registered on ``ddp_model``, if any.

    Example:
        >>> registered_state(torch.nn.Linear(2, 1)) is None
        True
    """
    state = getattr(ddp_model, STATE_ATTR, None)
    return state if isinstance(state, DDPNoiseScaleState) else None


def find_ddp(model: Any) -> torch.nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` that ``model`` is or compiles (``torch.compile``'s
    ``_orig_mod``); ``None`` if there is none (one process, FSDP, DeepSpeed...).

    Example:
        >>> find_ddp(torch.nn.Linear(2, 1)) is None
        True
    """
    for _ in range(4):
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        model = getattr(model, "_orig_mod", None)
        if model is None:
            return None
    return None


class DDPStepNorms:
    """The DDP hook's observations, one per optimizer step, with the step's local samples
    counted by the training loop: what the HF and Lightning callbacks use.

    This rank's batch is the samples its gradient averages at the synchronised backward (the
    sum of the `count` calls since the last `end_step`: with gradient accumulation under
    ``no_sync()``, every micro-batch of the step); ranks of unequal batches (a smaller last
    batch) give ``B_small`` = the harmonic mean ``H`` of their sizes and ``B_big = world x H``,
    all-reduced with the gradients (see the module's docstring). A step
    whose gradients were synchronised more than once (accumulation without ``no_sync()``) is
    left out with a warning: the later buckets then hold the earlier averaged gradients plus
    the local one, not a local gradient.

    Args:
        ddp_model: the ``DistributedDataParallel`` model (its noise-scale hook is registered,
            or re-pointed here if it already has one).
        sink: receives each step's `StagedPairs` (e.g. `nnstat.NoiseScale.add_staged`).
        process_group: the group to all-reduce over; ``None``: the default group.

    Raises:
        RuntimeError / TypeError / ValueError: as `register_noise_scale_hook`.

    Example::

        feed = DDPStepNorms(ddp_model, gns.add_staged)
        for x, y in loader:
            feed.count(len(x))
            loss_fn(ddp_model(x), y).backward()
            feed.end_step()  # before clipping is fine too: the hook saw the raw gradients
            opt.step(); opt.zero_grad()
    """

    def __init__(self, ddp_model: Any, sink: Any, process_group: Any = None) -> None:
        self.sink = sink
        self._lock = threading.Lock()
        self._staged: list[StagedPairs] = []
        self._samples = self._last = 0
        self._items: list[Any] = []  # each micro-batch's item count (None: a mean loss)
        self._warned = False
        self.state = register_noise_scale_hook(ddp_model, self, 1, process_group)

    def add_staged(self, staged: StagedPairs) -> None:
        """Called by the hook at the end of each synchronised backward (maybe on the
        communication thread): keep its two squared norms for `end_step`."""
        with self._lock:
            self._staged.append(staged)

    def count(self, samples: int, items: Any = None) -> None:
        """A micro-batch of ``samples`` local samples is about to run its forward; ``items``:
        its item count when the loss is the items' sum divided by the global count (an int or
        a tensor, left on the device; see `DDPNoiseScaleState`), for every micro-batch or none.

        Raises:
            ValueError: ``items`` given for some micro-batches of the step and not others.
        """
        self._last = int(samples)
        self._samples += self._last
        self._items.append(items)
        self._set_state()

    def _set_state(self) -> None:
        if self.state.tracker is not self:  # re-pointed at a newer feed since
            return
        # what the hook all-reduces at the synchronised backward
        self.state.local_batch_size = max(self._samples, 1)
        known = [n for n in self._items if n is not None]
        if known and len(known) < len(self._items):
            raise ValueError(
                "DDPStepNorms.count: items given for some micro-batches of the step and not "
                "others; pass items for every micro-batch (a loss summed over items) or none"
            )
        self.state.local_items = sum(known[1:], known[0]) if known else None

    @property
    def counted(self) -> bool:
        """Whether a micro-batch was counted since the last `end_step`."""
        return self._samples > 0

    def recount(self, samples: int, items: Any = None) -> None:
        """The micro-batch last counted has ``samples`` samples (and ``items`` items, as in
        `count`) after all (a framework that counts before it sees the batch: HF's Trainer,
        corrected by its forward)."""
        self._samples -= self._last
        self._items = self._items[:-1]
        self.count(samples, items)

    @property
    def pending(self) -> int:
        """Synchronised backwards seen since the last `end_step`."""
        return len(self._staged)

    def discard(self) -> None:
        """Forget the step so far (nothing is staged)."""
        with self._lock:
            self._staged, self._samples, self._last, self._items = [], 0, 0, []

    def end_step(self) -> bool:
        """The optimizer step: hand its observation to the sink.

        Returns:
            Whether one was staged (``False``: no synchronised backward, or more than one).

        Raises:
            ValueError: no samples counted for a step that synchronised its gradients.
        """
        with self._lock:
            staged, samples = self._staged, self._samples
            self._staged, self._samples, self._last, self._items = [], 0, 0, []
        if len(staged) != 1:
            if len(staged) > 1 and not self._warned:
                self._warned = True
                warnings.warn(
                    f"nnstat: DDP synchronised the gradients {len(staged)} times in one "
                    "optimizer step (gradient accumulation without no_sync()), so the hook saw "
                    "no purely local gradient: such steps are left out of the DDP noise scale. "
                    "Accumulate under ddp_model.no_sync(), or use the micro-batch noise scale "
                    "(warned once)",
                    RuntimeWarning,
                    stacklevel=2,
                )
            return False
        if samples < 1:
            raise ValueError(
                "DDPStepNorms.end_step: no samples counted for this step; call count(samples) "
                "before each micro-batch's forward"
            )
        self.sink(staged[0])  # its sizes came with the gradients, from every rank
        return True

    def close(self) -> None:
        """Stop feeding (the hook stays registered, DDP cannot remove it, and then only
        averages the gradients)."""
        if self.state.tracker is self:  # not re-pointed at a newer feed since
            self.state.detach()
        self.discard()


def _whole_model(world: int, buckets: int, v: list[float]) -> Any:
    # a step with non-finite norms never gets here: `StagedPairs.resolve` drops it
    # (`maths.finite_step`). v = (mean_r |G_r|^2, |G|^2, then buckets x mean_r of u_r, u_r^2,
    # u_r^2/b_r). Rank r's gradient is w_r g_r, w_r = u_r / mean(u) (u = 1: a mean loss; u = n_r
    # items: a summed loss over the global count), so E mean_r |w_r g_r|^2 = m |G|^2 + tr q with
    # m = mean(u^2)/mean(u)^2, q = mean(u^2/b)/mean(u)^2, and E |G|^2 = |G|^2 + tr q / R: the
    # local norm over m at B_small = m/q, B_big = R/q (u = 1: the harmonic mean H of the sizes
    # and R H, exact integers when the ranks' sizes are equal)
    mean_u, mean_u2, mean_q = v[2] / buckets, v[3] / buckets, v[4] / buckets
    m = mean_u2 / mean_u**2
    return [], [v[0] / m], v[1:2], integral(mean_u2 / mean_q), integral(world * mean_u**2 / mean_q)
