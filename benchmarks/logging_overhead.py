"""Logging overhead: projected per-sample gradients to disk vs a plain forward+backward, vs LogIX.

A ~10M-parameter MLP (1024-2048-2048-2048-10), 4096 samples, batch 128, rank 64 on every Linear
(LoGra: 64x64 per layer, 10x64 on the head). Each method runs the whole pass (including the
final flush to disk) ``--repeats`` rounds, interleaved; each method's time is divided by the
plain pass of the same round (the machine is shared, load drifts; rounds alternate the order
of the methods) and the median ratio is reported, for wall time and for the process's CPU time
(all threads; steadier than wall time on a loaded machine). LogIX uses ``add_lora()`` +
``setup({"grad": ["log"]})`` + ``save(True)`` as in its README.

    .venv/bin/python benchmarks/logging_overhead.py [--samples 4096] [--repeats 5] [--threads 1]
        [--no-logix] [--steady-malloc] [--staged] [--breakdown]

``--staged`` adds the nnstat pass with the accelerator branch forced on the CPU (every module's
rows projected into one staging buffer, copied to the host once per batch: what runs on a GPU).
The last column counts the training thread's host reads per batch (``item``/``bool``/``float``/
``tolist``/``cpu``/``numpy`` calls, one more pass of each method: each is a wait for the queue
on a GPU).

``--breakdown`` adds diagnostic variants of the nnstat pass: float16 rows, the same pass with
the shard files' write calls replaced by no-ops (everything else, fsyncs included, runs), and
with no writer at all (rows are assembled, then the buffer is handed straight back): the
differences split the overhead into computing the rows and writing them. It also times, in one
more pass, the training thread's share per batch: the projection GEMMs (with their small
bookkeeping), forming the rows there, and everything the Run and the capture engine do.

Prints a markdown table: seconds, ratio to the plain pass, page faults per pass, bytes written
per sample. Page faults: glibc returns freed multi-MB blocks (the parameter gradients every
step) to the OS or keeps them depending on the order of frees, so a pass takes 10k to 200k page
faults (0.05-0.4 s of kernel time on a VM) more or less at random, for every method.
``--steady-malloc`` re-runs the script with glibc's dynamic thresholds fixed
(``MALLOC_MMAP_THRESHOLD_=32 MiB``, ``MALLOC_TRIM_THRESHOLD_=1 GiB``: freed memory is kept), which
removes that noise and shows the steady state of every method.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

import nnstat


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(1024, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 10),
    )


def batches(n: int, bs: int):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 1024, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return [(list(range(i, min(i + bs, n))), x[i : i + bs], y[i : i + bs]) for i in range(0, n, bs)]


def plain(model, data, workdir):
    for _, x, y in data:
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        model.zero_grad(set_to_none=True)
    return 0


def nnstat_pass(param_grads: bool, dtype: str = "float32", io: str = "full", staged=False):
    def go(model, data, workdir):
        with _io_mode(io), _staged(staged):
            return run_pass(model, data, workdir)

    def run_pass(model, data, workdir):
        run = nnstat.init(project="bench", root_dir=workdir)
        nnstat.setup(
            {
                "log": "grad",
                "save": "grad",
                "statistic": "none",
                "param_grads": param_grads,
                "dtype": dtype,
            }
        )
        nnstat.watch(model)
        nnstat.add_projection(rank=64)
        for ids, x, y in data:
            with run(data_id=ids):
                nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
            model.zero_grad(set_to_none=True)
        nnstat.finalize()
        nnstat.unwatch()
        return _bytes(Path(workdir) / "bench" / "shards")

    return go


@contextlib.contextmanager
def _io_mode(io: str):
    """Diagnostics only: "nowrite" makes the shard files' write calls no-ops, "nowriter" hands
    every row buffer straight back instead of queueing it (patched for the pass, then undone)."""
    from nnstat.store import direct, writer

    saved = []

    def patch(obj, name, fn):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, fn)

    if io == "nowrite":
        # Linux shards always go through DirectShardFile (O_DIRECT or its buffered fallback)
        patch(direct.DirectShardFile, "_write", lambda self, data: None)
    elif io == "nowriter":

        def put(self, ids, rows, recycle=None, factors=None):
            if recycle is not None:
                self._release(recycle)

        patch(writer.StoreWriter, "put", put)
    try:
        yield
    finally:
        for obj, name, fn in reversed(saved):
            setattr(obj, name, fn)


@contextlib.contextmanager
def _staged(on: bool):
    """Force the accelerator branch of the Run's row assembly (``nnstat.run.rows``) on the CPU."""
    from nnstat.run import rows

    real = getattr(rows, "on_accelerator", None)
    if on and real is None:
        raise SystemExit("--staged: this nnstat has no accelerator branch (nnstat.run.rows)")
    if on:
        rows.on_accelerator = lambda device: True
    try:
        yield
    finally:
        if on:
            rows.on_accelerator = real


