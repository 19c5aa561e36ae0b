"""Noise-scale benchmark: tracker overhead and estimator accuracy on scikit-learn digits.

1. Overhead: an MLP training loop with ``nnstat.NoiseScale`` (per-sample norms from the capture
   engine, every step) vs. the same plain loop, and vs. ``HandWritten``, the
   minimal hook-based tracker written by hand for this model: the floor of the approach.
2. Accuracy: each method of ``nnstat.noise_scale`` vs. the exact B_simple of the data set,
   computed from exhaustive per-sample gradients (``torch.func.vmap(grad)``), and the exact
   Hessian-weighted B_noise.
3. B_simple over training (streaming tracker), printed and optionally plotted.

4. Long sequences (``--parts sequence``): GPT-2 small's per-layer linear maps (width 768) over
   T = 512 positions: a training step with and without ``nnstat.NoiseScale``, and the per-batch
   norm reduction alone on the same captures, three ways: summed without per-sample values
   (what the tracker does: the Grams' dot where cheaper, else ``G_i`` into one foreach norm),
   per-sample ``[N]`` values then their mean, and every ``G_i`` materialised.

Run: ``.venv/bin/python benchmarks/noise_scale_overhead.py [--plot docs/img/noise_scale.png]``
(``--parts overhead --widths 256/64 --rounds 6`` for a quick look; ``--parts sequence``).
Not a test: CI never runs it. Prints markdown tables.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.gradient_noise.hessian import hessian_noise_scale


def digits() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    return torch.tensor(x, dtype=torch.float32), torch.tensor(y)


def mlp(width: int, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )


class HandWritten:
    """The floor of any hook-based per-sample noise-scale tracker, written by hand for this MLP.

    Same quantities as ``nnstat.NoiseScale`` (per layer and total, EMA of tr(Sigma) and |G|^2
    separately): a forward hook keeps each Linear's input and registers a hook on its output;
    after backward, the per-sample squared norms ``(|a_i|^2 + 1)|b_i|^2`` (row norms, one
    ``_foreach_mul``) and the batch gradient norms come from one ``_foreach_norm`` and one
    ``.tolist()``, and the EMAs are Python floats. No validation, no generality: what nnstat is
    measured against.
    """

    def __init__(self, model: nn.Module, beta: float = 0.99) -> None:
        self.layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
        self.params = [p for m in self.layers for p in (m.weight, m.bias)]
        self.acts: list = [None] * len(self.layers)
        self.grads: list = [None] * len(self.layers)
        self.on, self.beta = False, beta
        self.ema = [[0.0, 0.0] for _ in range(len(self.layers) + 1)]  # layers, then the total
        for k, layer in enumerate(self.layers):
            layer.register_forward_hook(self._forward_hook(k))

    def _forward_hook(self, k: int):
        def keep_grad(g: torch.Tensor) -> None:
            self.grads[k] = g

        def hook(module, inputs, output) -> None:
            if self.on:
                self.acts[k] = inputs[0].detach()
                output.register_hook(keep_grad)

        return hook

    def step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """Backward of the mean cross-entropy of ``model(x)`` and update the estimate."""
        self.on = True
        try:
            nn.functional.cross_entropy(model(x), y).backward()
        finally:
            self.on = False
        n, m = self.acts[0].shape[0], len(self.layers)
        na = [torch.linalg.vector_norm(a, dim=1) for a in self.acts]
        nb = [torch.linalg.vector_norm(g, dim=1) for g in self.grads]
        factors = [*torch._foreach_mul(nb, na), *nb]  # |a_i||b_i| and |b_i| per layer, [N]
        v = torch.stack(torch._foreach_norm(factors + [p.grad for p in self.params])).tolist()
        # output gradients of a mean loss are 1/n of each sample's own: scale n^2, mean 1/n
        small = [(v[k] ** 2 + v[m + k] ** 2) * n for k in range(m)]
        big = [v[2 * m + 2 * k] ** 2 + v[2 * m + 2 * k + 1] ** 2 for k in range(m)]
        small.append(sum(small))
        big.append(sum(big))
        b = self.beta
        for acc, s, g in zip(self.ema, small, big, strict=True):
            acc[0] = b * acc[0] + (1 - b) * (s - g) * n / (n - 1)  # tr(Sigma)
            acc[1] = b * acc[1] + (1 - b) * (n * g - s) / (n - 1)  # |G|^2

    @property
    def value(self) -> float:
        return self.ema[-1][0] / self.ema[-1][1]


def time_loop(model, x, y, batch, steps, tracker=None, every: int = 1) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per step. ``tracker``: None, a NoiseScale or a HandWritten."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    start, wall = time.process_time(), time.perf_counter()
    for step in range(steps):
        idx = torch.randint(len(x), (batch,), generator=g)
        xb, yb = x[idx], y[idx]
        if tracker is None or step % every:
            nn.functional.cross_entropy(model(xb), yb).backward()
        elif isinstance(tracker, HandWritten):
            tracker.step(model, xb, yb)
        else:
            with tracker.batch():
                nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
        opt.zero_grad()
    return (time.process_time() - start) / steps, (time.perf_counter() - wall) / steps


def overhead(x, y, width: int, batch: int, steps: int, rounds: int) -> dict:
    """Plain vs nnstat vs the hand-written floor, interleaved rounds in a rotating order."""
    models = {k: mlp(width) for k in ("plain", "nnstat", "nnstat4", "floor")}
    gns = nnstat.NoiseScale(beta=0.99)
    gns.watch(models["nnstat"])
    gns4 = nnstat.NoiseScale(beta=0.99)
    gns4.watch(models["nnstat4"])
    floor = HandWritten(models["floor"], beta=0.99)
    runs = {
        "plain": lambda n: time_loop(models["plain"], x, y, batch, n),
        "nnstat": lambda n: time_loop(models["nnstat"], x, y, batch, n, gns),
        "nnstat4": lambda n: time_loop(models["nnstat4"], x, y, batch, n, gns4, every=4),
        "floor": lambda n: time_loop(models["floor"], x, y, batch, n, floor),
    }
    for run in runs.values():
        run(max(3, steps // 4))  # warm-up
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    order = list(runs)
    for r in range(rounds):  # interleaved: load changes on the shared machine hit all variants
        for k in order[r % len(order) :] + order[: r % len(order)]:
            times[k].append(runs[k](steps))
    gns.unwatch()
    gns4.unwatch()

    def ratio(k: str, i: int) -> float:
        return statistics.median(a[i] / b[i] for a, b in zip(times[k], times["plain"], strict=True))

    # same data, same initialisation, same updates: the two trackers must agree
    if not math.isclose(gns.value, floor.value, rel_tol=1e-3):
        raise AssertionError(f"nnstat {gns.value} != hand-written {floor.value}")
    return {
        "width": width,
        "batch": batch,
        "plain_ms": 1e3 * statistics.median(t[0] for t in times["plain"]),
        **{f"{k}_cpu": ratio(k, 0) for k in ("nnstat", "nnstat4", "floor")},
        **{f"{k}_wall": ratio(k, 1) for k in ("nnstat", "nnstat4", "floor")},
        "b_simple": gns.value,
    }


class Layers(nn.Module):
    """GPT-2's per-layer linear maps (qkv, attention output, MLP in and out) over [N, T, D]."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        d = width
        self.blocks = nn.ModuleList(
            nn.ModuleList(
                [nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)]
            )
            for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1]
        for qkv, out, fc, proj in self.blocks:
            q, k, v = qkv(x).split(d, dim=-1)
            x = x + out(torch.tanh(q * k) * v)
            x = x + proj(nn.functional.gelu(fc(x)))
        return x


