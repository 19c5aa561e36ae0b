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

``--factored 64:8,64:4`` compares instead stores of factored rows (``factors=c``: ``c`` pairs
``[c, r]`` per module of two ``r x r`` modules, random rows, random K-FAC factors) with the dense
store of ``--dense-rank``: bytes per row and nnstat's CPU scoring time, all pairs, per
preconditioner (``--preconditioners``; the fits are cached, so a pass is the queries'
preconditioning plus the scoring) and for a single query (the direct contraction), rows in the
page cache. ``--cold-rows N`` adds stores of ``N`` rows scored right after their shard files
were dropped from the page cache (``posix_fadvise(DONTNEED)``, no root needed), so the pass
reads them from the disk: rows/s and stored bytes read per second, dense and factored side by
side (``--dir``: a directory on a disk; tmpfs cannot be evicted).

    .venv/bin/python benchmarks/scoring_throughput.py --rows 4000 --queries 32 --repeat 3 \
        --factored 64:8,64:4 --cold-rows 40000 --dir .

``--factored-queries`` gives the factored stores queries stored as factors too (random rows of
the store's own layout, as queries logged into a factored store), which the preconditioners that
keep them factored (identity; K-FAC at damping 0) score by their factors
(`nnstat.influence.factored_scores.cheapest_route`); the dense store keeps dense queries. A
preconditioner ``kind@damping`` (``kfac@0``) sets its damping (default 0.1), ``kind/mode``
(``identity/relatif``) the scoring mode (default ``dot``).

    .venv/bin/python benchmarks/scoring_throughput.py --rows 8000 --queries 32 --repeat 5 \
        --factored 64:1,64:2,64:4 --factored-queries \
        --preconditioners identity,kfac,kfac@0,identity/relatif

``--rank-one-queries`` scores each factored store with dense queries of rank 1 per module (an
MLP's per-sample gradients, logged the usual way: dense), identity, all pairs: as nnstat scores
them (factored exactly on the query side, `nnstat.influence.lowrank_queries`: the factors route),
on the dense queries' route (the singular values never taken), and the same queries logged as
their factors (one pair: the factors route without the query side's SVD); and dense queries of
full rank (a sequence model's: the singular values taken, the dense route kept) against the
dense route alone.

    .venv/bin/python benchmarks/scoring_throughput.py --rows 40000 --queries 32 --repeat 5 \
        --factored 64:1,64:4 --rank-one-queries --threads 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from nnstat.influence import compute_influence_all
from nnstat.store import GradientLog, GradientStore, StoreWriter
from nnstat.store.factored import dense_layout


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


def _write_factored(root: Path, rows: int, r: int, c: int | None, gen) -> dict:
    """A store of two ``r x r`` modules, dense rows (``c`` None) or ``c`` factor pairs each, with
    K-FAC factors (random, symmetric positive definite) so that ``kfac``/``ekfac`` fit."""
    from safetensors.torch import save_file

    modules, offset = [], 0
    for name in ("fc1", "fc2"):
        w = r * r if c is None else c * 2 * r
        m = {"name": name, "kind": "linear", "offset": offset, "width": w, "r_out": r, "r_in": r}
        modules.append(m if c is None else {**m, "factors": c})
        offset += w
    meta = {"format_version": 1, "row_width": offset, "dtype": "float32", "modules": modules}
    root.mkdir(parents=True)
    (root / "meta.json").write_text(json.dumps(meta))
    writer = StoreWriter(root / "shards", row_width=offset, shard_rows=50_000)
    for start in range(0, rows, 8192):
        n = min(8192, rows - start)
        writer.put(list(range(start, start + n)), torch.randn(n, offset, generator=gen))
    writer.close()
    stats = {}
    for name in ("fc1", "fc2"):
        for side in ("forward", "backward"):
            a = torch.randn(r, 4 * r, generator=gen)
            stats[f"{name}/{side}/covariance"] = a @ a.T / (4 * r)
    save_file(stats, str(root / "statistics.safetensors"))
    return meta


def rank_one_main(args) -> None:
    """Each factored store of ``--factored`` against dense rank-1 queries (see the module's
    docstring): their exact factors, the dense route, the same queries stored as factors."""
    import nnstat.influence.lowrank_queries as lq

    gen = torch.Generator().manual_seed(0)
    methods, n_q = {}, args.queries
    kw = dict(preconditioner="identity", progress=False)

    def dense_route(log, store):
        share, lq.SVD_SHARE = lq.SVD_SHARE, 0.0  # the singular values never worth taking
        try:
            compute_influence_all(log, store, **kw)
        finally:
            lq.SVD_SHARE = share

    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for r, c in _configs(args)[1:]:
            name = _name(r, c)
            root = Path(d) / name.replace(" ", "_").replace(",", "")
            meta = _write_factored(root, args.rows, r, c, gen)
            store = GradientStore(root)
            u, v = torch.randn(n_q, 2, r, generator=gen), torch.randn(n_q, 2, r, generator=gen)
            dense = (u[..., :, None] * v[..., None, :]).reshape(n_q, -1)  # per module u vᵀ
            log = GradientLog(list(range(n_q)), dense, {**meta, **dense_layout(meta)})
            one = {**meta, "modules": [{**m, "factors": 1, "width": 2 * r, "offset": 2 * r * i}
                                       for i, m in enumerate(meta["modules"])]}  # fmt: skip
            pairs = torch.cat([u[:, 0], v[:, 0], u[:, 1], v[:, 1]], 1)
            factors = GradientLog(list(range(n_q)), pairs, {**one, "row_width": 4 * r})
            compute_influence_all(log, store, **kw)  # the page cache warmed
            methods[(name, "dense queries of rank 1 (nnstat: exact factors)")] = (
                lambda log=log, store=store: _timed(
                    lambda: compute_influence_all(log, store, **kw), CPU
                )
            )
            methods[(name, "the same, on the dense route")] = lambda log=log, store=store: _timed(
                lambda: dense_route(log, store), CPU
            )
            full = GradientLog(list(range(n_q)), torch.randn(n_q, 2 * r * r, generator=gen),
                               log.meta)  # fmt: skip
            methods[(name, "dense queries of full rank (a sequence model's)")] = (
                lambda log=full, store=store: _timed(
                    lambda: compute_influence_all(log, store, **kw), CPU
                )
            )
            methods[(name, "full rank, on the dense route")] = lambda log=full, store=store: _timed(
                lambda: dense_route(log, store), CPU
            )
            methods[(name, "the same queries stored as factors (c_q = 1)")] = (
                lambda log=factors, store=store: _timed(
                    lambda: compute_influence_all(log, store, **kw), CPU
                )
            )
        times = _rounds(methods, args.repeat)
    print(
        f"\n{args.rows} train rows, {n_q} dense queries of rank 1 per module, two r x r modules, "
        f"identity, all pairs, CPU, torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"{args.repeat} interleaved rounds (median)\n"
    )
    print("| store | queries | seconds | rows / s | dense route's time / this |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (name, method), ts in times.items():
        dense = (
            "full rank, on the dense route"
            if "full rank" in method
            else "the same, on the dense route"
        )
        base = np.array(times[(name, dense)])
        t = float(np.median(ts))
        ratio = float(np.median(base / np.array(ts)))
        print(f"| {name} | {method} | {t:.4f} | {args.rows / t:,.0f} | {ratio:.2f}x |", flush=True)


def _evict(root: Path) -> None:
    """Drop a store's shard files from the page cache (flushed first: only clean pages go), so
    the next pass reads them from the disk. No root needed."""
    for path in sorted((root / "shards").glob("*")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _stored_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "shards").glob("*.npy"))


def _configs(args) -> list[tuple[int, int | None]]:
    return [(args.dense_rank, None)] + [
        tuple(int(v) for v in p.split(":")) for p in args.factored.split(",") if p
    ]


def _name(r: int, c: int | None) -> str:
    return f"dense rank {r}" if c is None else f"factored rank {r}, c = {c}"


def _rounds(methods: dict, repeat: int) -> dict:
    """Interleaved rounds (a new seeded order each): every method sees the same load."""
    times = {k: [] for k in methods}
    for rnd in range(repeat):
        keys = list(methods)
        random.Random(rnd).shuffle(keys)
        for k in keys:
            times[k].append(methods[k]())
    return times


def factored_main(args) -> None:
    """Dense rank ``--dense-rank`` against each ``rank:c`` of ``--factored`` (see the module's
    docstring): rows in the page cache, then (``--cold-rows``) read from the disk."""
    gen = torch.Generator().manual_seed(0)
    kinds = [k for k in args.preconditioners.split(",") if k]
    methods, info = {}, {}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for r, c in _configs(args):
            name = _name(r, c)
            root = Path(d) / name.replace(" ", "_").replace(",", "")
            meta = _write_factored(root, args.rows, r, c, gen)
            store = GradientStore(root)
            dense_width = 2 * r * r
            q = torch.randn(args.queries, dense_width, generator=gen)
            log = GradientLog(list(range(args.queries)), q, {**meta, **dense_layout(meta)})
            if args.factored_queries and c is not None:  # the queries as factors, c pairs
                q = torch.randn(args.queries, meta["row_width"], generator=gen)
                log = GradientLog(list(range(args.queries)), q, meta)
            one = GradientLog([0], q[:1].clone(), log.meta)
            info[name] = meta["row_width"] * 4
            # raw fits a dense covariance per module: (r²)² entries, too large past rank 64
            for spec in [k for k in kinds if not k.startswith("raw") or r <= 64]:
                spec_kind, _, mode = spec.partition("/")
                kind, _, damping = spec_kind.partition("@")
                for label, queries in ((f"nnstat {spec}", log), (f"nnstat {spec}, 1 query", one)):
                    if queries is one and spec != "identity":
                        continue
                    kw = {"preconditioner": kind, "damping": float(damping or 0.1)}
                    kw.update(progress=False, mode=mode or "dot")
                    compute_influence_all(queries, store, **kw)  # the fit, cached

                    def score(queries=queries, store=store, kw=kw):
                        compute_influence_all(queries, store, **kw)

                    methods[(name, label)] = lambda f=score: _timed(f, CPU)
            if c is None:
                rows = torch.cat([torch.from_numpy(np.load(p)) for p in store.shards])
                methods[(name, "torch Q @ Tᵀ (rows in memory)")] = lambda q=q, rows=rows: _timed(
                    lambda: q @ rows.T, CPU
                )
        # one phase per method, the stores interleaved within it: the fits of one kind for every
        # store stay in nnstat's fit cache (8 entries, least recently used first out), as when a
        # user scores one store again and again; interleaving every kind of every store would
        # cycle more fits than that through it and time a refit on every pass
        times = {}
        for label in dict.fromkeys(method for _, method in methods):
            times.update(_rounds({k: f for k, f in methods.items() if k[1] == label}, args.repeat))
        times = {k: times[k] for k in methods}
        dense = _name(args.dense_rank, None)
        queries = "factored queries (c pairs)" if args.factored_queries else "dense queries"
        print(
            f"\n{args.rows} train rows, {args.queries} {queries}, two r x r modules, CPU, torch "
            f"{torch.__version__}, threads {torch.get_num_threads()}, {args.repeat} interleaved "
            "rounds (median), rows in the page cache\n"
        )
        print("| store | bytes per row | method | seconds | rows / s | dense rank's time / this |")
        print("| --- | ---: | --- | ---: | ---: | ---: |")
        for (name, method), ts in times.items():
            base = np.array(times.get((dense, method), ts))
            t = float(np.median(ts))
            ratio = float(np.median(base / np.array(ts)))
            fewer = info[dense] / info[name]
            print(
                f"| {name} | {info[name]:,} ({fewer:.1f}x fewer) | {method} | {t:.4f} | "
                f"{args.rows / t:,.0f} | {ratio:.2f}x |",
                flush=True,
            )
        if args.cold_rows:
            _cold(args, Path(d), gen)


def _cold(args, d: Path, gen) -> None:
    """Each store of ``--cold-rows`` rows scored (identity, all pairs) right after its files were
    dropped from the page cache, and again warm; interleaved rounds."""
    methods, info = {}, {}
    for r, c in _configs(args):
        if r > 64:  # the larger stores of equal storage: compute-bound, see the warm table
            continue
        name = _name(r, c)
        root = d / ("cold_" + name.replace(" ", "_").replace(",", ""))
        meta = _write_factored(root, args.cold_rows, r, c, gen)
        q = torch.randn(args.queries, 2 * r * r, generator=gen)
        log = GradientLog(list(range(args.queries)), q, {**meta, **dense_layout(meta)})
        info[name] = (meta["row_width"] * 4, _stored_bytes(root))

        def one_pass(root=root, log=log, evict=False):
            # a store opened for the pass and closed after it: pages a live memory map holds
            # cannot be dropped from the page cache, so no store object outlives its pass
            gc.collect()
            if evict:
                _evict(root)
            t0 = time.perf_counter()
            compute_influence_all(
                log, GradientStore(root), preconditioner="identity", progress=False
            )
            return time.perf_counter() - t0

        one_pass()
        methods[(name, "cold")] = lambda f=one_pass: f(evict=True)
        methods[(name, "warm")] = one_pass
    times = _rounds(methods, args.repeat)
    dense = _name(args.dense_rank, None)
    print(
        f"\n{args.cold_rows} train rows, {args.queries} queries, identity, all pairs; cold: the "
        f"store's files dropped from the page cache before each pass ({args.repeat} interleaved "
        "rounds, median)\n"
    )
    print(
        "| store | bytes per row | read | seconds | rows / s | stored MB read / s "
        "| dense rank's time / this |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for (name, how), ts in times.items():
        t = float(np.median(ts))
        per_row, total = info[name]
        ratio = float(np.median(np.array(times[(dense, how)]) / np.array(ts)))
        print(
            f"| {name} | {per_row:,} | {how} | {t:.3f} | {args.cold_rows / t:,.0f} | "
            f"{total / t / 1e6:,.0f} | {ratio:.2f}x |",
            flush=True,
        )


CPU = torch.device("cpu")


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
    ap.add_argument("--factored", default="", help="rank:c pairs: factored stores (see above)")
    ap.add_argument("--dense-rank", type=int, default=64, help="the dense store --factored beats")
    ap.add_argument(
        "--preconditioners",
        default="identity,raw,kfac,ekfac",
        help="with --factored; kind@damping sets the damping (default 0.1), kind/mode the mode",
    )
    ap.add_argument(
        "--factored-queries",
        action="store_true",
        help="with --factored: the factored stores' queries stored as factors too",
    )
    ap.add_argument(
        "--rank-one-queries",
        action="store_true",
        help="with --factored: dense queries of rank 1 against the factored stores (see above)",
    )
    ap.add_argument(
        "--cold-rows", type=int, default=0, help="with --factored: stores scored cold (see above)"
    )
    ap.add_argument("--dir", default=None, help="where the stores are written (a disk, not tmpfs)")
    ap.add_argument("--threads", type=int, default=0, help="torch's CPU threads (0: its default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.factored and args.rank_one_queries:
        rank_one_main(args)
        return
    if args.factored:
        factored_main(args)
        return
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
