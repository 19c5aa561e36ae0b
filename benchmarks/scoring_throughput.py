"""Scoring throughput: training rows scored per second by `nnstat.influence` vs a plain matmul.

Writes a gradient store of random rows (``--rows`` x ``--width``, float32, sharded), then scores a
query log against it with `compute_influence_all` (all pairs and top-k, identity and raw
preconditioners: the preconditioner touches the queries only) and compares with one torch
``Q @ T.T`` of the same shapes on the scoring device with the rows already there (the device's
own matmul rate), measured in the same run; on the CPU also numpy's, on a GPU also the copy of
the rows from pinned memory followed by the product (the bus's bound: a store crosses it once).
Prints a markdown table, one line per configuration, with achieved GFLOP/s (``2 · queries · rows ·
width`` per call).

    .venv/bin/python benchmarks/scoring_throughput.py --rows 200000 --width 512 --queries 64
    .venv/bin/python benchmarks/scoring_throughput.py --device cuda   # < 1 min on an H100
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


def _timed(fn, device: torch.device, inner: int = 1) -> float:
    """Seconds per call of ``fn`` (``inner`` calls, the device drained before and after)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / inner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--queries", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=None, help="default: nnstat's own")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument(
        "--device", default="cpu", help="where the queries are, so where nnstat scores (cuda)"
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    flops = 2.0 * args.queries * args.rows * args.width  # one Q @ T.T
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        meta = _write_store(root, args.rows, args.width, shard_rows=50_000)
        gen = torch.Generator().manual_seed(1)
        q = torch.randn(args.queries, args.width, generator=gen)
        log = GradientLog(list(range(args.queries)), q.to(device), meta)
        train = np.concatenate([np.load(p) for p in sorted((root / "shards").glob("*.npy"))])
        qn = q.numpy()
        # the same product in plain torch on the scoring device, the rows already there: the
        # device's own matmul rate for this shape (the ceiling scoring is measured against)
        q_dev, t_dev = q.to(device), torch.from_numpy(train).to(device)
        inner = 20 if device.type == "cuda" else 1
        # the store is opened once, as a log dataloader holds it; the page cache is warmed and the
        # preconditioner fitted once (fits are cached across calls, keyed by store and damping)
        store = GradientStore(root)
        for kind in ("identity", "raw"):
            compute_influence_all(log, store, preconditioner=kind, damping=0.1, progress=False)
        matmul_label = f"torch `Q @ T.T` on {device.type} (rows already there)"
        methods = {matmul_label: lambda: _timed(lambda: q_dev @ t_dev.T, device, inner)}
        if device.type == "cpu":
            methods["numpy `Q @ T.T` (arrays in memory)"] = lambda: _timed(
                lambda: qn @ train.T, device
            )
        else:
            pinned = torch.from_numpy(train).pin_memory()

            def copy_and_matmul():
                return q_dev @ pinned.to(device, non_blocking=True).T

            # the host-to-device bound: every row crosses the bus once, as when scoring a store
            methods["torch pinned rows -> device, then `Q @ T.T`"] = lambda: _timed(
                copy_and_matmul, device
            )
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

            label = f"nnstat {kind}, {'top-10' if top_k else 'all pairs'} (from the store)"
            # results come back on the host: the call's time includes the device's work
            methods[label] = lambda score=score: _timed(score, device)
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
                times[label].append(methods[label]())
    base = np.array(times[matmul_label])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"\n{args.rows} train rows x {args.width} columns, {args.queries} queries, {name}, torch "
        f"{torch.__version__}, threads {torch.get_num_threads()}, {args.repeat} interleaved "
        "rounds (median)\n"
    )
    print("| method | seconds | train rows / s | GFLOP/s | vs torch matmul |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, ts in times.items():
        ts = np.array(ts)
        ratio = float(np.median(base / ts))
        t = float(np.median(ts))
        print(
            f"| {label} | {t:.4f} | {args.rows / t:,.0f} | {flops / t / 1e9:,.1f} | {ratio:.1%} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
