"""Cost of the logging pass's weights check at a block boundary (one on-device checksum of every
parameter and buffer per dtype group: `nnstat.run.weights.BlockGuard`) next to the block's own
work, and of the Tracker's norm check of the weights at a background ``step()``.

Run: ``python benchmarks/weights_check.py [--width 1536] [--batch 32] [--repeat 5]``
(CPU; the default model has ~10M parameters).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch import nn

import nnstat
from nnstat.run.weights import BlockGuard, enclosing
from nnstat.tracker.worker import NormCheck


def _best(fn, repeat: int) -> float:
    """The fastest of ``repeat`` runs, in ms."""
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    w = a.width
    model = nn.Sequential(
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, 10),
    )
    n = sum(p.numel() for p in model.parameters())
    x, y = torch.randn(a.batch, w), torch.randint(0, 10, (a.batch,))
    guard = BlockGuard()
    guard.record(model)

    def boundary() -> None:  # the block's end (record) and the next block's start (check)
        guard.record(model)
        guard.check(model)

    check = _best(boundary, a.repeat)
    run = nnstat.init(project="w", root_dir=tempfile.mkdtemp())
    nnstat.setup({"statistic": "none", "rank": 16})
    nnstat.watch(model)
    ids = iter(range(10**9))

    def block() -> None:
        with run(data_id=[next(ids) for _ in range(a.batch)]):
            nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        model.zero_grad()

    block()
    logged = _best(block, a.repeat)
    nnstat.finalize()
    nnstat.unwatch()
    parents = _best(lambda: enclosing(model[2]), a.repeat)
    norms = _best(lambda: NormCheck([(k, p) for k, p in model.named_parameters()]), a.repeat)
    print(f"{n / 1e6:.1f}M parameters, batch {a.batch}, {torch.get_num_threads()} threads")
    print(f"block boundary check (record + check): {check:.2f} ms")
    print(f"logged block (forward, backward, rows, boundary check): {logged:.2f} ms")
    print(f"check / block: {check / logged:.1%}")
    print(f"enclosing modules of a submodule (once per pass): {parents:.2f} ms")
    print(f"Tracker background step: weight norms at step(): {norms:.2f} ms")


if __name__ == "__main__":
    main()
