"""Host-read ledgers for tests: count the calls that copy a tensor's values to the host.

``host_reads``: ``bool``/``float``/``int``/``item``/``tolist``/``numpy``/``cpu`` are recorded on
CPU tensors, where they still run; on a GPU each would wait for the queue to drain.
:class:`DeviceLedger`: the same at the aten level, for code run on the ``meta`` device.
:class:`Kernels`: the aten ops that launch work on the device, by name.
"""

from __future__ import annotations

import collections
import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_READS = ("__bool__", "__float__", "__int__", "item", "tolist", "numpy", "cpu")


@contextlib.contextmanager
def host_reads(counter: list[str], this_thread: bool = False):
    """Append to ``counter`` the name of every read; ``this_thread``: only the calling
    thread's (not a background writer's, which reads host copies off the training thread)."""
    originals = {name: getattr(torch.Tensor, name) for name in _READS}
    me = threading.get_ident()

    def counting(name):
        def read(self, *args, **kwargs):
            if not this_thread or threading.get_ident() == me:
                counter.append(name)
            return originals[name](self, *args, **kwargs)

        return read

    try:
        for name in _READS:
            setattr(torch.Tensor, name, counting(name))
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


_SYNC_OPS = {
    "aten::nonzero": "nonzero",
    "aten::masked_select": "masked_select",
    "aten::_unique": "unique",
    "aten::_unique2": "unique",
    "aten::unique_dim": "unique",
    "aten::unique_consecutive": "unique",
    # CUDA's bincount reads its input's maximum back even with a minlength
    "aten::bincount": "bincount",
}


class DeviceLedger(TorchDispatchMode):
    """Counts, per aten op, what would stall an accelerator's queue; for the ``meta`` device,
    which takes the accelerator branches of the code on a machine without one.

    ``reads``: values copied to the host (``item``/``bool``/``float``, ``.cpu()``/``.tolist()``,
    a copy into a CPU tensor); those of ``meta`` tensors are answered with ones (True) instead
    of failing. ``to_host``: copies from a device into an existing CPU tensor (``copy_``), with
    ``non_blocking`` recorded. ``to_device``: host tensors copied to a device (each a wait on
    the queue unless pinned). ``sync_ops``: ops whose output size depends on the data
    (``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing) or that read the device
    back (``bincount``). Ops of other threads are not seen (dispatch modes are per thread).
    """

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.to_host: list[bool] = []  # non_blocking of each copy
        self.to_device = 0
        self.sync_ops: list[str] = []

    def counts(self) -> tuple[int, int, int, int]:
        """``(reads, copies to the host, copies to the device, sync-prone ops)`` so far."""
        return self.reads, len(self.to_host), self.to_device, len(self.sync_ops)

    def since(self, before: tuple[int, int, int, int]) -> tuple[int, ...]:
        """:meth:`counts` added since ``before`` (an earlier :meth:`counts`)."""
        return tuple(a - b for a, b in zip(self.counts(), before, strict=True))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        sync = _SYNC_OPS.get(name)
        if name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
        ):
            sync = "boolean-mask index"
        src = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if sync is not None:
            self.sync_ops.append(sync)
            if src is not None and src.device.type == "meta":
                # meta cannot size the output: say what ran instead of failing inside torch
                raise AssertionError(f"a sync-prone op ran on the device: {sync}")
        if name == "aten::_local_scalar_dense":
            self.reads += 1
            if src.device.type == "meta":
                return True if src.dtype == torch.bool else 1
        elif name == "aten::_to_copy" and src is not None:
            target = torch.device(kwargs.get("device") or src.device)
            if src.device.type != "cpu" and target.type == "cpu":
                self.reads += 1
                if src.device.type == "meta":
                    return torch.ones(src.shape, dtype=kwargs.get("dtype") or src.dtype)
            elif src.device.type == "cpu" and target.type != "cpu":
                self.to_device += 1
        elif name == "aten::copy_":
            dst, source = args[0], args[1]
            if dst.device.type == "cpu" and source.device.type != "cpu":
                self.to_host.append(bool(args[2]) if len(args) > 2 else False)
                if source.device.type == "meta":
                    return dst.fill_(1)  # answered with ones, like a read (flags: True)
            elif dst.device.type != "cpu" and source.device.type == "cpu" and source.dim():
                self.to_device += 1
        return func(*args, **kwargs)


#: ops that launch no kernel (views, metadata, allocation)
NO_KERNEL = {
    "aten::detach", "aten::view", "aten::_unsafe_view", "aten::alias", "aten::t",
    "aten::expand", "aten::as_strided", "aten::slice", "aten::select", "aten::unsqueeze",
    "aten::squeeze", "aten::reshape", "aten::_reshape_alias", "aten::permute",
    "aten::transpose", "aten::split", "aten::split_with_sizes", "aten::unbind", "aten::empty",
    "aten::empty_like", "aten::empty_strided", "aten::lift_fresh",
}  # fmt: skip


class Kernels(TorchDispatchMode):
    """Counts the aten ops that launch work on the device (``ops``: by schema name)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name not in NO_KERNEL:
            self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class LargestTensor(Kernels):
    """`Kernels`, and the largest tensor any op makes (``largest``, bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def device_branch_staging(monkeypatch, on: bool = True) -> list[tuple[int, torch.dtype]]:
    """Scoring's device branch switched ``on`` (run on the CPU, as a GPU would take it); returns
    the list each host staging buffer the reader takes (what is copied to the device) is added
    to, as ``(bytes, dtype)``."""
    from nnstat.background.transfer import HostBuffers
    from nnstat.influence import pipeline, score

    staged: list[tuple[int, torch.dtype]] = []

    class Counting(HostBuffers):
        def take(self, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            staged.append((n * torch.empty(0, dtype=dtype).element_size(), dtype))
            return super().take(n, dtype)

    monkeypatch.setattr(score, "_device_branch", lambda device: on)
    monkeypatch.setattr(pipeline, "HostBuffers", Counting)
    return staged
