"""Pure estimators behind :mod:`nnstat.gradient_noise` (McCandlish et al. 2018, appendix A).

Everything here works on floats or numpy arrays and has no torch state, so it is easy to test
against closed forms.
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

ArrayLike = float | np.ndarray


def check_batch_sizes(b_small: float, b_big: float) -> None:
    """Raise a ``ValueError`` unless ``1 <= b_small < b_big`` (both finite).

    Example:
        >>> check_batch_sizes(8, 128)
    """
    for name, value in (("b_small", b_small), ("b_big", b_big)):
        if not math.isfinite(float(value)) or float(value) < 1:
            raise ValueError(f"{name} must be a finite batch size >= 1, got {value!r}")
    if float(b_small) >= float(b_big):
        raise ValueError(
            f"b_small must be smaller than b_big (got b_small={b_small}, b_big={b_big}); the "
            "two-batch estimator needs two different batch sizes"
        )


def two_batch(
    g_small_sq: ArrayLike, g_big_sq: ArrayLike, b_small: float, b_big: float
) -> tuple[ArrayLike, ArrayLike]:
    """Unbiased estimates of ``|G|^2`` and ``tr(Sigma)`` from two squared gradient norms.

    Uses ``E|G_B|^2 = |G|^2 + tr(Sigma)/B`` at two batch sizes and solves the 2x2 system.

    Example:
        >>> two_batch(1.0 + 4.0 / 2, 1.0 + 4.0 / 8, 2, 8)
        (1.0, 4.0)
    """
    check_batch_sizes(b_small, b_big)
    g_sq = (b_big * g_big_sq - b_small * g_small_sq) / (b_big - b_small)
    trace = (g_small_sq - g_big_sq) / (1.0 / b_small - 1.0 / b_big)
    return g_sq, trace


def safe_ratio(num: float, den: float) -> float:
    """``num / den``, or ``inf`` when the gradient estimate ``den`` is not positive.

    Example:
        >>> safe_ratio(4.0, 2.0), safe_ratio(4.0, -1.0)
        (2.0, inf)
    """
    return float(num) / float(den) if den > 0 else math.inf


@dataclass(frozen=True)
class RatioStats:
    """Ratio of means with its delta-method standard error and a bootstrap interval."""

    ratio: float
    num_mean: float
    den_mean: float
    stderr: float
    interval: tuple[float, float]


def ratio_of_means(
    num: np.ndarray, den: np.ndarray, *, n_boot: int = 1000, level: float = 0.95, seed: int = 0
) -> RatioStats:
    """``mean(num) / mean(den)`` (never the mean of ratios) with uncertainty.

    ``num`` and ``den`` are paired per-estimate values (``tr(Sigma)_i`` and ``|G|^2_i``). The
    standard error uses the delta method; the interval is a percentile bootstrap over the
    pairs, where resamples with a non-positive denominator count as ``inf``.

    Example:
        >>> s = ratio_of_means(np.array([4.0, 6.0]), np.array([1.0, 1.0]))
        >>> s.ratio
        5.0
    """
    num = np.asarray(num, dtype=np.float64).ravel()
    den = np.asarray(den, dtype=np.float64).ravel()
    if num.shape != den.shape or num.size == 0:
        raise ValueError(f"num and den must be non-empty and paired, got {num.shape}, {den.shape}")
    n = num.size
    nm, dm = float(num.mean()), float(den.mean())
    ratio = safe_ratio(nm, dm)
    if n > 1 and math.isfinite(ratio):
        cov = np.cov(num, den, ddof=1)
        var = (cov[0, 0] - 2 * ratio * cov[0, 1] + ratio**2 * cov[1, 1]) / (n * dm**2)
        stderr = math.sqrt(max(float(var), 0.0))
    else:
        stderr = math.nan if n == 1 else math.inf
    if n > 1:
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, n, size=(n_boot, n))
        bn, bd = num[idx].mean(axis=1), den[idx].mean(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            boot = np.where(bd > 0, bn / np.where(bd > 0, bd, 1.0), np.inf)
        boot.sort()
        alpha = (1.0 - level) / 2
        lo = float(boot[int(math.floor(alpha * (n_boot - 1)))])
        hi = float(boot[int(math.ceil((1 - alpha) * (n_boot - 1)))])
    else:
        lo = hi = math.nan
    return RatioStats(ratio, nm, dm, stderr, (lo, hi))


def geometric_ladder(small: int, big: int, num: int = 5) -> list[int]:
    """Distinct integer batch sizes spaced geometrically from ``small`` to ``big``.

    Example:
        >>> geometric_ladder(8, 128)
        [8, 16, 32, 64, 128]
    """
    check_batch_sizes(small, big)
    sizes = np.unique(np.round(np.geomspace(small, big, num=num)).astype(int))
    return [int(s) for s in sizes]


@dataclass(frozen=True)
class FitResult:
    """Least-squares fit of ``|G_B|^2 = g_sq + trace / B``."""

    g_sq: float
    trace: float
    b_simple: float
    b_simple_stderr: float
    residual: float  # RMS of the residuals divided by the mean of |G_B|^2 (relative)


def fit_sq_norms(
    batch_sizes: np.ndarray, mean_sq: np.ndarray, stderr: np.ndarray | None = None
) -> FitResult:
    """Fit ``|G_B|^2 = |G|^2 + tr(Sigma)/B`` with ``scipy.optimize.curve_fit``.

    ``stderr`` (per batch size) weights the fit; the parameter covariance then gives the
    standard error of ``B_simple = tr(Sigma)/|G|^2`` by the delta method.

    Example:
        >>> b = np.array([1.0, 2.0, 4.0, 8.0])
        >>> r = fit_sq_norms(b, 2.0 + 6.0 / b)
        >>> round(r.g_sq, 6), round(r.trace, 6), round(r.b_simple, 6)
        (2.0, 6.0, 3.0)
    """
    from scipy.optimize import curve_fit

    x = np.asarray(batch_sizes, dtype=np.float64)
    y = np.asarray(mean_sq, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape or np.unique(x).size < 2:
        raise ValueError("the fit needs at least two distinct batch sizes with one value each")
    if not np.all(np.isfinite(y)):
        raise ValueError(f"squared gradient norms must be finite, got {y.tolist()}")
    sigma = None
    if stderr is not None:
        s = np.asarray(stderr, dtype=np.float64)
        if np.all(np.isfinite(s)) and np.all(s > 0):
            sigma = s
    # Start from the exact two-point solution at the extremes so the fit cannot wander off.
    lo, hi = int(np.argmin(x)), int(np.argmax(x))
    p0 = two_batch(y[lo], y[hi], x[lo], x[hi])
    with warnings.catch_warnings():
        # A perfect fit (noise-free data) makes the covariance degenerate; that is not an error.
        warnings.simplefilter("ignore", category=RuntimeWarning)
        from scipy.optimize import OptimizeWarning

        warnings.simplefilter("ignore", category=OptimizeWarning)
        popt, pcov = curve_fit(
            lambda b, g, t: g + t / b, x, y, p0=p0, sigma=sigma, absolute_sigma=sigma is not None
        )
    g_sq, trace = float(popt[0]), float(popt[1])
    b_simple = safe_ratio(trace, g_sq)
    if math.isfinite(b_simple) and np.all(np.isfinite(pcov)) and trace != 0:
        rel = pcov[1, 1] / trace**2 + pcov[0, 0] / g_sq**2 - 2 * pcov[0, 1] / (trace * g_sq)
        b_stderr = abs(b_simple) * math.sqrt(max(float(rel), 0.0))
    else:
        b_stderr = math.inf
    resid = y - (g_sq + trace / x)
    residual = float(np.sqrt(np.mean(resid**2)) / abs(np.mean(y))) if np.mean(y) != 0 else 0.0
    return FitResult(g_sq, trace, b_simple, b_stderr, residual)


def doubling_ladder(small: int, big: int) -> list[int]:
    """``small, 2 small, 4 small, ...`` up to ``big`` (``big`` appended if not reached exactly).

    Sizes that are multiples of the smallest let one big batch serve every size (nested chunks).

    Example:
        >>> doubling_ladder(8, 128), doubling_ladder(3, 20)
        ([8, 16, 32, 64, 128], [3, 6, 12, 20])
    """
    check_batch_sizes(small, big)
    sizes = [int(small)]
    while sizes[-1] * 2 <= big:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != big:
        sizes.append(int(big))
    return sizes


def finite_step(values: Sequence[float]) -> bool:
    """Whether a staged training step's squared norms, read back to the host, are all finite;
    when not, a ``RuntimeWarning`` says that the step is left out of the noise scale.

    The one check of every hooked feed (per-sample capture, micro-batches, DDP hook): NaN/Inf
    gradients there come from a mixed-precision overflow (a step the GradScaler skips, so no
    update the optimizer applies) or a NaN from the loss or the data, and training goes on.
    It runs on the values the tracker reads anyway, so the step itself reads nothing. A
    direct `nnstat.NoiseScale.update` with non-finite values still raises: that is input.

    Args:
        values: the step's staged values, as host floats.

    Returns:
        ``True`` when every value is finite (the caller adds the step), else ``False`` (after
        the warning; the caller leaves the step out).

    Example:
        >>> finite_step([4.0, 1.5])
        True
    """
    if all(map(math.isfinite, values)):
        return True
    warnings.warn(
        "nnstat: the noise scale left out an optimizer step with non-finite gradients "
        "(NaN/Inf: a mixed-precision overflow, which the GradScaler skips, or a NaN "
        "from the loss or the data)",
        RuntimeWarning,
        stacklevel=3,
    )
    return False


def warn_if_noise(g_sq: float) -> None:
    if g_sq <= 0:
        warnings.warn(
            f"the |G|^2 estimate is {g_sq:.3g} <= 0: the gradient is indistinguishable from noise "
            "at this sample size, so b_simple is inf (grad_sq_norm and trace_sigma keep the raw "
            "estimates); use more n_estimates or a larger big_batch",
            RuntimeWarning,
            stacklevel=3,
        )


class SeparateAverages:
    """Separate running averages of the numerator tr(Sigma) and denominator |G|^2: an EMA with
    factor ``beta`` (bias-corrected, like Adam's ``1 - beta^t``) or the mean of the last
    ``window`` observations (``beta`` then unused). Their ratio, never the mean of the per-step
    ratios, is the noise scale (`nnstat.NoiseScale`).

    Example:
        >>> avg = SeparateAverages(beta=0.5, window=None)
        >>> avg.add(4.0, 1.0); avg.add(8.0, 1.0)
        >>> avg.means()
        (6.666666666666667, 1.0)
    """

    def __init__(self, beta: float | None, window: int | None) -> None:
        self.beta, self.window = beta, window
        self.num = self.den = self.weight = 0.0
        self.nums: deque[float] = deque(maxlen=window)
        self.dens: deque[float] = deque(maxlen=window)

    def add(self, trace: float, g_sq: float) -> None:
        if self.window is not None:
            self.nums.append(trace)
            self.dens.append(g_sq)
            return
        b = self.beta
        assert b is not None
        self.num = b * self.num + (1 - b) * trace
        self.den = b * self.den + (1 - b) * g_sq
        self.weight = b * self.weight + (1 - b)  # bias correction, like Adam's 1 - beta^t

    def means(self) -> tuple[float, float]:
        if self.window is not None:
            n = len(self.nums)
            return (sum(self.nums) / n, sum(self.dens) / n) if n else (math.nan, math.nan)
        if self.weight == 0:
            return math.nan, math.nan
        return self.num / self.weight, self.den / self.weight

    def state(self) -> dict[str, Any]:
        if self.window is not None:
            return {"nums": list(self.nums), "dens": list(self.dens)}
        return {"num": self.num, "den": self.den, "weight": self.weight}

    def load(self, state: Mapping[str, Any]) -> None:
        if self.window is not None:
            self.nums.clear()
            self.dens.clear()
            self.nums.extend(float(v) for v in state["nums"])
            self.dens.extend(float(v) for v in state["dens"])
        else:
            self.num, self.den = float(state["num"]), float(state["den"])
            self.weight = float(state["weight"])
