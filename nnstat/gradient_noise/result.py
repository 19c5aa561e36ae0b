"""Result types of :func:`nnstat.noise_scale` (re-exported by :mod:`nnstat.gradient_noise`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class LayerNoiseScale:
    """Noise-scale estimates restricted to one parameter (or module, for ``per_sample``):
    ``b_simple = trace_sigma / grad_sq_norm``, as in :class:`NoiseScaleResult`.

    Example:
        >>> layer = LayerNoiseScale(b_simple=4.0, grad_sq_norm=0.5, trace_sigma=2.0)
        >>> layer.trace_sigma / layer.grad_sq_norm == layer.b_simple
        True
    """

    b_simple: float
    grad_sq_norm: float
    trace_sigma: float


@dataclass
class NoiseScaleResult:
    """Result of :func:`noise_scale`.

    ``b_simple = trace_sigma / grad_sq_norm`` (``inf`` when ``grad_sq_norm <= 0``: the gradient
    is indistinguishable from noise at this sample size; the raw estimates stay available).
    For ``two_batch``/``per_sample``, ``b_simple_stderr`` is the delta-method standard error of
    the ratio of means and ``interval`` a 95% percentile bootstrap over the estimates. For
    ``fit`` both come from refitting on resampled big batches (the spread of the refitted
    ``b_simple`` and its 2.5/97.5% order statistics); with ``n_estimates=1`` the standard error
    is the delta method on the fit's covariance and the interval is NaN. ``per_layer`` is keyed
    by parameter name (module name for ``per_sample``).

    Args:
        method: ``"two_batch"``, ``"per_sample"`` or ``"fit"``.
        b_simple: the noise scale ``trace_sigma / grad_sq_norm``.
        grad_sq_norm: the unbiased estimate of ``|G|^2``.
        trace_sigma: the unbiased estimate of ``tr(Sigma)``.
        b_simple_stderr: standard error of ``b_simple``.
        interval: 95% interval of ``b_simple``.
        n_samples: samples drawn in all.
        n_estimates: independent big batches.
        batch_sizes: the batch sizes used.
        per_layer: the same estimates per layer.
        fit_residual: (``fit``) the curve fit's residual.
        b_noise: the Hessian-weighted ``B_noise`` when asked for.
        estimates: the raw per-batch estimates.

    Example:
        >>> r = NoiseScaleResult("two_batch", 4.0, 1.0, 4.0, 0.1, (3.8, 4.2), 10, 1, [2, 8])
        >>> r.b_simple == r.trace_sigma / r.grad_sq_norm
        True
    """

    method: str
    b_simple: float
    grad_sq_norm: float
    trace_sigma: float
    b_simple_stderr: float
    interval: tuple[float, float]
    n_samples: int
    n_estimates: int
    batch_sizes: list[int]
    per_layer: dict[str, LayerNoiseScale] = field(default_factory=dict)
    fit_residual: float | None = None
    b_noise: float | None = None
    estimates: dict[str, list[float]] = field(default_factory=dict)

    def to_dict(self, prefix: str = "noise_scale") -> dict[str, float]:
        """Flat metrics, e.g. ``noise_scale/b_simple`` and ``noise_scale/fc1.weight/b_simple`` (``<group>/<layer>/<stat>``).

        Example:
            >>> r = NoiseScaleResult("two_batch", 4.0, 1.0, 4.0, 0.1, (3.8, 4.2), 10, 1, [2, 8])
            >>> r.to_dict()["noise_scale/b_simple"]
            4.0
        """
        out = {
            f"{prefix}/b_simple": self.b_simple,
            f"{prefix}/grad_sq_norm": self.grad_sq_norm,
            f"{prefix}/trace_sigma": self.trace_sigma,
            f"{prefix}/b_simple_stderr": self.b_simple_stderr,
            f"{prefix}/low": self.interval[0],
            f"{prefix}/high": self.interval[1],
            f"{prefix}/n_samples": float(self.n_samples),
        }
        if self.fit_residual is not None:
            out[f"{prefix}/fit_residual"] = self.fit_residual
        if self.b_noise is not None:
            out[f"{prefix}/b_noise"] = self.b_noise
        for name, layer in self.per_layer.items():
            out[f"{prefix}/{name}/b_simple"] = layer.b_simple
        return out

    def summary(self) -> str:
        """One line: ``B_simple = 123 (95% CI 100-150) from 4096 samples``."""
        lo, hi = self.interval
        return (
            f"B_simple = {self.b_simple:.4g} (95% interval {lo:.4g}-{hi:.4g}, {self.method}) from "
            f"{self.n_samples} samples"
        )

    def as_json(self) -> dict[str, Any]:
        """Plain-data view (dataclasses turned into dicts)."""
        return asdict(self)
