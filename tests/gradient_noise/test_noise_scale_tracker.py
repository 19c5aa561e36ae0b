"""nnstat.NoiseScale (streaming tracker) and the per-sample method through the capture engine."""

from __future__ import annotations

import json
import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.gradient_noise.maths import two_batch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def gaussian_stream(steps: int, seed: int = 0, d: int = 50, g_norm: float = 1.0, trace=100.0):
    """Squared norms of mean gradients of i.i.d. N(G, Sigma) samples, small batch inside big."""
    rng = np.random.default_rng(seed)
    g = np.zeros(d)
    g[0] = g_norm
    std = math.sqrt(trace / d)
    for _ in range(steps):
        samples = g + std * rng.standard_normal((64, d))
        yield float((samples[:8].mean(0) ** 2).sum()), float((samples.mean(0) ** 2).sum())


def test_ratio_of_averages_not_average_of_ratios():
    """Regression test: per-step |G|^2 estimates sometimes go negative, so per-step ratios are
    Cauchy-like and their average never settles; the ratio of averages does."""
    stream = list(gaussian_stream(4000))
    chunk_values, chunk_naive = [], []
    for start in range(0, 4000, 500):
        gns = nnstat.NoiseScale(window=500)
        ratios = []
        for small, big in stream[start : start + 500]:
            gns.update(small, big, 8, 64)
            g_sq, trace = two_batch(small, big, 8, 64)
            ratios.append(trace / g_sq)
        chunk_values.append(gns.value)
        chunk_naive.append(np.mean(ratios))
    assert np.allclose(chunk_values, 100.0, rtol=0.15), chunk_values
    assert np.max(np.abs(np.array(chunk_naive) - 100.0)) > 50.0, chunk_naive
    gns = nnstat.NoiseScale(window=4000)
    for small, big in stream:
        gns.update(small, big, 8, 64)
    assert gns.value == pytest.approx(100.0, rel=0.05)
    assert gns.grad_sq_norm == pytest.approx(1.0, rel=0.05)
    assert gns.trace_sigma == pytest.approx(100.0, rel=0.05)
    lo, hi = gns.interval
    assert lo < 100.0 < hi and hi - lo < 0.2 * gns.value
    assert gns.to_dict()["noise_scale/low"] == lo


def test_ema_is_ratio_of_separate_emas():
    beta = 0.9
    gns = nnstat.NoiseScale(beta=beta)
    num = den = 0.0
    for small, big in gaussian_stream(50, seed=1):
        gns.update(small, big, 8, 64)
        g_sq, trace = two_batch(small, big, 8, 64)
        num = beta * num + (1 - beta) * trace
        den = beta * den + (1 - beta) * g_sq
    assert gns.value == pytest.approx(num / den, rel=1e-12)
    bias = 1 - beta**50
    assert gns.grad_sq_norm == pytest.approx(den / bias, rel=1e-12)
    assert gns.trace_sigma == pytest.approx(num / bias, rel=1e-12)


@pytest.mark.parametrize("kwargs", [dict(beta=0.8), dict(window=7)])
def test_state_dict_round_trip(kwargs):
    a = nnstat.NoiseScale(**kwargs)
    stream = list(gaussian_stream(30, seed=2))
    for s, b in stream[:20]:
        a.update({"fc1": s * 0.25, "fc2": s * 0.75}, {"fc1": b * 0.25, "fc2": b * 0.75}, 8, 64)
    b_ = nnstat.NoiseScale(**kwargs)
    b_.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b_.to_dict() == a.to_dict()
    for s, b in stream[20:]:
        for t in (a, b_):
            t.update({"fc1": s * 0.25, "fc2": s * 0.75}, {"fc1": b * 0.25, "fc2": b * 0.75}, 8, 64)
    assert b_.to_dict() == a.to_dict()
    assert b_.n_updates == a.n_updates == 30
    assert set(a.layer_values()) == {"fc1", "fc2"}
    other = nnstat.NoiseScale(beta=0.5)
    with pytest.raises(ValueError, match="beta="):
        other.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="expected"):
        other.load_state_dict({"beta": 0.5})


def test_window_forgets_old_values():
    gns = nnstat.NoiseScale(window=2)
    gns.update(1 + 10 / 2, 1 + 10 / 8, 2, 8)  # B = 10
    for _ in range(2):
        gns.update(1 + 40 / 2, 1 + 40 / 8, 2, 8)  # B = 40
    assert gns.value == pytest.approx(40.0)


