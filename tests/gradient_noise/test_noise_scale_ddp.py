"""NoiseScale.register_ddp with 2 gloo processes equals a single-process reference."""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from _dist import spawn
from _noise_ref import population_noise
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import nnstat

B, WORLD, STEPS = 8, 2, 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD * B, 6, generator=g), torch.randint(0, 2, (WORLD * B,), generator=g)


def _flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _train(rank: int, out_dir: str) -> None:
    # a tiny bucket cap gives several buckets per backward, exercising the bucket counting
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=1e-4)
    gns = nnstat.NoiseScale(window=10)
    gns.register_ddp(ddp, local_batch_size=B)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    record = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = nn.functional.cross_entropy(ddp(x[rank * B : (rank + 1) * B]), y[rank * B :][:B])
        loss.backward()
        record.append({"grad": _flat_grad(ddp.module).tolist(), "state": gns.state_dict()})
        opt.step()
        opt.zero_grad()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)


def _skip_overflow(rank: int, out_dir: str) -> None:
    """`_train`'s steps through the hook, once as they are and once with an overflowed step
    (an infinite loss, as a float16 overflow; no update, as the GradScaler skips it) before
    step 1."""
    runs = {}
    for overflow in (False, True):
        ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=1e-4)
        gns = nnstat.NoiseScale(window=10)
        gns.register_ddp(ddp, local_batch_size=B)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        steps = [0, "overflow", 1, 2] if overflow else list(range(STEPS))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in steps:
                x, y = _data(1 if step == "overflow" else step)
                sl = slice(rank * B, (rank + 1) * B)
                loss = nn.functional.cross_entropy(ddp(x[sl]), y[sl])
                (loss * math.inf if step == "overflow" else loss).backward()
                if step != "overflow":
                    opt.step()
                opt.zero_grad()
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        runs[str(overflow)] = {"state": gns.state_dict(), "warnings": messages}
    with open(os.path.join(out_dir, f"overflow{rank}.json"), "w") as f:
        json.dump(runs, f)


def _count_reads(rank: int, out_dir: str) -> None:
    """Host reads during the synchronised backwards, copies held back as on a GPU."""
    from _ledger import host_reads

    from nnstat.background.transfer import LocalCopy

    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=1e-4)
    gns = nnstat.NoiseScale(window=10)
    gns.register_ddp(ddp, local_batch_size=B)
    LocalCopy.ready = False
    counter: list[str] = []
    with host_reads(counter):  # every thread's: the hook's futures finish off this one
        for step in range(STEPS):
            x, y = _data(step)
            sl = slice(rank * B, (rank + 1) * B)
            nn.functional.cross_entropy(ddp(x[sl]), y[sl]).backward()
            ddp.zero_grad()
    LocalCopy.ready = True
    with open(os.path.join(out_dir, f"reads{rank}.json"), "w") as f:
        json.dump({"reads": counter, "n_updates": gns.n_updates}, f)


