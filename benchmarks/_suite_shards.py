"""The test suite in parallel pytest processes, without pytest-xdist: `gpu_check.py`'s suite.

The GPU image may lack pytest-xdist, and one pytest process runs the suite in minutes. Here the
test files are packed into shards (longest-expected first, each file whole: a module's fixtures
and caches stay in one process), and ``workers`` pytest processes take shards from a queue
until none is left. Each shard writes its own verbose log (one line per test as it ends), so a
suite cut at its time cap still names every failure so far and the files that never finished.

A file's expected cost is its size plus a fixed charge for each child process it starts (a
child re-imports torch: seconds each), each compile and each benchmark script it runs in
process: what the slowest files have in common.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

# bytes of test source counted for one child process (each re-imports torch), compile or
# benchmark run in process (a quick mode that trains models)
CHILD_COST = 30_000
CHILD = re.compile(
    r"subprocess\.(?:run|Popen)|mp\.spawn\(|torchrun|torch\.compile\(|\"benchmarks\" / \""
)
# "tests/x.py::test_a[p] PASSED   [ 12%]" (-v); "FAILED tests/x.py::test_a - ..." (-ra)
# (parameter ids may hold spaces)
VERBOSE = re.compile(r"^(tests/\S+?\.py)::(.+?) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?= |$)")
SUMMARY = re.compile(r"^(FAILED|ERROR) (tests/.+?)(?: - .*)?$")
# "12.31s call     tests/x.py::test_a" (--durations)
DURATION = re.compile(r"^(\d+\.\d+)s (call|setup|teardown) +(tests/\S.*)$")


def test_files(root: Path, exclude: set[str] | frozenset[str] = frozenset()) -> list[str]:
    """Every ``tests/**/test_*.py`` under `root`, relative, sorted, less `exclude`."""
    found = (p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py"))
    return sorted(f for f in found if f not in exclude)


def expected_cost(path: Path) -> int:
    """Bytes of the file plus `CHILD_COST` per child process it starts (the ordering key)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    return len(text) + CHILD_COST * len(CHILD.findall(text))


def plan(costs: dict[str, int], shards: int) -> list[list[str]]:
    """Files packed into at most `shards` groups, largest expected cost first (each file to the
    lightest group so far); the groups come back heaviest first, so they start first."""
    groups: list[tuple[int, list[str]]] = [(0, []) for _ in range(max(1, shards))]
    for f in sorted(costs, key=lambda f: (-costs[f], f)):
        i = min(range(len(groups)), key=lambda k: groups[k][0])
        total, files = groups[i]
        groups[i] = (total + costs[f], files + [f])
    return [files for _, files in sorted(groups, key=lambda g: -g[0]) if files]


@dataclass
class SuiteResult:
    """What the shards reported: per-test outcomes, and the files that did not finish."""

    outcomes: dict[str, str] = field(default_factory=dict)  # "file::test" -> PASSED, ...
    failed: list[str] = field(default_factory=list)
    unfinished: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)  # shards that exited without a summary
    slowest: list[tuple[float, str]] = field(default_factory=list)  # (s, "call tests/...")
    seconds: float = 0.0

    def counts(self) -> Counter:
        return Counter(v.lower() for v in self.outcomes.values())

    def ok(self) -> bool:
        return not (self.failed or self.unfinished or self.crashed) and bool(self.outcomes)

    def summary(self) -> str:
        c = self.counts()
        text = ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "error", "skipped") if c[k])
        text = (text or "no test ran") + f" in {self.seconds:.0f} s"
        if self.failed:
            text += "; FAILED " + ", ".join(self.failed[:12])
            text += f" (+{len(self.failed) - 12})" if len(self.failed) > 12 else ""
        if self.unfinished:
            text += "; not finished: " + ", ".join(self.unfinished)
        if self.crashed:
            text += "; shards without a summary: " + ", ".join(self.crashed)
        return text


