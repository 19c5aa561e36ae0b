"""Scoring throughput: training rows scored per second by `nnstat.influence` vs a bare numpy matmul.

Writes a gradient store of random rows (``--rows`` x ``--width``, float32, sharded), then scores a
query log against it with `compute_influence_all` (all pairs and top-k, identity and raw
preconditioners: the preconditioner touches the queries only) and compares with one numpy
``Q @ T.T`` of the same shapes on arrays already in memory. Prints a markdown table.

    .venv/bin/python benchmarks/scoring_throughput.py --rows 200000 --width 512 --queries 64
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nnstat.influence import compute_influence_all
from nnstat.store import GradientLog, GradientStore, StoreWriter


def _write_store(root: Path, rows: int, width: int, shard_rows: int) -> dict:
    modules, offset, r = [], 0, int(np.sqrt(width // 2))
    for name in ("fc1", "fc2"):
        w = r * r if name == "fc1" else width - r * r
        modules.append(
            {
                "name": name,
                "kind": "linear",
                "offset": offset,
                "width": w,
                "r_out": r,
                "r_in": w // r,
            }
        )
        offset += w
    meta = {"format_version": 1, "row_width": width, "dtype": "float32", "modules": modules}
    (root / "meta.json").write_text(json.dumps(meta))
    writer = StoreWriter(root / "shards", row_width=width, shard_rows=shard_rows)
    gen = torch.Generator().manual_seed(0)
    for start in range(0, rows, 8192):
        n = min(8192, rows - start)
        writer.put(list(range(start, start + n)), torch.randn(n, width, generator=gen))
    writer.close()
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=None, help="default: nnstat's own")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        meta = _write_store(root, args.rows, args.width, shard_rows=50_000)
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(args.queries, args.width, generator=gen)
        log = GradientLog(list(range(args.queries)), q, meta)
        train = np.concatenate([np.load(p) for p in sorted((root / "shards").glob("*.npy"))])
        qn = q.numpy()
        # the store is opened once, as a log dataloader holds it; the page cache is warmed and the
        # preconditioner fitted once (fits are cached across calls, keyed by store and damping)
        store = GradientStore(root)
        for kind in ("identity", "raw"):
            compute_influence_all(log, store, preconditioner=kind, damping=0.1, progress=False)
        numpy_label = "numpy `Q @ T.T` (arrays in memory)"
        methods = {numpy_label: lambda: qn @ train.T}
        for kind, top_k in (("identity", None), ("raw", None), ("identity", 10), ("raw", 10)):

            def score(kind=kind, top_k=top_k):
                compute_influence_all(
                    log,
                    store,
                    preconditioner=kind,
                    damping=0.1,
                    top_k=top_k,
                    batch_size=args.batch_size,
                    progress=False,
                )

            methods[f"nnstat {kind}, {'top-10' if top_k else 'all pairs'} (from the store)"] = score
        # interleaved rounds: on a shared machine every method sees the same load; the ratio is
        # taken within each round and its median reported
        times: dict[str, list[float]] = {label: [] for label in methods}
        for r in range(args.repeat):
            # a new order every round (seeded): whichever method runs right after numpy pays for
            # re-faulting the memory numpy's freed result returned to the OS, so that cost moves
            # around the methods instead of always landing on the same one
            labels = list(methods)
            random.Random(r).shuffle(labels)
            for label in labels:
                fn = methods[label]
                t0 = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t0)
    base = np.array(times[numpy_label])
    print(
        f"\n{args.rows} train rows x {args.width} columns, {args.queries} queries, torch threads "
        f"{torch.get_num_threads()}, {args.repeat} interleaved rounds (median)\n"
    )
    print("| method | seconds | train rows / s | throughput vs numpy |")
    print("| --- | ---: | ---: | ---: |")
    for label, ts in times.items():
        ts = np.array(ts)
        ratio = float(np.median(base / ts))
        t = float(np.median(ts))
        print(f"| {label} | {t:.3f} | {args.rows / t:,.0f} | {ratio:.0%} |")


if __name__ == "__main__":
    main()