def sequence(width: int, seq: int, batch: int, layers: int, rounds: int) -> dict:
    """Step time with and without the tracker, and the norm reduction alone three ways."""
    from nnstat.capture.norms import sq_norm_sums

    torch.manual_seed(0)
    model = Layers(width, layers)
    x = torch.randn(batch, seq, width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    gns = nnstat.NoiseScale(beta=0.9)

    def step(tracked: bool) -> float:
        t0 = time.perf_counter()
        if tracked:
            with gns.batch():
                model(x).square().mean().backward()
        else:
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    gns.watch(model)
    steps: dict[str, list[float]] = {"plain": [], "tracked": []}
    for r in range(rounds + 1):  # the first round warms up
        for k in ("plain", "tracked") if r % 2 else ("tracked", "plain"):
            t = step(k == "tracked")
            if r:
                steps[k].append(t)
    b_simple = gns.value
    gns.unwatch()

    engine = nnstat.CaptureEngine()
    engine.watch(model)
    caps: list = []
    engine.add_consumer(caps.append)
    with engine.batch():
        model(x).square().mean().backward()
    model.zero_grad()

    def summed() -> torch.Tensor:  # the tracker's reduction
        parts = sq_norm_sums(caps)
        tensors = [t for ts, _, _ in parts for t in ts]
        values = [v for _, vs, _ in parts for v in vs]
        return torch.stack([*torch._foreach_norm(tensors), *values])

    ways = {
        "summed": summed,
        "per_sample": lambda: torch.stack([c.per_sample_sq_norm().mean() for c in caps]),
        "materialised": lambda: torch.stack(
            [c.per_sample_grad().square().sum((1, 2)).mean() for c in caps]
        ),
    }
    norm_times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(rounds + 1):
        order = list(ways)[r % 3 :] + list(ways)[: r % 3]
        for k in order:
            t0 = time.perf_counter()
            ways[k]()
            if r:
                norm_times[k].append(time.perf_counter() - t0)
    engine.unwatch()
    med = statistics.median
    return {
        "plain_s": med(steps["plain"]),
        "ratio": med(a / b for a, b in zip(steps["tracked"], steps["plain"], strict=True)),
        "b_simple": b_simple,
        **{f"{k}_ms": 1e3 * med(v) for k, v in norm_times.items()},
        **{
            f"{k}_rel": med(a / b for a, b in zip(v, norm_times["summed"], strict=True))
            for k, v in norm_times.items()
        },
    }


def exact_b_simple(model, x, y) -> float:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    g = torch.cat([v.reshape(len(x), -1) for v in per.values()], 1).double()
    mean = g.mean(0)
    trace = float((g - mean).pow(2).sum(1).mean())
    return trace / float(mean @ mean)


def train(
    model,
    x,
    y,
    steps: int,
    batch: int = 32,
    record: nnstat.NoiseScale | None = None,
    every: int = 10,
) -> list[tuple[int, float, float, float]]:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    history = []
    if record is not None:
        record.watch(model)
    for step in range(steps):
        idx = torch.randint(len(x), (batch,), generator=g)
        if record is None:
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        else:
            with record.batch():
                nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            if step % every == every - 1:
                history.append((step + 1, record.value, *record.interval))
        opt.step()
        opt.zero_grad()
    if record is not None:
        record.unwatch()
    return history


def accuracy(x, y, seeds: int) -> tuple[list[dict], float, float]:
    model = mlp(32)
    train(model, x, y, steps=300)
    truth = exact_b_simple(model, x, y)
    b_noise = hessian_noise_scale(model, nn.functional.cross_entropy, x, y).b_noise
    rows = []
    configs = [
        ("two_batch", dict(small_batch=8, big_batch=128)),
        ("per_sample", dict(big_batch=128)),
        ("fit", dict(small_batch=8, big_batch=128)),
    ]
    for method, kw in configs:
        for n_est in (16, 64):
            est, cover, secs, used = [], 0, [], 0
            for seed in range(seeds):
                t0 = time.perf_counter()
                r = nnstat.noise_scale(
                    model,
                    nn.functional.cross_entropy,
                    (x, y),
                    method=method,
                    n_estimates=n_est,
                    seed=seed,
                    **kw,
                )
                secs.append(time.perf_counter() - t0)
                est.append(r.b_simple)
                cover += int(r.interval[0] <= truth <= r.interval[1])
                used = r.n_samples
            err = np.abs(np.array(est) / truth - 1)
            rows.append(
                {
                    "method": method,
                    "n_estimates": n_est,
                    "samples": used,
                    "mean": float(np.mean(est)),
                    "mean_abs_err": float(err.mean()),
                    "coverage": cover / seeds,
                    "seconds": statistics.median(secs),
                }
            )
    return rows, truth, b_noise


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80, help="steps per timing round (batch 64)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument(
        "--widths", default="256/64,512/128,1024/256,2048/512", help="width/batch pairs"
    )
    ap.add_argument("--seeds", type=int, default=10, help="repetitions per accuracy cell")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plot", default=None, help="write the B_simple-over-training figure here")
    ap.add_argument(
        "--parts", default="overhead,accuracy,training", help="comma-separated (or: sequence)"
    )
    ap.add_argument("--seq", default="768/512/2/1", help="sequence part: width/T/batch/layers")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    x, y = digits()

    parts = set(args.parts.split(","))
    if "overhead" in parts:
        print_overhead(x, y, args)
    if "accuracy" in parts:
        print_accuracy(x, y, args)
    if "training" in parts:
        print_training(x, y, args)
    if "sequence" in parts:
        print_sequence(args)


