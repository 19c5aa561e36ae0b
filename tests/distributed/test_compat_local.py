"""Every model-facing capability under torch.compile, autocast bf16 and activation checkpointing.

References are independent of nnstat: ``torch.func`` per-sample gradients (under the same autocast
when the model runs in bf16), closed-form K-FAC input factors, numpy statistics of the gradients.
``aot_eager`` proves the hooks survive dynamo + AOTAutograd; one test uses inductor.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils.checkpoint import checkpoint

import nnstat
from nnstat.capture import CaptureEngine
from nnstat.curvature import StatisticsCollector

MODES = ("checkpoint", "compile", "autocast")
N = 6
pytestmark = pytest.mark.timeout(300)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.LayerNorm(7), nn.Linear(7, 3))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)


def _amp(mode: str):
    return (
        torch.autocast("cpu", dtype=torch.bfloat16)
        if mode == "autocast"
        else (contextlib.nullcontext())
    )


def forward(mode: str, m: nn.Module, x: torch.Tensor, backend: str = "aot_eager") -> torch.Tensor:
    """The model's output computed the way `mode` says (float32 logits)."""
    if mode == "checkpoint":
        # the first block is recomputed in backward: its hooks fire twice in forward
        h = checkpoint(m[:3], x, use_reentrant=False)
        return m[3](h)
    if mode == "compile":
        torch._dynamo.reset()
        return torch.compile(m, backend=backend)(x)
    with _amp(mode):
        return m(x).float()


def per_sample_ref(mode: str, m: nn.Module) -> dict[str, torch.Tensor]:
    x, y = data()
    params = {k: v.detach() for k, v in m.named_parameters()}
    if mode == "autocast":
        # torch.func cannot differentiate through autocast: one autograd backward per sample
        names, leaves = list(params), [p.clone().requires_grad_() for p in params.values()]
        rows = []
        for i in range(N):
            with _amp(mode):
                out = functional_call(
                    m, dict(zip(names, leaves, strict=True)), (x[i : i + 1],)
                ).float()
            loss = F.cross_entropy(out, y[i : i + 1], reduction="sum")
            rows.append(torch.autograd.grad(loss, leaves))
        return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(names)}

    def loss(p, xi, yi):
        out = functional_call(m, p, (xi[None],))
        return F.cross_entropy(out, yi[None], reduction="sum")

    return vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)


def tol(mode: str) -> dict:
    # bf16 matmuls: per-sample products differ in rounding between batched and vmapped calls
    return dict(rtol=3e-2, atol=3e-2) if mode == "autocast" else dict(rtol=1e-4, atol=1e-6)


def capture_grads(mode: str, backend: str = "aot_eager") -> tuple[nn.Module, dict]:
    m = model()
    x, y = data()
    engine = CaptureEngine()
    engine.watch(m)
    got: dict[str, torch.Tensor] = {}

    def keep(cap) -> None:
        for p, g in cap.per_sample_grads_by_param().items():
            got[f"{cap.name}.{p}"] = g

    engine.add_consumer(keep)
    with engine.batch(loss_reduction="sum"):
        F.cross_entropy(forward(mode, m, x, backend), y, reduction="sum").backward()
    engine.unwatch()
    return m, got


@pytest.mark.parametrize("mode", MODES)
def test_capture_per_sample_grads_match_torch_func(mode):
    m, got = capture_grads(mode)
    ref = per_sample_ref(mode, m)
    assert set(got) == set(ref)
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, **tol(mode), msg=k)
    # the per-sample gradients add up to the gradient autograd computed in the same mode
    for k, p in m.named_parameters():
        torch.testing.assert_close(got[k].sum(0), p.grad, **tol(mode), msg=k)


def test_capture_under_inductor_matches_torch_func():
    m, got = capture_grads("compile", backend="inductor")
    ref = per_sample_ref("compile", m)
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-6, msg=k)


@pytest.mark.parametrize("mode", MODES)
def test_statistics_ekfac_match_eager_and_closed_form(mode):
    x, y = data()

    def collect(how: str) -> dict:
        m = model()
        engine = CaptureEngine()
        engine.watch(m)
        col = StatisticsCollector("ekfac")
        engine.add_consumer(col)
        for _ in col.passes:
            with engine.batch(loss_reduction="mean"):
                F.cross_entropy(forward(how, m, x), y).backward()
            col.finalize()
        engine.unwatch()
        return col.state_dict()

    got, eager = collect(mode), collect("eager")
    assert set(got) == set(eager)
    a = torch.cat([x, torch.ones(N, 1)], 1)
    torch.testing.assert_close(got["0/forward/covariance"], a.T @ a / N, rtol=1e-5, atol=1e-6)
    for k, v in eager.items():
        if k.endswith("eigenvectors"):
            continue  # sign/order of near-degenerate eigenvectors is not comparable across modes
        scale = dict(rtol=5e-2, atol=5e-3 * float(v.abs().max())) if mode == "autocast" else {}
        torch.testing.assert_close(got[k], v, **(scale or dict(rtol=1e-4, atol=1e-6)), msg=k)


