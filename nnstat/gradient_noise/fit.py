"""``method="fit"`` of :func:`nnstat.noise_scale`: curve fit over several batch sizes."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from nnstat.gradient_noise.batches import BatchSource, LossFn, mean_grads, sq_norms, to_host
from nnstat.gradient_noise.maths import FitResult, fit_sq_norms, warn_if_noise
from nnstat.gradient_noise.result import LayerNoiseScale, NoiseScaleResult


def _nested_sq_norms(
    model: nn.Module,
    loss_fn: LossFn,
    batch: tuple[Any, Any],
    params: Sequence[nn.Parameter],
    sizes: Sequence[int],
) -> np.ndarray:
    """Mean squared norm per size of the gradients of consecutive chunks of one batch.

    The batch is cut into chunks of the smallest size; a size ``k`` times larger averages ``k``
    consecutive chunk gradients. Each chunk is i.i.d., so every average is an unbiased
    ``|G_B|^2`` sample, and one big batch serves all sizes.
    """
    base = sizes[0]
    x, y = batch
    n_chunks = sizes[-1] // base
    chunks = []
    for c in range(n_chunks):
        part = (_slice(x, c * base, (c + 1) * base), _slice(y, c * base, (c + 1) * base))
        chunks.append([g.double() for g in mean_grads(model, loss_fn, part, params)])
    out = []
    for b in sizes:
        k = b // base
        groups = []
        for start in range(0, n_chunks - k + 1, k):
            # a few foreach kernels per chunk added, not one per tensor (same sums, same order)
            mean = list(chunks[start])
            for ch in chunks[start + 1 : start + k]:
                mean = torch._foreach_add(mean, ch)
            groups.append(sq_norms(torch._foreach_div(mean, k)))
        out.append(torch.stack(groups).mean(0))
    return torch.stack(out)  # [sizes, params], on the model's device


def _slice(obj: Any, lo: int, hi: int) -> Any:
    if isinstance(obj, Mapping):
        return type(obj)({k: v[lo:hi] for k, v in obj.items()})
    return obj[lo:hi]


def _fit_totals(x: np.ndarray, totals: np.ndarray) -> FitResult:
    n = totals.shape[1]
    se = totals.std(1, ddof=1) / math.sqrt(n) if n > 1 else None
    return fit_sq_norms(x, totals.mean(1), se)


def fit_method(
    model: nn.Module,
    loss_fn: LossFn,
    src: BatchSource,
    params: Sequence[nn.Parameter],
    names: Sequence[str],
    sizes: Sequence[int],
    n_estimates: int,
    gen: torch.Generator,
    seed: int,
    n_boot: int = 200,
) -> NoiseScaleResult:
    """Fit ``|G_B|^2 = |G|^2 + tr(Sigma)/B``; the interval bootstraps over the big batches."""

    sizes = sorted(sizes)
    nested = all(b % sizes[0] == 0 for b in sizes)
    estimates: list[torch.Tensor] = []  # [sizes, params] per big batch, on the device
    for _ in range(n_estimates):
        if nested:
            idx = torch.randint(len(src), (sizes[-1],), generator=gen)
            estimates.append(_nested_sq_norms(model, loss_fn, src.batch(idx), params, sizes))
        else:
            rows = []
            for b in sizes:
                idx = torch.randint(len(src), (b,), generator=gen)
                rows.append(sq_norms(mean_grads(model, loss_fn, src.batch(idx), params)))
            estimates.append(torch.stack(rows))
    per_size = to_host(estimates).transpose(1, 0, 2)  # one copy: [sizes, estimates, params]
    x = np.asarray(sizes, dtype=np.float64)
    totals = per_size.sum(2)
    fit = _fit_totals(x, totals)
    warn_if_noise(fit.g_sq)
    layer_fits = [_fit_totals(x, per_size[:, :, k]) for k in range(len(params))]
    stderr, interval = fit.b_simple_stderr, (math.nan, math.nan)
    if n_estimates > 1:
        # Nested sizes share samples, so the fit's own covariance ignores their correlation;
        # resampling whole big batches accounts for it.
        rng = np.random.default_rng(seed)
        boot = np.array(
            [
                _fit_totals(x, totals[:, rng.integers(0, n_estimates, n_estimates)]).b_simple
                for _ in range(n_boot)
            ]
        )
        boot.sort()
        interval = (float(boot[int(0.025 * (n_boot - 1))]), float(boot[int(0.975 * (n_boot - 1))]))
        finite = boot[np.isfinite(boot)]
        stderr = float(finite.std(ddof=1)) if finite.size > 1 else math.inf
    n_samples = n_estimates * (sizes[-1] if nested else int(sum(sizes)))
    return NoiseScaleResult(
        method="fit",
        b_simple=fit.b_simple,
        grad_sq_norm=fit.g_sq,
        trace_sigma=fit.trace,
        b_simple_stderr=stderr,
        interval=interval,
        n_samples=n_samples,
        n_estimates=n_estimates,
        batch_sizes=list(sizes),
        per_layer={
            n: LayerNoiseScale(f.b_simple, f.g_sq, f.trace)
            for n, f in zip(names, layer_fits, strict=True)
        },
        fit_residual=fit.residual,
        estimates={f"sq_norm/{b}": totals[j].tolist() for j, b in enumerate(sizes)},
    )
