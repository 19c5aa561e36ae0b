"""The micro-batch noise scale against the per-sample one on the same run, and the exact value.

    python benchmarks/microbatch_noise_scale.py [--steps 300] [--seed 0]

A 2-layer MLP (6-32-3, tanh) at fixed weights (no update: one true ``B_simple``) on 512 random
points; every optimizer step accumulates K micro-batches of b points drawn with replacement.
Both estimators see the same backward passes: ``NoiseScale.watch`` + ``batch()`` around each
micro-batch (per-sample norms, ``B_small = 1``, ``B_big = b``: K observations per step) and
``NoiseScale.watch_microbatches`` (``B_small = b``, ``B_big = K b``: one per step), each with a
window over the whole run (a bootstrap 95% interval). The exact ``B_simple`` of the data comes
from every point's gradient (torch.func). Prints a markdown table.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat


def exact_b_simple(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """``tr(Sigma) / |G|^2`` of the empirical distribution, from per-point gradients."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def loss(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
    flat = torch.cat([g.reshape(len(x), -1) for g in per.values()], 1).double()
    g = flat.mean(0)
    return float((flat - g).pow(2).sum(1).mean()) / float(g.pow(2).sum())


def compare(k: int, b: int, steps: int, seed: int) -> dict[str, tuple[float, float, float]]:
    """``{estimator: (value, low, high)}`` plus ``"exact"`` for one (K, b)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(512, 6, generator=gen)
    y = (x[:, 0] + 0.5 * torch.randn(512, generator=gen) > 0).long() + (x[:, 1] > 1).long()
    per_sample, micro_gns = nnstat.NoiseScale(window=steps * k), nnstat.NoiseScale(window=steps)
    per_sample.watch(model)
    micro = micro_gns.watch_microbatches(model, micro_batch_size=b)
    for _ in range(steps):
        for _ in range(k):
            i = torch.randint(0, len(x), (b,), generator=gen)
            with per_sample.batch():
                (nn.functional.cross_entropy(model(x[i]), y[i]) / k).backward()
        micro.end_step()
        model.zero_grad(set_to_none=True)
    out = {"exact": (exact_b_simple(model, x, y), float("nan"), float("nan"))}
    for name, gns in (("per-sample", per_sample), ("micro-batch", micro_gns)):
        out[name] = (gns.value, *gns.interval)
        gns.unwatch()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"\n{a.steps} steps at fixed weights, window = the whole run, seed {a.seed}\n")
    print(
        "| K x b | exact B_simple | per-sample: value [95% interval] | micro-batch: value "
        "[95% interval] | width micro / per-sample |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for k, b in ((2, 8), (4, 8), (4, 32), (8, 32)):
        r = compare(k, b, a.steps, a.seed)
        (exact, _, _), (ps, pl, ph), (mb, ml, mh) = r["exact"], r["per-sample"], r["micro-batch"]
        print(
            f"| {k} x {b} | {exact:.1f} | {ps:.1f} [{pl:.1f}, {ph:.1f}] | {mb:.1f} "
            f"[{ml:.1f}, {mh:.1f}] | {(mh - ml) / (ph - pl):.2f} |"
        )


if __name__ == "__main__":
    main()
