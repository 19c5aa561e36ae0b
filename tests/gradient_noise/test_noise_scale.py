"""nnstat.noise_scale against closed forms and torch.func per-sample gradients.

Synthetic problem: x ~ N(0, C) (C diagonal), y = w*.x + eps with eps ~ N(0, s^2), a linear
model at w = w* + d and the squared loss. Per-example gradient g = -2 r x with r = d.x + eps, so
G = -2 C d and Sigma = 4 [(d'Cd + s^2) C + C d d' C] (Gaussian fourth moments).
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.gradient_noise.hessian import hessian_noise_scale
from nnstat.gradient_noise.maths import fit_sq_norms, geometric_ladder, ratio_of_means, two_batch


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models on a shared 2-core machine: intra-op threads only add contention."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


D, N, S2 = 5, 20000, 1.0
C = torch.tensor([1.0, 2.0, 0.5, 1.5, 1.0], dtype=torch.float64)
DELTA = torch.tensor([0.3, -0.2, 0.4, 0.1, -0.3], dtype=torch.float64)


def closed_form() -> tuple[float, float]:
    cd = C * DELTA
    g_sq = 4 * float(cd @ cd)
    trace = 4 * (float(DELTA @ cd) + S2) * float(C.sum()) + 4 * float(cd @ cd)
    return g_sq, trace


@pytest.fixture(scope="module")
def problem():
    torch.manual_seed(0)
    x = torch.randn(N, D) * C.float().sqrt()
    w_star = torch.randn(D)
    y = (x @ w_star + math.sqrt(S2) * torch.randn(N)).unsqueeze(1)
    model = nn.Linear(D, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + DELTA.float())[None])
    # Reference: exact per-example gradients with torch.func on the whole data set.
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, xi, yi):
        return nn.functional.mse_loss(functional_call(model, p, (xi[None],)), yi[None])

    g = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)["weight"].reshape(N, -1).double()
    g_mean = g.mean(0)
    cov = (g - g_mean).T @ (g - g_mean) / N
    truth = {"g_sq": float(g_mean @ g_mean), "trace": float(cov.trace())}
    truth["b_simple"] = truth["trace"] / truth["g_sq"]
    return model, x, y, truth


def test_empirical_truth_matches_closed_form(problem):
    _, _, _, truth = problem
    g_sq, trace = closed_form()
    assert truth["g_sq"] == pytest.approx(g_sq, rel=0.05)
    assert truth["trace"] == pytest.approx(trace, rel=0.05)
    assert truth["b_simple"] == pytest.approx(trace / g_sq, rel=0.05)


@pytest.mark.parametrize(
    "method,kwargs",
    [
        ("two_batch", dict(small_batch=8, big_batch=64, n_estimates=2000)),
        ("fit", dict(small_batch=4, big_batch=64, n_estimates=800)),
        ("per_sample", dict(big_batch=64, n_estimates=1000)),
    ],
)
def test_methods_within_5_percent(problem, method, kwargs):
    model, x, y, truth = problem
    r = nnstat.noise_scale(model, nn.functional.mse_loss, (x, y), method=method, seed=1, **kwargs)
    assert r.b_simple == pytest.approx(truth["b_simple"], rel=0.05)
    assert r.grad_sq_norm == pytest.approx(truth["g_sq"], rel=0.05)
    assert r.trace_sigma == pytest.approx(truth["trace"], rel=0.05)
    lo, hi = r.interval
    assert lo < truth["b_simple"] < hi
    assert r.b_simple_stderr > 0
    # a single parameter: the per-layer values are the totals (per_sample keys modules)
    layer = "model" if method == "per_sample" else "weight"
    assert list(r.per_layer) == [layer]
    assert r.per_layer[layer].b_simple == pytest.approx(r.b_simple, rel=1e-6)
    flat = r.to_dict()
    assert flat["noise_scale/b_simple"] == r.b_simple
    assert flat[f"noise_scale/{layer}/b_simple"] == pytest.approx(r.b_simple, rel=1e-6)
    if method == "fit":
        assert r.fit_residual is not None and r.fit_residual < 0.05


def test_two_batch_estimators_are_unbiased(problem):
    """The mean of many independent |G|^2 and tr(Sigma) estimates is the truth (4 s.e.)."""
    model, x, y, truth = problem
    r = nnstat.noise_scale(
        model, nn.functional.mse_loss, (x, y), small_batch=2, big_batch=16, n_estimates=1500
    )
    for key, true in (("grad_sq_norm", truth["g_sq"]), ("trace_sigma", truth["trace"])):
        est = np.asarray(r.estimates[key])
        se = est.std(ddof=1) / math.sqrt(est.size)
        assert abs(est.mean() - true) < 4 * se, (key, est.mean(), true, se)
        # single estimates are very noisy: the test has power, the estimator is not trivially exact
        assert est.std() > 0.2 * abs(true)
    assert r.n_samples == 1500 * 16


@pytest.mark.parametrize("sizes,nested", [([4, 8, 16, 32], True), ([3, 8, 20], False)])
def test_fit_squared_norms_are_unbiased(problem, sizes, nested):
    """Every batch size's mean |G_B|^2 matches |G|^2 + tr(Sigma)/B (4 s.e.), nested or not."""
    model, x, y, truth = problem
    n = 400
    r = nnstat.noise_scale(
        model, nn.functional.mse_loss, (x, y), method="fit", batch_sizes=sizes, n_estimates=n
    )
    assert r.batch_sizes == sizes
    assert r.n_samples == n * (max(sizes) if nested else sum(sizes))
    for b in sizes:
        est = np.asarray(r.estimates[f"sq_norm/{b}"])
        expected = truth["g_sq"] + truth["trace"] / b
        assert abs(est.mean() - expected) < 4 * est.std(ddof=1) / math.sqrt(n), b