@pytest.mark.parametrize("mode", MODES)
def test_store_rows_match_projected_torch_func(mode, tmp_path):
    m = model()
    x, y = data()
    run = nnstat.init(project=mode, root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(m)
    nnstat.add_projection(rank=2)
    with run(data_id=list(range(N))):
        F.cross_entropy(forward(mode, m, x), y, reduction="sum").backward()
    nnstat.finalize()
    nnstat.unwatch()
    store = nnstat.GradientStore(run.path)
    ref = per_sample_ref(mode, m)
    proj = store.projections()
    rows = store.rows(0, len(store))
    assert store.ids == list(range(N))
    for spec in store.modules:
        name = spec["name"]
        block = rows[:, spec["offset"] : spec["offset"] + spec["width"]]
        w, b = ref[f"{name}.weight"], ref[f"{name}.bias"]
        if spec["kind"] == "layernorm":
            g = torch.cat([w, b], 1)
            want = g if f"{name}/p_in" not in proj else g @ proj[f"{name}/p_in"].T
        else:
            g = torch.cat([w, b[:, :, None]], 2)
            if f"{name}/p_in" in proj:
                g = g @ proj[f"{name}/p_in"].T
            if f"{name}/p_out" in proj:
                g = proj[f"{name}/p_out"] @ g
            want = g.reshape(N, -1)
        torch.testing.assert_close(block, want, **tol(mode), msg=name)


@pytest.mark.parametrize("mode", MODES)
def test_noise_scale_per_sample_matches_torch_func(mode):
    m = model()
    x, y = data()
    gns = nnstat.NoiseScale(window=4)
    gns.watch(m)
    with gns.batch():
        F.cross_entropy(forward(mode, m, x), y).backward()
    gns.unwatch()
    per = torch.cat([v.reshape(N, -1) for v in per_sample_ref(mode, m).values()], 1).double()
    want = nnstat.NoiseScale(window=4)
    want.update(float(per.pow(2).sum(1).mean()), float(per.mean(0).pow(2).sum()), 1, N)
    rel = 5e-2 if mode == "autocast" else 1e-4
    assert gns.grad_sq_norm == pytest.approx(want.grad_sq_norm, rel=rel)
    assert gns.value == pytest.approx(want.value, rel=rel)


@pytest.mark.parametrize("mode", MODES)
def test_tracker_and_describe_match_numpy(mode):
    m = model()
    x, y = data()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    tracker = nnstat.Tracker(m, opt, stats=["l2", "mean", "max", "nonfinite"])
    F.cross_entropy(forward(mode, m, x), y, reduction="sum").backward()
    ref = {k: v.sum(0).double().numpy().ravel() for k, v in per_sample_ref(mode, m).items()}
    desc = nnstat.get_grad(m).describe_layers(stats=["l2", "mean"])
    opt.step()
    metrics = tracker.step()
    rel = 3e-2 if mode == "autocast" else 1e-4
    for k, g in ref.items():
        norm = float(np.linalg.norm(g))
        assert metrics[f"grad/{k}/l2"] == pytest.approx(norm, rel=rel)
        assert desc[f"{k}/l2"] == pytest.approx(norm, rel=rel)
        assert desc[f"{k}/mean"] == pytest.approx(g.mean(), abs=rel * np.abs(g).mean() + 1e-7)
        # the update of plain SGD is -lr * grad
        assert metrics[f"update/{k}/l2"] == pytest.approx(0.1 * np.linalg.norm(g), rel=rel)
        assert metrics[f"update/{k}/max"] == pytest.approx(float((-0.1 * g).max()), rel=rel)
        assert metrics[f"grad/{k}/nonfinite"] == 0


@pytest.mark.parametrize("mode", MODES)
def test_recorder_activations_match_autograd(mode, tmp_path):
    from nnstat.recorder import STAT_NAMES, Recorder, read_step_meta, read_step_stats

    m = model()
    x, y = data()
    rec = Recorder(tmp_path, every=1)
    rec.track_module(m)
    rec.track_activations(m, loss_reduction="sum")
    rec.start_batch(0)
    out = rec.register_tensor("out", forward(mode, m, x), role="output")
    loss = rec.register_tensor("loss", F.cross_entropy(out, y, reduction="sum"), role="loss")
    loss.backward()
    rec.finish_batch()
    rec.close()
    meta = read_step_meta(rec.path)[0]
    stats = read_step_stats(rec.path, "train-000000000")
    r = meta["rows"]
    keys = list(zip(r["tensor"], r["stream"], r["sample"], strict=True))
    col = {s: i for i, s in enumerate(STAT_NAMES)}
    # independent reference: the last layer's input and the first layer's output gradient
    with _amp(mode):
        z = m[0](x).detach().requires_grad_(True)
        h = m[2](m[1](z))
        logits = m[3](h).float()
    (gz,) = torch.autograd.grad(F.cross_entropy(logits, y, reduction="sum"), z)
    rel = 3e-2 if mode == "autocast" else 1e-5
    # a recomputed forward (checkpointing) must not add a second record
    assert keys.count(("0:input", "forward", -1)) == 1
    assert keys.count(("3:input", "forward", -1)) == 1
    got_x = stats[keys.index(("0:input", "forward", -1))][col["norm"]]
    np.testing.assert_allclose(got_x, float(x.norm()), rtol=1e-5)
    got_h = stats[keys.index(("3:input", "forward", -1))][col["norm"]]
    np.testing.assert_allclose(got_h, float(h.float().norm()), rtol=rel)
    got_g = stats[keys.index(("0:output", "gradient", -1))][col["norm"]]
    np.testing.assert_allclose(got_g, float(gz.float().norm()), rtol=rel)
