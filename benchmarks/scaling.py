"""Cost growth: how logging, scoring and Tracker time (and bytes) grow with the work.

Five sweeps, each fitted with a log-log least-squares line ``cost = c * x^k`` (k is printed):

* logging (projected per-sample gradients to a store, rank 16 per layer) vs number of samples;
* logging vs hidden width (fixed samples); the overhead over a plain forward+backward is fitted
  separately from the total;
* influence scoring (``compute_influence_all``, identity preconditioner, from the store) vs
  stored rows, and vs number of queries;
* ``Tracker.step()`` (default statistics: weight, grad, Adam states, update) vs parameter count.

Expected: bytes exactly linear in samples; logging and scoring time linear in rows and queries
(k ~ 1 once fixed costs are amortised). Times are CPU seconds of the process (all threads, best
of ``--repeats``), one intra-op thread by default, so other jobs on a shared machine distort
them far less than wall time. Prints markdown tables; ``--quick`` shrinks the sweeps.

    .venv/bin/python benchmarks/scaling.py            # 1k -> 64k samples, ~10 minutes on 2 cores
    .venv/bin/python benchmarks/scaling.py --quick    # 1k -> 8k, ~1 minute
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

import nnstat
from nnstat.influence import compute_influence_all
from nnstat.store import GradientLog, GradientStore, StoreWriter

RANK = 16


def fit_exponent(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(k, c)`` of the least-squares line ``log y = k log x + log c``."""
    k, logc = np.polyfit(np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float)), 1)
    return float(k), float(np.exp(logc))


def clock() -> float:
    """CPU seconds of this process (all threads): robust to other jobs on a shared machine."""
    return time.process_time()


