"""The main paths on CUDA, each compared with the same computation on the CPU.

Marked ``cuda``: they run wherever a GPU exists and skip elsewhere (CI has none). Besides
equal results they check the device contract of docs/architecture.md: tensors stay on the
GPU until one transfer per logged step, counted with ``torch.cuda.set_sync_debug_mode``
(which warns on, or with ``"error"`` refuses, every synchronising call: ``.item()``,
``.cpu()``, ``.tolist()``, ...); the Tracker's and the noise scale's steps make none at all
(their one copy to the host does not wait).
``NNSTAT_TEST_DEVICE=cpu`` runs the same code on the CPU twice, to check the tests themselves
where no GPU exists (the synchronisation counts are then empty).
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.capture import CaptureEngine

DEV = os.environ.get("NNSTAT_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"
    ),
]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 5))


def data(n: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


@contextlib.contextmanager
def count_syncs():
    """Yields a list that holds, on exit, the messages of the synchronising CUDA calls."""
    found: list[str] = []
    if DEV != "cuda":
        yield found
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found.extend(str(w.message) for w in caught if "synchroniz" in str(w.message).lower())


@contextlib.contextmanager
def no_syncs():
    """Any synchronising CUDA call inside the block raises (``set_sync_debug_mode("error")``)."""
    if DEV != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _train_tracker(device: str, steps: int = 4, strict: bool = False, **kw) -> list[tuple]:
    model = mlp().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = (t.to(device) for t in data())
    out: list[tuple] = []
    sink = [lambda m, step: out.append((step, dict(m)))]
    tracker = nnstat.Tracker(model, opt, every=1, sinks=sink, **kw)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        with no_syncs() if strict else contextlib.nullcontext():
            tracker.step()
    tracker.close()
    return out


@pytest.mark.parametrize(
    "kw", [{}, {"stats": None, "histograms": True, "bins": 16}], ids=["default", "full+hist"]
)
def test_tracker_cuda_equals_cpu_and_never_syncs_inside_step(kw):
    cpu = _train_tracker("cpu", **kw)
    gpu = _train_tracker(DEV, strict=True, **kw)  # a synchronisation inside step() raises
    assert [s for s, _ in gpu] == [s for s, _ in cpu] == [0, 1, 2, 3]  # every step, in order
    for (_, a), (_, b) in zip(cpu, gpu, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if hasattr(a[k], "counts"):
                assert b[k].num == a[k].num and b[k].max == pytest.approx(a[k].max, rel=2e-3)
            else:
                assert b[k] == pytest.approx(a[k], rel=2e-3, abs=1e-5), k


def test_capture_per_sample_grads_cuda_match_torch_func():
    model = mlp().to(DEV)
    x, y = (t.to(DEV) for t in data(16))
    engine = CaptureEngine()
    engine.watch(model)
    caps = {}
    engine.add_consumer(lambda cap: caps.__setitem__(cap.name, cap))
    with engine.batch(loss_reduction="sum"):
        F.cross_entropy(model(x), y, reduction="sum").backward()
    engine.unwatch()
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return F.cross_entropy(functional_call(model, p, (xi[None],)), yi[None], reduction="sum")

    ref = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    assert set(caps) == {"0", "2", "3"}
    for name, cap in caps.items():
        for pname, g in cap.per_sample_grads_by_param().items():
            assert g.device.type == DEV
            torch.testing.assert_close(g, ref[f"{name}.{pname}"], rtol=1e-4, atol=1e-5)


def _log_store(device: str, root: str) -> nnstat.GradientStore:
    model = mlp().to(device)
    x, y = (t.to(device) for t in data())
    run = nnstat.init(project=f"store-{device}", root_dir=root)
    nnstat.setup({"statistic": "kfac"})
    nnstat.watch(model)
    nnstat.add_projection(rank=4, seed=0)
    for lo in range(0, len(x), 16):
        with run(data_id=list(range(lo, lo + 16))):
            F.cross_entropy(model(x[lo : lo + 16]), y[lo : lo + 16], reduction="sum").backward()
        model.zero_grad()
    nnstat.finalize()
    nnstat.unwatch()
    return nnstat.GradientStore(f"{root}/store-{device}")


def test_store_and_influence_cuda_equal_cpu(tmp_path):
    cpu = _log_store("cpu", str(tmp_path))
    gpu = _log_store(DEV, str(tmp_path / "dev"))
    assert cpu.ids == gpu.ids
    torch.testing.assert_close(gpu.rows(0, len(gpu)), cpu.rows(0, len(cpu)), rtol=1e-3, atol=1e-5)
    for pre in ("identity", "kfac", "ekfac"):
        a = nnstat.influence.compute_influence_all(cpu, cpu.path, preconditioner=pre)
        b = nnstat.influence.compute_influence_all(gpu, gpu.path, preconditioner=pre)
        torch.testing.assert_close(b.scores, a.scores, rtol=2e-3, atol=1e-4, msg=pre)


@pytest.mark.parametrize("method", ["two_batch", "per_sample"])
def test_noise_scale_cuda_equals_cpu(method):
    x, y = data(256)
    kw = dict(method=method, small_batch=4, big_batch=32, n_estimates=4, seed=3)
    a = nnstat.noise_scale(mlp(), F.cross_entropy, (x, y), **kw)
    b = nnstat.noise_scale(mlp().to(DEV), F.cross_entropy, (x.to(DEV), y.to(DEV)), **kw)
    assert b.b_simple == pytest.approx(a.b_simple, rel=1e-3)


def test_streaming_noise_scale_cuda_never_syncs_inside_batch():
    def run(device: str, strict: bool) -> nnstat.NoiseScale:
        model = mlp().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        x, y = (t.to(device) for t in data(64))
        ns = nnstat.NoiseScale(beta=0.5)
        ns.watch(model)
        for i in range(4):
            opt.zero_grad()
            # the first block checks how the loss reduced (MeanLossProbe reads it once)
            with no_syncs() if strict and i else contextlib.nullcontext():
                with ns.batch():
                    F.cross_entropy(model(x), y).backward()
            opt.step()
        return ns

    cpu, gpu = run("cpu", False), run(DEV, True)
    assert gpu.n_updates == cpu.n_updates == 4  # reading waits for the copies
    assert gpu.trace_sigma == pytest.approx(cpu.trace_sigma, rel=1e-3)
    assert gpu.grad_sq_norm == pytest.approx(cpu.grad_sq_norm, rel=1e-3)


def test_recorder_cuda_equals_cpu(tmp_path):
    from nnstat.recorder import STAT_NAMES, Recorder, read_step_stats

    def record(device: str) -> torch.Tensor:
        model = mlp().to(device)
        x, y = (t.to(device) for t in data())
        rec = Recorder(str(tmp_path / f"rec-{len(list(tmp_path.iterdir()))}"), every=1)
        rec.track_module(model)
        rec.start_batch(0)
        loss = F.cross_entropy(model(x), y)
        rec.register_tensor("loss", loss, role="loss")
        loss.backward()
        rec.finish_batch()
        rec.close()
        return read_step_stats(rec.path, "train-000000000")

    a, b = record("cpu"), record(DEV)
    assert a.shape == b.shape and a.shape[-1] == len(STAT_NAMES)
    torch.testing.assert_close(b, a, rtol=2e-3, atol=1e-5, equal_nan=True)


def _log_blocks(device: str, root: str, syncs: list | None = None) -> nnstat.GradientStore:
    """A logging pass (every module, a padding mask on sequence inputs, an embedding):
    ``syncs`` gets ``(what, synchronising calls)`` of the backward of blocks 1 and 3 and of the
    whole of blocks 2 and 4 (block 0 also fingerprints the weights; the counter does not nest)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(30, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    model = model.to(device)
    g = torch.Generator().manual_seed(1)
    run = nnstat.init(project=f"rows-{device}", root_dir=root)
    nnstat.setup({"statistic": "none", "rank": 4})
    nnstat.watch(model)
    for b in range(5):
        idx = torch.randint(0, 30, (8, 6), generator=g).to(device)
        mask = (torch.rand(8, 6, generator=g) > 0.2).float().to(device)
        whole = count_syncs() if b and b % 2 == 0 else contextlib.nullcontext([])
        with whole as found_whole:
            with run(data_id=list(range(8 * b, 8 * b + 8)), mask=mask):
                loss = model(idx).square().sum()
                inside = count_syncs() if b % 2 else contextlib.nullcontext([])
                with inside as found_inside:
                    loss.backward()
        if syncs is not None and b:
            syncs.append(("backward", len(found_inside)) if b % 2 else ("block", len(found_whole)))
        model.zero_grad()
    nnstat.finalize()
    nnstat.unwatch()
    return nnstat.GradientStore(f"{root}/rows-{device}")


def test_logging_cuda_equals_cpu_and_reads_once_per_block(tmp_path):
    """The rows stay on the GPU until one non-blocking copy per block: nothing synchronises
    inside backward; the weights guard's and the rows' NaN/Inf flags travel in that copy and
    are checked by the writer's thread (a block reads at most what the bound below allows)."""
    cpu = _log_blocks("cpu", str(tmp_path))
    syncs: list[tuple[str, int]] = []
    gpu = _log_blocks(DEV, str(tmp_path / "dev"), syncs)
    assert cpu.ids == gpu.ids == list(range(40))
    torch.testing.assert_close(gpu.rows(0, 40), cpu.rows(0, 40), rtol=1e-4, atol=1e-5)
    assert all(n <= (what == "block") for what, n in syncs), syncs


def _train_callback_driver(device: str, strict: bool) -> list[tuple]:
    """The training callbacks' shared driver (`StepStats`), logging steps 2, 3 and 5."""
    from nnstat.integrations._hooks import StatsOptions, StepStats

    model = mlp().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = (t.to(device) for t in data())
    hooks = StepStats(StatsOptions(noise_scale_every=1))
    out: list[tuple] = []
    for step in range(1, 7):
        opt.zero_grad()
        hooks.begin_batch(model)
        F.cross_entropy(model(x), y).backward()
        # the noise scale's first block reads the loss once (its reduction check); its blocks
        # never sync after that (test_streaming_noise_scale_cuda_never_syncs_inside_batch)
        hooks.end_backward()
        with no_syncs() if strict else contextlib.nullcontext():
            hooks.before_step(model, opt, log=step in (2, 3, 5))  # the snapshot: one copy
            opt.step()
            hooks.after_step(step)  # queued: nothing read back
            out += hooks.collect()  # only what has arrived: never waits
    hooks.close()
    return out + hooks.collect()


def test_callback_driver_cuda_equals_cpu_and_never_syncs_inside_the_step():
    cpu = _train_callback_driver("cpu", False)
    gpu = _train_callback_driver(DEV, True)  # a synchronisation inside the step raises
    assert [s for s, _ in gpu] == [s for s, _ in cpu] == [2, 3, 5]
    for (_, a), (_, b) in zip(cpu, gpu, strict=True):
        assert a.keys() == b.keys() and "trust_ratio/0.weight" in a
        for k in a:
            assert b[k] == pytest.approx(a[k], rel=2e-3, abs=1e-5), k
