"""A host-read ledger for tests: counts the calls that copy a tensor's values to the host.

``bool``/``float``/``int``/``item``/``tolist``/``numpy``/``cpu`` are recorded on CPU tensors,
where they still run; on a GPU each would wait for the queue to drain.
"""

from __future__ import annotations

import contextlib

import torch

_READS = ("__bool__", "__float__", "__int__", "item", "tolist", "numpy", "cpu")


@contextlib.contextmanager
def host_reads(counter: list[str]):
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def counting(name):
        def read(self, *args, **kwargs):
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
