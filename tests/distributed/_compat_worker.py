"""The per-rank workflow of tests/distributed/test_compat_dist.py (importable by spawned processes)."""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

import nnstat
from nnstat.capture import CaptureEngine
from nnstat.curvature import StatisticsCollector

WORLD = 2
# unequal shards (5 and 3 samples) catch an average of per-rank averages
SPLITS = ((0, 5), (5, 8))
LR, MOMENTUM = 0.1, 0.9
STATS = ("numel", "mean", "var", "skew", "kurtosis", "min", "max", "abs_max", "l1", "l2")
STATS += ("sparsity", "nonfinite")


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)


def model() -> nn.Module:
    # 7 rows: FSDP shards them unevenly (4 + 3) and the 3-row head as 2 + 1
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.LayerNorm(7), nn.Linear(7, 3))


def wrap(kind: str, m: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``(wrapped model to train, inner module whose submodules are watched)``."""
    if kind == "ddp":
        w = nn.parallel.DistributedDataParallel(m)
        return w, w.module
    if kind == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # an explicit CPU mesh: without one fully_shard picks cuda:0 where a GPU is visible
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for mod in (m[0], m[3], m):
            fully_shard(mod, mesh=mesh)
        return m, m
    if kind == "hsdp":
        # a 2-D mesh: replicated over the 2 ranks, sharded within each (size-1) group
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
        for mod in (m[0], m[3], m):
            fully_shard(mod, mesh=mesh)
        return m, m
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        w = FSDP(m, device_id=torch.device("cpu"), use_orig_params=True)
        return w, w.module
    raise ValueError(kind)


def collect_ekfac(train: nn.Module, x: torch.Tensor, y: torch.Tensor, inner=None) -> dict:
    engine = CaptureEngine()
    engine.watch(inner if inner is not None else train)
    col = StatisticsCollector("ekfac")
    engine.add_consumer(col)
    for _ in col.passes:
        # the same number of batches on every rank: each FSDP forward is a collective
        for idx in torch.arange(len(x)).tensor_split(2):
            with engine.batch(loss_reduction="mean"):
                F.cross_entropy(train(x[idx]), y[idx]).backward()
            train.zero_grad()
        col.finalize()
    engine.unwatch()
    return col.state_dict()


@contextlib.contextmanager
def _no_full_gather():
    """Statistics must come from local shards: gathering a DTensor fails the test."""
    from torch.distributed.tensor import DTensor

    def refuse(*args, **kwargs):
        raise AssertionError("a DTensor was gathered or redistributed")

    saved = DTensor.full_tensor, DTensor.redistribute
    DTensor.full_tensor = DTensor.redistribute = refuse
    try:
        yield
    finally:
        DTensor.full_tensor, DTensor.redistribute = saved


def _netdict_and_tracker(kind: str, rank: int, x, y, out_dir: str) -> None:
    m = model()
    train, inner = wrap(kind, m)
    opt = torch.optim.SGD(train.parameters(), lr=LR, momentum=MOMENTUM)
    # FSDP1: the wrapper knows the slices (its flat parameters); nothing is gathered
    src = train if kind == "fsdp1" else inner
    tracker = nnstat.Tracker(src, opt, stats=STATS)
    engine = CaptureEngine()
    engine.watch(inner)
    psg: dict[str, torch.Tensor] = {}

    def keep(cap) -> None:
        for p, g in cap.per_sample_grads_by_param().items():
            psg[f"{cap.name}.{p}"] = g.contiguous()

    seen: dict[str, torch.Tensor] = {}

    class Watcher:
        """What a forward hook sees while the layer computes (FSDP: the unsharded weight)."""

        on_capture = staticmethod(keep)

        @staticmethod
        def on_forward(name, module, inp, out) -> None:
            w = module.weight
            # cloned now: FSDP frees the unsharded storage after the forward
            full = w.full_tensor() if hasattr(w, "full_tensor") else w
            seen[f"{name}.weight"] = full.detach().clone()
            seen[f"{name}.is_dtensor"] = torch.tensor(float(hasattr(w, "full_tensor")))

    engine.add_consumer(Watcher())
    with engine.batch(loss_reduction="sum"):
        F.cross_entropy(train(x), y, reduction="sum").backward()
    engine.unwatch()
    save_file(psg, os.path.join(out_dir, f"psg-rank{rank}.safetensors"))
    save_file(
        {k: v.clone().contiguous() for k, v in seen.items()},
        os.path.join(out_dir, f"seen-rank{rank}.safetensors"),
    )
    with _no_full_gather():
        G = nnstat.get_grad(src)
        opt.step()
        metrics = tracker.step()
        W = nnstat.get_weight(src)
        M = nnstat.get_optimizer_state(src, opt, "momentum_buffer")
        res = {
            "tracker": metrics,
            "describe_layers": W.describe_layers(stats=STATS, prefix="w/"),
            "describe_grad": dict(G.describe(stats=STATS)),
            "layer_norms": W.layer_norms(2),
            "norm1": W.norm(1),
            "describe_momentum": M.describe_layers(stats=STATS, prefix="m/"),
        }
    with open(os.path.join(out_dir, f"netdict-rank{rank}.json"), "w") as f:
        json.dump(res, f)


def _store_and_influence(kind: str, rank: int, x, y, out_dir: str) -> None:
    m = model()
    train, inner = wrap(kind, m)
    lo, hi = SPLITS[rank]
    run = nnstat.init(project="store", root_dir=out_dir)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(inner)
    nnstat.add_projection(rank=2)
    with run(data_id=list(range(lo, hi))):
        F.cross_entropy(train(x), y, reduction="sum").backward()
    from nnstat.run.current import current_run
    from nnstat.run.params import params_fingerprint

    # every rank must name the same weights in the shared meta.json (FSDP1 ranks hold shards)
    fingerprint = params_fingerprint(current_run().engine)
    nnstat.finalize()
    nnstat.unwatch()
    with open(os.path.join(out_dir, f"fingerprint-rank{rank}.txt"), "w") as f:
        f.write(fingerprint)
    dist.barrier()  # every rank's shard is on disk before anyone reads the union
    path = os.path.join(out_dir, "store")
    query = nnstat.GradientStore(path)
    res = nnstat.influence.compute_influence_all(query, path, preconditioner="identity")
    torch.save(
        {"scores": res.scores, "train_ids": res.train_ids, "query_ids": res.test_ids},
        os.path.join(out_dir, f"influence-rank{rank}.pt"),
    )


def _recorder(kind: str, rank: int, x, y, out_dir: str) -> None:
    from nnstat.recorder import STAT_NAMES, Recorder, read_step_meta, read_step_stats

    m = model()
    train, inner = wrap(kind, m)
    rec = Recorder(os.path.join(out_dir, f"rec{rank}"), every=1)
    rec.track_module(train if kind == "fsdp1" else inner)  # FSDP1: the wrapper knows the slices
    rec.track_activations(inner, loss_reduction="sum")
    rec.start_batch(0)
    loss = F.cross_entropy(train(x), y, reduction="sum")
    rec.register_tensor("loss", loss, role="loss")
    loss.backward()
    rec.finish_batch()
    rec.close()
    meta = read_step_meta(rec.path)[0]
    stats = read_step_stats(rec.path, "train-000000000")
    r = meta["rows"]
    rows = {
        f"{t}|{st}": dict(zip(STAT_NAMES, stats[i].tolist(), strict=True))
        for i, (t, st, smp) in enumerate(zip(r["tensor"], r["stream"], r["sample"], strict=True))
        if smp == -1
    }
    with open(os.path.join(out_dir, f"recorder-rank{rank}.json"), "w") as f:
        json.dump(rows, f)


def _noise_scale(kind: str, rank: int, x, y, out_dir: str) -> None:
    m = model()
    train, inner = wrap(kind, m)
    gns = nnstat.NoiseScale(window=4)
    gns.watch(inner)
    with gns.batch():
        F.cross_entropy(train(x), y).backward()
    gns.unwatch()
    with open(os.path.join(out_dir, f"gns-rank{rank}.json"), "w") as f:
        json.dump({"value": gns.value, "grad_sq_norm": gns.grad_sq_norm}, f)


def worker(rank: int, kind: str, out_dir: str) -> None:
    """One rank's whole workflow, run by ``_dist.spawn`` inside its process group (torn down
    once both ranks are done and the wrappers, which hold the group, are collected)."""
    x, y = data()
    lo, hi = SPLITS[rank]
    x, y = x[lo:hi], y[lo:hi]
    _netdict_and_tracker(kind, rank, x, y, out_dir)
    m = model()
    train, inner = wrap(kind, m)
    state = collect_ekfac(train, x, y, inner)
    save_file(state, os.path.join(out_dir, f"ekfac-rank{rank}.safetensors"))
    _store_and_influence(kind, rank, x, y, out_dir)
    _recorder(kind, rank, x, y, out_dir)
    _noise_scale(kind, rank, x, y, out_dir)