def print_sequence(args) -> None:
    width, seq, batch, layers = (int(v) for v in args.seq.split("/"))
    r = sequence(width, seq, batch, layers, args.rounds)
    print(
        f"\n## Long sequences (linear maps of {layers} GPT-2 layer(s), width {width}, T = {seq}, "
        f"batch {batch}, {args.threads} thread(s); medians of {args.rounds} interleaved rounds)\n"
    )
    print(
        "| plain step s | NoiseScale step / plain | norms summed ms | per-sample values, x "
        "| G_i materialised, x |"
    )
    print("| --- | --- | --- | --- | --- |")
    print(
        f"| {r['plain_s']:.2f} | {r['ratio']:.2f}x | {r['summed_ms']:.0f} "
        f"| {r['per_sample_rel']:.2f}x | {r['materialised_rel']:.2f}x |"
    )


def print_overhead(x, y, args) -> None:
    print(
        f"## Overhead (digits MLP 64-w-w-10, SGD, {args.threads} thread(s); medians of "
        f"{args.rounds} interleaved rounds of per-round ratios to the plain loop)\n"
    )
    print(
        "| width | batch | plain ms/step (CPU) | nnstat every step, CPU | wall "
        "| hand-written floor, CPU | wall | nnstat / floor (CPU) | nnstat every 4th step, CPU |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for spec in args.widths.split(","):
        width, batch = (int(v) for v in spec.split("/"))
        steps = max(20, args.steps * 64 // batch)
        r = overhead(x, y, width, batch, steps, args.rounds)
        print(
            f"| {r['width']} | {r['batch']} | {r['plain_ms']:.2f} | {r['nnstat_cpu']:.2f}x "
            f"| {r['nnstat_wall']:.2f}x | {r['floor_cpu']:.2f}x | {r['floor_wall']:.2f}x "
            f"| {r['nnstat_cpu'] / r['floor_cpu']:.2f} | {r['nnstat4_cpu']:.2f}x |",
            flush=True,
        )


def print_accuracy(x, y, args) -> None:
    rows, truth, b_noise = accuracy(x, y, args.seeds)
    print(
        f"\n## Accuracy vs exhaustive per-sample gradients (digits, MLP 64-32-32-10 after 300 "
        f"steps; exact B_simple = {truth:.1f}, exact B_noise = {b_noise:.1f}; "
        f"{args.seeds} seeds per row)\n"
    )
    print(
        "| method | n_estimates | samples/call | mean B_simple | mean abs. rel. error | "
        "95% interval coverage | s/call |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['method']} | {r['n_estimates']} | {r['samples']} | {r['mean']:.1f} | "
            f"{100 * r['mean_abs_err']:.1f}% | {100 * r['coverage']:.0f}% | {r['seconds']:.2f} |"
        )


def print_training(x, y, args) -> None:
    gns = nnstat.NoiseScale(window=200)
    history = train(mlp(32), x, y, steps=1000, record=gns, every=50)
    print("\n## B_simple over training (batch 32, SGD lr 0.05, window of 200 steps)\n")
    print("| step | B_simple | 95% interval |")
    print("| --- | --- | --- |")
    for step, value, lo, hi in history:
        print(f"| {step} | {value:.1f} | {lo:.1f}-{hi:.1f} |")
    if args.plot:
        from nnstat.plot import noise_scale_plot

        steps, values, lo, hi = (np.array(c) for c in zip(*history, strict=True))
        fig = noise_scale_plot(
            steps, values, (lo, hi), batch_size=32, title="B_simple while training an MLP on digits"
        )
        fig.savefig(args.plot, dpi=110, bbox_inches="tight")
        print(f"\nplot written to {args.plot}")


if __name__ == "__main__":
    main()