_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__")


def reads_per_batch(fn, data) -> str:
    """Host reads of tensor values per batch in the training thread, over one more pass: those
    of the batches after the first (the first also fingerprints the weights, once per pass)."""
    count = [0]
    marks: list[int] = []

    def marked():
        for batch in data:
            marks.append(count[0])
            yield batch
        marks.append(count[0])

    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def counted(name):
        def read(self, *args, **kwargs):
            if threading.current_thread() is threading.main_thread():
                count[0] += 1
            return saved[name](self, *args, **kwargs)

        return read

    workdir = tempfile.mkdtemp(prefix="nnstat_bench_")
    try:
        for name in _READS:
            setattr(torch.Tensor, name, counted(name))
        fn(make_model(), marked(), workdir)
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)
        shutil.rmtree(workdir, ignore_errors=True)
    return f"{(marks[-1] - marks[1]) / (len(marks) - 2):.2f}"


def timed_shares(data) -> dict[str, float]:
    """ms per batch the training thread spends in each part of the nnstat pass (one pass)."""
    from nnstat.capture import capture, engine
    from nnstat.run import core as _run_core
    from nnstat.store import outer

    spent: dict[str, float] = {}
    saved = []

    def timer(obj, name, label):
        fn = getattr(obj, name)
        saved.append((obj, name, fn))

        def timed(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return fn(*args, **kwargs)  # the writer's share is not the training thread's
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)

    timer(capture.ModuleCapture, "_projected_factors", "projection GEMMs")
    timer(outer, "fill", "forming rows in the training thread")
    timer(engine.CaptureEngine, "flush", "engine flush (includes the GEMMs)")
    timer(engine.CaptureEngine, "_on_forward", "forward hooks")
    timer(_run_core.Run, "_complete", "Run._complete (includes forming rows)")
    workdir = tempfile.mkdtemp(prefix="nnstat_bench_")
    try:
        nnstat_pass(True)(make_model(), data, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        for obj, name, fn in reversed(saved):
            setattr(obj, name, fn)
    return {k: v * 1e3 / len(data) for k, v in spent.items()}


def logix_pass(model, data, workdir):
    from logix import LogIX

    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        lx = LogIX(project="bench")
        lx.watch(model)
        lx.add_lora()
        lx.setup({"grad": ["log"]})
        lx.save(True)
        for ids, x, y in data:
            with lx(data_id=ids):
                nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
            model.zero_grad(set_to_none=True)
        lx.finalize()
    finally:
        os.chdir(cwd)
    return _bytes(Path(workdir) / "logix" / "bench", suffixes=(".mmap",))


def _bytes(root: Path, suffixes=(".npy",)) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.suffix in suffixes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-logix", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--steady-malloc", action="store_true", help="fix glibc's trim/mmap thresholds (see above)"
    )
    ap.add_argument("--breakdown", action="store_true", help="add the diagnostic variants")
    ap.add_argument(
        "--staged", action="store_true", help="add the accelerator branch, forced on the CPU"
    )
    args = ap.parse_args()
    if args.steady_malloc and "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        # glibc reads these once, at start-up: run the script again with them set
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(32 * 2**20))
        env["MALLOC_TRIM_THRESHOLD_"] = str(2**30)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    if args.threads:
        torch.set_num_threads(args.threads)
    data = batches(args.samples, args.batch)
    methods = {
        "plain fwd+bwd": plain,
        "nnstat (user grads untouched)": nnstat_pass(True),
        "nnstat (param_grads=False)": nnstat_pass(False),
    }
    if args.staged:
        methods["nnstat, device staging forced (CPU)"] = nnstat_pass(True, staged=True)
    if args.breakdown:
        methods["nnstat, float16 rows"] = nnstat_pass(True, dtype="float16")
        methods["nnstat, write calls as no-ops (diagnostic)"] = nnstat_pass(True, io="nowrite")
        methods["nnstat, no writer (diagnostic)"] = nnstat_pass(True, io="nowriter")
    logix_error = None
    if not args.no_logix:
        try:
            import logix  # noqa: F401

            methods["LogIX add_lora + save"] = logix_pass
        except Exception as e:  # reported in the output, not hidden
            logix_error = f"{type(e).__name__}: {e}"
    times: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    faults: dict[str, list[int]] = {name: [] for name in methods}
    nbytes: dict[str, int] = {}
    plain(make_model(), data[:2], None)  # warm-up
    for r in range(args.repeats):
        # ABBA order: a load drift within a round penalises every method equally over rounds
        order = list(methods.items())
        for name, fn in order if r % 2 == 0 else order[::-1]:
            if name not in methods:
                continue
            model = make_model()
            workdir = tempfile.mkdtemp(prefix="nnstat_bench_")
            try:
                f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                t0, c0 = time.perf_counter(), time.process_time()
                nbytes[name] = fn(model, data, workdir)
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            except Exception as e:
                if not name.startswith("LogIX"):
                    raise
                logix_error = f"{type(e).__name__}: {e}"
                del methods[name], times[name], cpu[name], faults[name]
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
    # the machine is shared: each method is compared with the plain pass of the same round
    # (adjacent in time), and the median over rounds is reported
    base = times["plain fwd+bwd"]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"{args.samples} samples, batch {args.batch}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, {args.repeats} rounds, load average {load:.1f}, "
        f"glibc thresholds {'fixed' if 'MALLOC_TRIM_THRESHOLD_' in os.environ else 'default'}\n"
    )
    reads = {
        name: reads_per_batch(fn, data[:8])
        for name, fn in methods.items()
        if not name.startswith("LogIX")
    }
    print(
        "| method | wall s (median) | wall ratio to plain | CPU s (median) | CPU ratio to plain "
        "| page faults (median) | bytes/sample | host reads/batch |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, ts in times.items():
        ratio = statistics.median(t / b for t, b in zip(ts, base, strict=True))
        cratio = statistics.median(
            c / b for c, b in zip(cpu[name], cpu["plain fwd+bwd"], strict=True)
        )
        per = nbytes.get(name, 0) / args.samples
        print(
            f"| {name} | {statistics.median(ts):.2f} | {ratio:.2f}x | "
            f"{statistics.median(cpu[name]):.2f} | {cratio:.2f}x | "
            f"{statistics.median(faults[name]):,.0f} | {per:,.0f} | {reads.get(name, 'n/a')} |"
        )
    if logix_error:
        print(f"\nLogIX could not run: {logix_error}")
    if args.breakdown:
        print("\ntraining thread, one more nnstat pass (ms per batch):")
        for label, ms in timed_shares(data).items():
            print(f"  {label}: {ms:.2f}")


if __name__ == "__main__":
    main()
