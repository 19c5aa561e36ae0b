"""`NoiseScale.watch_microbatches`: the noise scale from gradient accumulation's micro-batches.

Checked against per-micro-batch gradients computed independently (``torch.autograd.grad`` and
the two-batch formula), against the closed form of linear regression (unbiased for ``|G|^2``
and ``tr(Sigma)`` over many draws), against the per-sample estimator on the same run (both
intervals hold the exact ``B_simple`` of the data), and on ``meta`` for what it launches and
reads inside the step.
"""

from __future__ import annotations

import collections
import contextlib
import math
import warnings

import numpy as np
import pytest
import torch
from _ledger import DeviceLedger, Kernels, host_reads
from _noise_ref import population_noise
from torch import nn

import nnstat
from nnstat.background.transfer import LocalCopy
from nnstat.gradient_noise.maths import two_batch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _mlp(layers: int = 1, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(6, 6), nn.Tanh()]
    return nn.Sequential(*mods, nn.Linear(6, 3))


def _data(n: int = 64, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _micro_pairs(model: nn.Module, x, y, idx: list) -> tuple[dict[str, float], dict[str, float]]:
    """The reference: each micro-batch's mean gradient on its own (``torch.autograd.grad``,
    before any backward), reduced per layer to ``mean_k |g_k|^2`` and ``|mean_k g_k|^2``."""
    k = len(idx)
    means = [
        torch.autograd.grad(
            nn.functional.cross_entropy(model(x[i]), y[i]), list(model.parameters())
        )
        for i in idx
    ]
    names = [n for n, _ in model.named_parameters()]
    small, big = collections.defaultdict(float), collections.defaultdict(float)
    for j, name in enumerate(names):
        layer = name.rpartition(".")[0]
        stack = torch.stack([m[j].double() for m in means])
        small[layer] += float(stack.pow(2).sum()) / k
        big[layer] += float(stack.mean(0).pow(2).sum())
    return dict(small), dict(big)


def _assert_steps(state: dict, expected: list, b: int, k: int, factors: list | None = None):
    """The tracker's per-step ``dens``/``nums`` (a window holding every step) are the
    two-batch estimates of `expected`'s pairs (times ``factors``, one per step, if given)."""
    for step, (small, big) in enumerate(expected):
        pairs = {layer: (small[layer], big[layer]) for layer in small}
        pairs[""] = (sum(small.values()), sum(big.values()))
        for layer, (s_sq, b_sq) in pairs.items():
            if factors is not None:
                s_sq, b_sq = s_sq * factors[step], b_sq * factors[step]
            g_sq, trace = two_batch(s_sq, b_sq, b, k * b)
            # the norms accumulate in float32: each input within ~1e-6 of its own size,
            # carried through the two-batch formula's differences
            g_tol = 1e-6 * (k * b * b_sq + b * s_sq) / (k * b - b)
            t_tol = 1e-6 * (s_sq + b_sq) / (1 / b - 1 / (k * b))
            assert state[layer]["dens"][step] == pytest.approx(g_sq, abs=g_tol)
            assert state[layer]["nums"][step] == pytest.approx(trace, abs=t_tol)
    assert all(len(state[layer]["dens"]) == len(expected) for layer in state)


@pytest.mark.parametrize("accumulation", ["mean", "sum"])
def test_each_step_is_the_two_batch_estimate_of_its_micro_batch_gradients(accumulation):
    model, (x, y) = _mlp(), _data()
    k, b = 3, 5
    gns = nnstat.NoiseScale(window=10)
    micro = gns.watch_microbatches(model, micro_batch_size=b, accumulation=accumulation)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    gen = torch.Generator().manual_seed(2)
    expected: list[tuple[dict[str, float], dict[str, float]]] = []
    for _ in range(4):
        idx = [torch.randint(0, 64, (b,), generator=gen) for _ in range(k)]
        expected.append(_micro_pairs(model, x, y, idx))
        for i in idx:
            loss = nn.functional.cross_entropy(model(x[i]), y[i])
            (loss / k if accumulation == "mean" else loss).backward()
        assert micro.end_step()
        opt.step()
        opt.zero_grad()
    _assert_steps(gns.state_dict()["stats"], expected, b, k)
    assert sorted(gns.layer_values()) == ["0", "2"]
    gns.unwatch()
    assert all(not p._backward_hooks for p in model.parameters())


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_non_finite_micro_batch_leaves_its_step_out_with_a_warning(bad):
    """A micro-batch whose gradients hold NaN/Inf (a mixed-precision overflow, a step the
    GradScaler skips): its step is left out with a warning, and the estimate is that of the
    same run without it (the other steps' reference pairs, nothing else averaged)."""
    model, (x, y) = _mlp(), _data()
    k, b, skipped = 3, 5, 2
    gns = nnstat.NoiseScale(window=10)
    micro = gns.watch_microbatches(model, micro_batch_size=b)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    gen = torch.Generator().manual_seed(2)
    expected: list[tuple[dict[str, float], dict[str, float]]] = []
    for step in range(5):
        idx = [torch.randint(0, 64, (b,), generator=gen) for _ in range(k)]
        if step != skipped:
            expected.append(_micro_pairs(model, x, y, idx))
        for j, i in enumerate(idx):
            loss = nn.functional.cross_entropy(model(x[i]), y[i]) / k
            (loss * bad if (step, j) == (skipped, 1) else loss).backward()
        # on CPU the step's norms arrive at once; on a GPU the warning comes at a later read
        warns = pytest.warns(RuntimeWarning, match="non-finite gradients")
        with warns if step == skipped else _no_warning():
            assert micro.end_step()
        if step != skipped:  # what the GradScaler does: no update from that step
            opt.step()
        opt.zero_grad()
    assert gns.n_updates == len(expected)
    _assert_steps(gns.state_dict()["stats"], expected, b, k)
    assert math.isfinite(gns.value)


def test_the_callbacks_driver_leaves_a_grad_scaler_skipped_step_out():
    """The HF and Lightning callbacks' driver under gradient accumulation (the micro-batch
    estimator) with a real GradScaler: the step it skips for an overflow is left out with a
    warning and not counted; the others are measured on the scaled gradients (the scale
    squared on ``|G|^2`` and ``tr(Sigma)``, the scale of their own step)."""
    from nnstat.integrations._hooks import StatsOptions, StepStats

    model, (x, y) = _mlp(), _data()
    k, b, skipped = 2, 6, 1
    hooks = StepStats(StatsOptions(stats=["l2"], groups=["weight"], noise_scale_window=10))
    hooks.configure(accumulation_steps=k, micro_batch_size=b)
    assert hooks.method == "micro_batch"
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1000)
    gen = torch.Generator().manual_seed(3)
    expected, factors = [], []
    for step in range(4):
        idx = [torch.randint(0, 64, (b,), generator=gen) for _ in range(k)]
        if step != skipped:
            expected.append(_micro_pairs(model, x, y, idx))
            factors.append(scaler.get_scale() ** 2)
        for j, i in enumerate(idx):
            hooks.begin_batch(model)
            loss = nn.functional.cross_entropy(model(x[i]), y[i]) / k
            if (step, j) == (skipped, 0):
                loss = loss * math.inf  # an fp16 overflow, as the scaler sees it
            scaler.scale(loss).backward()
        warns = pytest.warns(RuntimeWarning, match="non-finite gradients")
        with warns if step == skipped else _no_warning():
            hooks.before_step(model, opt, log=False)
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        assert (scaler.get_scale() < scale) == (step == skipped)  # the scaler skipped it
        hooks.after_step()
        opt.zero_grad(set_to_none=True)
    assert hooks.gns.n_updates == len(expected) == 3
    _assert_steps(hooks.gns.state_dict()["stats"], expected, b, k, factors)
    hooks.close()


