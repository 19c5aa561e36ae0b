"""Critical batch size measured by training, next to the noise scale that predicts it.

    nice -n 10 python benchmarks/critical_batch.py              # full: three tasks, ~20 min
    python benchmarks/critical_batch.py --quick                 # a smoke run, < 1 min

McCandlish et al. (2018, "An Empirical Model of Large-Batch Training") measure the critical
batch size by training: at each batch size ``B`` (learning rate tuned per ``B``) count the steps
``S`` and examples ``E = B S`` to reach a target loss; the pairs follow
``(S/S_min - 1)(E/E_min - 1) = 1`` and ``B_crit = E_min / S_min``. This script does that on
three CPU tasks (a digits MLP, a digits CNN, a character-level transformer LM) and, at the same
model states (snapshots of a reference run as its training loss first reaches each target),
measures what nnstat predicts without training: ``B_simple`` (``nnstat.noise_scale``,
per-sample estimator) and the Hessian-weighted ``B_noise`` (``hessian=True``).

Method. Plain SGD (the setting of the paper's derivation), batches drawn with replacement, the
training loss evaluated on the whole training set (a fixed 1024-window subset for the LM) at
steps spaced 4% apart and interpolated to each target (`nnstat.gradient_noise.steps_to_target`).
Learning rate: seed 0 scans a grid of powers of two from the top (diverging runs stop at once)
and stops one rate past the best, a run stopping once it is 1.5x slower than the best so far.
Per batch size and target, the rate used is the largest from seed 0's best down (by at most two
grid steps) at which every seed reaches the target (seed 0's best can sit at the edge of
stability, where another seed diverges). Fit:
`nnstat.critical_batch_size` over the seeds (seed bootstrap, 95%).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _lm_task  # noqa: E402

import nnstat  # noqa: E402
from nnstat.gradient_noise import steps_to_target  # noqa: E402

PRUNE = 1.5  # a run stops once it is this much slower than the best rate so far


@dataclass
class Task:
    name: str
    make_model: Callable[[int], nn.Module]
    loss_fn: Callable[..., torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    batch_sizes: list[int]
    lrs: list[float]  # the grid, scanned from the largest
    targets: list[float]  # training losses, in the order training reaches them
    max_steps: int
    ref_batch: int  # the reference run whose states the noise scale is measured at
    eval_rows: int = 0  # evaluate on the first rows only (0: all)
    describe: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def _digits() -> tuple[torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, _, y_tr, _ = train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)
    x_tr = torch.tensor(x_tr, dtype=torch.float32)
    return (x_tr - x_tr.mean(0)) / (x_tr.std(0) + 1e-6), torch.tensor(y_tr)


def _seeded(build: Callable[[], nn.Module]) -> Callable[[int], nn.Module]:
    def make(seed: int) -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            return build()

    return make


def digits_mlp(quick: bool) -> Task:
    x, y = _digits()
    return Task(
        "digits MLP",
        _seeded(lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))),
        nn.functional.cross_entropy,
        x,
        y,
        batch_sizes=[8, 32, 128] if quick else [4, 8, 16, 32, 64, 128, 256, 512],
        lrs=[2.0**k for k in range(3, -7, -1)],
        targets=[0.5, 0.2] if quick else [0.5, 0.1, 0.01],
        max_steps=1500 if quick else 8000,
        ref_batch=32,
        describe=f"scikit-learn digits, {len(x)} training images, MLP 64-64-10",
    )


class _Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.c1(x.view(-1, 1, 8, 8)))
        return self.fc(torch.relu(self.c2(h)).flatten(1))


def digits_cnn(quick: bool) -> Task:
    x, y = _digits()
    return Task(
        "digits CNN",
        _seeded(_Cnn),
        nn.functional.cross_entropy,
        x,
        y,
        batch_sizes=[8, 32, 128] if quick else [4, 8, 16, 32, 64, 128, 256, 512],
        lrs=[2.0**k for k in range(3, -7, -1)],
        targets=[0.5, 0.2] if quick else [0.5, 0.1, 0.01],
        max_steps=1500 if quick else 8000,
        ref_batch=32,
        describe=f"scikit-learn digits, {len(x)} training images, CNN conv8-conv16/2-fc",
    )


def char_lm(quick: bool) -> Task:
    ns = argparse.Namespace(
        lm_text="argparse",
        lm_context=16,
        lm_d=32,
        lm_heads=2,
        lm_mlp=0,
        lm_init_seed=0,
        n_train=4096,
        n_query=0,
    )
    describe, _, (x, y), _, info = _lm_task.make_lm(ns)
    shape = (len(info["vocabulary"]), ns.lm_context, ns.lm_d, ns.lm_heads, ns.lm_mlp)
    return Task(
        "char LM",
        _seeded(lambda: _lm_task.CharTransformer(*shape)),
        _lm_task.lm_loss,
        x,
        y,
        batch_sizes=[8, 32, 128] if quick else [4, 8, 16, 32, 64, 128, 256, 512],
        lrs=[2.0**k for k in range(2, -6, -1)],
        targets=[2.8, 2.6] if quick else [2.5, 2.2, 2.0],
        max_steps=1000 if quick else 8000,
        ref_batch=32,
        eval_rows=1024,
        describe=describe.replace("stdlib", "Python's") + f", {len(x)} training windows",
        info={k: v for k, v in info.items() if k != "vocabulary"},
    )


TASKS = {"mlp": digits_mlp, "cnn": digits_cnn, "lm": char_lm}


def _eval_steps(max_steps: int) -> list[int]:
    """Every step up to 10, then 4% apart: steps to a target resolved to ~2% after interpolation."""
    out = list(range(0, 11))
    while out[-1] < max_steps:
        out.append(max(out[-1] + 1, int(out[-1] * 1.04)))
    return out


@dataclass
class Run:
    history: list[tuple[int, float]]
    steps: list[float | None]  # per target
    diverged: bool
    snapshots: dict[int, dict[str, torch.Tensor]]  # target index -> state at its first eval


def train(task: Task, batch: int, lr: float, seed: int, limit: int, snapshot: bool = False) -> Run:
    """Plain SGD until every target is reached, the loss diverges or ``limit`` steps pass."""
    model = task.make_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(10_000 + seed)
    ex = task.x[: task.eval_rows] if task.eval_rows else task.x
    ey = task.y[: task.eval_rows] if task.eval_rows else task.y
    history: list[tuple[int, float]] = []
    snaps: dict[int, dict[str, torch.Tensor]] = {}
    evals = iter(_eval_steps(limit))
    next_eval = next(evals)
    first = math.nan
    step = 0
    while True:
        if step == next_eval:
            with torch.no_grad():
                loss = float(task.loss_fn(model(ex), ey))
            history.append((step, loss))
            first = loss if step == 0 else first
            if not math.isfinite(loss) or loss > 1.5 * first:
                return Run(history, [None] * len(task.targets), True, snaps)
            for i, t in enumerate(task.targets):
                if snapshot and i not in snaps and loss <= t:
                    snaps[i] = copy.deepcopy(model.state_dict())
            if loss <= task.targets[-1] or step >= limit:
                break
            next_eval = next(evals)
        idx = torch.randint(0, len(task.x), (batch,), generator=gen)
        opt.zero_grad(set_to_none=True)
        task.loss_fn(model(task.x[idx]), task.y[idx]).backward()
        opt.step()
        step += 1
    return Run(history, [steps_to_target(history, t) for t in task.targets], False, snaps)


def tune(task: Task, batch: int, start: float) -> dict[float, Run]:
    """Seed 0 over the rate grid from ``start`` down; stop one rate past the best (last
    target)."""
    runs: dict[float, Run] = {}
    best = math.inf
    for lr in (v for v in task.lrs if v <= start):
        limit = task.max_steps if math.isinf(best) else int(min(task.max_steps, PRUNE * best))
        run = runs[lr] = train(task, batch, lr, 0, limit)
        last = run.steps[-1]
        if last is not None and last < best:
            best = last
        elif math.isfinite(best) and not run.diverged:
            break  # slower than the best after it was found: past the optimum
    return runs


def sweep_task(task: Task, seeds: int, log: Callable[[str], None]) -> dict[str, Any]:
    per_b: dict[int, dict[str, Any]] = {}
    start = max(task.lrs)
    for b in task.batch_sizes:
        t0 = time.perf_counter()
        scan = tune(task, b, start)
        full: dict[tuple[float, int], Run] = {}

        def run(
            lr: float,
            seed: int,
            b: int = b,
            scan: dict[float, Run] = scan,
            full: dict[tuple[float, int], Run] = full,
        ) -> Run:
            """Seed 0 reuses its scan run unless that one was cut short by the pruning."""
            if seed == 0 and lr in scan and (scan[lr].diverged or scan[lr].steps[-1] is not None):
                return scan[lr]
            if (lr, seed) not in full:
                full[lr, seed] = train(task, b, lr, seed, task.max_steps)
            return full[lr, seed]

        best_lr: list[float | None] = []
        chosen: list[float | None] = []
        steps: list[list[float]] = []
        for i in range(len(task.targets)):
            reached = {lr: r.steps[i] for lr, r in scan.items() if r.steps[i] is not None}
            best = min(reached, key=reached.get) if reached else None
            best_lr.append(best)
            chosen.append(None)
            steps.append([])
            # the best rate of seed 0 can sit at the edge of stability: the rate used is the
            # largest, from the best down by at most two steps of the grid, at which every seed
            # reaches the target
            for lr in [v for v in task.lrs if best is not None and v <= best][:3]:
                at = [run(lr, s).steps[i] for s in range(seeds)]
                if all(v is not None for v in at):
                    chosen[i], steps[i] = lr, at
                    break
        # below B_crit the best rate grows about in proportion to B, above it less: a batch
        # twice as large starts its scan at four times the previous best rate
        found = [v for v in best_lr if v is not None]
        start = min(max(task.lrs), 4 * max(found)) if found else max(task.lrs)
        per_b[b] = {
            "best_lr": best_lr,
            "lr": chosen,
            "steps": steps,
            "scanned": {str(lr): r.steps for lr, r in scan.items()},
        }
        log(
            f"  B={b:4d} lr={chosen} (seed 0 best {best_lr}) steps(seed 0)="
            f"{[round(s[0], 1) if s else None for s in steps]} ({time.perf_counter() - t0:.1f} s)"
        )
    return per_b


def noise_at_targets(task: Task, per_b: dict[int, dict[str, Any]], quick: bool) -> list[dict]:
    """B_simple and B_noise at the states of the reference run as it reaches each target."""
    lr = next((v for v in reversed(per_b[task.ref_batch]["lr"]) if v is not None), None)
    if lr is None:
        return [{} for _ in task.targets]
    run = train(task, task.ref_batch, lr, 0, task.max_steps, snapshot=True)
    out = []
    for i in range(len(task.targets)):
        if i not in run.snapshots:
            out.append({})
            continue
        model = task.make_model(0)
        model.load_state_dict(run.snapshots[i])
        r = nnstat.noise_scale(
            model,
            task.loss_fn,
            (task.x, task.y),
            method="per_sample",
            big_batch=128 if quick else 256,
            n_estimates=8 if quick else 64,
            hessian=True,
            hessian_samples=128 if quick else 512,
            seed=i,
        )
        out.append(
            {
                "step": steps_to_target(run.history, task.targets[i]),
                "b_simple": r.b_simple,
                "b_simple_interval": list(r.interval),
                "b_noise": r.b_noise,
            }
        )
    return out


def fit_targets(task: Task, per_b: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    fits = []
    for i, target in enumerate(task.targets):
        sweep = {b: d["steps"][i] for b, d in per_b.items() if d["steps"][i]}
        left_out = [b for b in per_b if b not in sweep]
        entry: dict[str, Any] = {"target": target, "sweep": sweep, "left_out": left_out}
        try:
            r = nnstat.critical_batch_size(sweep)
        except ValueError as err:
            entry["error"] = str(err)
        else:
            entry.update(
                s_min=r.s_min,
                e_min=r.e_min,
                b_crit=r.b_crit,
                b_crit_interval=list(r.b_crit_interval),
                s_min_interval=list(r.s_min_interval),
                e_min_interval=list(r.e_min_interval),
                residual=r.residual,
                method=r.method,
            )
        fits.append(entry)
    return fits


def _g(v: float | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return "∞" if math.isinf(v) else f"{v:.3g}"


def table(result: dict[str, Any]) -> str:
    lines = [
        "| task | target loss | B_crit (95% interval) | S_min | E_min | B_simple | B_noise "
        "| B_simple / B_crit | B_noise / B_crit | batch sizes fitted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for task in result["tasks"]:
        for fit, ns in zip(task["fits"], task["noise"], strict=True):
            bs, bn = ns.get("b_simple"), ns.get("b_noise")
            if "error" in fit:
                crit = "no fit: " + fit["error"].split(" (")[0]
                cells = [crit, "–", "–", _g(bs), _g(bn), "–", "–"]
            else:
                lo, hi = fit["b_crit_interval"]
                bc = fit["b_crit"]
                cells = [
                    f"{_g(bc)} ({_g(lo)}–{_g(hi)})",
                    _g(fit["s_min"]),
                    _g(fit["e_min"]),
                    _g(bs),
                    _g(bn),
                    _g(bs / bc) if bs is not None else "–",
                    _g(bn / bc) if bn is not None else "–",
                ]
            # a batch size left out: no rate near the tuned one took every seed to the target
            cells.append(f"{len(fit['sweep'])} of {len(task['batch_sizes'])}")
            lines.append(f"| {task['name']} | {fit['target']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.6 * len(tasks), 4.0), squeeze=False)
    for ax, task in zip(axes[0], tasks, strict=True):
        for k, fit in enumerate(task["fits"]):
            color = f"C{k}"
            for b, runs in fit["sweep"].items():
                s = np.asarray(runs, dtype=float)
                ax.scatter(int(b) * s, s, s=10, color=color, alpha=0.6)
            if "error" in fit:
                continue
            bb = np.geomspace(min(task["batch_sizes"]) / 2, max(task["batch_sizes"]) * 2, 200)
            s_fit = fit["s_min"] + fit["e_min"] / bb
            ax.plot(
                bb * s_fit,
                s_fit,
                color=color,
                lw=1.2,
                label=f"loss {fit['target']}: B_crit {fit['b_crit']:.3g}",
            )
            ax.scatter([2 * fit["e_min"]], [2 * fit["s_min"]], marker="x", color=color, s=40)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("examples E to target")
        ax.set_ylabel("steps S to target")
        ax.set_title(task["name"], fontsize=10)
        if any("error" not in f for f in task["fits"]):
            ax.legend(fontsize=7)
    fig.suptitle(
        "Steps vs examples to a target loss; fitted (S/S_min−1)(E/E_min−1)=1, × at B_crit",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (< 1 min)")
    ap.add_argument("--tasks", default="mlp,cnn,lm", help="comma-separated: mlp, cnn, lm")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per batch size (default 5)")
    ap.add_argument("--img", default="docs/img/critical_batch.png", help="figure path ('' none)")
    ap.add_argument("--json", default="", help="write the full results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the CPU is shared; small models gain nothing from threads
    seeds = args.seeds or (2 if args.quick else 5)
    log = print if not args.quick else (lambda *_: None)
    result: dict[str, Any] = {"quick": args.quick, "seeds": seeds, "tasks": []}
    for key in args.tasks.split(","):
        task = TASKS[key](args.quick)
        t0 = time.perf_counter()
        log(f"{task.name}: {task.describe}")
        per_b = sweep_task(task, seeds, log)
        fits = fit_targets(task, per_b)
        noise = noise_at_targets(task, per_b, args.quick)
        result["tasks"].append(
            {
                "name": task.name,
                "describe": task.describe,
                "info": task.info,
                "batch_sizes": task.batch_sizes,
                "lrs": task.lrs,
                "targets": task.targets,
                "per_batch": {str(b): d for b, d in per_b.items()},
                "fits": fits,
                "noise": noise,
                "seconds": time.perf_counter() - t0,
            }
        )
        log(f"  {time.perf_counter() - t0:.0f} s")
    print(table(result))
    if args.img:
        plot(result, Path(args.img))
        print(f"figure: {args.img}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=float))
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
