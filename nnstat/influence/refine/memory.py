"""How much memory refinement may use and what it uses: the default budget
(`available_memory`) and the peak of a computation (`measure_peak`), measured without a
profiler and without printing anything.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: the default budget: this fraction of the free device memory (CUDA) or of the available RAM
DEFAULT_FRACTION = {"cuda": 0.8, "cpu": 0.5}
GiB = 2**30


def size(n: float) -> str:
    """``n`` bytes for a message.

    Example:
        >>> size(3 * 2**30), size(1536)
        ('3.00 GiB', '1.50 KiB')
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def available_memory(device: torch.device | str) -> int:
    """The default ``memory`` budget on ``device``: `DEFAULT_FRACTION` of its free memory
    (CUDA: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` of ``/proc/meminfo``, else the
    physical memory).

    Example:
        >>> available_memory("cpu") > 0
        True
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(DEFAULT_FRACTION["cuda"] * free)
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        try:
            free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            free = 8 * GiB
    return int(DEFAULT_FRACTION["cpu"] * free)


class Allocations(TorchDispatchMode):
    """Bytes of the CPU storages the operations under it allocate, live (``now``) and at most
    (``peak``): each new storage counted once (views share it) until it is freed. A dispatch
    mode, below autograd and ``torch.func``: it sees the graph's saved tensors and the
    transforms' own, and neither starts a profiler nor prints."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.peak = 0
        self.live: dict[int, int] = {}

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            try:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
            except RuntimeError:  # a wrapper without storage of its own (its data is seen)
                continue
            if nbytes == 0 or key in self.live:
                continue
            self.live[key] = nbytes
            self.now += nbytes
            self.peak = max(self.peak, self.now)
            weakref.finalize(storage, self._free, key)  # storages keep their Python object
        return out


def measure_peak(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int | None]:
    """``(fn(), peak bytes)``: the most ``fn`` had allocated on ``device`` at once beyond what
    was allocated when it started (CUDA: the caching allocator's statistics, whose peak this
    resets; CPU: the storages its operations allocate, `Allocations`). ``None`` for another
    device.

    Args:
        fn: the computation.
        device: where its allocations are measured.

    Returns:
        ``(fn(), peak bytes or None)``.

    Example:
        >>> _, peak = measure_peak(lambda: torch.ones(1000, 1000).sum(), torch.device("cpu"))
        >>> peak >= 4_000_000
        True
    """
    if device.type == "cuda":
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        return out, torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        return fn(), None
    with Allocations() as counter:
        out = fn()
    return out, counter.peak
