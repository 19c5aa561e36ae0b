"""The critical batch size measured by training, as McCandlish et al. (2018) measure it.

Train at several batch sizes ``B`` (learning rate tuned per ``B``) and count the optimizer steps
``S`` to reach a target loss; ``E = B S`` examples are then spent. The pairs follow the hyperbola
``(S/S_min - 1)(E/E_min - 1) = 1``, whose parametrisation by ``B`` is

    S(B) = S_min + E_min / B          E(B) = E_min + S_min B

so ``S`` is linear in ``1/B`` and the fit is a weighted linear least-squares problem in closed
form (the same form as ``|G_B|^2 = |G|^2 + tr(Sigma)/B`` in :mod:`maths`, solved here for many
bootstrap resamples at once). ``B_crit = E_min / S_min`` is where a run spends twice the minimum
steps and twice the minimum examples. This is the measurement that ``B_simple`` and ``B_noise``
(:func:`nnstat.noise_scale`) predict without training.

The weights are relative (``1/S(B)^2``, refined twice from the fitted curve): steps to a target
scatter about proportionally to their size, and an absolute fit would let the smallest batch
alone set ``E_min``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CriticalBatchSize", "critical_batch_size", "steps_to_target"]

_IRLS_ROUNDS = 3  # relative weights from the observed steps, then twice from the fitted curve


@dataclass(frozen=True)
class CriticalBatchSize:
    """Fit of ``(S/S_min - 1)(E/E_min - 1) = 1`` to steps-to-target at several batch sizes.

    ``*_interval`` are percentile bootstrap intervals at ``level``: over the seeds within each
    batch size when some batch size has two or more (``method="seed bootstrap"``), else over the
    fit's relative residuals (``method="residual bootstrap"``), widened by Student's
    ``t/z`` for the few degrees of freedom behind the spread. A resample whose fitted ``S_min``
    is <= 0 counts as ``B_crit = inf`` (steps still fall as ``1/B`` over the whole sweep), one
    whose ``E_min`` is <= 0 as ``B_crit = 0``.

    Example:
        >>> r = critical_batch_size({b: 50 + 6000 / b for b in (16, 32, 64, 128, 256)}, n_boot=50)
        >>> round(r.b_crit), round(r.predicted_steps(120), 6)  # S_min + E_min / 120
        (120, 100.0)
    """

    s_min: float
    e_min: float
    b_crit: float
    s_min_interval: tuple[float, float]
    e_min_interval: tuple[float, float]
    b_crit_interval: tuple[float, float]
    batch_sizes: list[int]
    steps: list[float]  # mean steps to the target per batch size (over its seeds)
    n_runs: list[int]  # runs (seeds) per batch size
    residual: float  # RMS relative residual of the fit
    method: str
    level: float = 0.95
    n_boot: int = 0

    def predicted_steps(self, batch_size: float) -> float:
        """``S(B) = S_min + E_min / B``: the steps the fit predicts at ``batch_size``."""
        return self.s_min + self.e_min / batch_size

    def summary(self) -> str:
        """One line, e.g. ``B_crit = 120 (95% interval 90-160; S_min = 50, E_min = 6000)``."""
        lo, hi = self.b_crit_interval
        return (
            f"B_crit = {self.b_crit:.4g} ({100 * self.level:.0f}% interval {lo:.4g}-{hi:.4g}, "
            f"{self.method}; S_min = {self.s_min:.4g}, E_min = {self.e_min:.4g})"
        )


def _line_fit(x: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weighted least squares of ``y = a + b x`` over the last axis, batched over the others."""
    sw = w.sum(-1)
    mx = (w * x).sum(-1) / sw
    my = (w * y).sum(-1) / sw
    dx = x - mx[..., None]
    b = (w * dx * (y - my[..., None])).sum(-1) / (w * dx * dx).sum(-1)
    return my - b * mx, b


