"""One prepared check of nnstat on a CUDA machine: tests, step costs and scoring, one table.

Run it on a machine with a GPU and no network, from the repository root, in one call, with
nnstat INSTALLED (a wheel: the source tree lacks the ``nnstat.integrations`` mapping that
installing makes) and the peers' wheels carried (``../shared/tools/gpu_wheels.sh`` fetches them):

    # here: python -m pip wheel -q --no-deps -w .whl .
    python3 benchmarks/gpu_check.py --wheels .whl --out "$OUT"      # [--budget 480]

``--wheels DIR`` installs every ``DIR/*.whl`` (no network, no dependencies) into ``DIR/site``
and puts it first on every part's ``PYTHONPATH``. The whole check fits ``--budget`` (480 s by
default, the install included): the caps below sum to 390 s, which leaves 90 s for one more
part. Each part runs in its own process group with its own cap (a part that runs out of time is
killed with its children and reported; the next still runs); time an earlier part leaves unused
goes to the later ones. ``gpu_check.md`` (the summary table and every part's tables) and
``gpu_check.log`` (every part's full output) are written under ``--out`` after each part, so a
call cut short still returns what finished:

1. ``cuda`` (55 s): ``tests/test_cuda.py`` (the step paths' synchronisation counts are checked
   inside those tests with ``torch.cuda.set_sync_debug_mode``), the statistics kernels' tests
   (``tests/describe``: the fused Triton row kernels compiled for the device), scoring and
   refinement on the device: every test file that uses the GPU (``CUDA_FILES``), one pytest
   process per file;
2. ``syncs`` (35 s): a training step with a default and one with an all-statistics +
   histograms ``Tracker.step()``, a ``NoiseScale`` step and the backward of a logged batch on
   GPT-2 small under ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call in
   them fails the part, and the frame of nnstat that made it is printed;
3. ``profile`` (40 s): where a Tracker step's time goes (host ms of ``step()``/``flush()``, the
   device ms of its kernels beside the training step's, its top kernels), then the same for a
   logged batch (rank 64, every module) beside the plain pass;
4. ``stats`` (45 s), ``logging`` (45 s), ``hf`` (30 s): ``benchmarks/scale.py --device cuda``
   on GPT-2 small (batch 8 x 512, AdamW), with wandb.watch side by side when importable
   (skipped with a note otherwise); logging measures every module (``--loggers
   every-module``: the like-for-like rows against LogIX are ``scale.py --parts logging``);
5. ``noise`` (25 s): the streaming ``NoiseScale`` (per-sample; micro-batch over 2 accumulated
   micro-batches) and ``describe_layers()`` on GPT-2 small, ms
   per step next to a plain step measured in the same process;
6. ``scoring`` (20 s): ``benchmarks/scoring_throughput.py --device cuda`` (100,000 rows;
   throughput against the device's own matmul rate);
7. ``refine`` (35 s): ``benchmarks/scale_influence.py --device cuda --refine-steps 5`` (GPT-2
   small, time, peak memory, products);
8. ``suite`` (60 s, or what the budget has left): every other test file (CPU only), in
   parallel pytest processes with one torch thread each (``benchmarks/_suite_shards.py``: no
   pytest-xdist needed), last, since it only needs to pass. Each process logs one line per
   test as it ends (``--out/suite-logs``), so a suite cut at its cap still names its failures
   and the files that did not finish; the slowest tests are listed under ``## suite``.

``--parts`` picks a subset (comma list); ``--quick`` shrinks every part (a smoke run;
``NNSTAT_GPU_CHECK_DEVICE=cpu`` runs it on the CPU). Without CUDA the script says so and exits
2. Not a test: CI has no GPU (tests/test_gpu_check.py checks the plan and the suite's runner).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
# a dry run of the inline parts on the CPU checks this script where no GPU is (sizes --quick)
DEV = os.environ.get("NNSTAT_GPU_CHECK_DEVICE", "cuda")
# -P: the installed nnstat, not the source tree in the working directory (which lacks the
# nnstat.integrations mapping that installing makes)
PYTEST = [PY, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def sync_debug(mode: str) -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.set_sync_debug_mode(mode)


@dataclass
class Part:
    """One step of the check: a command, its time cap (s) and what to keep of its output."""

    name: str
    argv: list[str]
    cap: float
    keep: Callable[[str], str] = field(default=lambda out: "")


@dataclass
class Outcome:
    name: str
    status: str
    seconds: float
    summary: str
    tables: str


def tables_of(out: str) -> str:
    """The markdown tables and headings of a part's output (what goes into the docs)."""
    keep = [ln for ln in out.splitlines() if ln.startswith(("|", "#", "GPT-2", "device"))]
    return "\n".join(keep)