def test_update_grads_and_bad_input():
    gns = nnstat.NoiseScale(beta=0.0)
    small = {"w": torch.tensor([3.0, 4.0])}
    big = {"w": torch.tensor([2.0, 2.0])}
    gns.update_grads(small, big, 2, 8)
    g_sq, trace = two_batch(25.0, 8.0, 2, 8)
    assert gns.value == pytest.approx(trace / g_sq)
    assert gns.layer_values()["w"] == pytest.approx(trace / g_sq)
    with pytest.raises(ValueError, match="smaller than b_big"):
        gns.update(1.0, 1.0, 8, 8)
    with pytest.raises(ValueError, match="finite"):
        gns.update(float("nan"), 1.0, 2, 8)
    with pytest.raises(ValueError, match="keys differ"):
        gns.update({"a": 1.0}, {"b": 1.0}, 2, 8)
    with pytest.raises(ValueError, match="shapes differ"):
        gns.update_grads({"w": torch.ones(2)}, {"w": torch.ones(3)}, 2, 8)
    with pytest.raises(ValueError, match="not both"):
        nnstat.NoiseScale(beta=0.9, window=3)
    assert math.isnan(nnstat.NoiseScale().value)


def test_pure_noise_value_is_inf():
    gns = nnstat.NoiseScale(beta=0.5)
    gns.update(1.0, 1.0, 2, 8)  # equal norms: |G|^2 estimate = 1 > 0, tr = 0
    gns.update(10.0, 1.0, 2, 8)  # |G|^2 estimate -2 pushes the average below zero
    assert gns.grad_sq_norm < 0
    assert gns.value == math.inf


