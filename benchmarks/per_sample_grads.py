"""Per-sample gradients: nnstat's capture engine vs torch.func vmap and Opacus GradSampleModule.

Standalone (not a test). Everything runs side by side in one process on the same models and
batches; each method materialises every per-sample gradient (weight and bias) of every layer.
Prints a markdown table: samples/s and the time ratio to a plain forward+backward.

    .venv/bin/python benchmarks/per_sample_grads.py [--repeats 7] [--threads 1]

One thread by default: on a shared, oversubscribed 2-core machine every multi-threaded op waits
for a second core, so timings measure the scheduler instead of the methods.

Requires ``opacus`` (benchmarks/requirements.txt).
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from nnstat.capture import CaptureEngine


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 10),
    )


def timed(methods: dict[str, Callable[[], None]], repeats: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds per method; methods interleave round by round so a shared,
    noisy machine slows them alike."""
    for fn in methods.values():
        fn()  # warm-up
    wall: dict[str, list[float]] = {k: [] for k in methods}
    cpu: dict[str, list[float]] = {k: [] for k in methods}
    for _ in range(repeats):
        for k, fn in methods.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in methods}


def bench(name: str, make: Callable[[], nn.Module], x: torch.Tensor, y: torch.Tensor, repeats: int):
    torch.manual_seed(0)
    model = make()
    n = len(x)
    sink: list[torch.Tensor] = []

    def plain():
        model.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").backward()

    engine = CaptureEngine()
    engine.watch(model)
    what = {"fn": lambda cap: cap.per_sample_grad()}
    engine.add_consumer(lambda cap: sink.append(what["fn"](cap)))

    # every method materialises its per-sample gradients and frees them inside the timed region
    def nnstat_psg():
        model.zero_grad()
        with engine.batch():
            F.cross_entropy(model(x), y, reduction="sum").backward()
        sink.clear()

    def nnstat_frozen():
        # a dedicated logging pass (the store's param_grads=False): no weight-gradient products
        flags = [(p, p.requires_grad) for p in model.parameters()]
        for p, _ in flags:
            p.requires_grad_(False)
        try:
            with engine.batch(outputs_require_grad=True):
                F.cross_entropy(model(x), y, reduction="sum").backward()
        finally:
            for p, f in flags:
                p.requires_grad_(f)
        sink.clear()

    def nnstat_sq_norms():
        what["fn"] = lambda cap: cap.per_sample_sq_norm()
        try:
            nnstat_psg()
        finally:
            what["fn"] = lambda cap: cap.per_sample_grad()

    def func_vmap():
        sink[:] = list(per_sample(params, x, y).values())
        sink.clear()

    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None], reduction="sum")

    per_sample = vmap(grad(one), in_dims=(None, 0, 0))

    methods = {
        "plain fwd+bwd": plain,
        "nnstat CaptureEngine": nnstat_psg,
        "nnstat, parameters frozen (param_grads=False)": nnstat_frozen,
        "nnstat, squared norms only (no G_i)": nnstat_sq_norms,
        "torch.func vmap": func_vmap,
    }
    try:
        from opacus import GradSampleModule
    except ImportError:
        print("opacus not installed: pip install opacus (see benchmarks/requirements.txt)")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            gsm = GradSampleModule(make())

        def opacus_psg():
            with warnings.catch_warnings():  # "full backward hook ... no inputs require grad"
                warnings.simplefilter("ignore")
                F.cross_entropy(gsm(x), y, reduction="sum").backward()
            sink[:] = [p.grad_sample for p in gsm.parameters()]
            sink.clear()
            gsm.zero_grad(set_to_none=True)  # also drops grad_sample

        methods["Opacus GradSampleModule"] = opacus_psg
    results = timed(methods, repeats)
    engine.unwatch()
    base_wall, base_cpu = results["plain fwd+bwd"]
    rows = []
    for method, (t, c) in results.items():
        rows.append(
            f"| {name} | {method} | {n / t:,.0f} | {t / base_wall:.2f}x | {c / base_cpu:.2f}x |"
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    b = args.batch
    print(
        f"torch {torch.__version__}, {args.threads} CPU threads, batch {b}, median of {args.repeats}"
    )
    print()
    print("| model | method | samples/s | wall time / plain | CPU time / plain |")
    print("| --- | --- | ---: | ---: | ---: |")
    x, y = torch.randn(b, 784, generator=g), torch.randint(0, 10, (b,), generator=g)
    for row in bench("MLP 784-512-512-10", mlp, x, y, args.repeats):
        print(row)
    x = torch.randn(b, 1, 28, 28, generator=g)
    for row in bench("CNN 3 conv + linear, 28x28", cnn, x, y, args.repeats):
        print(row)


if __name__ == "__main__":
    main()
