"""Results of device work on their way to the host: one non-blocking copy, awaited later.

`start_copy` flattens a list of device tensors into one float64 vector and starts ONE copy to
the host; on CUDA with ``non_blocking=True`` into a pinned buffer (`PinnedBuffers`, reused
across calls), followed by a CUDA event. `HostCopy.done` polls the event (``Event.query()``,
which never waits); `HostCopy.wait` blocks only when the caller has chosen to. What is queued on
the device meanwhile keeps running: the training step that follows is not held up by a read.

`LocalCopy` serves CPU and meta tensors (and accelerators without CUDA events): it copies at
once; its class flag ``LocalCopy.ready`` lets tests hold completion back, so deferred paths run
on CPU tensors in CI.

Example:
    >>> import torch
    >>> copy = start_copy([torch.tensor([[1.0, 2.0]]), torch.tensor([3])], PinnedBuffers())
    >>> copy.done(), [t.tolist() for t in copy.wait()]
    (True, [[[1.0, 2.0]], [3.0]])
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch

__all__ = [
    "CudaCopy",
    "HostCopy",
    "LocalCopy",
    "PinnedBuffers",
    "flatten_parts",
    "split_parts",
    "start_copy",
]


def flatten_parts(parts: list[torch.Tensor]) -> torch.Tensor:
    """`parts` (tensors on one device) as one float64 vector on that device.

    Example:
        >>> flatten_parts([torch.ones(2, 1), torch.tensor([2])]).tolist()
        [1.0, 1.0, 2.0]
    """
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t.reshape(-1).to(torch.float64) for t in parts])


def split_parts(flat: torch.Tensor, shapes: list[torch.Size]) -> list[torch.Tensor]:
    """Views of `flat` (from `flatten_parts`) with the parts' shapes.

    Example:
        >>> [t.tolist() for t in split_parts(torch.arange(3.0), [torch.Size([2, 1]), torch.Size([1])])]
        [[[0.0], [1.0]], [2.0]]
    """
    out, start = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[start : start + n].view(shape))
        start += n
    return out


class PinnedBuffers:
    """Page-locked float64 host buffers, reused across steps (a buffer returns once its copy
    has been read; allocating pinned memory is slow and freeing it synchronises the device)."""

    def __init__(self) -> None:
        self._free: list[torch.Tensor] = []

    def take(self, n: int) -> torch.Tensor:
        """A free buffer of at least `n` elements (a new one if none fits)."""
        for i, buf in enumerate(self._free):
            if buf.numel() >= n:
                return self._free.pop(i)
        return torch.empty(max(n, 256), dtype=torch.float64, pin_memory=True)

    def give(self, buf: torch.Tensor) -> None:
        self._free.append(buf)


class HostCopy:
    """One step's staged tables on their way to the host, in ONE transfer.

    `done` says (without waiting) whether they have arrived; `wait` returns them as float64
    host tensors of the parts' shapes, waiting if needed.
    """

    def __init__(self, parts: list[torch.Tensor]) -> None:
        self._shapes = [t.shape for t in parts]
        self._host: list[torch.Tensor] | None = None

    def done(self) -> bool:
        raise NotImplementedError

    def wait(self) -> list[torch.Tensor]:
        raise NotImplementedError


class LocalCopy(HostCopy):
    """CPU and meta tensors (and accelerators without CUDA events): copied at once.

    Meta tensors hold no values: such a copy never completes, and `wait` raises.
    """

    #: what `wait` raises for meta tensors
    META = (
        "a model on the meta device has no values to deliver: build it on a real device to "
        "log its statistics (on meta, count operations only)"
    )

    #: Tests set this False to hold completion back (the deferred path on CPU tensors).
    ready: ClassVar[bool] = True

    def __init__(self, parts: list[torch.Tensor]) -> None:
        super().__init__(parts)
        flat = flatten_parts(parts)
        self.meta = flat.is_meta
        if not self.meta and flat.device.type != "cpu":
            flat = torch.empty(flat.shape, dtype=flat.dtype).copy_(flat)  # blocking
        self._flat = flat

    def done(self) -> bool:
        return LocalCopy.ready and not self.meta

    def wait(self) -> list[torch.Tensor]:
        if self.meta:
            raise RuntimeError(self.META)
        return split_parts(self._flat, self._shapes)


class CudaCopy(HostCopy):
    """A non-blocking copy into pinned memory, and the CUDA event recorded after it."""

    def __init__(self, parts: list[torch.Tensor], buffers: PinnedBuffers) -> None:
        super().__init__(parts)
        flat = flatten_parts(parts)
        self._n = flat.numel()
        self._buffers = buffers
        self._buf: torch.Tensor | None = buffers.take(self._n)
        # the device vector may be freed right after: the caching allocator reuses its memory
        # only for work queued later on this stream, i.e. after the copy
        self._buf[: self._n].copy_(flat, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(flat.device))

    def done(self) -> bool:
        return self._buf is None or self._event.query()

    def wait(self) -> list[torch.Tensor]:
        if self._buf is not None:
            if not self._event.query():  # arrived copies (the usual case) wait for nothing
                self._event.synchronize()
            # copied off the pinned buffer, which the next steps reuse (KBs: microseconds)
            self._host = split_parts(self._buf[: self._n].clone(), self._shapes)
            self._buffers.give(self._buf)
            self._buf = None
        assert self._host is not None
        return self._host


def start_copy(parts: list[torch.Tensor], buffers: PinnedBuffers) -> HostCopy:
    """Start moving `parts` (tensors on one device) to the host in one transfer.

    Pinned memory and an event on CUDA; elsewhere the copy is made at once (`LocalCopy`).
    """
    if parts and parts[0].device.type == "cuda":
        return CudaCopy(parts, buffers)
    return LocalCopy(parts)
