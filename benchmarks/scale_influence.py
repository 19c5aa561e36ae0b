"""Influence scoring at GPT-2-small scale: seconds and peak extra memory per preconditioner.

Logs ``--n`` (default 256) training sequences and ``--queries`` (32) query sequences of a randomly
initialised ``GPT2LMHeadModel(GPT2Config(n_layer=...))`` (nothing is downloaded) with the plain
``nnstat.watch`` / ``run(...)`` workflow, rank-64 projection of every supported module, then scores
the queries against the store with every preconditioner, each in a fresh process so that its peak
resident memory is its own, and prints a markdown table.

``--statistics kfac`` (the default) first runs a K-FAC statistics pass over the first
``--stat-samples`` training sequences (the ``kfac``/``ekfac`` preconditioners need it). Every
supported module is logged, ``lm_head`` included (its 50257-wide output factor is kept in its
projected space), from the stock model call (``transformer.wpe`` sees ``[1, T]`` position ids).
``--statistics none`` scores ``identity`` and ``raw`` (the default without statistics) only.

    .venv/bin/python benchmarks/scale_influence.py --threads 2            # full size
    .venv/bin/python benchmarks/scale_influence.py --quick                # 2 layers, 32 samples
    # refinement on the CPU (GGN, block CG, raw preconditioner; plan and peak in the row)
    .venv/bin/python benchmarks/scale_influence.py --n-layer 2 --n 16 --queries 4 --seq 32 \
        --batch 4 --statistics none --refine-steps 5 --refine-batch 4 --kinds refined \
        --store /tmp/nnstat_refine2
    # on a GPU: everything on --device (logging, products, solves), TF32 matmuls
    python3 benchmarks/scale_influence.py --device cuda --n 1024 --queries 32 --seq 128 \
        --statistics none --refine-steps 5 --refine-batch 32 --kinds refined

``--refine-memory GIB`` gives refinement its memory budget (default: its own, a fraction of the
free memory); ``--refine-plan-only`` measures and prints the plan (``result.meta``'s estimate)
without solving, e.g. for a size the machine cannot run.

The store is kept in ``--store`` and reused when its ``bench.json`` matches the options
(logging GPT-2 small costs ~4 s per sequence on 2 shared cores; scoring is what is measured).
``--synthetic-rows M`` scores against a copy of the logged training store (same meta.json,
projections and statistics) holding ``M`` Gaussian rows with the logged rows' column scales:
scoring cost depends on the shapes only, so this measures an ``M``-row store without logging
``M`` sequences (the table says when it was used).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

SEQ_VOCAB = 50257


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _reset_peak() -> None:
    """Reset the kernel's resident high-water mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _model(n_layer: int, seed: int = 0, device: str = "cpu"):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(n_layer=n_layer)).eval().to(device)


