"""Figures of what nnstat measured: layer histograms and heatmaps, statistics over training,
trust ratios, the noise scale, and influence.

Every function takes plain data (tensors, arrays, NetDicts, metric histories, influence results)
and returns a :class:`matplotlib.figure.Figure` built without ``pyplot``, so nothing global is
touched and no GUI backend is needed: ``fig.savefig("x.png")`` works anywhere. matplotlib is
imported only when a function is called (``pip install nnstat[viz]``).

Example:
    >>> import torch, nnstat.plot as nplt
    >>> fig = nplt.histogram(torch.randn(1000), title="w")
    >>> fig.savefig("/tmp/hist.png")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from nnstat.plot.canvas import new_figure
from nnstat.plot.frames import (
    matrix_2d,
    metrics_frame,
    no_finite_error,
    nonfinite_note,
    select_layers,
    to_numpy,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "histogram",
    "weight_heatmap",
    "stat_heatmap",
    "trust_ratio_plot",
    "noise_scale_plot",
    "training_curves",
]


def _pick(data: Any, layer: str | None) -> tuple[np.ndarray, str]:
    if isinstance(data, Mapping):
        if layer is None:
            if len(data) != 1:
                raise ValueError(f"pass layer=...; the data holds {len(data)} layers: {list(data)}")
            layer = next(iter(data))
        if layer not in data:
            raise KeyError(f"unknown layer {layer!r}; available: {list(data)}")
        return to_numpy(data[layer]), layer
    return to_numpy(data), layer or ""


def histogram(
    data: Any,
    layer: str | Sequence[str] | None = None,
    *,
    bins: int = 60,
    log_y: bool = False,
    title: str | None = None,
) -> Figure:
    """Histogram of a layer's values (parameters, gradients, updates, optimizer states).

    ``data`` is a tensor/array, or a mapping such as a NetDict from ``nnstat.get_weight(model)``
    with ``layer`` naming the parameter (several names overlay their histograms). NaN/Inf are
    left out of the bins and counted in the legend.

    Raises:
        ValueError: no value of the chosen layers is finite (the message names the layers, their
            NaN and Inf counts, and how to find the step that produced them); ``layer`` missing
            for a mapping of several layers.
        KeyError: ``layer`` is not in the mapping.

    Example:
        >>> import torch
        >>> fig = histogram({"fc.weight": torch.randn(64, 32)}, "fc.weight")
    """
    names = [layer] if layer is None or isinstance(layer, str) else list(layer)
    fig = new_figure(6.4, 3.8)
    ax = fig.add_subplot()
    picked = [_pick(data, name) for name in names]
    finite_all = np.concatenate([v[np.isfinite(v)].ravel() for v, _ in picked])
    if finite_all.size == 0:
        everything = np.concatenate([v.ravel() for v, _ in picked])
        raise no_finite_error(everything, [name for _, name in picked])
    edges = np.histogram_bin_edges(finite_all, bins=bins)
    for values, name in picked:
        flat = values.ravel()
        finite = flat[np.isfinite(flat)]
        bad = flat.size - finite.size
        label = (
            f"{name or 'values'}  n={flat.size:,}  mean={finite.mean():.3g}  std={finite.std():.3g}"
            if finite.size
            # an overlaid layer with nothing to draw says why rather than "mean=nan"
            else f"{name or 'values'}  no finite value ({nonfinite_note(flat)})"
        )
        if bad and finite.size:
            label += f"  nonfinite={bad}"
        style = "stepfilled" if len(picked) == 1 else "step"
        ax.hist(finite, bins=edges, histtype=style, alpha=0.75, linewidth=1.5, label=label)
    if log_y:
        ax.set_yscale("log")
    ax.axvline(0.0, color="0.3", linewidth=0.8, linestyle=":")
    ax.set_xlabel("value")
    ax.set_ylabel("count")
    # below the axes: a legend inside would hide the bars of a flat distribution
    ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
    shown = ", ".join(name for _, name in picked if name) or "values"
    # a title names what is plotted: "histogram" alone says nothing when several figures sit
    # side by side in a report
    ax.set_title(title or f"distribution of {shown}", fontsize=11)
    return fig


def weight_heatmap(
    data: Any,
    layer: str | None = None,
    *,
    max_size: int = 256,
    cmap: str = "RdBu_r",
    title: str | None = None,
) -> Figure:
    """Heatmap of a layer's weight matrix (rows: outputs, columns: inputs), on a colour scale
    symmetric around zero. Conv kernels are flattened per output channel; matrices larger than
    ``max_size`` on a side are block-averaged.

    Raises:
        ValueError: the layer holds no finite value (the message names it and how to find the
            step that produced the NaN/Inf).

    Example:
        >>> import torch
        >>> fig = weight_heatmap(torch.nn.Linear(20, 10).weight)
    """
    values, name = _pick(data, layer)
    if not np.isfinite(values).any():
        # an all-blank image would look like a drawing bug, not like a diverged layer
        raise no_finite_error(values, [name])
    original = values.shape
    mat = matrix_2d(values, max_size)
    limit = float(np.nanmax(np.abs(mat))) if np.isfinite(mat).any() else 1.0
    rows, cols = mat.shape
    aspect = cols / max(rows, 1)
    width = float(np.clip(3.0 + 4.0 * min(aspect, 1.6), 4.0, 9.0))
    height = float(np.clip(width / max(aspect, 0.35), 2.6, 5.0))
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    n_out, n_in = (
        (original[0], int(np.prod(original[1:]))) if len(original) > 1 else (1, original[0])
    )
    # extent keeps the axes in the original indices when blocks were averaged
    image = ax.imshow(
        mat,
        cmap=cmap,
        vmin=-limit or -1,
        vmax=limit or 1,
        aspect="auto",
        interpolation="nearest",
        extent=(-0.5, n_in - 0.5, n_out - 0.5, -0.5),
    )
    fig.colorbar(image, ax=ax, shrink=0.85, label="value")
    averaged = " (blocks averaged)"
    ax.set_xlabel("input" + (averaged if mat.shape[1] < n_in else ""))
    ax.set_ylabel("output" + (averaged if mat.shape[0] < n_out else ""))
    shape = "×".join(str(s) for s in original)
    ax.set_title(title or f"{name or 'weight'}  [{shape}]", fontsize=10)
    return fig


def stat_heatmap(
    history: Any,
    stat: str = "l2",
    *,
    prefix: str = "weight/",
    layers: Sequence[str] | None = None,
    include: str | None = None,
    exclude: str | None = None,
    log: bool | None = None,
    robust: bool = False,
    cmap: str = "viridis",
    title: str | None = None,
) -> Figure:
    """Layers × steps heatmap of one statistic from a metric history.

    ``history`` is a list of flat metric dicts as the Tracker or ``describe_layers`` produce
    (keys ``"{prefix}{layer}/{stat}"``), ``(step, dict)`` pairs, or a pandas frame (see
    :func:`metrics_frame`); ``include``/``exclude`` are regexes on layer names. ``log=None``
    picks a log colour scale when the positive values span
    more than two decades. ``robust=True`` sets the colour limits to the 2nd and 98th percentiles
    (values beyond are drawn in the end colours, the colour bar's arrows say so): one extreme
    step, such as Adam's sign-like first update, then no longer flattens the rest of training.

    Example:
        >>> hist = [{"grad/fc1.weight/l2": 1.0, "grad/fc2.weight/l2": 0.5, "step": s} for s in range(3)]
        >>> fig = stat_heatmap(hist, "l2", prefix="grad/")
    """
    from matplotlib.colors import LogNorm

    table = select_layers(metrics_frame(history), stat, prefix, layers, include, exclude)
    values = table.to_numpy(dtype=float).T  # layers × steps
    positive = values[np.isfinite(values) & (values > 0)]
    if log is None:
        log = positive.size > 0 and positive.max() / positive.min() > 100.0
    finite = values[np.isfinite(values)]
    pool = positive if log else finite
    lo: float | None = None
    hi: float | None = None
    if pool.size:
        lo, hi = (
            (float(v) for v in np.percentile(pool, [2.0, 98.0]))
            if robust
            else (float(pool.min()), float(pool.max()))
        )
    norm = LogNorm(vmin=lo, vmax=hi) if log and positive.size else None
    n_layers, n_steps = values.shape
    fig = new_figure(max(6.0, min(12.0, 4.0 + 0.08 * n_steps)), max(2.6, 1.2 + 0.28 * n_layers))
    ax = fig.add_subplot()
    steps = table.index.to_numpy()
    image = ax.imshow(
        np.ma.masked_invalid(values),
        aspect="auto",
        cmap=cmap,
        norm=norm,
        vmin=None if norm is not None else lo,
        vmax=None if norm is not None else hi,
        interpolation="nearest",
    )
    ax.set_yticks(range(n_layers), list(table.columns), fontsize=9)
    ticks = _step_ticks(steps)
    ax.set_xticks(ticks, [str(steps[t]) for t in ticks])
    ax.set_xlabel("step")
    clipped = robust and finite.size and (finite.min() < lo or finite.max() > hi)
    label = stat + (" (log)" if norm is not None else "") + (", 2–98% range" if robust else "")
    fig.colorbar(image, ax=ax, label=label, extend="both" if clipped else "neither")
    group = prefix.strip("/") or "metric"
    ax.set_title(title or f"{stat} of {group} per layer over training", fontsize=10)
    return fig


def _step_ticks(steps: np.ndarray, n: int = 8) -> np.ndarray:
    """Column indices whose steps are round numbers (10, 20, ... rather than 5, 20, 40, 55)."""
    from matplotlib.ticker import MaxNLocator

    nice = MaxNLocator(nbins=n, integer=True, steps=[1, 2, 5, 10]).tick_values(
        steps.min(), steps.max()
    )
    idx = np.unique(np.clip(np.searchsorted(steps, nice), 0, len(steps) - 1))
    exact = idx[np.isin(steps[idx], nice)]
    return (
        exact
        if len(exact) >= 2
        else np.unique(np.linspace(0, len(steps) - 1, min(len(steps), n)).round().astype(int))
    )


def trust_ratio_plot(
    history: Any,
    *,
    prefix: str = "trust_ratio/",
    stat: str | None = None,
    layers: Sequence[str] | None = None,
    include: str | None = None,
    exclude: str | None = None,
    log: bool | None = None,
    title: str | None = None,
) -> Figure:
    """Trust ratio ‖W_t‖ / ‖W_t − W_{t−1}‖ per layer over steps, one line per layer.

    Keys are ``"{prefix}{layer}"`` (or ``"{prefix}{layer}/{stat}"`` when ``stat`` is given);
    ``include``/``exclude`` are regexes on layer names (e.g. ``include="weight$"``). Infinite
    values (layers that did not move) are left out of the lines. ``log=None`` uses a log scale
    when the values span more than a factor 20. Beyond 10 layers the colours follow depth.

    Example:
        >>> hist = [{"trust_ratio/fc.weight": 100.0 + s, "step": s} for s in range(5)]
        >>> fig = trust_ratio_plot(hist)
    """
    table = select_layers(metrics_frame(history), stat, prefix, layers, include, exclude)
    table = table.replace([np.inf, -np.inf], np.nan)
    n = len(table.columns)
    ncol = 1 if n <= 12 else 2 if n <= 30 else 3
    longest = max(len(c) for c in table.columns)
    fig = new_figure(5.2 + ncol * (0.6 + 0.065 * longest), max(3.8, 0.7 + 0.16 * -(-n // ncol)))
    ax = fig.add_subplot()
    colours = _cycle(n)
    for i, name in enumerate(table.columns):
        ax.plot(table.index, table[name], label=name, color=colours[i], linewidth=1.3)
    _auto_log(ax, table.to_numpy(dtype=float), log)
    ax.set_xlabel("step")
    ax.set_ylabel("‖W‖ / ‖ΔW‖")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=9, frameon=False, loc="center left", bbox_to_anchor=(1.0, 0.5), ncol=ncol)
    ax.set_title(title or "trust ratio per layer (higher = smaller relative update)", fontsize=10)
    return fig


def _auto_log(ax: Any, values: np.ndarray, log: bool | None) -> None:
    positive = values[np.isfinite(values) & (values > 0)]
    if log is None:
        log = positive.size > 0 and positive.max() / positive.min() > 20.0
    if log:
        ax.set_yscale("log")


def noise_scale_plot(
    steps: Sequence[float] | Any,
    b_simple: Sequence[float] | None = None,
    interval: tuple[Sequence[float], Sequence[float]] | None = None,
    *,
    batch_size: int | None = None,
    log: bool | None = None,
    title: str | None = None,
) -> Figure:
    """The simple noise scale B_simple = tr(Σ)/‖G‖² over training, with its interval band.

    Either pass arrays (``steps``, ``b_simple``, optional ``interval=(low, high)``), or a metric
    history as the first argument: keys ``noise_scale/b_simple`` and, when logged,
    ``noise_scale/low``/``noise_scale/high``. ``batch_size`` draws the batch size used for
    training: B_simple well above it means a larger batch would still cut the number of steps
    almost proportionally (McCandlish et al. 2018).

    Example:
        >>> fig = noise_scale_plot([0, 10, 20], [30.0, 60.0, 90.0], ([20, 40, 70], [40, 80, 110]))
    """
    if b_simple is None:
        frame = metrics_frame(steps)
        if "noise_scale/b_simple" not in frame.columns:
            raise KeyError(f"no 'noise_scale/b_simple' in history; keys: {list(frame.columns)[:8]}")
        frame = frame[frame["noise_scale/b_simple"].notna()]
        x, y = frame.index.to_numpy(dtype=float), frame["noise_scale/b_simple"].to_numpy()
        for low, high in (("low", "high"), ("b_simple_low", "b_simple_high")):
            keys = {f"noise_scale/{low}", f"noise_scale/{high}"}
            if keys <= set(frame.columns):
                lo, hi = frame[f"noise_scale/{low}"], frame[f"noise_scale/{high}"]
                interval = (lo.to_numpy(), hi.to_numpy())
                break
    else:
        x, y = to_numpy(steps), to_numpy(b_simple)
    if x.shape != y.shape:
        raise ValueError(f"steps {x.shape} and b_simple {y.shape} differ in shape")
    fig = new_figure(7.0, 3.8)
    ax = fig.add_subplot()
    finite = y[np.isfinite(y) & (y > 0)]
    if log is None:
        log = finite.size > 0 and finite.max() / finite.min() > 20.0
    shown = np.where(np.isfinite(y) & (y > 0 if log else True), y, np.nan)
    unbounded = False
    if interval is not None:
        low, high = to_numpy(interval[0]), to_numpy(interval[1])
        if low.shape != x.shape or high.shape != x.shape:
            raise ValueError("interval bounds must have the shape of steps")
        if log:
            low = np.where(low > 0, low, np.nanmin(shown) / 10 if np.isfinite(shown).any() else 1)
        # an infinite upper bound (|G|² may be <= 0 in a bootstrap sample) is drawn to the top
        # of the axes rather than left out, which would hide the least certain estimates
        top = np.nanmax(np.where(np.isfinite(high), high, shown)) if np.isfinite(shown).any() else 1
        unbounded = bool(np.isposinf(high).any())
        ax.fill_between(
            x,
            low,
            np.where(np.isposinf(high), top * 1e3, high),
            color="#4c72b0",
            alpha=0.2,
            label="interval" + (" (to the top: no upper bound)" if unbounded else ""),
        )
    ax.plot(x, shown, marker="o", markersize=3, color="#4c72b0", label="B_simple = tr(Σ)/‖G‖²")
    if batch_size is not None:
        ax.axhline(batch_size, color="#dd8452", linestyle="--", label=f"batch size {batch_size}")
    if log:
        ax.set_yscale("log")
    if unbounded:
        finite_top = max(
            float(np.nanmax(shown)), float(np.nanmax(np.where(np.isfinite(high), high, np.nan)))
        )
        lowest = float(np.nanmin(low)) if log else 0.0
        ax.set_ylim(lowest * (0.8 if log else 1.0), finite_top * (2.0 if log else 1.15))
    ax.set_xlabel("step")
    ax.set_ylabel("noise scale (samples)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=9, frameon=False)
    ax.set_title(title or "gradient noise scale over training", fontsize=10)
    return fig


def _cycle(n: int) -> list:
    from matplotlib import colormaps

    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    # many layers: a sequential map keeps neighbours (depth) in similar colours
    return [colormaps["viridis"](i / max(n - 1, 1) * 0.92) for i in range(n)]


def training_curves(
    history: Any,
    panels: Mapping[str, Mapping[str, str]],
    *,
    title: str | None = None,
) -> Figure:
    """Metrics over training, one panel per group: e.g. loss and accuracy, train and test.

    ``panels`` maps a panel's y-axis label to ``{line label: metric key}``; the history is any
    form :func:`metrics_frame` reads. Steps at which a key was not logged are skipped (the line
    joins the logged points).

    Example:
        >>> hist = [{"step": s, "train/loss": 1 / (s + 1), "test/loss": 1.2 / (s + 1)} for s in range(5)]
        >>> fig = training_curves(hist, {"loss": {"train": "train/loss", "test": "test/loss"}})
    """
    frame = metrics_frame(history)
    missing = [k for lines in panels.values() for k in lines.values() if k not in frame.columns]
    if missing:
        raise KeyError(f"no metric {missing} in history; keys look like: {list(frame.columns)[:8]}")
    if not panels:
        raise ValueError("panels is empty: nothing to plot")
    fig = new_figure(4.2 * len(panels) + 0.6, 3.6)
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (ylabel, lines) in zip(axes, panels.items(), strict=True):
        for i, (label, key) in enumerate(lines.items()):
            series = frame[key].dropna()
            ax.plot(series.index, series.to_numpy(), label=label, color=_cycle(len(lines))[i])
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, frameon=False)
        ax.set_title(f"{ylabel} over training", fontsize=11)
    if title:
        fig.suptitle(title, fontsize=12)
    return fig