# the test files the `cuda` part runs (the suite leaves them out when both run)
CUDA_FILES = [
    "tests/test_cuda.py",
    # the fused row kernels compiled for the GPU (on CI they run interpreted)
    "tests/describe/test_triton_rows.py",
    "tests/describe/test_segments.py",
    "tests/influence/test_scoring_device.py",
    "tests/influence/test_refine_device.py",
    # a factored store scored on the device: the copy carries the stored bytes
    "tests/store/test_store_factored.py",
    # a 16-bit store scored on the device: the copy carries 2 bytes a value, widened there
    "tests/influence/test_stored_dtype_device.py",
]
# seconds for the whole check (the caps of `parts` sum to at most this: one device call with
# time to run it again)
BUDGET = 480.0


def parts(args: argparse.Namespace) -> list[Part]:
    """The parts, in order, with their caps (seconds; they sum to at most `BUDGET`)."""
    q = args.quick
    scale = [PY, "benchmarks/scale.py", "--device", DEV, "--layers", "2" if q else "12"]
    scale += ["--batch", "8", "--seq", "128" if q else "512", "--rounds", "1" if q else "2"]
    # blocks of 8 steps: the block's closing flush (once per run in training) is amortised
    scale += ["--steps", "1" if q else "8"]
    quick = ["--quick"] if q else []
    # the ~1B Llama's stages, then its scoring target: 64 queries against 100,000 factored rows,
    # timed against the host-to-device copy bound of their bytes
    attribution = ["--n", "16", "--queries", "64", "--refine-steps", "1"]
    attribution += ["--score-rows", "100000"]
    return [
        # the installed nnstat: the callbacks' test imports nnstat.integrations
        Part("cuda", ["suite", *CUDA_FILES], 55),
        Part("syncs", [PY, __file__, "--inline", "syncs"] + quick, 35),
        # a Tracker step's and a logged batch's device time, one process (one CUDA start-up)
        Part("profile", [PY, __file__, "--inline", "profile"] + quick, 40),
        Part("stats", scale + ["--parts", "stats"], 45),
        # the row the targets need; the like-for-like rows: scale.py --parts logging
        Part("logging", scale + ["--parts", "logging", "--loggers", "every-module"], 45),
        Part("hf", scale + ["--parts", "hf"], 30),
        Part("noise", [PY, __file__, "--inline", "noise"] + quick, 25),
        Part(
            "scoring",
            [PY, "benchmarks/scoring_throughput.py", "--device", DEV]
            + (
                ["--rows", "20000", "--repeat", "2"] if q else ["--rows", "100000", "--repeat", "3"]
            ),
            20,
        ),
        Part(
            "refine",
            [PY, "benchmarks/scale_influence.py", "--device", DEV, "--refine-steps", "5"]
            + (["--quick"] if q else ["--n", "512", "--queries", "16", "--seq", "128"]),
            35,
        ),
        Part(
            # the ~1B Llama: log with EK-FAC (and LogIX), score, refine; GPT-2's 12-layer
            # refinement row is the `refine` part's
            "attribution",
            [PY, "benchmarks/attribution_scale.py", "--device", DEV]
            + (["--quick"] if q else attribution),
            90,
        ),
        # last: it only needs to pass, and it may use what the budget has left
        Part("suite", ["suite"], 60),
    ]


def cores() -> int:
    """Parallel pytest processes: the cores less two (the GPU parts' own processes)."""
    return max(2, min(14, (os.cpu_count() or 4) - 2))


def run_suite(part: Part, cap: float, log, out: Path, skip: set[str]) -> tuple[str, str, str]:
    """A test part through `_suite_shards` (parallel pytest processes, no xdist needed):
    the part's listed files, or every test file but `skip`. Returns (status, summary, the
    table of the slowest tests)."""
    from _suite_shards import run, test_files

    files = part.argv[1:] or test_files(ROOT, exclude=skip)
    workers = min(cores(), len(files))

    def progress(line: str) -> None:
        log.write(line + "\n")
        log.flush()

    pytest = PYTEST + ["--durations=8"]  # each shard's slowest: where the next cut comes from
    res = run(pytest, files, workers, cap, out / f"{part.name}-logs", ROOT, progress)
    status = "ok" if res.ok() else "FAILED"
    if res.unfinished:
        status = f"TIMEOUT after {cap:.0f} s"
    slow = [f"| {what} | {sec:.1f} |" for sec, what in res.slowest[:12]]
    table = "\n".join([f"### slowest tests ({workers} processes)", "", "| test | s |"])
    return status, res.summary(), "\n".join([table, "| --- | ---: |", *slow]) if slow else ""