def test_unbiased_for_linear_regression_closed_form():
    """x ~ N(0, I_d), y = x.w* + eps (eps ~ N(0, s^2)), loss (x.w - y)^2 / 2 at w = w* + delta:
    the per-sample gradient (x.delta - eps) x has G = delta and, by the Gaussian fourth
    moment, Sigma = |delta|^2 I + delta delta^T + s^2 I, so |G|^2 = |delta|^2 and
    tr(Sigma) = (d + 1) |delta|^2 + d s^2. Micro-batches are i.i.d. draws; the mean over N
    steps of the per-step estimates must be within 4 standard errors (from their own spread)."""
    d, s, k, b, steps = 5, 1.0, 4, 4, 1500
    delta = torch.linspace(0.2, 1.0, d)
    w_star = torch.randn(d, generator=torch.Generator().manual_seed(3))
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    gns = nnstat.NoiseScale(window=steps)
    micro = gns.watch_microbatches(model, micro_batch_size=b)
    gen = torch.Generator().manual_seed(4)
    for _ in range(steps):
        x = torch.randn(k, b, d, generator=gen)
        y = x @ w_star + s * torch.randn(k, b, generator=gen)
        for j in range(k):
            (0.5 * (model(x[j])[:, 0] - y[j]).pow(2).mean() / k).backward()
        micro.end_step()
        model.zero_grad(set_to_none=True)
    stats = gns.state_dict()["stats"][""]
    nums, dens = np.array(stats["nums"]), np.array(stats["dens"])
    g_sq, trace = float(delta.pow(2).sum()), (d + 1) * float(delta.pow(2).sum()) + d * s**2
    for est, truth in ((dens, g_sq), (nums, trace)):
        stderr = est.std(ddof=1) / math.sqrt(steps)
        assert abs(est.mean() - truth) < 4 * stderr, (est.mean(), truth, stderr)
        assert 4 * stderr < 0.1 * truth  # tight enough to catch a wrong factor of k or b
    assert gns.value == pytest.approx(trace / g_sq, rel=0.1)