def best_of(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def mlp(width: int, d_in: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(d_in, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


def _data(n: int, d_in: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, d_in, generator=g), torch.randint(0, 10, (n,), generator=g)


def log_pass(model: nn.Module, n: int, batch: int, workdir: str | None) -> int:
    """Time-free body: log `n` samples (or a plain pass when `workdir` is None); bytes written."""
    x, y = _data(n)
    loss = nn.functional.cross_entropy
    if workdir is None:
        for i in range(0, n, batch):
            loss(model(x[i : i + batch]), y[i : i + batch], reduction="sum").backward()
            model.zero_grad(set_to_none=True)
        return 0
    run = nnstat.init(project="scale", root_dir=workdir)
    nnstat.setup({"statistic": "none", "shard_rows": 16384})
    nnstat.watch(model)
    nnstat.add_projection(rank=RANK)
    for i in range(0, n, batch):
        with run(data_id=list(range(i, min(i + batch, n)))):
            loss(model(x[i : i + batch]), y[i : i + batch], reduction="sum").backward()
        model.zero_grad(set_to_none=True)
    nnstat.finalize()
    nnstat.unwatch()
    shards = Path(workdir) / "scale" / "shards"
    return sum(p.stat().st_size for p in shards.iterdir())


def timed_log(width: int, n: int, batch: int, repeats: int) -> tuple[float, float, int]:
    """``(plain CPU seconds, logging CPU seconds, bytes)``, best of `repeats` each."""
    plain = best_of(lambda: log_pass(mlp(width), n, batch, None), repeats)
    nbytes, times = 0, []
    for _ in range(repeats):
        d = tempfile.mkdtemp(prefix="nnstat_scale_")
        try:
            t0 = clock()
            nbytes = log_pass(mlp(width), n, batch, d)
            times.append(clock() - t0)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return plain, min(times), nbytes


def write_store(root: Path, rows: int, width: int) -> dict:
    half = width // 2
    modules = [
        {"name": "a", "kind": "linear", "offset": 0, "width": half, "r_out": 8, "r_in": half // 8},
        {"name": "b", "kind": "linear", "offset": half, "width": width - half, "r_out": 8},
    ]
    modules[1]["r_in"] = (width - half) // 8
    meta = {"format_version": 1, "row_width": width, "dtype": "float32", "modules": modules}
    (root / "meta.json").write_text(json.dumps(meta))
    writer = StoreWriter(root / "shards", row_width=width, shard_rows=16384)
    gen = torch.Generator().manual_seed(0)
    for start in range(0, rows, 8192):
        k = min(8192, rows - start)
        writer.put(list(range(start, start + k)), torch.randn(k, width, generator=gen))
    writer.close()
    return meta


def score_time(root: Path, meta: dict, queries: int, repeats: int) -> float:
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(queries, meta["row_width"], generator=gen)
    log = GradientLog(list(range(queries)), q, meta)
    store = GradientStore(root)

    def go() -> None:
        compute_influence_all(log, store, preconditioner="identity", progress=False)

    go()  # page cache warm, as for a store that is scored repeatedly
    return best_of(go, repeats)


def tracker_time(width: int, repeats: int) -> tuple[int, float]:
    model = mlp(width, d_in=width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tracker = nnstat.Tracker(model, opt)
    x, y = torch.randn(8, width), torch.randint(0, 10, (8,))
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    tracker.step()  # warm-up (allocates the workspace)
    n_params = sum(p.numel() for p in model.parameters())
    return n_params, best_of(tracker.step, repeats)


def table(title: str, header: Sequence[str], rows: list[Sequence[object]], fits: dict) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(" ---:" for _ in header) + " |")
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")
    print("\nfitted exponents: " + ", ".join(f"{k} ~ x^{v[0]:.2f}" for k, v in fits.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sweeps (about a minute)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quick, rep = args.quick, args.repeats
    samples = [1024 * 2**i for i in range(4 if quick else 7)]  # 1k .. 8k or 64k
    widths = [64, 128, 256, 512] if quick else [64, 128, 256, 512, 1024]
    rows_sweep = [8192 * 2**i for i in range(3 if quick else 5)]  # 8k .. 32k or 128k
    query_sweep = [8, 32, 128] if quick else [8, 16, 32, 64, 128, 256, 512]
    track_widths = [64, 256, 1024] if quick else [64, 128, 256, 512, 1024, 2048]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load average {load:.1f}, best of {rep}, CPU seconds of the process (time.process_time)"
    )

    res = [(n, *timed_log(128, n, 256, rep)) for n in samples]
    fits = {
        "logging CPU seconds": fit_exponent(samples, [r[2] for r in res]),
        "overhead CPU seconds": fit_exponent(samples, [max(r[2] - r[1], 1e-9) for r in res]),
        "bytes": fit_exponent(samples, [r[3] for r in res]),
    }
    table(
        "Logging vs samples (MLP 64-128-128-10, rank 16, batch 256)",
        ["samples", "plain CPU s", "logging CPU s", "overhead CPU s", "bytes", "bytes/sample"],
        [
            (n, f"{p:.3f}", f"{t:.3f}", f"{t - p:.3f}", f"{b:,}", f"{b / n:.0f}")
            for n, p, t, b in res
        ],
        fits,
    )

    n_w = 2048 if quick else 8192
    res = [(w, *timed_log(w, n_w, 256, rep)) for w in widths]
    fits = {
        "logging CPU seconds": fit_exponent(widths, [r[2] for r in res]),
        "overhead CPU seconds": fit_exponent(widths, [max(r[2] - r[1], 1e-9) for r in res]),
        "plain CPU seconds": fit_exponent(widths, [r[1] for r in res]),
    }
    table(
        f"Logging vs hidden width ({n_w} samples, rank 16 per layer)",
        ["width", "plain CPU s", "logging CPU s", "overhead CPU s", "bytes/sample"],
        [(w, f"{p:.3f}", f"{t:.3f}", f"{t - p:.3f}", f"{b / n_w:.0f}") for w, p, t, b in res],
        fits,
    )

    width, q_fixed, rows_fixed = 512, 32, rows_sweep[-1]
    with tempfile.TemporaryDirectory() as d:
        out = []
        for rows in rows_sweep:
            root = Path(d) / f"r{rows}"
            root.mkdir()
            meta = write_store(root, rows, width)
            out.append((rows, score_time(root, meta, q_fixed, rep)))
        table(
            f"Scoring vs stored rows ({width} columns, {q_fixed} queries, all pairs)",
            ["rows", "CPU seconds", "rows/s"],
            [(r, f"{t:.3f}", f"{r / t:,.0f}") for r, t in out],
            {"seconds": fit_exponent(*zip(*out, strict=True))},
        )
        root = Path(d) / f"r{rows_fixed}"
        meta = json.loads((root / "meta.json").read_text())
        out = [(q, score_time(root, meta, q, rep)) for q in query_sweep]
        table(
            f"Scoring vs queries ({rows_fixed} rows x {width} columns, all pairs)",
            ["queries", "CPU seconds", "query x row pairs/s"],
            [(q, f"{t:.3f}", f"{q * rows_fixed / t:,.0f}") for q, t in out],
            {"seconds": fit_exponent(*zip(*out, strict=True))},
        )

    out = [tracker_time(w, rep * 3) for w in track_widths]
    table(
        "Tracker.step() vs parameter count (MLP, Adam, default stats, 4 groups)",
        ["parameters", "CPU seconds", "parameters/s"],
        [(f"{n:,}", f"{t:.4f}", f"{n / t:,.0f}") for n, t in out],
        {"seconds": fit_exponent(*zip(*out, strict=True))},
    )
    print(f"\nbest-of-{rep} CPU times; exponents from log-log least squares")


if __name__ == "__main__":
    main()
