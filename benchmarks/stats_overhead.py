"""Cost of logging statistics every step, relative to a plain training step (one process).

A ~10M-parameter MLP trained with Adam on CPU. Variants, each on its own identically initialised
model, measured in interleaved rounds so machine load hits all of them alike:

* plain                      forward + backward + Adam step
* hand-written norms         + ``p.norm().item()`` of every weight and gradient
* hand-written, 5 groups     + l2 only of weights, grads, both Adam states and updates with
                               ``torch._foreach_norm`` (+ the snapshot copy the update needs):
                               the same memory traffic as the Tracker's default, fewer statistics
* nnstat Tracker (default)   + l2, rms, abs_max, nonfinite of weights, grads, Adam states and
                               updates, plus trust ratios (fused, one host transfer)
* nnstat Tracker (full+hist) + all 15 statistics and 64-bin histograms of all of the above
* wandb.watch(log="all")     offline, ``log_freq=1``, one ``wandb.log`` per step
* TensorBoard add_histogram  ``SummaryWriter.add_histogram`` of every parameter and gradient

Run:  WANDB_MODE=offline .venv/bin/python benchmarks/stats_overhead.py [--steps 2 --rounds 12]
      [--threads 1] [--batch 256] [--no-peers]
Prints a markdown table of median wall and CPU (process) times per step, their ratios to the
plain step's medians, and the median over rounds of each round's CPU ratio to the plain step of
the same round (drift of the machine load cancels in it, but each round has few samples); on a
shared machine the CPU-time ratios are the steadier ones.
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


def variants(args: argparse.Namespace, tmp: str) -> dict[str, Callable[[], None]]:
    """name -> a closure doing one training step with that kind of logging."""
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

    m3, o3 = make(args.width, args.depth)
    t3 = nnstat.Tracker(m3, o3)
    out["nnstat Tracker, default stats"] = lambda: (train_step(m3, o3, X, y), t3.step())

    m4, o4 = make(args.width, args.depth)
    t4 = nnstat.Tracker(m4, o4, stats=None, histograms=True)
    out["nnstat Tracker, all stats + histograms"] = lambda: (train_step(m4, o4, X, y), t4.step())

    if not args.no_peers:
        import wandb
        from torch.utils.tensorboard import SummaryWriter

        m5, o5 = make(args.width, args.depth)
        run = wandb.init(project="nnstat-bench", dir=tmp, mode="offline")
        run.watch(m5, log="all", log_freq=1)

        def watched() -> None:
            loss = train_step(m5, o5, X, y)
            run.log({"loss": loss.item()})

        out['wandb.watch(log="all", log_freq=1)'] = watched

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
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--no-peers", action="store_true", help="skip wandb and TensorBoard")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    with tempfile.TemporaryDirectory() as tmp:
        runs = variants(args, tmp)
        n_params = sum(p.numel() for p in make(args.width, args.depth)[0].parameters())
        times: dict[str, list[float]] = {k: [] for k in runs}
        cpu: dict[str, list[float]] = {k: [] for k in runs}
        for fn in runs.values():  # warm-up (allocations, Adam state, first snapshot)
            fn()
            fn()
        # per round: every variant runs `steps` steps back to back (rotated start), and each
        # variant's CPU time is divided by the plain step's of the SAME round, so slow drifts
        # of the machine load cancel in the ratio; medians over rounds are reported
        ratio_cpu: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds):
            order = list(runs.items())
            order = order[r % len(order) :] + order[: r % len(order)]  # rotate start variant
            cpu_r: dict[str, float] = {}
            for name, fn in order:
                c_sum = 0.0
                for _ in range(args.steps):
                    c0, t0 = time.process_time(), time.perf_counter()
                    fn()
                    w, c = time.perf_counter() - t0, time.process_time() - c0
                    times[name].append(w)
                    # CPU time of the process: less sensitive to other jobs on a shared machine
                    cpu[name].append(c)
                    c_sum += c
                cpu_r[name] = c_sum
            for name in runs:
                ratio_cpu[name].append(cpu_r[name] / cpu_r["plain step"])
        print(
            f"\n{n_params / 1e6:.1f}M-parameter MLP, Adam, batch {args.batch}, "
            f"{torch.get_num_threads()} threads, {platform.machine()} CPU "
            f"({os.cpu_count()} cores), torch {torch.__version__}, "
            f"{args.rounds} rounds x {args.steps} steps, load average "
            f"{os.getloadavg()[0]:.1f}\n"
        )
        print(
            "| variant | wall ms / step | wall / plain | CPU ms / step | CPU / plain "
            "| CPU / plain, per round |"
        )
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        base = statistics.median(times["plain step"])
        base_cpu = statistics.median(cpu["plain step"])
        for name, ts in times.items():
            med, med_cpu = statistics.median(ts), statistics.median(cpu[name])
            print(
                f"| {name} | {med * 1e3:.1f} | {med / base:.2f}x "
                f"| {med_cpu * 1e3:.1f} | {med_cpu / base_cpu:.2f}x "
                f"| {statistics.median(ratio_cpu[name]):.2f}x |"
            )
        if not args.no_peers:
            import wandb

            wandb.finish()


if __name__ == "__main__":
    main()