def run_part(
    part: Part, cap: float, log, folder: Path, skip: frozenset[str] = frozenset()
) -> Outcome:
    if cap < 15:
        return Outcome(part.name, "skipped (no time left)", 0.0, "", "")
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", WANDB_SILENT="true")
    t0 = time.perf_counter()
    log.write(f"\n\n===== {part.name}: {' '.join(part.argv)} (cap {cap:.0f} s)\n")
    log.flush()
    if part.argv[0] == "suite":
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
        status, summary, slowest = run_suite(part, cap, log, folder, set(skip))
        return Outcome(part.name, status, time.perf_counter() - t0, summary, slowest)
    # its own process group: a part cut at its cap takes its children with it (scale.py
    # runs each logger in a child that would otherwise keep the GPU busy for the next part)
    proc = subprocess.Popen(
        part.argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=cap)
        status = "ok" if proc.returncode == 0 else "FAILED"
        if proc.returncode not in (0, 1):
            status = f"FAILED (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        status = f"TIMEOUT after {cap:.0f} s"
    seconds = time.perf_counter() - t0
    log.write(out)
    log.flush()
    summary = part.keep(out) or _last_error(out, status)
    return Outcome(part.name, status, seconds, summary, tables_of(out))


def _last_error(out: str, status: str) -> str:
    if status == "ok":
        return ""
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    errs = [ln for ln in lines if re.match(r"^\w*(Error|Exception)\b", ln)]
    return (errs or lines or ["(no output)"])[-1][:300]


def write_report(path: Path, header: str, outcomes: list[Outcome]) -> None:
    lines = [header, "", "| part | status | seconds | summary |", "| --- | --- | ---: | --- |"]
    for o in outcomes:
        summary = o.summary.replace("|", "/").replace("\n", " ")
        lines.append(f"| {o.name} | {o.status} | {o.seconds:.0f} | {summary} |")
    for o in outcomes:
        if o.tables:
            lines += ["", f"## {o.name}", "", o.tables]
    path.write_text("\n".join(lines) + "\n")


def device_header() -> str:
    import torch

    if DEV != "cuda":
        return f"# nnstat GPU check: dry run on {DEV}, torch {torch.__version__}"
    p = torch.cuda.get_device_properties(0)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return (
        f"# nnstat GPU check: {p.name} ({p.total_memory / 2**30:.0f} GiB, "
        f"{p.multi_processor_count} SMs), torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"{os.cpu_count()} CPU cores, commit {commit or '?'}, {time.strftime('%Y-%m-%d %H:%M')}"
    )


# ---- inline parts (run in their own process through --inline) ----


def _gpt2(layers: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=layers)).to(DEV)


def _lm_step(model, opt, x) -> None:
    opt.zero_grad(set_to_none=True)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()


def _logging_run(model, root: str):
    """A logging run under `root` of every supported module's rank-64 projected gradients (the
    logging workload of the GPU tables in docs/benchmarks.md)."""
    import nnstat

    run = nnstat.init(project="gpu_check", root_dir=root)
    nnstat.setup({"log": "grad", "save": "grad", "loss_reduction": "mean"})
    nnstat.watch(model)
    nnstat.add_projection(rank=64)
    return run