def _exact_b_simple(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """B_simple of the empirical distribution (batches drawn with replacement): per-sample
    gradients of every data point by torch.func."""
    g_sq, trace = population_noise(model, x, y, nn.functional.cross_entropy)
    return trace / g_sq


def test_agrees_with_the_per_sample_estimator_on_the_same_run():
    """Same weights, same micro-batches, both estimators at once: both 95% intervals hold the
    exact B_simple of the data (and so overlap); `interval_widths` gives both for the
    comparison in docs/noise-scale.md."""
    widths = interval_widths(steps=300)
    for name, (lo, hi, value) in widths["intervals"].items():
        assert lo < widths["exact"] < hi, (name, lo, hi, widths["exact"])
        assert math.isfinite(value)
    (lo_a, hi_a, _), (lo_b, hi_b, _) = widths["intervals"].values()
    assert max(lo_a, lo_b) < min(hi_a, hi_b)


def interval_widths(steps: int, k: int = 4, b: int = 8) -> dict:
    """Run both estimators on one stream of micro-batches at fixed weights (no update, so one
    true B_simple): ``{"exact": B, "intervals": {name: (low, high, value)}}``."""
    model, (x, y) = _mlp(seed=5), _data(n=256, seed=6)
    per_sample, micro_gns = nnstat.NoiseScale(window=steps * k), nnstat.NoiseScale(window=steps)
    per_sample.watch(model)
    micro = micro_gns.watch_microbatches(model, micro_batch_size=b)
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for _ in range(k):
            i = torch.randint(0, len(x), (b,), generator=gen)
            with per_sample.batch():
                (nn.functional.cross_entropy(model(x[i]), y[i]) / k).backward()
        micro.end_step()
        model.zero_grad(set_to_none=True)
    out = {}
    for name, gns in (("per-sample", per_sample), ("micro-batch", micro_gns)):
        out[name] = (*gns.interval, gns.value)
        gns.unwatch()
    return {"exact": _exact_b_simple(model, x, y), "intervals": out}


def test_fewer_than_two_micro_batches_stage_nothing():
    model, (x, y) = _mlp(), _data()
    gns = nnstat.NoiseScale(window=5)
    micro = gns.watch_microbatches(model, micro_batch_size=8)
    nn.functional.cross_entropy(model(x[:8]), y[:8]).backward()
    assert micro.pending == 1
    assert micro.end_step() is False
    assert micro.pending == 0 and gns.n_updates == 0


def test_gradients_left_from_before_the_step_are_refused_with_the_fix():
    model, (x, y) = _mlp(), _data()
    gns = nnstat.NoiseScale(window=5)
    micro = gns.watch_microbatches(model, micro_batch_size=8)
    for step in range(2):  # no zero_grad: the second step's .grad holds the first's too
        for j in range(2):
            loss = nn.functional.cross_entropy(model(x[8 * j : 8 * j + 8]), y[8 * j : 8 * j + 8])
            loss.backward()
        # on CPU the step's norms arrive at once; on a GPU the warning comes at a later read
        with pytest.warns(RuntimeWarning, match=r"zero_grad") if step else _no_warning():
            micro.end_step()
            assert gns.n_updates == 1


@contextlib.contextmanager
def _no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def test_a_layer_replaced_after_watching_is_refused_and_watching_again_is_exact():
    # the new layer's parameters carried no hook: the step's norms silently left it out
    model, (x, y) = _mlp(), _data()
    k, b = 2, 8
    gns = nnstat.NoiseScale(window=5)
    micro = gns.watch_microbatches(model, micro_batch_size=b)
    model[2] = nn.Linear(6, 3)
    for j in range(k):
        nn.functional.cross_entropy(
            model(x[b * j : b * (j + 1)]), y[b * j : b * (j + 1)]
        ).backward()
    with pytest.raises(ValueError, match=r"\['2\.weight', '2\.bias'\].*gns\.unwatch\(\)"):
        micro.end_step()
    gns.unwatch()
    model.zero_grad()
    gns = nnstat.NoiseScale(window=5)
    micro = gns.watch_microbatches(model, micro_batch_size=b)
    idx = [torch.arange(b * j, b * (j + 1)) for j in range(k)]
    expected = [_micro_pairs(model, x, y, idx)]
    for i in idx:
        (nn.functional.cross_entropy(model(x[i]), y[i]) / k).backward()
    assert micro.end_step()
    _assert_steps(gns.state_dict()["stats"], expected, b, k)
    gns.unwatch()


def test_bad_arguments_name_the_fix():
    model = _mlp()
    with pytest.raises(ValueError, match="accumulation"):
        nnstat.NoiseScale().watch_microbatches(model, 4, accumulation="avg")
    micro = nnstat.NoiseScale().watch_microbatches(model)
    x, y = _data()
    for _ in range(2):
        nn.functional.cross_entropy(model(x[:4]), y[:4]).backward()
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro.end_step()


def test_no_host_read_inside_the_step():
    """CPU tensors with copies held back (as on a GPU): the step path reads nothing."""
    model, (x, y) = _mlp(), _data()
    gns = nnstat.NoiseScale(beta=0.9)
    micro = gns.watch_microbatches(model, micro_batch_size=8)
    LocalCopy.ready = False
    try:
        counter: list[str] = []
        with host_reads(counter):
            for _ in range(3):
                for j in range(2):
                    loss = nn.functional.cross_entropy(model(x[8 * j : 8 * j + 8]), y[:8]) / 2
                    loss.backward()
                micro.end_step()
                model.zero_grad(set_to_none=True)
        assert counter == []
    finally:
        LocalCopy.ready = True
    assert gns.n_updates == 3 and math.isfinite(gns.value)


def _meta_step(layers: int, watched: bool, k: int = 3) -> tuple[collections.Counter, tuple]:
    """Kernels and ledger counts of one optimizer step's k micro-batches on ``meta``."""
    with torch.device("meta"):
        model = _mlp(layers)
        x, y = torch.randn(8, 6), torch.zeros(8, dtype=torch.long)
    gns = nnstat.NoiseScale(beta=0.9)
    micro = gns.watch_microbatches(model, micro_batch_size=8) if watched else None
    kernels, ledger = Kernels(), DeviceLedger()
    with warnings.catch_warnings(), ledger, kernels:
        warnings.simplefilter("ignore")
        for _ in range(k):
            (nn.functional.cross_entropy(model(x), y) / k).backward()
        if micro is not None:
            assert micro.end_step()
    return kernels.ops, ledger.counts()


def test_meta_ops_grow_with_micro_batches_not_tensors_and_read_nothing():
    added = {}
    for layers in (1, 6):  # 4 vs 14 parameter tensors
        plain, _ = _meta_step(layers, watched=False)
        ops, counts = _meta_step(layers, watched=True)
        assert counts == (0, 0, 0, 0)  # no read, no copy either way, nothing data-dependent
        added[layers] = ops - plain
    assert added[1] == added[6]
    # per micro-batch one multi-tensor norm, its stack and square; at the step the same for
    # .grad (float32), then the staging concatenation and the copy's float64 flattening
    norms = 3 + 1
    assert dict(added[1]) == {
        "aten::_foreach_norm": norms, "aten::stack": norms, "aten::pow": norms, "aten::cat": 2,
        "aten::_to_copy": 1,
    }  # fmt: skip


def test_sparse_embedding_gradients_are_measured():
    """nn.Embedding(sparse=True) brings sparse gradients to the hooks and to .grad: their norms
    are those of the dense gradients (autograd on the dense twin of the lookup)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Flatten(), nn.Linear(12, 3))
    x, y = torch.randint(0, 10, (6, 3)), torch.randint(0, 3, (6,))
    k, b = 3, 2
    gns = nnstat.NoiseScale()
    micro = gns.watch_microbatches(model, micro_batch_size=b, accumulation="sum")
    for i in range(k):
        nn.functional.cross_entropy(
            model(x[i * b : (i + 1) * b]), y[i * b : (i + 1) * b]
        ).backward()
    assert model[0].weight.grad.is_sparse
    assert micro.end_step()
    gns.unwatch()
    model[0].sparse = False
    means = [
        torch.cat(
            [
                g.flatten()
                for g in torch.autograd.grad(
                    nn.functional.cross_entropy(
                        model(x[i * b : (i + 1) * b]), y[i * b : (i + 1) * b]
                    ),
                    list(model.parameters()),
                )
            ]
        ).double()
        for i in range(k)
    ]
    stack = torch.stack(means)
    g_sq, trace = two_batch(
        float(stack.pow(2).sum(1).mean()), float(stack.mean(0).pow(2).sum()), b, k * b
    )
    assert gns.grad_sq_norm == pytest.approx(g_sq, rel=1e-4)
    assert gns.trace_sigma == pytest.approx(trace, rel=1e-4)


@pytest.mark.parametrize("accumulation", ["mean", "sum", "items"])
def test_unequal_micro_batches_are_exact_in_expectation_with_their_sizes(accumulation):
    """A smaller last micro-batch (``drop_last=False``): every draw with replacement of
    micro-batches of 2 and 1 samples from 5 points, enumerated (the exact expectation), gives
    the data's exact ``|G|^2`` and ``tr(Sigma)`` (torch.func per-sample gradients) when
    ``end_step`` is given each micro-batch's size, whichever way the micro-batch losses add up
    (each mean / K, each mean, each sum / all the step's samples); one size for both biases
    ``tr(Sigma)``."""
    import itertools

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(5, 1, generator=gen, dtype=torch.float64)
    model = nn.Linear(3, 1).double()
    g_sq, trace = population_noise(model, x, y)
    # how the step's loss weights micro-batch k's summed loss over its b samples
    weight = {"mean": lambda b: 1 / (2 * b), "sum": lambda b: 1 / b, "items": lambda b: 1 / 3}

    def expectation(sizes_given):
        gns = nnstat.NoiseScale(window=10**6)
        micro = gns.watch_microbatches(model, accumulation=accumulation)
        for draw in itertools.product(range(5), repeat=3):
            model.zero_grad(set_to_none=True)
            for idx in (list(draw[:2]), list(draw[2:])):  # micro-batches of 2 and 1
                loss = (model(x[idx]) - y[idx]).pow(2).sum() * weight[accumulation](len(idx))
                loss.backward()
            assert micro.end_step(sizes_given)
        return gns.grad_sq_norm, gns.trace_sigma

    assert expectation([2, 1]) == pytest.approx((g_sq, trace), rel=1e-9)
    one_size = expectation(2)
    assert one_size[1] != pytest.approx(trace, rel=0.1)  # the bias of one size
    assert expectation((2, 2)) == one_size  # equal sizes given one by one: the same
    micro = nnstat.NoiseScale().watch_microbatches(model)
    for _ in range(2):
        model(x).sum().backward()
    with pytest.raises(ValueError, match="holds 3 sizes but the step had 2 micro-batches"):
        micro.end_step([2, 2, 1])


def test_a_step_of_fewer_micro_batches_than_the_divisor_is_exact_with_the_divisor():
    """Two micro-batches of 2 samples whose mean losses are each divided by 3 (Lightning's
    ``accumulate_grad_batches=3`` in an epoch's shorter last step): every draw from 4 points
    enumerated gives the data's exact ``|G|^2`` and ``tr(Sigma)`` (torch.func per-sample
    gradients) with ``divisor=3``; without it both are (2/3)^2 of them."""
    import itertools

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    y = torch.randn(4, 1, generator=gen, dtype=torch.float64)
    model = nn.Linear(3, 1).double()
    g_sq, trace = population_noise(model, x, y)

    def expectation(divisor):
        gns = nnstat.NoiseScale(window=10**6)
        micro = gns.watch_microbatches(model, micro_batch_size=2)
        for draw in itertools.product(range(4), repeat=4):
            model.zero_grad(set_to_none=True)
            for idx in (list(draw[:2]), list(draw[2:])):
                ((model(x[idx]) - y[idx]).pow(2).mean() / 3).backward()
            assert micro.end_step(divisor=divisor)
        micro.close()
        return gns.grad_sq_norm, gns.trace_sigma

    assert expectation(3) == pytest.approx((g_sq, trace), rel=1e-9)
    assert expectation(None) == pytest.approx((g_sq * 4 / 9, trace * 4 / 9), rel=1e-9)
    micro = nnstat.NoiseScale().watch_microbatches(model, micro_batch_size=2)
    for _ in range(2):
        model(x).sum().backward()
    with pytest.raises(ValueError, match="at least the step's 2 micro-batches"):
        micro.end_step(divisor=1)