def test_two_batch_formula_inverts_expectation():
    g_sq, trace = 2.5, 40.0
    small, big = g_sq + trace / 4, g_sq + trace / 64
    assert two_batch(small, big, 4, 64) == pytest.approx((g_sq, trace))


def test_curve_fit_recovers_known_parameters():
    rng = np.random.default_rng(0)
    b = np.array(geometric_ladder(2, 256, num=8), dtype=float)
    y = 0.7 + 35.0 / b
    noisy = y * (1 + 0.002 * rng.standard_normal(b.size))
    fit = fit_sq_norms(b, noisy, stderr=0.002 * y)
    assert fit.g_sq == pytest.approx(0.7, rel=0.01)
    assert fit.trace == pytest.approx(35.0, rel=0.01)
    assert fit.b_simple == pytest.approx(50.0, rel=0.02)
    assert 0 < fit.residual < 0.01
    assert fit.b_simple_stderr < 2.0
    exact = fit_sq_norms(b, y)
    assert exact.residual == pytest.approx(0.0, abs=1e-9)


def test_ratio_of_means_not_mean_of_ratios():
    num = np.array([10.0, 10.0, 10.0, 10.0])
    den = np.array([0.1, 1.9, 1.0, 1.0])
    s = ratio_of_means(num, den)
    assert s.ratio == pytest.approx(10.0)
    assert np.mean(num / den) > 30  # what averaging ratios would have reported


def test_hessian_noise_scale_linear_regression_closed_form(problem):
    """For the squared loss H = 2 X'X/n exactly; reference in numpy."""
    model, x, y, _ = problem
    xs, ys = x[:300], y[:300]
    r = hessian_noise_scale(model, nn.functional.mse_loss, xs, ys)
    X = xs.double().numpy()
    w = model.weight.detach().double().numpy()[0]
    res = ys.double().numpy()[:, 0] - X @ w
    g = -2 * res[:, None] * X
    G = g.mean(0)
    sigma = np.cov(g.T, bias=True)
    H = 2 * X.T @ X / len(X)
    assert r.trace_h_sigma == pytest.approx(np.trace(H @ sigma), rel=1e-5)
    assert r.g_h_g == pytest.approx(G @ H @ G, rel=1e-5)
    assert r.b_noise == pytest.approx(np.trace(H @ sigma) / (G @ H @ G), rel=1e-5)


