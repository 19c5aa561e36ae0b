"""Noise scale for free under DDP: local gradient (per-rank batch) vs all-reduced gradient.

A communication hook replaces DDP's default all-reduce: it appends the squared norm of the
rank's local gradient bucket to the bucket and averages both in the same collective, so every
rank gets ``mean_r |G_r|^2`` (``B_small`` = per-rank batch) and ``|G|^2`` of the averaged
gradient (``B_big`` = global batch) with no extra communication round and no read back: the
norms are staged on the device for the tracker's one non-blocking copy.
"""

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nnstat.distributed import is_distributed
from nnstat.gradient_noise.microbatch import StagedPairs


class StagedUpdates(Protocol):
    """What the hook feeds: `nnstat.NoiseScale.add_staged` (squared norms at two batch sizes,
    still on the device)."""

    def add_staged(self, staged: StagedPairs) -> None: ...


@dataclass
class DDPNoiseScaleState:
    """State of :func:`noise_scale_comm_hook`; set ``local_batch_size`` if it changes.

    ``local_batch_size`` is the number of samples per rank behind the synchronised gradient, and
    the loss must be their mean (DDP averages gradients across ranks). The buckets' squared
    norms are summed on the device and staged at the last bucket: the hook reads nothing back.
    """

    tracker: StagedUpdates
    local_batch_size: int
    process_group: Any = None
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
            staged, self._sums = self._sums, None
            self._done, self._total = 0, None
        world = dist.get_world_size(self.process_group)
        b = self.local_batch_size
        self.tracker.add_staged(StagedPairs(staged, lambda v: ([], v[:1], v[1:], b, b * world)))


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
    # Half-precision buckets are reduced in float32 so the appended squared norm keeps its range.
    comm_dtype = buf.dtype if buf.dtype in (torch.float32, torch.float64) else torch.float32
    packed = torch.empty(buf.numel() + 1, dtype=comm_dtype, device=buf.device)
    packed[:-1].copy_(buf.reshape(-1))
    packed[-1] = buf.detach().double().pow(2).sum()
    packed.div_(world)
    if bucket.is_last():
        with state._lock:
            state._total = bucket.index() + 1
    fut = dist.all_reduce(packed, group=group, async_op=True).get_future()

    def finish(f: torch.futures.Future[Any]) -> torch.Tensor:
        reduced = f.value()[0]
        grads = reduced[:-1]
        # (mean_r |G_r|^2, |G|^2) of this bucket, left on the device
        state._bucket_done(torch.stack([reduced[-1].double(), grads.double().pow(2).sum()]))
        return grads.to(buf.dtype).reshape(buf.shape)

    return fut.then(finish)


def register_noise_scale_hook(
    ddp_model: Any, tracker: StagedUpdates, local_batch_size: int, process_group: Any = None
) -> DDPNoiseScaleState:
    """Register :func:`noise_scale_comm_hook` on a ``DistributedDataParallel`` model."""
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
    state = DDPNoiseScaleState(tracker, int(local_batch_size), process_group)
    ddp_model.register_comm_hook(state, noise_scale_comm_hook)
    return state
