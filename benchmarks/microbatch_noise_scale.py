"""The micro-batch noise scale against the per-sample one on the same run, and the exact value.

    python benchmarks/microbatch_noise_scale.py [--steps 300] [--seed 0] [--no-ddp]

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
import json
import os
import socket
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
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


def _problem(seed: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor, torch.Generator]:
    """The MLP, its 512 points and the generator that drew them (it draws the batches next)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(512, 6, generator=gen)
    y = (x[:, 0] + 0.5 * torch.randn(512, generator=gen) > 0).long() + (x[:, 1] > 1).long()
    return model, x, y, gen


def compare(k: int, b: int, steps: int, seed: int) -> dict[str, tuple[float, float, float]]:
    """``{estimator: (value, low, high)}`` plus ``"exact"`` for one (K, b)."""
    model, x, y, gen = _problem(seed)
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


def _ddp_rank(rank: int, port: int, b: int, steps: int, seed: int, out: str) -> None:
    """One of 2 gloo ranks: per-sample and DDP-hook estimates on the same backward passes,
    then the step time with the hook against DDP's own all-reduce."""
    from nnstat.gradient_noise.ddp import DDPStepNorms

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, x, y, _ = _problem(seed)
    gen = torch.Generator().manual_seed(seed + 10 + rank)  # each rank its own draws
    per_sample, hook_gns = nnstat.NoiseScale(window=steps), nnstat.NoiseScale(window=steps)
    per_sample.watch(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    feed = DDPStepNorms(ddp, hook_gns.add_staged)
    for _ in range(steps):
        i = torch.randint(0, len(x), (b,), generator=gen)
        feed.count(b)
        with per_sample.batch():
            nn.functional.cross_entropy(ddp(x[i]), y[i]).backward()
        feed.end_step()
        ddp.zero_grad(set_to_none=True)
    per_sample.unwatch()
    result = {
        "hook": (hook_gns.value, *hook_gns.interval),
        "per_sample": (per_sample.value, *per_sample.interval),
        "per_sample_state": per_sample.state_dict(),
    }
    times = {}
    for arm in ("plain", "hook", "plain", "hook"):  # interleaved: the load drifts
        if arm == "plain":
            feed.close()  # the hook then averages as DDP's default all-reduce
        else:
            feed = DDPStepNorms(ddp, hook_gns.add_staged)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(steps):
            i = torch.randint(0, len(x), (b,), generator=gen)
            feed.count(b)
            nn.functional.cross_entropy(ddp(x[i]), y[i]).backward()
            feed.end_step()
            ddp.zero_grad(set_to_none=True)
        times.setdefault(arm, []).append(time.perf_counter() - start)
    hook_gns.value  # noqa: B018  (waits for the staged copies)
    result["time"] = {arm: min(t) for arm, t in times.items()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    del ddp, feed
    dist.destroy_process_group()


def compare_ddp(b: int, steps: int, seed: int) -> dict[str, tuple[float, ...]]:
    """``{estimator: (value, low, high)}`` of the DDP arm, ``"exact"``, and the wall time of a
    step (ms, best of 2) with the hook and with DDP's plain all-reduce as ``"time"``."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_ddp_rank, args=(port, b, steps, seed, out), nprocs=2, join=True)
        ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    pooled = nnstat.NoiseScale(window=2 * steps)  # both ranks' per-sample observations
    stats = [r["per_sample_state"]["stats"][""] for r in ranks]
    both = {key: stats[0][key] + stats[1][key] for key in ("nums", "dens")}
    pooled.load_state_dict({**ranks[0]["per_sample_state"], "window": 2 * steps,
                            "stats": {"": both}})  # fmt: skip
    model, x, y, _ = _problem(seed)
    t = ranks[0]["time"]
    return {
        "exact": (exact_b_simple(model, x, y), float("nan"), float("nan")),
        "hook": tuple(ranks[0]["hook"]),
        "per-sample rank 0": tuple(ranks[0]["per_sample"]),
        "per-sample pooled": (pooled.value, *pooled.interval),
        "time": (1e3 * t["hook"] / steps, 1e3 * t["plain"] / steps),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ddp", action="store_true", help="skip the 2-process DDP arm")
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
    if a.no_ddp:
        return
    print(f"\nDDP, 2 gloo processes, b points per rank and step, {a.steps} steps\n")
    print(
        "| b | exact B_simple | DDP hook: value [95% interval] | per-sample rank 0 | "
        "per-sample both ranks | width hook / rank 0 / pooled | step ms: hook / plain |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for b in (8, 32):
        r = compare_ddp(b, a.steps, a.seed)
        (exact, _, _), (hv, hl, hh) = r["exact"], r["hook"]
        (pv, pl, ph), (qv, ql, qh) = r["per-sample rank 0"], r["per-sample pooled"]
        print(
            f"| {b} | {exact:.1f} | {hv:.1f} [{hl:.1f}, {hh:.1f}] | {pv:.1f} [{pl:.1f}, "
            f"{ph:.1f}] | {qv:.1f} [{ql:.1f}, {qh:.1f}] | {(hh - hl) / (ph - pl):.2f} / "
            f"{(hh - hl) / (qh - ql):.2f} | {r['time'][0]:.2f} / {r['time'][1]:.2f} |"
        )


if __name__ == "__main__":
    main()
