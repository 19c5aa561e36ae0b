"""Where the CPU time of a default Tracker step goes, against the read-once floor, part by part.

The model, optimizer and batch of ``benchmarks/stats_overhead.py`` (10.5M-parameter MLP, Adam).
After each training step, one of two variants reads the statistics' bytes, alternately:

* floor      one ``torch.dot`` per tensor of gradients, both Adam states and the snapshot, then
             the copy of the weights into the snapshot (the ``floor`` row of stats_overhead.py)
* Tracker    ``Tracker(model, opt, background=False).step()``: default statistics, synchronous

Each part is timed in CPU time of the process (``time.process_time``), which a loaded machine
disturbs far less than wall time: the floor per group, the Tracker per task (a group's blocked
norm pass; the weights with their update and the snapshot refresh in one pass) and the Tracker's
whole ``step()`` (the rest is building the metric dict). Medians over rounds.

Run:  .venv/bin/python benchmarks/tracker_cpu_parts.py [--rounds 14] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from stats_overhead import make, train_step

import nnstat
import nnstat.tracker.tracker as tracker_module


def timed(out: dict[str, list[float]], key: str, fn: Callable[[], object]) -> object:
    c = time.process_time()
    value = fn()
    out.setdefault(key, []).append((time.process_time() - c) * 1e3)
    return value


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=14)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    X, y = torch.randn(256, 1024), torch.randint(0, 10, (256,))
    model, opt = make(2048, 3)
    tracker = nnstat.Tracker(model, opt, background=False)
    m2, o2 = make(2048, 3)
    weights = [p.detach() for p in m2.parameters()]
    prev = [p.clone() for p in weights]
    ms: dict[str, list[float]] = {}
    tasks = tracker_module.tasks

    def timed_tasks(plan, workspaces):  # each task's CPU time
        return [
            (k, lambda fn=fn, k=k: timed(ms, f"Tracker: {k}", fn))
            for k, fn in tasks(plan, workspaces)
        ]

    tracker_module.tasks = timed_tasks

    def floor() -> None:
        states = [o2.state[p] for p in m2.parameters()]
        for name, group in (
            ("grad", [p.grad for p in m2.parameters()]),
            ("exp_avg", [s["exp_avg"] for s in states]),
            ("exp_avg_sq", [s["exp_avg_sq"] for s in states]),
            ("snapshot", prev),
        ):
            timed(
                ms,
                f"floor: dot of {name}",
                lambda g=group: [torch.dot(t.view(-1), t.view(-1)) for t in g],
            )
        timed(ms, "floor: copy weights -> snapshot", lambda: torch._foreach_copy_(prev, weights))

    for r in range(args.rounds + 2):
        if r == 2:
            ms.clear()  # warm-up rounds
        train_step(m2, o2, X, y)
        timed(ms, "floor, total", floor)
        train_step(model, opt, X, y)
        timed(ms, "Tracker step(), total", tracker.step)
    print(
        f"\nCPU ms per step part (median of {args.rounds} rounds), {torch.get_num_threads()} "
        f"torch threads, load average {os.getloadavg()[0]:.1f}\n"
    )
    print("| part | CPU ms |\n| --- | ---: |")
    for key in sorted(ms, key=lambda k: (not k.startswith("floor"), k)):
        print(f"| {key} | {statistics.median(ms[key]):.2f} |")


if __name__ == "__main__":
    main()