def _peak(device: str, base: float) -> float:
    """Peak extra memory (MiB): the process's resident high-water mark on the CPU, the caching
    allocator's peak on a GPU."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return _peak_mb() - base


def _tokens(n: int, seq: int, seed: int):
    import torch

    return torch.randint(0, SEQ_VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed))


def _batch_loss(model, x):
    """Sum over sequences of each sequence's mean next-token loss (the store's per-sample loss)."""
    import torch

    # stock call: transformer.wpe sees [1, T] position ids, expanded per sample by the engine
    logits = model(input_ids=x).logits[:, :-1]
    per_token = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
    )
    return per_token.reshape(x.shape[0], -1).mean(1).sum()


def _log(args: argparse.Namespace, root: Path) -> dict:
    """Write the training store and the query store under ``root``; returns their timings."""
    import nnstat

    model = _model(args.n_layer, device=args.device)
    train, query = _tokens(args.n, args.seq, 1), _tokens(args.queries, args.seq, 2)
    train, query = train.to(args.device), query.to(args.device)
    timings = {}
    for project, data in (("train", train), ("queries", query)):
        run = nnstat.init(project=project, root_dir=str(root), overwrite=True)
        nnstat.setup({"log": "grad", "save": [], "statistic": "none", "rank": args.rank})
        # every supported module: lm_head's 50257-wide output factor is kept in its projected
        # (rank x rank) space, wte's input factor as its diagonal of token counts
        names = nnstat.watch(model)
        nnstat.add_projection(rank=args.rank)  # seeded: both stores get the same projection
        start = time.perf_counter()
        if project == "train" and args.statistics == "kfac":
            nnstat.setup({"statistic": "kfac"})
            for lo in range(0, args.stat_samples, args.batch):
                with run(data_id=list(range(lo, min(lo + args.batch, args.stat_samples)))):
                    _batch_loss(model, data[lo : lo + args.batch]).backward()
                model.zero_grad()
            nnstat.finalize()
        timings[f"{project}_statistics_s"] = time.perf_counter() - start
        nnstat.setup({"save": "grad", "statistic": "none"})
        start = time.perf_counter()
        for lo in range(0, len(data), args.batch):
            with run(data_id=list(range(lo, min(lo + args.batch, len(data))))):
                _batch_loss(model, data[lo : lo + args.batch]).backward()
            model.zero_grad()
            print(f"{project}: {min(lo + args.batch, len(data))}/{len(data)}", flush=True)
        nnstat.finalize()
        nnstat.unwatch()
        timings[f"{project}_log_s"] = time.perf_counter() - start
        timings["modules"] = len(names)
    return timings


def _synthesize(root: Path, rows: int) -> Path:
    """``root/train_synthetic``: the training store's files with ``rows`` Gaussian rows whose
    column scales are those of the logged rows."""
    import shutil

    import numpy as np
    import torch

    from nnstat.store import GradientStore, StoreWriter

    src, dst = root / "train", root / "train_synthetic"
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir()
    for name in ("meta.json", "projections.safetensors", "statistics.safetensors"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    real = np.concatenate([r for _, r in GradientStore(src).iter_blocks(4096)])
    scale = torch.from_numpy(real.std(0) + 1e-12)
    writer = StoreWriter(dst / "shards", row_width=real.shape[1], shard_rows=4096)
    gen = torch.Generator().manual_seed(0)
    for lo in range(0, rows, 64):
        n = min(64, rows - lo)
        writer.put(list(range(lo, lo + n)), torch.randn(n, real.shape[1], generator=gen) * scale)
    writer.close()
    return dst


def _score_one(args: argparse.Namespace, root: Path, kind: str) -> dict:
    """Score the queries with ``kind`` in this process; seconds and peak extra RSS."""
    import torch

    from nnstat.influence import compute_influence_all

    torch.set_num_threads(args.threads)
    train, query = root / "train", root / "queries"
    if args.synthetic_rows:
        train = root / "train_synthetic"
    _reset_peak()
    base = _rss_mb()
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True  # the products' matmuls
        torch.cuda.reset_peak_memory_stats()
    start, cpu = time.perf_counter(), time.process_time()
    if kind == "refined":
        res = _refined(args, train, query)
        if res is None:  # --refine-plan-only
            return {"kind": kind, "plan_only": True}
    else:
        res = compute_influence_all(
            str(query),
            str(train),
            preconditioner=None if kind == "default" else kind,
            progress=False,
        )
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    scores = res.scores
    out = {
        "kind": kind,
        "used": res.meta.get("preconditioner"),
        "seconds": seconds,
        "cpu_seconds": cpu,
        "peak_extra_mb": _peak(args.device, base),
        "shape": list(scores.shape),
        "finite": bool(torch.isfinite(scores).all()),
        "scores_head": scores[0, :4].tolist(),
    }
    if "refine" in res.meta:
        info = res.meta["refine"]
        plan = info["memory"]
        out["refine"] = {k: info[k] for k in ("products", "passes", "solver", "seconds")}
        out["refine"].update(
            {k: plan[k] for k in ("estimate", "budget", "block", "chunk", "directions", "parts")}
        )
        out["refine"]["device"] = info["device"]
    return out


def _refined(args: argparse.Namespace, train: Path, query: Path):
    from nnstat.influence import Refinement, compute_influence_all, refinement_plan

    model = _model(args.n_layer, device=args.device)
    data = _tokens(args.n, args.seq, 1)  # on the CPU: refinement moves each batch to the model
    batches = [data[lo : lo + args.batch] for lo in range(0, args.n, args.batch)]
    refine = Refinement(
        model,
        None,
        batches,
        batch_loss=lambda x: _batch_loss(model, x),
        steps=args.refine_steps,
        curvature="ggn",
        loss_reduction="sum",
        preconditioner="raw",
        query_batch=args.refine_batch,
        memory=int(args.refine_memory * 2**30) if args.refine_memory else None,
        progress=False,
    )
    if args.refine_plan_only:
        plan = refinement_plan(refine, str(query), str(train))
        print("PLAN " + json.dumps(plan.meta()), flush=True)
        return None
    res = compute_influence_all(str(query), str(train), refine=refine, progress=False)
    print("PLAN " + json.dumps(res.meta["refine"]["memory"]), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n", type=int, default=256, help="training sequences")
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--statistics", choices=("kfac", "none"), default="kfac")
    ap.add_argument("--stat-samples", type=int, default=64)
    ap.add_argument("--kinds", default=None, help="comma list (default: all that apply)")
    ap.add_argument("--refine-steps", type=int, default=0, help="0: refinement not run")
    ap.add_argument("--refine-batch", type=int, default=1, help="queries solved together")
    ap.add_argument("--refine-memory", type=float, default=0, help="GiB (0: the default)")
    ap.add_argument("--refine-plan-only", action="store_true", help="print the plan, no solve")
    ap.add_argument("--device", default="cpu", help="cpu or cuda: model, logging and products")
    ap.add_argument("--store", default="/tmp/nnstat_scale_influence")
    ap.add_argument("--synthetic-rows", type=int, default=0, help="see the module docstring")
    ap.add_argument("--quick", action="store_true", help="2 layers, 32 sequences, 8 queries")
    ap.add_argument("--score-one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.n_layer, args.n, args.queries, args.stat_samples = 2, 32, 8, 16
        args.seq = min(args.seq, 64)
    import torch

    torch.set_num_threads(args.threads)
    root = Path(args.store)
    if args.score_one:
        print("RESULT " + json.dumps(_score_one(args, root, args.score_one)), flush=True)
        return
    keys = ("n_layer", "n", "queries", "seq", "rank", "batch", "statistics", "stat_samples")
    want = {k: getattr(args, k) for k in keys}
    stamp = root / "bench.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("options") == want:
        timings = json.loads(stamp.read_text())["timings"]
        print(f"reusing the stores in {root}")
    else:
        timings = _log(args, root)
        stamp.write_text(json.dumps({"options": want, "timings": timings}))
    print(json.dumps(timings))
    if args.synthetic_rows:
        _synthesize(root, args.synthetic_rows)
    kinds = ["identity", "default", "raw"]
    if args.statistics == "kfac":
        kinds += ["kfac", "ekfac"]
    if args.refine_steps:
        kinds.append("refined")
    if args.kinds:
        kinds = args.kinds.split(",")
    rows = []
    for kind in kinds:
        cmd = [sys.executable, __file__, "--score-one", kind, "--store", str(root)]
        cmd += [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in keys if k != "statistics"]
        cmd += [f"--statistics={args.statistics}", f"--threads={args.threads}"]
        cmd += [f"--refine-steps={args.refine_steps}", f"--refine-batch={args.refine_batch}"]
        cmd += [f"--refine-memory={args.refine_memory}", f"--device={args.device}"]
        cmd += ["--refine-plan-only"] if args.refine_plan_only else []
        cmd += [f"--synthetic-rows={args.synthetic_rows}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        for plan in (x for x in proc.stdout.splitlines() if x.startswith("PLAN ")):
            print(plan, flush=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            err = (proc.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"kind": kind, "error": err})
        else:
            rows.append(json.loads(line[0][7:]))
        print(json.dumps(rows[-1]), flush=True)
    print()
    print("| preconditioner | used | seconds (wall) | CPU seconds | peak extra RSS (MiB) |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['kind']} | failed: {r['error'][:100]} | | | |")
        elif not r.get("plan_only"):
            print(
                f"| {r['kind']} | {r['used']} | {r['seconds']:.1f} | {r['cpu_seconds']:.1f} "
                f"| {r['peak_extra_mb']:.0f} |"
            )


if __name__ == "__main__":
    main()
