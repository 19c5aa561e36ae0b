"""Cost of logging statistics every step, relative to a plain training step (one process).

A ~10M-parameter MLP trained with Adam on CPU. Variants, each on its own identically initialised
model, measured in interleaved rounds so machine load hits all of them alike:

* plain                      forward + backward + Adam step
* hand-written norms         + ``p.norm().item()`` of every weight and gradient
* hand-written, 5 groups     + l2 only of weights, grads, both Adam states and updates with
                               ``torch._foreach_norm`` (+ the snapshot copy the update needs):
                               the same memory traffic as the Tracker's default, fewer statistics
* floor                      + one dot product per tensor of gradients, both Adam states and the
                               snapshot, then the copy of the weights into the snapshot: every
                               byte the default statistics need read once (and the snapshot
                               written once), no more: what no exact implementation undercuts
* nnstat Tracker (default)   + l2, rms, abs_max, nonfinite of weights, grads, Adam states and
                               updates, plus trust ratios (fused, one host transfer)
* nnstat Tracker (full+hist) + all 15 statistics and 64-bin histograms of all of the above
* wandb.watch(log="all")     offline, ``log_freq=1``, one ``wandb.log`` per step
* TensorBoard add_histogram  ``SummaryWriter.add_histogram`` of every parameter and gradient

The Tracker runs with its default (``background=None``: background statistics at one torch
thread, else synchronous), with background statistics (step t's reductions on a worker thread
while step t+1 trains; its CPU time counts, since the process's CPU time covers every thread)
and synchronously (with two or more torch threads this thread and the worker share every
blocked pass block by block, all tasks' blocks in one pass; the "one thread" variant keeps
them on this thread alone, "split by tasks" gives each thread whole tasks instead of shared
blocks, and "a shared pass per task" shares each task's pass on its own: one hand-over to the
worker and one wait for it per task instead of one per step).

Run:  WANDB_MODE=offline .venv/bin/python benchmarks/stats_overhead.py [--steps 4 --rounds 12]
      [--threads 1] [--batch 256] [--no-peers]
Prints a markdown table of median (over rounds) wall and CPU (process) times per step, their
ratios to the plain step's medians, and the medians of each round's ratio to the plain step of
the same round (drift of the machine load cancels in those). A variant's block of steps ends
with waiting for its background statistics, so nothing it computes is left uncharged.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
from torch import nn

import nnstat
import nnstat.tracker.inline as inline_module
from nnstat.tracker.compute import tasks


def make(width: int, depth: int, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(1024, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    model = nn.Sequential(*layers)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, X: torch.Tensor, y: torch.Tensor):
    opt.zero_grad(set_to_none=True)
    loss = nn.functional.cross_entropy(model(X), y)
    loss.backward()
    opt.step()
    return loss


def variants(
    args: argparse.Namespace, tmp: str, flushes: dict[str, Callable[[], None]]
) -> dict[str, Callable[[], None]]:
    """name -> a closure doing one training step with that kind of logging.

    `flushes` receives, per Tracker variant, the call that waits for its background statistics
    (run inside the variant's timed block, so work left at the end of a block is charged to it).
    """
    X = torch.randn(args.batch, 1024)
    y = torch.randint(0, 10, (args.batch,))
    out: dict[str, Callable[[], None]] = {}

    model, opt = make(args.width, args.depth)
    out["plain step"] = lambda: train_step(model, opt, X, y)

    m2, o2 = make(args.width, args.depth)

    def manual() -> None:
        train_step(m2, o2, X, y)
        for p in m2.parameters():
            _ = (p.detach().norm().item(), p.grad.norm().item())

    out["hand-written per-layer norms"] = manual

    m7, o7 = make(args.width, args.depth)
    p7 = [p.detach() for p in m7.parameters()]
    prev7 = [p.clone() for p in p7]

    def manual_groups() -> None:
        train_step(m7, o7, X, y)
        states = [o7.state[p] for p in m7.parameters()]
        norms = torch._foreach_norm(p7) + torch._foreach_norm([p.grad for p in m7.parameters()])
        norms += torch._foreach_norm([s["exp_avg"] for s in states])
        norms += torch._foreach_norm([s["exp_avg_sq"] for s in states])
        torch._foreach_sub_(prev7, p7)
        norms += torch._foreach_norm(prev7)
        torch._foreach_copy_(prev7, p7)
        _ = torch.stack(norms).tolist()

    out["hand-written l2 of the 5 groups (foreach)"] = manual_groups

    m8, o8 = make(args.width, args.depth)
    p8 = [p.detach() for p in m8.parameters()]
    prev8 = [p.clone() for p in p8]

    def read_once() -> None:
        # the memory floor of the default statistics: every tracked byte read once (one dot
        # product per tensor, torch's threads; the weights are read by the copy that refreshes
        # the snapshot), nothing else
        train_step(m8, o8, X, y)
        states = [o8.state[p] for p in m8.parameters()]
        for group in (
            [p.grad for p in m8.parameters()],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            prev8,
        ):
            for t in group:
                torch.dot(t.reshape(-1), t.reshape(-1))
        torch._foreach_copy_(prev8, p8)

    out["floor: read the 5 groups once (dot products + snapshot copy)"] = read_once

    def tracked(label: str, unsplit: bool = False, executor: str = "", **kw) -> None:
        m, o = make(args.width, args.depth)
        t = nnstat.Tracker(m, o, **kw)
        if unsplit:  # synchronous statistics on this thread alone
            t._inline.split_ok = lambda on_cpu: False

        def step() -> None:
            train_step(m, o, X, y)
            if not executor:
                t.step()
                return
            # two threads sharing the work otherwise: "by tasks" gives each thread whole tasks,
            # "pass per task" shares each task's blocked pass (one hand-over and one wait per
            # task) instead of one pass over every task's blocks
            name = "shares_blocks" if executor == "by tasks" else "one_pass"
            real = getattr(inline_module, name)
            if executor == "by tasks":
                setattr(inline_module, name, lambda plan: False)
            else:
                setattr(inline_module, name, lambda plan, ws: {k: f() for k, f in tasks(plan, ws)})
            try:
                t.step()
            finally:
                setattr(inline_module, name, real)

        out[label] = step
        flushes[label] = t.flush

    modes = [("background", {"background": True}), ("synchronous", {"background": False})]
    tracked("nnstat Tracker, default stats (default: auto)")
    for mode, kw in modes:
        tracked(f"nnstat Tracker, default stats ({mode})", **kw)
    if torch.get_num_threads() > 1:
        tracked(
            "nnstat Tracker, default stats (synchronous, one thread)",
            True,
            background=False,
        )
        tracked(
            "nnstat Tracker, default stats (synchronous, split by tasks)",
            executor="by tasks",
            background=False,
        )
        tracked(
            "nnstat Tracker, default stats (synchronous, a shared pass per task)",
            executor="pass per task",
            background=False,
        )
    tracked(
        "nnstat Tracker, default stats of weight, grad, update (no optimizer states)",
        groups=("weight", "grad", "update"),
    )
    for mode, kw in modes:
        tracked(
            f"nnstat Tracker, all stats + histograms ({mode})", stats=None, histograms=True, **kw
        )

    if not args.no_peers:
        # one import per block: a ./wandb run directory makes isort call wandb first-party
        import wandb

        m5, o5 = make(args.width, args.depth)
        run = wandb.init(project="nnstat-bench", dir=tmp, mode="offline")
        run.watch(m5, log="all", log_freq=1)

        def watched() -> None:
            loss = train_step(m5, o5, X, y)
            run.log({"loss": loss.item()})

        out['wandb.watch(log="all", log_freq=1)'] = watched

        from torch.utils.tensorboard import SummaryWriter

        m6, o6 = make(args.width, args.depth)
        writer = SummaryWriter(os.path.join(tmp, "tb"))
        counter = [0]

        def tb_hist() -> None:
            train_step(m6, o6, X, y)
            for n, p in m6.named_parameters():
                writer.add_histogram(f"weight/{n}", p.detach(), counter[0])
                writer.add_histogram(f"grad/{n}", p.grad, counter[0])
            writer.flush()  # its writer thread would charge the next variant otherwise
            counter[0] += 1

        out["TensorBoard add_histogram (weights+grads)"] = tb_hist
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--depth", type=int, default=3, help="hidden layers")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--no-peers", action="store_true", help="skip wandb and TensorBoard")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    p.add_argument(
        "--only",
        default="",
        help="comma-separated substrings: run only the variants whose name holds one of them "
        "(the plain step always runs)",
    )
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as tmp:
        flushes: dict[str, Callable[[], None]] = {}
        runs = variants(args, tmp, flushes)
        if args.only:
            keep = [k.strip() for k in args.only.split(",") if k.strip()]
            runs = {
                k: fn for k, fn in runs.items() if k == "plain step" or any(s in k for s in keep)
            }
        n_params = sum(p.numel() for p in make(args.width, args.depth)[0].parameters())
        for name, fn in runs.items():  # warm-up (allocations, Adam state, first snapshot)
            fn()
            fn()
            flushes.get(name, lambda: None)()
        # per round: every variant runs `steps` steps back to back (rotated start) and then
        # waits for its background statistics (inside its timed block); per-step means of the
        # block are divided by the plain step's of the SAME round, so slow drifts of the
        # machine load cancel in the ratio; medians over rounds are reported
        wall: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds):
            order = list(runs.items())
            order = order[r % len(order) :] + order[: r % len(order)]  # rotate start variant
            for name, fn in order:
                c0, t0 = time.process_time(), time.perf_counter()
                for _ in range(args.steps):
                    fn()
                flushes.get(name, lambda: None)()
                # CPU time of the process (every thread, the statistics worker included)
                wall[name].append((time.perf_counter() - t0) / args.steps)
                cpu[name].append((time.process_time() - c0) / args.steps)
        print(
            f"\n{n_params / 1e6:.1f}M-parameter MLP, Adam, batch {args.batch}, "
            f"{torch.get_num_threads()} threads, {platform.machine()} CPU "
            f"({os.cpu_count()} cores), torch {torch.__version__}, "
            f"{args.rounds} rounds x {args.steps} steps, load average "
            f"{os.getloadavg()[0]:.1f}\n"
        )
        print(
            "| variant | wall ms / step | wall / plain | wall / plain, per round "
            "| CPU ms / step | CPU / plain | CPU / plain, per round |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        base, base_cpu = wall["plain step"], cpu["plain step"]
        med = statistics.median
        for name in runs:
            w, c = wall[name], cpu[name]
            rw = med([a / b for a, b in zip(w, base, strict=True)])
            rc = med([a / b for a, b in zip(c, base_cpu, strict=True)])
            print(
                f"| {name} | {med(w) * 1e3:.1f} | {med(w) / med(base):.2f}x | {rw:.2f}x "
                f"| {med(c) * 1e3:.1f} | {med(c) / med(base_cpu):.2f}x | {rc:.2f}x |"
            )
        if not args.no_peers:
            import wandb

            wandb.finish()


if __name__ == "__main__":
    main()