def parse_log(text: str, result: SuiteResult) -> None:
    """Adds a shard's per-test lines (verbose mode), its short summary's failures and its
    slowest tests (``--durations``)."""
    for line in text.splitlines():
        m = DURATION.match(line)
        if m:
            result.slowest.append((float(m.group(1)), f"{m.group(2)} {m.group(3)}"))
            result.slowest.sort(reverse=True)
            continue
        m = VERBOSE.match(line)
        if m:
            result.outcomes[f"{m.group(1)}::{m.group(2)}"] = m.group(3)
            if m.group(3) in ("FAILED", "ERROR"):
                result.failed.append(f"{m.group(1)}::{m.group(2)}")
            continue
        m = SUMMARY.match(line)
        if m and m.group(2) not in result.failed:
            result.failed.append(m.group(2))  # collection errors have no verbose line
            result.outcomes.setdefault(m.group(2), m.group(1))


def run(
    pytest: list[str],
    files: list[str],
    workers: int,
    cap: float,
    logs: Path,
    cwd: Path,
    progress=None,
) -> SuiteResult:
    """Runs `files` in `workers` parallel pytest processes (`pytest`: the command up to the
    file names; its ``-q`` is dropped), each shard's output in ``logs/shard-NN.log``, all killed at `cap` seconds.

    ``progress(line)`` gets one line per shard as it ends (what it ran, its outcome).
    """
    logs.mkdir(parents=True, exist_ok=True)
    costs = {f: expected_cost(cwd / f) for f in files}
    queue = plan(costs, 3 * workers)  # more shards than workers: the queue evens the ends
    # one torch thread per process (and per child it starts): the workers share the cores
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    # -v (without -q, which would cancel it): one line per test as it ends
    argv = [a for a in pytest if a != "-q"] + ["-v", "--continue-on-collection-errors"]
    result = SuiteResult()
    running: dict[int, tuple[subprocess.Popen, list[str], Path, float, object]] = {}
    t0 = time.perf_counter()
    n = 0

    def finish(k: int, killed: bool) -> None:
        proc, shard, path, started, handle = running.pop(k)
        handle.close()
        text = path.read_text(errors="replace")
        parse_log(text, result)
        done = {key.split("::")[0] for key in result.outcomes}
        if killed:
            result.unfinished += [f for f in shard if not _finished(f, text)]
        elif not re.search(r"^=+ .*\b(passed|failed|skipped|error)", text, re.M):
            result.crashed.append(f"{path.name} (exit {proc.returncode})")
        if progress is not None:
            ran = sum(1 for f in shard if f in done)
            how = "cut at the cap" if killed else f"exit {proc.returncode}"
            took = time.perf_counter() - started
            progress(f"{path.name}: {ran}/{len(shard)} files, {how}, {took:.0f} s: {shard}")

    try:
        while queue or running:
            while queue and len(running) < workers:
                shard = queue.pop(0)
                path = logs / f"shard-{n:02d}.log"
                handle = open(path, "w")
                proc = subprocess.Popen(
                    argv + shard,
                    cwd=cwd,
                    env=env,
                    stdout=handle,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own group: a cut kills its children too
                )
                running[n] = (proc, shard, path, time.perf_counter(), handle)
                n += 1
            for k in [k for k, r in running.items() if r[0].poll() is not None]:
                finish(k, killed=False)
            if time.perf_counter() - t0 > cap:
                break
            time.sleep(0.2)
    finally:
        for k, (proc, *_rest) in list(running.items()):
            _kill_group(proc)
            finish(k, killed=True)
        result.unfinished += [f for shard in queue for f in shard]
        result.seconds = time.perf_counter() - t0
    return result


def _finished(file: str, text: str) -> bool:
    """Whether a killed shard's log shows that `file` ended: a later file had started."""
    names = re.findall(r"^(tests/\S+?\.py)::", text, re.M)
    return file in names and names[-1] != file


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


if __name__ == "__main__":  # a manual run: python benchmarks/_suite_shards.py [workers]
    root = Path(__file__).resolve().parent.parent
    w = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    res = run(
        [sys.executable, "-m", "pytest", "-q"],
        test_files(root),
        w,
        1e9,
        root / ".shards",
        root,
        print,
    )
    print(res.summary())
    raise SystemExit(0 if res.ok() else 1)