def where(error: BaseException) -> str:
    """The innermost frame of nnstat (else the innermost) that raised `error`."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if "nnstat" in f.filename and "gpu_check" not in f.filename]
    f = (ours or frames)[-1]
    return f"{Path(f.filename).name}:{f.lineno} ({f.name})"


def inline_syncs(quick: bool) -> None:
    """Every per-step path on GPT-2 under sync debug mode "error": a sync raises."""
    import tempfile

    import torch

    import nnstat

    model = _gpt2(2 if quick else 12)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 50257, (4, 128), device=DEV)
    failures = []

    def check(
        name: str,
        fn: Callable[[], None],
        warm: int = 2,
        whole: bool = True,
        arm: list[bool] | None = None,
    ) -> None:
        try:
            for _ in range(warm):
                fn()
            sync()
            sync_debug("error" if whole else "default")  # else fn sets it where it applies
            if arm is not None:
                arm[0] = True
            try:
                fn()
            finally:
                sync_debug("default")
            sync()
            print(f"| {name} | no synchronisation |")
        except Exception as e:  # reported, and the part fails at the end
            failures.append(name)
            print(f"| {name} | SYNC or error: {type(e).__name__}: {str(e)[:160]} at {where(e)} |")

    print("| step path (GPT-2, sync debug mode error) | result |")
    print("| --- | --- |")
    for label, kw in (("Tracker default", {}), ("Tracker all + histograms", {"stats": None})):
        if kw:
            kw["histograms"] = True
        # the default (background=None): on a GPU the step's tables reach the sinks later
        tracker = nnstat.Tracker(model, opt, **kw)

        def tracked(t=tracker) -> None:
            _lm_step(model, opt, x)
            t.step()

        check(f"{label}: step + tracker.step()", tracked)
        tracker.close()
    gns = nnstat.NoiseScale(beta=0.99)
    gns.watch(model)

    def noise() -> None:
        opt.zero_grad(set_to_none=True)
        with gns.batch():
            model(input_ids=x, labels=x).loss.backward()
        opt.step()

    check("NoiseScale streaming step", noise)
    gns.unwatch()
    micro_gns = nnstat.NoiseScale(beta=0.99)
    micro = micro_gns.watch_microbatches(model, micro_batch_size=x.shape[0] // 2)

    def micro_step() -> None:
        opt.zero_grad(set_to_none=True)
        for half in x.chunk(2):
            (model(input_ids=half, labels=half).loss / 2).backward()
        micro.end_step()
        opt.step()

    check("NoiseScale micro-batch step (2 micro-batches)", micro_step)
    micro_gns.unwatch()
    with tempfile.TemporaryDirectory() as tmp:
        run = _logging_run(model, tmp)
        ids = iter(range(10**6))
        armed = [False]  # the warm-up batches run in the default mode

        def backward_of_logged_batch() -> None:
            # the contract: nothing synchronises inside backward; the block's end reads one
            # flag (weights check and NaN/Inf rows), counted by tests/test_cuda.py
            i = next(ids)
            with run(data_id=[f"{i}-{j}" for j in range(x.shape[0])]):
                model.zero_grad(set_to_none=True)
                loss = model(input_ids=x, labels=x).loss
                sync_debug("error" if armed[0] else "default")
                try:
                    loss.backward()
                finally:
                    sync_debug("default")

        check(
            "backward of a logged batch (rank 64, every module)",
            backward_of_logged_batch,
            whole=False,
            arm=armed,
        )
        nnstat.finalize()
    if failures:
        raise SystemExit(f"synchronising calls in: {', '.join(failures)}")


def inline_noise(quick: bool) -> None:
    """ms per step: plain, + NoiseScale, and one describe_layers() of the weights; then 2
    accumulated micro-batches per step, plain and + the micro-batch NoiseScale."""
    import copy
    import statistics

    import torch

    import nnstat

    model = _gpt2(2 if quick else 12)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # the noise scale's model is a copy: its capture hooks stay off the plain variant's steps
    watched = copy.deepcopy(model)
    opt_w = torch.optim.AdamW(watched.parameters(), lr=1e-4)
    x = torch.randint(0, 50257, (8, 128 if quick else 512), device=DEV)
    gns = nnstat.NoiseScale(beta=0.99)
    gns.watch(watched)
    accumulated = copy.deepcopy(model)  # its own copy: the micro-batch hooks stay off the others
    opt_a = torch.optim.AdamW(accumulated.parameters(), lr=1e-4)
    micro_gns = nnstat.NoiseScale(beta=0.99)
    micro = micro_gns.watch_microbatches(accumulated, micro_batch_size=x.shape[0] // 2)

    def plain() -> None:
        _lm_step(model, opt, x)

    def accumulate(net, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        for half in x.chunk(2):
            (net(input_ids=half, labels=half).loss / 2).backward()

    def plain_two_micro() -> None:
        accumulate(model, opt)
        opt.step()

    def micro_noise() -> None:
        accumulate(accumulated, opt_a)
        micro.end_step()
        opt_a.step()

    def noise() -> None:
        opt_w.zero_grad(set_to_none=True)
        with gns.batch():
            watched(input_ids=x, labels=x).loss.backward()
        opt_w.step()

    def described() -> None:
        _lm_step(model, opt, x)
        nnstat.get_weight(model).describe_layers()

    variants = {
        "plain step": plain,
        "+ NoiseScale": noise,
        "+ describe_layers()": described,
        "plain, 2 micro-batches": plain_two_micro,
        "+ micro-batch NoiseScale": micro_noise,
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()
    for _ in range(2 if quick else 5):
        for name, fn in variants.items():
            for _ in range(2):
                fn()  # warm (and let deferred deliveries drain)
            sync()
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            sync()
            times[name].append((time.perf_counter() - t0) / 3)
    base = statistics.median(times["plain step"])
    print("| variant (GPT-2, batch 8) | ms / step | / plain |")
    print("| --- | ---: | ---: |")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med * 1e3:.1f} | {med / base:.2f}x |")


def _device_ms(prof) -> list[tuple[str, float, int]]:
    """(kernel, device ms, calls) of a profile, largest first: the device's own events only
    (an aten op's device time repeats its kernels'; the key name moved across torch)."""
    rows = []
    for e in prof.key_averages():
        if not str(getattr(e, "device_type", "")).endswith("CUDA"):
            continue
        if e.key.startswith("Activity Buffer"):  # the profiler's own
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        if us > 0:
            rows.append((e.key, us / 1e3, e.count))
    return sorted(rows, key=lambda r: -r[1])


def inline_profile(quick: bool) -> None:
    """Where a Tracker step's time goes on the device: host ms of ``step()`` and ``flush()``,
    device ms of the kernels ``step()`` queues (the profiler), its top kernels, beside the
    device ms of the training step itself."""
    import statistics

    import torch
    from torch.profiler import ProfilerActivity, profile

    import nnstat

    model = _gpt2(2 if quick else 12)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 50257, (8, 128 if quick else 512), device=DEV)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    for _ in range(2):
        _lm_step(model, opt, x)
    sync()
    with profile(activities=acts) as prof:
        _lm_step(model, opt, x)
        sync()
    train_ms = sum(r[1] for r in _device_ms(prof))
    print(f"### training step: {train_ms:.1f} device ms (kernels, GPT-2, batch 8)")
    for label, kw in (("default", {}), ("all + histograms", {"stats": None, "histograms": True})):
        t = nnstat.Tracker(model, opt, **kw)
        host, flush = [], []
        for i in range(8):
            _lm_step(model, opt, x)
            t0 = time.perf_counter()
            t.step()
            host.append(time.perf_counter() - t0)
            if i % 4 == 3:
                t0 = time.perf_counter()
                t.flush()
                flush.append(time.perf_counter() - t0)
        _lm_step(model, opt, x)
        sync()
        with profile(activities=acts) as prof:
            t.step()
            sync()
        rows = _device_ms(prof)
        total = sum(r[1] for r in rows)
        t.close()
        print(
            f"\n### Tracker {label}: step() host {statistics.median(host) * 1e3:.2f} ms, "
            f"flush() host {statistics.median(flush) * 1e3:.2f} ms, device {total:.2f} ms "
            f"({total / max(train_ms, 1e-9) * 100:.1f}% of the training step's device time)\n"
        )
        print("| op | device ms | calls |")
        print("| --- | ---: | ---: |")
        for key, ms, n in rows[:14]:
            print(f"| {key[:70]} | {ms:.3f} | {n} |")


def inline_profile_logging(quick: bool) -> None:
    """Where a logged batch's time goes (rank 64, every module): host ms of forward and of
    backward, device ms of their kernels, beside the plain pass; the top kernels."""
    import statistics
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    import nnstat

    model = _gpt2(2 if quick else 12)
    x = torch.randint(0, 50257, (8, 128 if quick else 512), device=DEV)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])

    def timed(logged: Callable[[], Any]) -> tuple[float, float, list[tuple[str, float, int]]]:
        host_f, host_b = [], []
        for _ in range(4):
            with logged():
                model.zero_grad(set_to_none=True)
                sync()
                t0 = time.perf_counter()
                loss = model(input_ids=x, labels=x).loss
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
            sync()
            host_f.append(t1 - t0)
            host_b.append(t2 - t1)
        with profile(activities=acts) as prof, logged():
            model.zero_grad(set_to_none=True)
            model(input_ids=x, labels=x).loss.backward()
            sync()
        med = statistics.median
        return med(host_f) * 1e3, med(host_b) * 1e3, _device_ms(prof)

    plain = timed(contextlib.nullcontext)
    with tempfile.TemporaryDirectory() as tmp:
        run = _logging_run(model, tmp)
        ids = iter(range(10**6))
        logged = timed(lambda: run(data_id=[f"{next(ids)}-{j}" for j in range(x.shape[0])]))
        nnstat.finalize()
    print("| pass (GPT-2, batch 8) | host ms forward | host ms backward | device ms |")
    print("| --- | ---: | ---: | ---: |")
    for name, (f, b, rows) in (("plain", plain), ("logged, rank 64, every module", logged)):
        print(f"| {name} | {f:.1f} | {b:.1f} | {sum(r[1] for r in rows):.1f} |")
    base = {k: ms for k, ms, _ in plain[2]}
    extra = sorted(((ms - base.get(k, 0.0), k, n) for k, ms, n in logged[2]), reverse=True)
    print("\n### kernels the logged pass adds (device ms beyond the plain pass)\n")
    print("| kernel | extra device ms | calls |")
    print("| --- | ---: | ---: |")
    for ms, key, n in extra[:14]:
        print(f"| {key[:70]} | {ms:.3f} | {n} |")


def install_wheels(folder: Path, log) -> None:
    """Installs every wheel in `folder` (nnstat's own, the peers' and pytest's where the
    image lacks them) into ``folder/site`` without network, first on every part's path."""
    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"gpu_check: --wheels {folder}: no .whl files there")
    site = folder.resolve() / "site"
    cmd = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    cmd += ["--ignore-requires-python", "--upgrade", "--target", str(site), *map(str, wheels)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    log.write(f"===== wheels: {' '.join(cmd)}\n{done.stdout}{done.stderr}")
    if done.returncode:
        raise SystemExit(f"gpu_check: installing {folder}/*.whl failed: {done.stderr[-500:]}")
    path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(site) + (os.pathsep + path if path else "")


def caps(todo: list[Part], remaining: float, i: int) -> float:
    """Part `i`'s time: its cap, or more where earlier parts left time that the later parts'
    caps do not need; never more than the budget has left."""
    later = sum(p.cap for p in todo[i + 1 :])
    return min(remaining, max(todo[i].cap, remaining - later))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu_check_out", help="folder for gpu_check.md/.log")
    ap.add_argument("--budget", type=float, default=BUDGET, help="seconds for all parts")
    ap.add_argument("--parts", default=None, help="comma list (default: all)")
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--wheels", type=Path, default=None, help="install DIR/*.whl first")
    ap.add_argument("--inline", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    import torch

    if args.inline:
        inline = {
            "syncs": inline_syncs,
            "noise": inline_noise,
            "profile": lambda q: (inline_profile(q), print(), inline_profile_logging(q)),
            "profile_logging": inline_profile_logging,
        }
        inline[args.inline](args.quick)
        return
    if DEV == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (CI never runs this).")
        raise SystemExit(2)
    start = time.perf_counter()  # the budget covers the wheels' install too
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    header = device_header()
    print(header, flush=True)
    todo = parts(args)
    if args.parts:
        wanted = args.parts.split(",")
        unknown = set(wanted) - {p.name for p in todo}
        if unknown:
            ap.error(f"unknown parts {sorted(unknown)}; choose from {[p.name for p in todo]}")
        by_name = {p.name: p for p in todo}
        todo = [by_name[name] for name in wanted]  # in the order asked: the budget runs out last
    # the suite leaves out the files a test part of this run has already run
    ran = frozenset(f for p in todo if p.argv[:1] == ["suite"] for f in p.argv[1:])
    outcomes: list[Outcome] = []
    with open(out / "gpu_check.log", "w") as log:
        if args.wheels:
            install_wheels(args.wheels, log)
        for i, part in enumerate(todo):
            cap = caps(todo, args.budget - (time.perf_counter() - start), i)
            o = run_part(part, cap, log, out, ran)
            outcomes.append(o)
            print(f"{o.name}: {o.status} in {o.seconds:.0f} s {o.summary}", flush=True)
            write_report(out / "gpu_check.md", header, outcomes)
    print((out / "gpu_check.md").read_text())
    if any(not o.status.startswith(("ok", "skipped")) for o in outcomes):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