@pytest.mark.filterwarnings("ignore:the .G.\\^2 estimate:RuntimeWarning")
def test_hessian_noise_scale_mlp_explicit_hessian():
    """Tiny MLP: explicit Hessian (autograd.functional.hessian) and a per-sample loop."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = torch.randn(40, 3, dtype=torch.float64), torch.randint(0, 2, (40,))
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]

    def loss_of(flat: torch.Tensor, xb, yb) -> torch.Tensor:
        ps = dict(
            zip(
                names,
                [t.reshape(s) for t, s in zip(flat.split(sizes), shapes, strict=True)],
                strict=True,
            )
        )
        return nn.functional.cross_entropy(functional_call(model, ps, (xb,)), yb)

    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    H = torch.autograd.functional.hessian(lambda t: loss_of(t, x, y), theta)
    rows = []
    for i in range(len(x)):
        t = theta.clone().requires_grad_(True)
        rows.append(torch.autograd.grad(loss_of(t, x[i : i + 1], y[i : i + 1]), t)[0])
    g = torch.stack(rows)
    G = g.mean(0)
    sigma = (g - G).T @ (g - G) / len(x)
    expected = float(torch.trace(H @ sigma) / (G @ H @ G))
    r = hessian_noise_scale(model, nn.functional.cross_entropy, x, y)
    assert r.b_noise == pytest.approx(expected, rel=1e-6)
    res = nnstat.noise_scale(
        model,
        nn.functional.cross_entropy,
        (x, y),
        small_batch=2,
        big_batch=8,
        n_estimates=2,
        hessian=True,
        hessian_samples=40,
    )
    assert res.b_noise == pytest.approx(expected, rel=1e-6)


def test_data_forms_agree_and_model_untouched(problem):
    model, x, y, _ = problem
    xs, ys = x[:500], y[:500]
    model.weight.grad = torch.full_like(model.weight, 7.0)
    before = model.weight.detach().clone()
    ds = torch.utils.data.TensorDataset(xs, ys)

    class Plain(torch.utils.data.Dataset):
        def __len__(self):
            return len(xs)

        def __getitem__(self, i):
            return xs[i], ys[i]

    kw = dict(small_batch=4, big_batch=16, n_estimates=5, seed=3)
    loss = nn.functional.mse_loss
    ref = nnstat.noise_scale(model, loss, (xs, ys), **kw)
    for data in (ds, Plain(), torch.utils.data.DataLoader(Plain(), batch_size=7)):
        r = nnstat.noise_scale(model, loss, data, **kw)
        assert r.b_simple == pytest.approx(ref.b_simple, rel=1e-6)
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 7.0))
    assert torch.equal(model.weight.detach(), before)
    model.weight.grad = None


def test_zero_gradient_gives_inf_with_warning():
    model = nn.Linear(3, 1)
    x, y = torch.zeros(64, 3), torch.zeros(64, 1)
    with torch.no_grad():
        model.weight.zero_()
        model.bias.zero_()
    with pytest.warns(RuntimeWarning, match="indistinguishable from noise"):
        r = nnstat.noise_scale(model, nn.functional.mse_loss, (x, y), small_batch=2, big_batch=8)
    assert r.b_simple == math.inf
    assert r.grad_sq_norm == 0.0 and r.trace_sigma == 0.0


def test_pure_noise_keeps_raw_estimates(problem):
    """At the optimum of a noiseless-in-expectation problem |G|^2 estimates straddle 0."""
    torch.manual_seed(0)
    x = torch.randn(2000, 2)
    y = torch.randn(2000, 1)  # independent of x: the least-squares optimum is w = 0
    model = nn.Linear(2, 1, bias=False)
    w = torch.linalg.lstsq(x, y).solution.T
    with torch.no_grad():
        model.weight.copy_(w)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        r = nnstat.noise_scale(
            model, nn.functional.mse_loss, (x, y), small_batch=2, big_batch=8, n_estimates=50
        )
    est = np.asarray(r.estimates["grad_sq_norm"])
    assert (est < 0).any() and (est > 0).any()
    # the data set's gradient is exactly 0 here: the |G|^2 estimates are centred on it
    assert abs(est.mean()) < 4 * est.std(ddof=1) / math.sqrt(est.size)
    assert r.trace_sigma > 0
    assert (r.b_simple == math.inf) == (r.grad_sq_norm <= 0)


def test_bad_input():
    model = nn.Linear(3, 1)
    x, y = torch.randn(32, 3), torch.randn(32, 1)
    loss = nn.functional.mse_loss
    with pytest.raises(ValueError, match="smaller than b_big"):
        nnstat.noise_scale(model, loss, (x, y), small_batch=16, big_batch=16)
    with pytest.raises(ValueError, match="smaller than b_big"):
        nnstat.noise_scale(model, loss, (x, y), small_batch=32, big_batch=8)
    with pytest.raises(ValueError, match="big_batch >= 2"):
        nnstat.noise_scale(model, loss, (x, y), method="per_sample", big_batch=1)
    with pytest.raises(ValueError, match="valid methods.*two_batch"):
        nnstat.noise_scale(model, loss, (x, y), method="hessian")
    with pytest.raises(ValueError, match="inputs have 32 samples but targets have 31"):
        nnstat.noise_scale(model, loss, (x, y[:31]))
    with pytest.raises(ValueError, match="scalar"):
        nnstat.noise_scale(model, lambda o, t: (o - t).pow(2), (x, y), small_batch=2, big_batch=4)
    bad = x.clone()
    bad[:] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        nnstat.noise_scale(model, loss, (bad, y), small_batch=2, big_batch=4)
    with pytest.raises(TypeError, match="Dataset, a DataLoader or an"):
        nnstat.noise_scale(model, loss, x, small_batch=2, big_batch=4)
    with pytest.raises(ValueError, match="two distinct"):
        nnstat.noise_scale(model, loss, (x, y), method="fit", batch_sizes=[4, 4])
    with pytest.raises(ValueError, match="n_estimates"):
        nnstat.noise_scale(model, loss, (x, y), n_estimates=0)


@pytest.mark.parametrize("method", ["two_batch", "per_sample", "fit"])
def test_a_loss_summed_over_the_batch_is_refused_naming_the_fix(method):
    """A sum loss leaves ``b_simple`` as it is but scales ``trace_sigma`` and ``grad_sq_norm``
    by the batch size squared, which nothing else would show: refused. A mean written as a sum
    divided by the batch size, and a sum over features inside a batch mean, are means."""
    model = nn.Linear(3, 2)
    x, y = torch.randn(32, 3), torch.randn(32, 2)
    kw = dict(method=method, small_batch=2, big_batch=8, n_estimates=2)

    def summed(o, t):
        return nn.functional.mse_loss(o, t, reduction="sum")

    with pytest.raises(ValueError, match=r"sum over the batch \(mse_loss\(reduction='sum'\)\).*"
                       r"reduction='mean'"):  # fmt: skip
        nnstat.noise_scale(model, summed, (x, y), **kw)
    with pytest.raises(ValueError, match="sum over the batch"):
        nnstat.noise_scale(model, lambda o, t: (o - t).pow(2).sum(), (x, y), **kw)
    means = [
        lambda o, t: (o - t).pow(2).sum() / len(o),
        lambda o, t: (o - t).pow(2).sum(1).mean(),
        nn.functional.mse_loss,
    ]
    for loss in means:
        r = nnstat.noise_scale(model, loss, (x, y), **kw)
        assert math.isfinite(r.trace_sigma)


# -- uncertainty outputs against independent references ----------------------------------------


def _delta_stderr(num: np.ndarray, den: np.ndarray) -> float:
    """Delta method for mean(num)/mean(den): gradient (1/d, -a/d^2) through the sample
    covariance of the pair means (ddof=1, divided by n)."""
    a, d = num.mean(), den.mean()
    grad = np.array([1.0 / d, -a / d**2])
    cov_of_means = np.cov(np.stack([num, den]), ddof=1) / num.size
    return float(np.sqrt(grad @ cov_of_means @ grad))


def _percentile_bootstrap(num, den, n_boot, level, seed):
    """Resample pairs with numpy's Generator(seed); 'lower'/'higher' quantiles at (1 -+ level)/2
    (the bracketing order statistics, so the interval never shrinks below the level)."""
    idx = np.random.default_rng(seed).integers(0, num.size, size=(n_boot, num.size))
    boot = num[idx].mean(1) / den[idx].mean(1)
    alpha = (1 - level) / 2
    return (
        float(np.quantile(boot, alpha, method="lower")),
        float(np.quantile(boot, 1 - alpha, method="higher")),
    )


def _correlated_pairs(rng, n):
    """num ~ N(4, 1), den ~ N(2, 0.25) with correlation 0.5: mean(num)/mean(den) -> 2."""
    z = rng.standard_normal((2, n))
    den = 2.0 + 0.5 * z[0]
    num = 4.0 + 0.5 * z[0] + math.sqrt(0.75) * z[1]
    return num, den


def test_per_sample_measurement_refuses_non_finite_losses_and_gradients():
    """`nnstat.noise_scale` is a measurement of its own: NaN/Inf there is bad data, weights or
    loss, refused with the cause named (a training loop's overflowed step is left out instead,
    see the streaming tracker's tests)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    x, y = torch.randn(32, 4), torch.randint(0, 3, (32,))
    bad = x.clone()
    bad[3] = math.nan
    with pytest.raises(ValueError, match=r"non-finite loss \(nan\)"):
        nnstat.noise_scale(
            model, nn.functional.cross_entropy, (bad, y), method="per_sample", big_batch=32
        )

    def nan_gradient(out, target):  # a finite loss whose gradient is NaN (sqrt at 0)
        return nn.functional.cross_entropy(out, target) + (out * 0).sqrt().sum() * 0

    with pytest.raises(ValueError, match="gradient norms of '0' contain NaN or Inf.*sqrt"):
        nnstat.noise_scale(model, nan_gradient, (x, y), method="per_sample", big_batch=8)


def test_ratio_of_means_stderr_and_interval_match_numpy_references():
    rng = np.random.default_rng(11)
    num, den = _correlated_pairs(rng, 60)
    for level, seed, n_boot in ((0.95, 0, 1000), (0.8, 7, 333), (0.5, 3, 200)):
        s = ratio_of_means(num, den, n_boot=n_boot, level=level, seed=seed)
        assert s.ratio == pytest.approx(num.mean() / den.mean(), rel=1e-14)
        assert s.stderr == pytest.approx(_delta_stderr(num, den), rel=1e-12)
        assert s.interval == pytest.approx(
            _percentile_bootstrap(num, den, n_boot, level, seed), rel=1e-14
        )
    # the seed is the bootstrap's: another seed moves the interval, not the point estimate
    a, b = ratio_of_means(num, den, seed=1), ratio_of_means(num, den, seed=2)
    assert a.interval != b.interval and a.ratio == b.ratio and a.stderr == b.stderr


def test_ratio_of_means_stderr_is_the_spread_and_interval_covers_at_its_level():
    """Over 400 independent data sets with a known ratio of means (2): the delta-method standard
    error matches the estimator's empirical spread (10%), and the bootstrap intervals cover the
    truth at their nominal level (binomial s.e. 1.5% at 90%, 2.5% at 50%)."""
    rng = np.random.default_rng(5)
    reps, ratios, ses = 400, [], []
    hits = {0.9: 0, 0.5: 0}
    for r in range(reps):
        num, den = _correlated_pairs(rng, 80)
        for level in hits:
            s = ratio_of_means(num, den, n_boot=400, level=level, seed=r)
            hits[level] += s.interval[0] <= 2.0 <= s.interval[1]
        ratios.append(s.ratio)
        ses.append(s.stderr)
    assert np.mean(ses) == pytest.approx(np.std(ratios, ddof=1), rel=0.1)
    assert 0.85 <= hits[0.9] / reps <= 0.95
    assert 0.42 <= hits[0.5] / reps <= 0.58


def _wls(b: np.ndarray, y: np.ndarray, sigma: np.ndarray | None):
    """Least squares of y = g + t / b in closed form (normal equations), its parameter
    covariance (absolute sigma when given, else scaled by the residual variance), B = t/g with
    its delta-method standard error, and the RMS residual relative to mean(y)."""
    A = np.stack([np.ones_like(b), 1.0 / b], 1)
    w = np.ones_like(b) if sigma is None else 1.0 / sigma**2
    AtWA = A.T @ (w[:, None] * A)
    g, t = np.linalg.solve(AtWA, A.T @ (w * y))
    resid = y - A @ np.array([g, t])
    cov = np.linalg.inv(AtWA)
    if sigma is None:
        cov = cov * (resid @ resid) / (b.size - 2)
    grad = np.array([-t / g**2, 1.0 / g])
    return (
        g,
        t,
        t / g,
        float(np.sqrt(grad @ cov @ grad)),
        np.sqrt(np.mean(resid**2)) / abs(y.mean()),
    )


@pytest.mark.parametrize("weighted", [True, False])
def test_fit_stderr_and_residual_match_closed_form_least_squares(weighted):
    rng = np.random.default_rng(2)
    b = np.array(geometric_ladder(2, 256, num=7), dtype=float)
    y0 = 0.7 + 35.0 / b
    sigma = 0.02 * y0
    y = y0 + sigma * rng.standard_normal(b.size)
    fit = fit_sq_norms(b, y, stderr=sigma if weighted else None)
    g, t, bs, se, residual = _wls(b, y, sigma if weighted else None)
    assert (fit.g_sq, fit.trace, fit.b_simple) == pytest.approx((g, t, bs), rel=1e-6)
    assert fit.b_simple_stderr == pytest.approx(se, rel=1e-5)
    assert fit.residual == pytest.approx(residual, rel=1e-6)
    assert fit.residual > 0.005  # the noise is visible: not a vacuous comparison of zeros


def test_fit_stderr_is_the_spread_of_b_simple():
    """300 noisy data sets from known |G|^2 = 0.7, tr = 35 with known per-size noise: the mean
    reported standard error matches the empirical spread of b_simple (10%)."""
    rng = np.random.default_rng(9)
    b = np.array([4.0, 8.0, 16.0, 32.0, 64.0])
    y0 = 0.7 + 35.0 / b
    sigma = 0.01 * y0
    fits = [fit_sq_norms(b, y0 + sigma * rng.standard_normal(b.size), sigma) for _ in range(300)]
    spread = np.std([f.b_simple for f in fits], ddof=1)
    assert np.mean([f.b_simple_stderr for f in fits]) == pytest.approx(spread, rel=0.1)


def test_noise_scale_uncertainty_is_that_of_its_own_estimates(problem):
    """two_batch: stderr and interval are the delta method and the seeded percentile bootstrap
    of the returned per-estimate (tr, |G|^2) pairs. fit: the stderr is the spread and the
    interval the 2.5/97.5% order statistics of b_simple refitted on big batches resampled with
    numpy's Generator(seed), weighted by each size's standard error of the mean."""
    model, x, y, _ = problem
    loss = nn.functional.mse_loss
    r = nnstat.noise_scale(model, loss, (x, y), small_batch=4, big_batch=16, n_estimates=40, seed=6)
    num, den = np.asarray(r.estimates["trace_sigma"]), np.asarray(r.estimates["grad_sq_norm"])
    assert r.b_simple_stderr == pytest.approx(_delta_stderr(num, den), rel=1e-12)
    assert r.interval == pytest.approx(_percentile_bootstrap(num, den, 1000, 0.95, 6), rel=1e-14)

    sizes, n_est, seed, n_boot = [4, 8, 16, 32], 24, 4, 200
    r = nnstat.noise_scale(
        model, loss, (x, y), method="fit", batch_sizes=sizes, n_estimates=n_est, seed=seed
    )
    b = np.asarray(sizes, dtype=float)
    totals = np.stack([np.asarray(r.estimates[f"sq_norm/{s}"]) for s in sizes])

    def refit(cols):
        t = totals[:, cols]
        return _wls(b, t.mean(1), t.std(1, ddof=1) / math.sqrt(n_est))

    full = refit(np.arange(n_est))
    assert r.fit_residual == pytest.approx(full[4], rel=1e-6)
    assert r.b_simple == pytest.approx(full[2], rel=1e-6)
    rng = np.random.default_rng(seed)
    fits = [refit(rng.integers(0, n_est, n_est)) for _ in range(n_boot)]
    # a resample whose |G|^2 fit is <= 0 has b_simple = inf: it sorts last, and the spread is
    # that of the finite ones
    boot = np.sort([bs if g > 0 else math.inf for g, _, bs, _, _ in fits])
    assert np.isfinite(boot).sum() > 0.9 * n_boot
    assert r.b_simple_stderr == pytest.approx(np.std(boot[np.isfinite(boot)], ddof=1), rel=1e-5)
    lo, hi = int(0.025 * (n_boot - 1)), int(0.975 * (n_boot - 1))
    assert r.interval == pytest.approx((boot[lo], boot[hi]), rel=1e-5)


@pytest.mark.parametrize("method", ["two_batch", "per_sample"])
def test_progress_bar_on_request_silent_by_default_and_results_unchanged(capsys, method):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(64, 4)
    y = x.sum(1, keepdim=True)
    kw = dict(method=method, small_batch=4, big_batch=16, n_estimates=5)
    quiet = nnstat.noise_scale(model, nn.functional.mse_loss, (x, y), **kw)
    assert capsys.readouterr() == ("", "")  # stderr is not a terminal here: no bar
    shown = nnstat.noise_scale(model, nn.functional.mse_loss, (x, y), progress=True, **kw)
    err = capsys.readouterr().err
    assert f"noise scale ({method})" in err and "/5 [" in err
    assert shown.b_simple == quiet.b_simple


def test_a_model_on_the_meta_device_is_refused_naming_the_parameter():
    # it failed inside torch ("Tensor.item() cannot be called on meta tensors")
    model = nn.Linear(4, 3).to("meta")
    data = (torch.randn(64, 4), torch.randint(0, 3, (64,)))
    with pytest.raises(ValueError, match=r"parameter 'weight' is on the meta device.*to_empty"):
        nnstat.noise_scale(model, nn.functional.cross_entropy, data, small_batch=4, big_batch=16)


def test_the_streaming_noise_scale_on_meta_says_so_when_read():
    # its first batch's loss check failed inside the backward ("Tensor.item() cannot be called
    # on meta tensors"); a meta model runs (operation counting) and refuses only its values
    model = nn.Linear(4, 3).to("meta")
    gns = nnstat.NoiseScale()
    gns.watch(model)
    x, y = torch.randn(5, 4, device="meta"), torch.randint(0, 3, (5,), device="meta")
    with gns.batch():
        nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="meta device has no values to deliver"):
        gns.to_dict()
    gns.unwatch()