def _reference(model: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """Per-module mean per-sample squared norm and |G_B|^2 from torch.func."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return nn.functional.cross_entropy(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    small, big = {}, {}
    for mod in ("0", "2"):
        per = [g[f"{mod}.{p}"].reshape(len(x), -1) for p in ("weight", "bias")]
        flat = torch.cat(per, 1).double()
        small[mod] = float(flat.pow(2).sum(1).mean())
        big[mod] = float(flat.mean(0).pow(2).sum())
    return small, big


def test_tracker_per_sample_matches_torch_func_with_accumulation():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    gns = nnstat.NoiseScale(window=1)
    assert gns.watch(model) == ["0", "2"]
    for step in range(2):  # no zero_grad: the tracker must use this batch's gradient only
        x, y = torch.randn(16, 5), torch.randint(0, 3, (16,))
        with gns.batch():
            nn.functional.cross_entropy(model(x), y).backward()
        small, big = _reference(model, x, y)
        for mod in ("0", "2"):
            g_sq, trace = two_batch(small[mod], big[mod], 1, 16)
            got = gns.layer_estimates()[mod]
            assert got == pytest.approx((g_sq, trace), rel=1e-4, abs=1e-7), step
            expected = trace / g_sq if g_sq > 0 else math.inf
            assert gns.layer_values()[mod] == pytest.approx(expected, rel=1e-4)
        g_sq, trace = two_batch(sum(small.values()), sum(big.values()), 1, 16)
        assert gns.grad_sq_norm == pytest.approx(g_sq, rel=1e-4, abs=1e-7)
        assert gns.trace_sigma == pytest.approx(trace, rel=1e-4)
    gns.unwatch()
    with pytest.raises(ValueError, match="at least 2 samples, got 1: .*drop_last=True"):
        gns.watch(model)
        with gns.batch():
            nn.functional.cross_entropy(model(x[:1]), y[:1]).backward()
    gns.unwatch()


def test_tracker_batch_that_raises_leaves_no_stale_capture():
    """An exception inside ``with gns.batch()`` updates nothing, and the next batch uses only
    its own captures (a stale one would make a module look captured twice)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    gns = nnstat.NoiseScale(window=1)
    gns.watch(model)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with pytest.raises(KeyError):
        with gns.batch():
            nn.functional.cross_entropy(model(x), y).backward()
            raise KeyError("user error after backward")
    assert gns.n_updates == 0 and math.isnan(gns.value)
    model.zero_grad(set_to_none=True)
    with gns.batch():
        nn.functional.cross_entropy(model(x), y).backward()
    small, big = _reference(model, x, y)
    g_sq, trace = two_batch(sum(small.values()), sum(big.values()), 1, 8)
    assert gns.n_updates == 1
    assert gns.grad_sq_norm == pytest.approx(g_sq, rel=1e-4, abs=1e-7)
    assert gns.trace_sigma == pytest.approx(trace, rel=1e-4)
    with pytest.raises(RuntimeError, match="no watched module"):
        with gns.batch():  # grad mode off: nothing captured, a clear error
            with torch.no_grad():
                model(x)
    assert gns.n_updates == 1
    gns.unwatch()


def test_nonfinite_or_negative_norms_are_named():
    """Norms handed to ``update`` are the caller's input: NaN/Inf or negative ones raise."""
    gns = nnstat.NoiseScale(window=3)
    with pytest.raises(ValueError, match="layer 'b'.*finite and >= 0"):
        gns.update({"a": 1.0, "b": -0.5}, {"a": 0.5, "b": 0.1}, 2, 8)
    with pytest.raises(ValueError, match="layer 'a'.*g_big_sq=inf"):
        gns.update({"a": 1.0, "b": 0.5}, {"a": math.inf, "b": 0.1}, 2, 8)
    assert gns.n_updates == 0


def _assert_per_sample_steps(state: dict, expected: list, n: int, factors: list | None = None):
    """The tracker's per-step ``dens``/``nums`` (a window holding every step) are the
    two-batch estimates (``B_small = 1``, ``B_big = n``) of `expected`'s `_reference` pairs,
    times ``factors`` (one per step: a loss scale squared) if given."""
    for step, (small, big) in enumerate(expected):
        f = 1.0 if factors is None else factors[step]
        pairs = {mod: (small[mod] * f, big[mod] * f) for mod in small}
        pairs[""] = (sum(small.values()) * f, sum(big.values()) * f)
        for mod, (s_sq, b_sq) in pairs.items():
            g_sq, trace = two_batch(s_sq, b_sq, 1, n)
            # float32 norms: each input within ~1e-6 of its size, through the differences
            g_tol, t_tol = 1e-5 * (n * b_sq + s_sq) / (n - 1), 1e-5 * (s_sq + b_sq) * n / (n - 1)
            assert state[mod]["dens"][step] == pytest.approx(g_sq, abs=g_tol)
            assert state[mod]["nums"][step] == pytest.approx(trace, abs=t_tol)
    assert all(len(state[mod]["dens"]) == len(expected) for mod in state)


def test_a_batch_with_non_finite_norms_is_left_out_with_a_warning():
    """A NaN in one sample reaches every layer's norms: the batch is left out with a warning
    (training goes on), and the tracker holds the run without it, batch for batch the
    torch.func reference of the other batches."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    batches = [(torch.randn(8, 4), torch.randint(0, 3, (8,))) for _ in range(3)]
    batches[1][0][3, 1] = math.nan

    def run(which: list[int]) -> nnstat.NoiseScale:
        gns = nnstat.NoiseScale(window=3)
        gns.watch(model)
        for i in which:
            x, y = batches[i]
            model.zero_grad(set_to_none=True)  # what a skipped step leaves: no stale NaN
            warns = pytest.warns(RuntimeWarning, match="non-finite gradients")
            with warns if i == 1 else warnings.catch_warnings():
                if i != 1:
                    warnings.simplefilter("error")
                with gns.batch():
                    nn.functional.cross_entropy(model(x), y).backward()
        gns.unwatch()
        return gns

    gns, without = run([0, 1, 2]), run([0, 2])
    assert gns.n_updates == 2
    assert gns.state_dict() == without.state_dict()
    expected = [_reference(model, *batches[i]) for i in (0, 2)]
    _assert_per_sample_steps(gns.state_dict()["stats"], expected, 8)
    assert math.isfinite(gns.value)


def test_per_sample_method_agrees_with_two_batch():
    """Both methods are unbiased: on a small MLP their estimates agree within their errors."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    x, y = torch.randn(512, 8), torch.randint(0, 3, (512,))
    loss = nn.functional.cross_entropy
    model.zero_grad()
    model[0].weight.grad = torch.ones_like(model[0].weight)
    ps = nnstat.noise_scale(model, loss, (x, y), method="per_sample", big_batch=64, n_estimates=300)
    tb = nnstat.noise_scale(model, loss, (x, y), small_batch=8, big_batch=64, n_estimates=300)
    assert set(ps.per_layer) == {"0", "2"}
    assert ps.n_samples == 300 * 64
    se = math.hypot(ps.b_simple_stderr, tb.b_simple_stderr)
    assert abs(ps.b_simple - tb.b_simple) < 4 * se
    assert ps.b_simple_stderr < 0.1 * ps.b_simple
    # the user's gradients are left alone
    assert torch.equal(model[0].weight.grad, torch.ones_like(model[0].weight))
    assert model[2].weight.grad is None


def test_provider_feeds_tracker():
    model = nn.Linear(3, 1)
    gns = nnstat.NoiseScale(beta=0.5)
    gns.update({"weight": 3.0}, {"weight": 1.5}, 2, 8)
    tracker = nnstat.Tracker(model, groups=["weight"], stats=["l2"])
    tracker.add_provider(gns.as_provider())
    metrics = tracker.step()
    assert metrics["noise_scale/b_simple"] == pytest.approx(gns.value)
    assert metrics["noise_scale/weight/b_simple"] == pytest.approx(gns.value)


def test_the_callbacks_driver_leaves_a_grad_scaler_skipped_per_sample_step_out():
    """The HF and Lightning callbacks' driver with one process and no accumulation (the
    per-sample estimator), called in the HF Trainer's order around a real GradScaler: the step
    it skips for an overflow is left out with a warning and not counted, training goes on,
    and the other steps are the torch.func reference times their own scale squared (the
    per-sample and batch gradients were both measured scaled, before ``unscale_``); each
    logged step carries the noise scale as of that step."""
    from nnstat.integrations._hooks import StatsOptions, StepStats

    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    n, skipped = 8, 3
    hooks = StepStats(StatsOptions(stats=["l2"], groups=["weight"], noise_scale_window=10))
    hooks.configure(accumulation_steps=1, micro_batch_size=n)
    assert hooks.method == "per_sample"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1000)
    gen = torch.Generator().manual_seed(6)
    expected, factors, counted = [], [], []
    for step in range(6):
        x, y = torch.randn(n, 4, generator=gen), torch.randint(0, 3, (n,), generator=gen)
        if step not in (0, skipped):  # the first batch only probes which modules to watch
            expected.append(_reference(model, x, y))
            factors.append(scaler.get_scale() ** 2)
        counted.append(len(expected))
        hooks.begin_batch(model)  # on_step_begin
        loss = nn.functional.cross_entropy(model(x), y)
        if step == skipped:
            loss = loss * math.inf  # an fp16 overflow, as the scaler sees it
        scaler.scale(loss).backward()
        warns = pytest.warns(RuntimeWarning, match="non-finite gradients")
        with warns if step == skipped else warnings.catch_warnings():
            if step != skipped:
                warnings.simplefilter("error")
            hooks.before_clip()  # inside accelerator.clip_grad_norm_, before its unscale_
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        hooks.before_step(model, opt, log=True)  # on_pre_optimizer_step
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        assert (scaler.get_scale() < scale) == (step == skipped)  # the scaler skipped it
        hooks.after_step(step)  # on_optimizer_step
        opt.zero_grad(set_to_none=True)
    assert hooks.gns.n_updates == len(expected) == 4
    stats = hooks.gns.state_dict()["stats"]
    _assert_per_sample_steps(stats, expected, n, factors)
    logged = dict(hooks.collect(wait=True))
    assert sorted(logged) == list(range(6))
    assert not any(k.startswith("noise_scale/") for k in logged[0])  # nothing measured yet
    for step in range(1, 6):  # the window's means over the steps counted by then
        k = counted[step]
        for key, what in (("grad_sq_norm", "dens"), ("trace_sigma", "nums")):
            mean = sum(stats[""][what][:k]) / k
            assert logged[step][f"noise_scale/{key}"] == pytest.approx(mean, rel=1e-12)
    noise = {
        s: {k: v for k, v in m.items() if k.startswith("noise_scale/")} for s, m in logged.items()
    }
    assert noise[skipped] == noise[skipped - 1]  # the skipped step added nothing
    hooks.close()
