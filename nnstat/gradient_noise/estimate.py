"""Gradient noise scale for choosing a batch size (McCandlish et al. 2018, appendix A).

With per-example gradient covariance ``Sigma`` and true gradient ``G``,
``E|G_B|^2 = |G|^2 + tr(Sigma)/B``. Measuring ``|G_B|^2`` at two (or more) batch sizes gives
unbiased estimates of ``|G|^2`` and ``tr(Sigma)``, and the *simple noise scale*
``B_simple = tr(Sigma)/|G|^2`` predicts the critical batch size ``B_crit`` (below ``B_crit``,
doubling the batch almost halves the number of steps; above it, extra samples are mostly
wasted), but over-estimates it: by 2-14x on the tasks of ``benchmarks/critical_batch.py``, where
``B_noise`` came closer (docs/noise-scale.md); `critical_batch_size` measures ``B_crit``.

``B_simple`` is always the ratio of separately averaged ``tr(Sigma)`` and ``|G|^2`` estimates.
The Hessian-weighted ``B_noise = tr(H Sigma)/G^T H G`` is available with ``hessian=True`` for
small models (exact HVPs).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from nnstat.gradient_noise.batches import (
    BatchSource,
    LossFn,
    batch_loss,
    check_mean_loss,
    mean_grads,
    sq_norms,
    to_host,
)
from nnstat.gradient_noise.fit import fit_method
from nnstat.gradient_noise.maths import (
    check_batch_sizes,
    doubling_ladder,
    ratio_of_means,
    safe_ratio,
    two_batch,
    warn_if_noise,
)
from nnstat.gradient_noise.result import LayerNoiseScale, NoiseScaleResult

__all__ = ["noise_scale"]

Method = Literal["two_batch", "per_sample", "fit"]
_METHODS = ("two_batch", "per_sample", "fit")


def _layers(names: list[str], g_sq: np.ndarray, trace: np.ndarray) -> dict[str, LayerNoiseScale]:
    return {
        n: LayerNoiseScale(safe_ratio(float(t), float(g)), float(g), float(t))
        for n, g, t in zip(names, g_sq, trace, strict=True)
    }


def _pair_result(
    method: str,
    small: np.ndarray,
    big: np.ndarray,
    b_small: int,
    b_big: int,
    names: list[str],
    n_samples: int,
    seed: int,
) -> NoiseScaleResult:
    """Result from per-estimate, per-layer squared norms ``small``/``big`` of shape [n, L]."""
    g_sq, trace = two_batch(small.sum(1), big.sum(1), b_small, b_big)
    stats = ratio_of_means(trace, g_sq, seed=seed)
    warn_if_noise(stats.den_mean)
    lg, lt = two_batch(small.mean(0), big.mean(0), b_small, b_big)
    return NoiseScaleResult(
        method=method,
        b_simple=stats.ratio,
        grad_sq_norm=stats.den_mean,
        trace_sigma=stats.num_mean,
        b_simple_stderr=stats.stderr,
        interval=stats.interval,
        n_samples=n_samples,
        n_estimates=int(small.shape[0]),
        batch_sizes=[b_small, b_big],
        per_layer=_layers(names, lg, lt),
        estimates={"grad_sq_norm": g_sq.tolist(), "trace_sigma": trace.tolist()},
    )


def _estimates(n: int, method: str, progress: bool | None) -> Any:
    """``range(n)`` with a tqdm bar on stderr: ``progress=None`` shows it when stderr is a
    terminal (tqdm's own rule: none in CI logs or tests), ``True`` always, ``False`` never."""
    from tqdm.auto import tqdm

    off = None if progress is None else not progress
    return tqdm(range(n), desc=f"noise scale ({method})", unit="batch", disable=off, leave=False)


def _draw(gen: torch.Generator, n_data: int, size: int) -> torch.Tensor:
    return torch.randint(n_data, (size,), generator=gen)


def _two_batch(
    model: nn.Module,
    loss_fn: LossFn,
    src: BatchSource,
    params: list[nn.Parameter],
    b_small: int,
    b_big: int,
    n_estimates: int,
    gen: torch.Generator,
    progress: bool | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Each big batch is split into chunks of ``b_small``: one big gradient, many small ones.

    A last chunk shorter than ``b_small`` counts towards the big gradient only.
    """
    # per-estimate vectors stay on the model's device; one copy to the host at the end
    small: list[torch.Tensor] = []
    big: list[torch.Tensor] = []
    for _ in _estimates(n_estimates, "two_batch", progress):
        idx = _draw(gen, len(src), b_big)
        total = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        chunk_sq = []
        for start in range(0, b_big, b_small):
            part = idx[start : start + b_small]
            grads = mean_grads(model, loss_fn, src.batch(part), params)
            # float64 totals += float32 gradients, cast inside the add (no float64 copies)
            torch._foreach_add_(total, grads, alpha=len(part) / b_big)
            if len(part) == b_small:
                chunk_sq.append(sq_norms(grads))
        small.append(torch.stack(chunk_sq).mean(0))
        big.append(sq_norms(total))
    return to_host(small), to_host(big)


def _per_sample(
    model: nn.Module,
    loss_fn: LossFn,
    src: BatchSource,
    b_big: int,
    n_estimates: int,
    gen: torch.Generator,
    name_filter: str | None,
    progress: bool | None = None,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    from nnstat.gradient_noise.persample import PerSampleNorms

    collector = PerSampleNorms(model, name_filter=name_filter)
    saved = {id(p): p.grad for p in model.parameters()}
    try:
        covered = collector.covered_parameters()
        missing = [
            n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered
        ]
        if missing:
            warnings.warn(
                f"per_sample covers only the modules the capture engine supports; left out: "
                f"{missing}",
                RuntimeWarning,
                stacklevel=3,
            )
        names = list(collector.names)
        small = np.zeros((n_estimates, len(names)))
        big = np.zeros((n_estimates, len(names)))
        for i in _estimates(n_estimates, "per_sample", progress):
            for p in model.parameters():
                p.grad = None
            batch = src.batch(_draw(gen, len(src), b_big))
            with collector.batch(b_big):
                loss = batch_loss(model, loss_fn, batch)
                # read with the norms at the batch's end (one host read per batch), and named
                # before them, so a NaN loss names itself, not the norms it makes
                collector.check_loss(loss)
                loss.backward()
            s, b, _ = collector.last
            small[i] = [s.get(n, 0.0) for n in names]
            big[i] = [b.get(n, 0.0) for n in names]
    finally:
        collector.close()
        for p in model.parameters():
            p.grad = saved[id(p)]
    return small, big, names


def noise_scale(
    model: nn.Module,
    loss_fn: LossFn,
    data: Any,
    *,
    method: Method = "two_batch",
    small_batch: int = 8,
    big_batch: int = 128,
    batch_sizes: list[int] | None = None,
    n_estimates: int = 32,
    seed: int = 0,
    hessian: bool = False,
    hessian_samples: int = 256,
    name_filter: str | None = None,
    progress: bool | None = None,
) -> NoiseScaleResult:
    """Estimate the gradient noise scale ``B_simple`` of ``model`` on ``data`` at its weights.

    Args:
        model: the network (its mode is left as is; parameters and ``.grad`` are not changed).
        loss_fn: ``loss_fn(model(inputs), targets)`` returning the batch MEAN loss.
        data: a map-style ``Dataset``, a ``DataLoader`` over one, or an ``(inputs, targets)``
            tuple. Batches are drawn with replacement, so the estimates are unbiased for the
            whole data set's ``G`` and ``Sigma``.
        method: ``"two_batch"`` (each big batch split into small chunks), ``"per_sample"``
            (``B_small = 1`` from per-sample norms of the capture engine, batches of
            ``big_batch``; ``small_batch`` ignored) or ``"fit"`` (curve fit over
            ``batch_sizes``, default ``small_batch, 2*small_batch, ...`` up to ``big_batch``;
            one big batch is cut into nested chunks so it serves every size).
        n_estimates: number of independent big batches (per batch size for ``fit``).
        seed: seed of the batch sampler (the global RNG is not touched).
        hessian: also compute ``B_noise = tr(H Sigma)/G^T H G`` on ``hessian_samples``
            samples with exact Hessian-vector products (small models, tensor data only).
        name_filter: regex of module names for ``per_sample`` (default: all supported).
        progress: a progress bar over the estimates on stderr (``two_batch``, ``per_sample``):
            ``None`` shows it when stderr is a terminal, ``True`` always, ``False`` never.

    Returns:
        A :class:`NoiseScaleResult`. ``b_simple`` is ``inf`` (with a ``RuntimeWarning``) when the
        ``|G|^2`` estimate is <= 0; the raw estimates stay in ``grad_sq_norm``/``trace_sigma``.
        ``per_layer`` is keyed by parameter name (module name for ``per_sample``).

    Raises:
        ValueError: ``small_batch >= big_batch``, ``per_sample`` with ``big_batch < 2``, an
            unknown ``method``, mismatched data, a non-scalar or non-finite loss, a loss
            that sums over the batch (``reduction="sum"``: the estimates need its mean), or a
            model on the meta device.

    Example:
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(4, 1)
        >>> x = torch.randn(256, 4); y = x.sum(1, keepdim=True) + torch.randn(256, 1)
        >>> r = noise_scale(model, nn.functional.mse_loss, (x, y), small_batch=4, big_batch=32)
        >>> r.b_simple > 0
        True
    """
    if method not in _METHODS:
        raise ValueError(f"unknown method {method!r}; valid methods: {list(_METHODS)}")
    if not isinstance(n_estimates, int) or n_estimates < 1:
        raise ValueError(f"n_estimates must be a positive int, got {n_estimates!r}")
    for name, v in (("small_batch", small_batch), ("big_batch", big_batch)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    params_named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not params_named:
        raise ValueError("the model has no trainable parameters")
    meta = next((n for n, p in params_named if p.is_meta), None)
    if meta is not None:  # a measurement reads values: it would fail in torch's .item()
        raise ValueError(
            f"noise_scale: the model's parameter {meta!r} is on the meta device, which holds no "
            "values (a model built under torch.device('meta') or with empty weights): "
            "materialise it first (model.to_empty(device=...) and load its weights)"
        )
    device = params_named[0][1].device
    src = BatchSource(data, device)
    gen = torch.Generator().manual_seed(seed)
    names = [n for n, _ in params_named]
    params = [p for _, p in params_named]
    check_mean_loss(model, loss_fn, src)

    if method == "two_batch":
        check_batch_sizes(small_batch, big_batch)
        small, big = _two_batch(
            model, loss_fn, src, params, small_batch, big_batch, n_estimates, gen, progress
        )
        result = _pair_result(
            method, small, big, small_batch, big_batch, names, n_estimates * big_batch, seed
        )
    elif method == "per_sample":
        if big_batch < 2:
            raise ValueError(f"per_sample needs big_batch >= 2 samples, got {big_batch}")
        small, big, mod_names = _per_sample(
            model, loss_fn, src, big_batch, n_estimates, gen, name_filter, progress
        )
        result = _pair_result(
            method, small, big, 1, big_batch, mod_names, n_estimates * big_batch, seed
        )
    else:
        sizes = sorted(set(batch_sizes)) if batch_sizes else doubling_ladder(small_batch, big_batch)
        if len(sizes) < 2 or any(not isinstance(b, int) or b < 1 for b in sizes):
            raise ValueError(f"batch_sizes must hold at least two distinct ints >= 1, got {sizes}")
        result = fit_method(model, loss_fn, src, params, names, sizes, n_estimates, gen, seed)

    if hessian:
        from nnstat.gradient_noise.hessian import hessian_noise_scale

        n_h = min(hessian_samples, len(src))
        perm = torch.randperm(len(src), generator=gen)[:n_h]
        x, y = src.batch(perm)
        result.b_noise = hessian_noise_scale(model, loss_fn, x, y).b_noise
    return result