def _fit(inv_b: np.ndarray, steps: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(S_min, E_min)`` of ``S = S_min + E_min / B`` with relative weights (batched)."""
    scale = steps
    for _ in range(_IRLS_ROUNDS):
        s_min, e_min = _line_fit(inv_b, steps, n / scale**2)
        fitted = s_min[..., None] + e_min[..., None] * inv_b
        # a fitted curve that dips to <= 0 cannot weight anything: keep the last weights
        scale = np.where(fitted > 0, fitted, scale)
    return s_min, e_min


def _interval(v: np.ndarray, point: float, level: float, dof: int) -> tuple[float, float]:
    """Percentile bootstrap interval, widened on the log scale by ``t_dof / z``.

    A bootstrap of a few seeds or residuals treats their spread as known; Student's factor
    accounts for it being estimated from ``dof`` degrees of freedom (on synthetic sweeps with 3
    seeds or 8 single runs it brings a 95% interval's coverage from about 0.85-0.9 to 0.9-0.95).
    """
    from scipy.stats import norm, t

    alpha = (1.0 - level) / 2
    lo, hi = np.quantile(v, [alpha, 1.0 - alpha], method="inverted_cdf")
    widen = float(t.ppf(1 - alpha, max(dof, 1)) / norm.ppf(1 - alpha))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        out = [point * (b / point) ** widen if 0 < b < math.inf else b for b in (lo, hi)]
    return float(out[0]), float(out[1])


def _as_runs(sweep: Mapping[int, float | Sequence[float]]) -> tuple[list[int], list[np.ndarray]]:
    if not isinstance(sweep, Mapping):
        raise TypeError(
            "sweep must be a dict {batch_size: steps_to_target} (or {batch_size: [steps per "
            f"seed, ...]}}), got {type(sweep).__name__}"
        )
    sizes, runs = [], []
    for b, s in sorted(sweep.items()):
        if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
            raise ValueError(f"batch sizes must be ints >= 1, got {b!r}")
        vals = [s] if s is None or np.ndim(s) == 0 else list(s)
        if not vals:
            raise ValueError(f"batch size {b} has no runs")
        if any(v is None for v in vals):
            raise ValueError(
                f"batch size {b} has a run that never reached the target (steps None): train it "
                "longer, use an easier target, or leave that batch size out"
            )
        arr = np.asarray(vals, dtype=np.float64)
        if not np.all(np.isfinite(arr)) or np.any(arr <= 0):
            raise ValueError(f"steps to the target must be finite and > 0; batch size {b}: {vals}")
        sizes.append(int(b))
        runs.append(arr)
    if len(sizes) < 3:
        raise ValueError(
            f"the critical batch size needs steps at >= 3 distinct batch sizes (two fix the "
            f"hyperbola exactly, leaving nothing to check it), got {sizes}"
        )
    return sizes, runs


def critical_batch_size(
    sweep: Mapping[int, float | Sequence[float]],
    *,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> CriticalBatchSize:
    """Fit ``S_min``, ``E_min`` and ``B_crit = E_min / S_min`` to a batch-size sweep.

    Args:
        sweep: ``{batch_size: steps_to_target}``, or ``{batch_size: [steps, ...]}`` with one
            value per seed, the learning rate tuned per batch size; at least 3 batch sizes,
            best spanning ``B_crit`` (e.g. with :func:`steps_to_target` on each run's history).
        n_boot: bootstrap resamples for the intervals.
        level: the intervals' coverage.
        seed: seed of the bootstrap.

    Returns:
        A :class:`CriticalBatchSize` with the point fit, bootstrap intervals, the mean steps
        per batch size and the fit's relative RMS residual.

    Raises:
        ValueError: fewer than 3 batch sizes, non-positive or non-finite steps, a run that never
            reached the target (``None``), or steps that do not follow the hyperbola: steps
            that do not fall as the batch grows (``E_min <= 0``), or that still fall as ``1/B``
            at the largest batch (``S_min <= 0``: ``B_crit`` lies above the sweep).
        TypeError: ``sweep`` is not a mapping.

    Example:
        >>> sweep = {b: 100 + 6400 / b for b in (8, 16, 32, 64, 128, 256)}  # S_min 100, E_min 6400
        >>> r = critical_batch_size(sweep, n_boot=200)
        >>> round(r.s_min, 6), round(r.e_min, 6), round(r.b_crit, 6)
        (100.0, 6400.0, 64.0)
    """
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    if not isinstance(n_boot, int) or n_boot < 0:
        raise ValueError(f"n_boot must be an int >= 0, got {n_boot!r}")
    sizes, runs = _as_runs(sweep)
    inv_b = 1.0 / np.asarray(sizes, dtype=np.float64)
    n = np.asarray([len(r) for r in runs], dtype=np.float64)
    mean = np.asarray([r.mean() for r in runs])
    s_min, e_min = (float(v) for v in _fit(inv_b, mean, n))
    if e_min <= 0:
        seen = dict(zip(sizes, mean.round(1).tolist(), strict=True))
        raise ValueError(
            f"steps to the target do not fall as the batch grows ({seen}; "
            f"fitted E_min = {e_min:.3g} <= 0): the sweep starts above the critical batch size "
            "or the learning rate was not tuned per batch size; add smaller batch sizes"
        )
    if s_min <= 0:
        raise ValueError(
            f"steps still fall as 1/B at the largest batch size {sizes[-1]} (fitted S_min = "
            f"{s_min:.3g} <= 0): the critical batch size lies above the sweep; add larger batch "
            "sizes"
        )
    fitted = s_min + e_min * inv_b
    residual = float(np.sqrt(np.mean((mean / fitted - 1.0) ** 2)))
    rng = np.random.default_rng(seed)
    if n.max() > 1:
        method = "seed bootstrap"
        dof = int(n.sum()) - len(sizes)  # the within-batch-size spread of the seeds
        # resample each batch size's seeds with replacement; the resampled means are refitted
        # seeds with replacement, their spread inflated by sqrt(k/(k-1)) (k seeds) so that a
        # resample's variance is the unbiased one, not (k-1)/k of it
        spread = [r.mean() + (r - r.mean()) * math.sqrt(len(r) / max(len(r) - 1, 1)) for r in runs]
        boot = np.stack(
            [r[rng.integers(0, len(r), size=(n_boot, len(r)))].mean(-1) for r in spread], -1
        )
    else:
        method = "residual bootstrap"
        dof = len(sizes) - 2  # residuals of a two-parameter fit
        # relative residuals on the log scale, inflated for the two fitted parameters
        resid = np.log(mean / fitted) * math.sqrt(len(sizes) / (len(sizes) - 2))
        boot = fitted * np.exp(resid[rng.integers(0, len(sizes), size=(n_boot, len(sizes)))])
    if n_boot:
        bs, be = _fit(inv_b, boot, n)
        with np.errstate(divide="ignore", invalid="ignore"):
            bb = np.where(bs <= 0, np.inf, np.where(be <= 0, 0.0, be / np.where(bs > 0, bs, 1)))
        intervals = [
            _interval(v, p, level, dof) for v, p in ((bs, s_min), (be, e_min), (bb, e_min / s_min))
        ]
    else:
        intervals = [(math.nan, math.nan)] * 3
    return CriticalBatchSize(
        s_min=s_min,
        e_min=e_min,
        b_crit=e_min / s_min,
        s_min_interval=intervals[0],
        e_min_interval=intervals[1],
        b_crit_interval=intervals[2],
        batch_sizes=sizes,
        steps=mean.tolist(),
        n_runs=[len(r) for r in runs],
        residual=residual,
        method=method,
        level=level,
        n_boot=n_boot,
    )


def _pairs(history: Any, key: str, step_key: str) -> np.ndarray:
    """``[n, 2]`` (step, loss) from pairs, an array, dict rows (JSONL) or a W&B DataFrame."""
    if hasattr(history, "to_dict") and hasattr(history, "columns"):  # pandas (W&B history())
        history = history.to_dict("records")
    rows = list(history) if isinstance(history, Iterable) else None
    if rows is None:
        raise TypeError(f"history must be a sequence of rows, got {type(history).__name__}")
    if rows and isinstance(rows[0], Mapping):
        rows = [
            (r[step_key], r[key])
            for r in rows
            if key in r and step_key in r and r[key] is not None and np.isfinite(r[key])
        ]
        if not rows:
            raise ValueError(f"no row of the history holds both {step_key!r} and {key!r}")
    arr = np.asarray(rows, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != 2 or len(arr) == 0:
        raise ValueError(
            f"history must be (step, loss) pairs, an [n, 2] array or dict rows; got shape "
            f"{arr.shape}"
        )
    if np.any(np.diff(arr[:, 0]) <= 0):
        raise ValueError("the history's steps must increase strictly (one row per logged step)")
    return arr


def steps_to_target(
    history: Any,
    target: float,
    *,
    key: str = "train/loss",
    step_key: str = "step",
    window: int = 1,
) -> float | None:
    """The first step at which a loss history reaches ``target``, interpolated between rows.

    Args:
        history: ``[(step, loss), ...]``, an ``[n, 2]`` array, dict rows as in a JSONL log
            (``{"step": 10, "train/loss": 0.5, ...}``) or a W&B ``run.history()`` DataFrame.
        target: the loss to reach.
        key: the loss column for dict rows / DataFrames (rows without it are skipped).
        step_key: the step column for dict rows / DataFrames.
        window: trailing moving average over this many rows first (for a noisy minibatch
            loss; the smoothing delays the crossing by about ``window / 2`` rows).

    Returns:
        The interpolated step (a float) where the loss first falls to ``target``, the first
        step if it starts there, ``None`` if it never does.

    Raises:
        ValueError: an empty or malformed history, steps that do not increase, ``window < 1``.
        TypeError: ``history`` is not a sequence.

    Example:
        >>> steps_to_target([(0, 2.0), (10, 1.0), (20, 0.5)], 0.75)
        15.0
        >>> steps_to_target([{"step": 0, "train/loss": 2.0}], 1.0) is None
        True
    """
    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1, got {window!r}")
    arr = _pairs(history, key, step_key)
    step, loss = arr[:, 0], arr[:, 1]
    if window > 1:
        c = np.cumsum(np.insert(loss, 0, 0.0))
        k = np.minimum(np.arange(1, len(loss) + 1), window)
        loss = (c[1:] - c[np.arange(1, len(loss) + 1) - k]) / k
    hit = np.flatnonzero(loss <= target)
    if hit.size == 0:
        return None
    i = int(hit[0])
    if i == 0:
        return float(step[0])
    f = (loss[i - 1] - target) / (loss[i - 1] - loss[i])
    return float(step[i - 1] + f * (step[i] - step[i - 1]))
