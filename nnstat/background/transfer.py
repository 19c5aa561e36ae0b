"""Results of device work on their way to the host: one non-blocking copy, awaited later.

`start_copy` flattens a list of device tensors into one float64 vector and starts ONE copy to
the host; on CUDA with ``non_blocking=True`` into a pinned buffer (`HostBuffers`, reused
across calls), followed by a CUDA event. `HostCopy.done` polls the event (``Event.query()``,
which never waits); `HostCopy.wait` blocks only when the caller has chosen to. What is queued on
the device meanwhile keeps running: the training step that follows is not held up by a read.

`LocalCopy` serves CPU and meta tensors (and accelerators without CUDA events): it copies at
once; its class flag ``LocalCopy.ready`` lets tests hold completion back, so deferred paths run
on CPU tensors in CI.

Example:
    >>> import torch
    >>> copy = start_copy([torch.tensor([[1.0, 2.0]]), torch.tensor([3])], HostBuffers(pin=True))
    >>> copy.done(), [t.tolist() for t in copy.wait()]
    (True, [[[1.0, 2.0]], [3.0]])
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import torch

__all__ = [
    "CudaCopy",
    "HostBuffers",
    "HostCopy",
    "LocalCopy",
    "copy_to_host",
    "host_empty",
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


def host_empty(
    n: int, dtype: torch.dtype | None = None, pin: bool = False, fallback: bool = False
) -> torch.Tensor:
    """A flat host buffer of `n` elements (`dtype`: torch's default); page-locked with `pin` (the target of a
    non-blocking copy from a CUDA device). `fallback`: pageable memory where pinning that much is
    refused (each copy into it then waits for the device).

    Example:
        >>> host_empty(3, torch.float64).shape
        torch.Size([3])
    """
    dtype = dtype or torch.get_default_dtype()
    if not pin:
        return torch.empty(n, dtype=dtype)
    try:
        return torch.empty(n, dtype=dtype, pin_memory=True)
    except RuntimeError:
        if not fallback:
            raise
        return torch.empty(n, dtype=dtype)


def copy_to_host(dst: torch.Tensor, src: torch.Tensor) -> Any:
    """Copy `src` into the host tensor `dst`: from a CUDA device without waiting (`dst` pinned)
    and return the CUDA event recorded after the copy (wait for it before reading `dst`);
    elsewhere at once, returning ``None``.

    Example:
        >>> dst = torch.empty(2); copy_to_host(dst, torch.ones(2)), dst.tolist()
        (None, [1.0, 1.0])
    """
    if src.device.type != "cuda":
        dst.copy_(src)
        return None
    # the device tensor may be freed right after: the caching allocator reuses its memory only
    # for work queued later on this stream, i.e. after the copy
    dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(src.device))
    return event


class HostBuffers:
    """Host staging buffers, reused: allocating pinned memory is slow and freeing it
    synchronises the device, and fresh multi-MB pageable buffers cost page faults.

    `take` hands out a flat buffer of at least `n` elements (the most recently returned one that
    fits, else a new one); `give` returns it, with the CUDA event after which the device no
    longer reads it (``None``: free now, as on CPU), and `take` waits for that event only when it
    hands the buffer out again. At most `keep` free buffers are kept (the oldest are let go).
    Thread-safe: one thread may give back what another takes.

    Args:
        pin: page-locked memory (the host end of non-blocking copies from a CUDA device).
        keep: free buffers kept at most (``None``: all).
        minimum: the smallest buffer allocated, in elements.
        alloc: makes a new flat buffer ``alloc(n, dtype)`` (default: `host_empty`).

    Example:
        >>> pool = HostBuffers(pin=False)
        >>> buf = pool.take(4, torch.float64); pool.give(buf)
        >>> pool.take(2, torch.float64) is buf, pool.owns(buf)
        (True, True)
    """

    def __init__(
        self,
        pin: bool,
        keep: int | None = None,
        minimum: int = 1,
        alloc: Callable[[int, torch.dtype], torch.Tensor] | None = None,
    ) -> None:
        self.pin, self._keep, self._minimum, self._alloc = pin, keep, minimum, alloc
        self._free: collections.deque[tuple[torch.Tensor, Any]] = collections.deque()
        self._mine: set[int] = set()  # data pointers of the buffers this pool made
        self._lock = threading.Lock()

    def take(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A flat buffer of at least `n` elements of `dtype` (its content is undefined)."""
        found = None
        with self._lock:
            for i in range(len(self._free) - 1, -1, -1):
                buf, event = self._free[i]
                if buf.dtype == dtype and buf.numel() >= n:
                    del self._free[i]
                    found = buf, event
                    break
        if found is None:
            n = max(n, self._minimum)
            if self._alloc is not None:
                buf = self._alloc(n, dtype)
            else:
                buf = host_empty(n, dtype, self.pin)
            self._mine.add(buf.data_ptr())
            return buf
        buf, event = found
        if event is not None and not event.query():
            event.synchronize()  # the device still reads it: the copy was queued just now
        return buf

    def give(self, buf: torch.Tensor, after: Any = None) -> None:
        """Take `buf` back (a view of it gives the whole buffer back), free once the CUDA event
        `after` has completed (``None``: now)."""
        base = buf._base if buf._base is not None else buf
        with self._lock:
            self._free.append((base, after))
            if self._keep is not None and len(self._free) > self._keep:
                self._mine.discard(self._free.popleft()[0].data_ptr())

    def owns(self, buf: torch.Tensor) -> bool:
        """Whether `buf` (or the buffer it views) was made by this pool."""
        base = buf._base if buf._base is not None else buf
        return base.data_ptr() in self._mine


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

    def __init__(self, parts: list[torch.Tensor], buffers: HostBuffers) -> None:
        super().__init__(parts)
        flat = flatten_parts(parts)
        self._n = flat.numel()
        self._buffers = buffers
        self._buf: torch.Tensor | None = buffers.take(self._n, torch.float64)
        self._event = copy_to_host(self._buf[: self._n], flat)

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


def start_copy(parts: list[torch.Tensor], buffers: HostBuffers) -> HostCopy:
    """Start moving `parts` (tensors on one device) to the host in one transfer.

    Pinned memory and an event on CUDA; elsewhere the copy is made at once (`LocalCopy`).
    """
    if parts and parts[0].device.type == "cuda":
        return CudaCopy(parts, buffers)
    return LocalCopy(parts)