def _accumulate(rank: int, out_dir: str) -> None:
    """Two micro-batches of B / 2 per rank and step, the first under no_sync()."""
    ddp = nn.parallel.DistributedDataParallel(_model(), bucket_cap_mb=1e-4)
    gns = nnstat.NoiseScale(window=10)
    micro = gns.watch_microbatches(ddp, micro_batch_size=B // 2, ranks=WORLD)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(STEPS):
        x, y = _data(step)
        for k, sync in ((0, ddp.no_sync()), (1, contextlib.nullcontext())):
            sl = slice(rank * B + k * B // 2, rank * B + (k + 1) * B // 2)
            with sync:
                (nn.functional.cross_entropy(ddp(x[sl]), y[sl]) / 2).backward()
        micro.end_step()
        opt.step()
        opt.zero_grad()
    with open(os.path.join(out_dir, f"micro{rank}.json"), "w") as f:
        json.dump(gns.state_dict(), f)


@pytest.mark.timeout(120)
def test_ddp_hook_matches_single_process(tmp_path):
    spawn(_train, str(tmp_path), world=WORLD)
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref = nnstat.NoiseScale(window=10)
    for step in range(STEPS):
        x, y = _data(step)
        local = []
        for r in range(WORLD):
            model.zero_grad()
            nn.functional.cross_entropy(
                model(x[r * B : (r + 1) * B]), y[r * B : (r + 1) * B]
            ).backward()
            local.append(_flat_grad(model).double().clone())
        global_grad = torch.stack(local).mean(0)
        local_sq = float(torch.stack([g.pow(2).sum() for g in local]).mean())
        ref.update(local_sq, float(global_grad.pow(2).sum()), B, WORLD * B)
        for r in range(WORLD):
            got = runs[r][step]
            # training is unchanged: the synchronised gradient is the global mean gradient
            assert torch.allclose(
                torch.tensor(got["grad"], dtype=torch.float64), global_grad, atol=1e-6
            )
            state = got["state"]["stats"][""]
            expected = ref.state_dict()["stats"][""]
            assert got["state"]["n_updates"] == step + 1
            assert state["nums"] == pytest.approx(expected["nums"], rel=1e-5)
            assert state["dens"] == pytest.approx(expected["dens"], rel=1e-5)
        with torch.no_grad():
            for p, g in zip(
                model.parameters(),
                global_grad.float().split([p.numel() for p in model.parameters()]),
                strict=True,
            ):
                p.grad = g.reshape(p.shape).clone()
        opt.step()


@pytest.mark.timeout(120)
def test_ddp_hook_leaves_a_non_finite_step_out_with_a_warning(tmp_path):
    """The estimate with the overflowed step is that of the same run without it (which
    `test_ddp_hook_matches_single_process` checks against a single-process reference)."""
    spawn(_skip_overflow, str(tmp_path), world=WORLD)
    for r in range(WORLD):
        got = json.loads((tmp_path / f"overflow{r}.json").read_text())
        assert got["True"]["state"] == got["False"]["state"]
        assert got["True"]["state"]["n_updates"] == STEPS
        assert got["False"]["warnings"] == []
        assert len(got["True"]["warnings"]) == 1
        assert "non-finite gradients" in got["True"]["warnings"][0]


@pytest.mark.timeout(120)
def test_ddp_hook_reads_nothing_back_inside_the_step(tmp_path):
    spawn(_count_reads, str(tmp_path), world=WORLD)
    for r in range(WORLD):
        got = json.loads((tmp_path / f"reads{r}.json").read_text())
        assert got == {"reads": [], "n_updates": STEPS}


@pytest.mark.timeout(120)
def test_micro_batches_under_ddp_no_sync_match_a_single_process_reference(tmp_path):
    """Each rank: its own micro-batches' gradients (local, before the all-reduce) against the
    all-reduced step gradient (B_big = ranks x micro-batches x samples)."""
    spawn(_accumulate, str(tmp_path), world=WORLD)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    refs = [nnstat.NoiseScale(window=10) for _ in range(WORLD)]
    for step in range(STEPS):
        x, y = _data(step)
        means = []  # [rank][micro-batch] mean gradients, each on its own
        for r in range(WORLD):
            means.append([])
            for k in range(2):
                sl = slice(r * B + k * B // 2, r * B + (k + 1) * B // 2)
                model.zero_grad()
                nn.functional.cross_entropy(model(x[sl]), y[sl]).backward()
                means[r].append(_flat_grad(model).double().clone())
        step_grad = torch.stack([g for r in means for g in r]).mean(0)
        for r in range(WORLD):
            small = float(torch.stack([g.pow(2).sum() for g in means[r]]).mean())
            refs[r].update(small, float(step_grad.pow(2).sum()), B // 2, WORLD * B)
        with torch.no_grad():
            sizes = [p.numel() for p in model.parameters()]
            for p, g in zip(model.parameters(), step_grad.float().split(sizes), strict=True):
                p.grad = g.reshape(p.shape).clone()
        opt.step()
    for r in range(WORLD):
        got = json.loads((tmp_path / f"micro{r}.json").read_text())["stats"][""]
        expected = refs[r].state_dict()["stats"][""]
        assert got["nums"] == pytest.approx(expected["nums"], rel=1e-5)
        assert got["dens"] == pytest.approx(expected["dens"], rel=1e-5)


def test_register_ddp_needs_distributed():
    with pytest.raises(RuntimeError, match="not initialised"):
        nnstat.NoiseScale().register_ddp(nn.Linear(2, 1), local_batch_size=4)


def _mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods: list[nn.Module] = [nn.Linear(6, 8), nn.Tanh()]
    for _ in range(layers - 1):
        mods += [nn.Linear(8, 8), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(8, 2))


class _Ops(TorchDispatchMode):
    """Counts aten ops (of this thread)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


def _count_ops(rank: int, out_dir: str) -> None:
    """aten ops of one step (one bucket) with the noise-scale feed and with DDP's Python
    all-reduce hook (the same reducer path without the noise scale), for 4 and 14 tensors. The
    all-reduce is made to finish before it returns, so the hooks' continuations run inline, on
    this thread, where the counter sees them."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from nnstat.gradient_noise.ddp import DDPStepNorms

    all_reduce = dist.all_reduce

    def blocking(*args, **kwargs):
        work = all_reduce(*args, **kwargs)
        work.wait()
        return work

    dist.all_reduce = blocking
    x, y = torch.randn(B, 6), torch.zeros(B, dtype=torch.long)
    ops = {}
    for layers in (1, 6):
        for feed_on in (False, True):
            ddp = nn.parallel.DistributedDataParallel(_mlp(layers))
            gns = nnstat.NoiseScale(beta=0.9)
            if feed_on:
                feed = DDPStepNorms(ddp, gns.add_staged)
            else:
                ddp.register_comm_hook(None, default_hooks.allreduce_hook)
            for it in range(3):  # the third: buckets rebuilt, everything warm
                counter = _Ops()
                with counter if it == 2 else contextlib.nullcontext():
                    if feed_on:
                        feed.count(B)
                    nn.functional.cross_entropy(ddp(x), y).backward()
                    if feed_on:
                        assert feed.end_step()
                ddp.zero_grad(set_to_none=True)
            ops[f"{layers}/{feed_on}"] = dict(counter.ops)
            assert gns.n_updates == (3 if feed_on else 0)
    dist.all_reduce = all_reduce
    with open(os.path.join(out_dir, f"ops{rank}.json"), "w") as f:
        json.dump(ops, f)


@pytest.mark.timeout(120)
def test_ddp_feed_adds_the_same_ops_for_4_and_14_tensors(tmp_path):
    spawn(_count_ops, str(tmp_path), world=WORLD)
    ops = json.loads((tmp_path / "ops0.json").read_text())
    added = {}
    for layers in (1, 6):
        diff = collections.Counter(ops[f"{layers}/True"])
        diff.subtract(ops[f"{layers}/False"])
        added[layers] = {k: v for k, v in diff.items() if v}
    assert added[1] == added[6]  # per bucket, not per tensor
    # the local and the all-reduced bucket's norms: one multi-tensor norm each
    assert added[1]["aten::_foreach_norm"] == 2


_SIZES = (2, 1)  # per-rank batch sizes: rank 1 has the smaller last batch of an epoch


def _unequal_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    return x, torch.randn(4, 1, generator=gen, dtype=torch.float64)


def _unequal_ranks(rank: int, out_dir: str, items: bool = False) -> None:
    """Every draw with replacement of rank 0's 2 and rank 1's 1 points from 4 (the exact
    expectation), at fixed weights, through `register_ddp` (this rank's size in the state) and
    through `DDPStepNorms` (the samples counted by the loop, as the callbacks do)."""
    import itertools

    from nnstat.gradient_noise.ddp import DDPStepNorms

    x, y = _unequal_data()
    out = {}
    for feed_kind in ("register_ddp", "step_norms"):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(3, 1).double(), bucket_cap_mb=1e-4)
        gns = nnstat.NoiseScale(window=10**6)
        count = torch.tensor(_SIZES[rank]) if items else None  # a device count, not a host int
        if feed_kind == "register_ddp":
            gns.register_ddp(ddp, local_batch_size=_SIZES[rank]).local_items = count
        else:
            feed = DDPStepNorms(ddp, gns.add_staged)
        for draw in itertools.product(range(4), repeat=sum(_SIZES)):
            idx = list(draw[: _SIZES[0]]) if rank == 0 else list(draw[_SIZES[0] :])
            if feed_kind == "step_norms":
                feed.count(len(idx), count)
            residual = (ddp(x[idx]) - y[idx]).pow(2)
            # HF's num_items_in_batch with average_tokens_across_devices: the items' sum over
            # the global count, times the world size (DDP averages)
            loss = residual.sum() * WORLD / sum(_SIZES) if items else residual.mean()
            loss.backward()
            if feed_kind == "step_norms":
                assert feed.end_step()
            ddp.zero_grad(set_to_none=True)
        out[feed_kind] = [gns.grad_sq_norm, gns.trace_sigma, gns.n_updates]
    with open(os.path.join(out_dir, f"unequal{rank}{'items' if items else ''}.json"), "w") as f:
        json.dump(out, f)


def _exact_unequal() -> tuple[float, float]:
    """``|G|^2`` and ``tr(Sigma)`` of `_unequal_data` at the initial weights (torch.func)."""
    x, y = _unequal_data()
    torch.manual_seed(0)
    return population_noise(nn.Linear(3, 1).double(), x, y)


@pytest.mark.timeout(120)
def test_ddp_ranks_of_unequal_batch_sizes_are_exact_in_expectation(tmp_path):
    """DDP averages the ranks' mean gradients equally: with ranks of 2 and 1 samples, every
    draw enumerated gives, on both ranks, the data's exact ``|G|^2`` and ``tr(Sigma)``
    (torch.func per-sample gradients); each rank using its own size biases both."""
    spawn(_unequal_ranks, str(tmp_path), world=WORLD)
    g_sq, trace = _exact_unequal()
    for r in range(WORLD):
        got = json.loads((tmp_path / f"unequal{r}.json").read_text())
        for feed_kind in ("register_ddp", "step_norms"):
            assert got[feed_kind][2] == 4 ** sum(_SIZES)
            assert got[feed_kind][:2] == pytest.approx([g_sq, trace], rel=1e-9)


@pytest.mark.timeout(120)
def test_ddp_ranks_summing_their_items_over_the_global_count_are_exact_in_expectation(tmp_path):
    """Each rank's loss is its items' sum over the global count times the world size (HF's
    ``average_tokens_across_devices``): rank r's gradient is ``R n_r / N`` times its items'
    mean. With ranks of 2 and 1 items and their counts given (`DDPNoiseScaleState.local_items`,
    `DDPStepNorms.count`), every draw enumerated gives the exact ``|G|^2`` and ``tr(Sigma)`` on
    both ranks; weighing the ranks equally overstates ``tr(Sigma)``."""
    spawn(_unequal_ranks, str(tmp_path), True, world=WORLD)
    g_sq, trace = _exact_unequal()
    for r in range(WORLD):
        got = json.loads((tmp_path / f"unequal{r}items.json").read_text())
        for feed_kind in ("register_ddp", "step_norms"):
            assert got[feed_kind][2] == 4 ** sum(_SIZES)
            assert got[feed_kind][:2] == pytest.approx([g_sq, trace], rel=1e-9)
