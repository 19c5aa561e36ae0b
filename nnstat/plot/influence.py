"""Influence figures for :mod:`nnstat.plot`: query images beside their most
helpful and harmful training images, and the distribution of scores.

Example:
    >>> import numpy as np
    >>> from nnstat.plot import score_distribution
    >>> fig = score_distribution(np.arange(10.0) - 5)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from nnstat.plot.canvas import new_figure
from nnstat.plot.frames import score_matrix, to_numpy

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_HELPFUL, _HARMFUL = "#1b7837", "#b2182b"


def _image(
    images: Any, key: Any, position: int | None, shape: tuple[int, ...] | None
) -> np.ndarray:
    if isinstance(images, Mapping):
        img = images[key]
    else:
        img = images[position if position is not None else int(key)]
    arr = to_numpy(img)
    if shape is not None:
        arr = arr.reshape(shape)
    if arr.ndim == 3 and arr.shape[0] in (1, 3) and arr.shape[-1] not in (1, 3):
        arr = np.moveaxis(arr, 0, -1)  # CHW -> HWC
    if arr.ndim == 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim == 1:
        side = int(round(np.sqrt(arr.size)))
        if side * side != arr.size:
            raise ValueError(f"cannot show a flat vector of {arr.size} values; pass image_shape")
        arr = arr.reshape(side, side)
    if arr.ndim == 3:
        lo, hi = arr.min(), arr.max()
        arr = (arr - lo) / (hi - lo) if hi > lo else np.zeros_like(arr)
    return arr


def _top_lists(result: Any, k: int) -> list[tuple[Any, int | None, list, list]]:
    """Per query: (query id, query position, helpful [(id, pos, score)], harmful [...])."""
    if hasattr(result, "helpful_scores"):  # a TopKInfluence
        out = []
        for q, qid in enumerate(result.test_ids):
            hs, hl = to_numpy(result.helpful_scores[q])[:k], to_numpy(result.harmful_scores[q])[:k]
            helpful = [(i, None, s) for i, s in zip(result.helpful_ids[q][:k], hs, strict=False)]
            harmful = [(i, None, s) for i, s in zip(result.harmful_ids[q][:k], hl, strict=False)]
            out.append((qid, q, helpful, harmful))
        return out
    scores, test_ids, train_ids = score_matrix(result)
    k = min(k, scores.shape[1])
    out = []
    for q, row in enumerate(scores):
        order = np.argsort(np.where(np.isnan(row), -np.inf, row))
        best = order[::-1][:k]
        worst = np.argsort(np.where(np.isnan(row), np.inf, row))[:k]
        helpful = [(train_ids[j], int(j), float(row[j])) for j in best]
        harmful = [(train_ids[j], int(j), float(row[j])) for j in worst]
        out.append((test_ids[q], q, helpful, harmful))
    return out


def _fmt(score: float) -> str:
    """Compact signed score: ``+2960``, ``+275``, ``+1.23``, ``-0.00451``, ``+1.2e+07``."""
    a = abs(score)
    if a >= 1e5:
        return f"{score:+.2e}"
    if a >= 100:
        return f"{score:+.0f}"
    return f"{score:+#.3g}"


def _label(labels: Any, key: Any, position: int | None) -> str:
    if labels is None:
        return ""
    if isinstance(labels, Mapping):
        value = labels.get(key, "")
    else:
        value = labels[position if position is not None else int(key)]
    return str(value.item() if hasattr(value, "item") else value)


def influence_figure(
    query_images: Any,
    train_images: Any,
    result: Any,
    *,
    k: int = 4,
    query_labels: Any = None,
    train_labels: Any = None,
    query_captions: Sequence[str] | None = None,
    image_shape: tuple[int, ...] | None = None,
    cmap: str = "gray_r",
    max_queries: int = 12,
    title: str | None = None,
) -> Figure:
    """Each query image beside its ``k`` most helpful and ``k`` most harmful training images,
    each with its score (and label when given).

    ``result`` is an influence result (``.scores`` ``[n_query, n_train]`` with ``.test_ids`` /
    ``.train_ids``), a ``TopKInfluence`` or a plain score array. Images are addressed like the
    scores: ``train_images`` is a mapping id → image, or a sequence indexed by score column (by
    integer id for a ``TopKInfluence``); ``query_images`` likewise by query row. Labels follow
    the same addressing. Images may be ``[H, W]``, ``[C, H, W]``, ``[H, W, C]`` or flat square
    vectors (``image_shape`` reshapes anything else).

    Example:
        >>> import torch
        >>> fig = influence_figure(torch.rand(2, 8, 8), torch.rand(10, 8, 8), torch.randn(2, 10), k=2)
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    rows = _top_lists(result, k)[:max_queries]
    if not rows:
        raise ValueError("the influence result has no query")
    k = max(len(r[2]) for r in rows)
    # axes placed by hand (inches): constrained layout takes seconds for ~100 small axes
    title_h = 0.4 if title else 0.0
    width, height = 1.25 * (2 * k + 1) + 0.6, 1.55 * len(rows) + 0.62 + title_h
    fig = new_figure(width, height, constrained=False)
    top = height - title_h - 0.45  # below the header line
    x_helpful, x_harmful = 0.1 + 1.25 + 0.2, 0.1 + 1.25 * (k + 1) + 0.4

    def cell(x: float, r: int) -> tuple[float, float, float, float]:
        bottom = top - (r + 1) * 1.55 + 0.13
        return (x / width, bottom / height, 1.0 / width, 1.0 / height)

    for x, span, text, colour in (
        (0.1, 1, "query", "black"),
        (x_helpful, k, "most helpful  (score > 0: lowers the query's loss)", _HELPFUL),
        (x_harmful, k, "most harmful  (score < 0: raises the query's loss)", _HARMFUL),
    ):
        centre = x + (1.25 * span - 0.25) / 2
        fig.text(
            centre / width,
            (top + 0.1) / height,
            text,
            color=colour,
            ha="center",
            va="bottom",
            fontsize=10,
        )

    def show(
        rect: tuple[float, float, float, float], img: np.ndarray, text: str, colour: str
    ) -> None:
        ax = fig.add_axes(rect)
        ax.imshow(img, cmap=None if img.ndim == 3 else cmap, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_edgecolor(colour)
            spine.set_linewidth(2.0)
        ax.set_title(text, fontsize=9, color=colour, pad=2)

    for r, (qid, qpos, helpful, harmful) in enumerate(rows):
        caption = query_captions[r] if query_captions is not None else f"query {qid}"
        qlabel = _label(query_labels, qid, qpos)
        if qlabel and query_captions is None:
            caption += f"\nlabel {qlabel}"
        show(cell(0.1, r), _image(query_images, qid, qpos, image_shape), caption, "black")
        for c, (tid, tpos, score) in enumerate(helpful):
            lab = _label(train_labels, tid, tpos)
            text = f"{_fmt(score)}\n#{tid}" + (f" · label {lab}" if lab else "")
            x = x_helpful + 1.25 * c
            show(cell(x, r), _image(train_images, tid, tpos, image_shape), text, _HELPFUL)
        for c, (tid, tpos, score) in enumerate(harmful):
            lab = _label(train_labels, tid, tpos)
            text = f"{_fmt(score)}\n#{tid}" + (f" · label {lab}" if lab else "")
            x = x_harmful + 1.25 * c
            show(cell(x, r), _image(train_images, tid, tpos, image_shape), text, _HARMFUL)
    if title:
        fig.suptitle(title, fontsize=12, y=1 - 0.1 / height, va="top")
    return fig


def score_distribution(
    scores: Any,
    *,
    bins: int = 80,
    query: int | None = None,
    highlight: Sequence[int] | None = None,
    log_y: bool = True,
    title: str | None = None,
) -> Figure:
    """Distribution of influence scores (all pairs, one query's row, or self-influence values).

    ``scores`` is an influence result, a self-influence result (``.scores`` ``[n]``) or an array.
    ``highlight`` marks given training positions (e.g. known mislabelled examples) as ticks on
    the axis; the 1% and 99% quantiles are drawn as dashed lines.

    Example:
        >>> import numpy as np
        >>> fig = score_distribution(np.random.default_rng(0).normal(size=(4, 500)))
    """
    values = to_numpy(getattr(scores, "scores", scores))
    if query is not None:
        if values.ndim != 2:
            raise ValueError("query= needs a [n_query, n_train] score matrix")
        values = values[query]
    flat = values.ravel()
    finite = flat[np.isfinite(flat)]
    if finite.size == 0:
        raise ValueError("no finite score to plot")
    fig = new_figure(6.4, 3.6)
    ax = fig.add_subplot()
    edges = np.histogram_bin_edges(finite, bins=bins)
    counts, _ = np.histogram(finite, bins=edges)
    centers = (edges[:-1] + edges[1:]) / 2
    colours = [_HELPFUL if c > 0 else _HARMFUL for c in centers]
    ax.bar(centers, counts, width=np.diff(edges), color=colours, alpha=0.8, linewidth=0)
    if log_y:
        ax.set_yscale("log")
    for q, name in ((0.01, "1%"), (0.99, "99%")):
        v = float(np.quantile(finite, q))
        ax.axvline(v, color="0.35", linestyle="--", linewidth=0.9)
        ax.text(v, 1.0, f" {name}", transform=ax.get_xaxis_transform(), fontsize=9, va="top")
    if highlight is not None and values.ndim == 1:
        marks = values[np.asarray(highlight, dtype=int)]
        ax.plot(marks, np.zeros_like(marks), "|", color="black", markersize=14, label="highlighted")
        ax.legend(fontsize=9, frameon=False)
    ax.axvline(0.0, color="black", linewidth=0.8)
    ax.set_xlabel("influence score (positive = helpful)")
    ax.set_ylabel("count")
    extra = (
        f"  ({(flat.size - finite.size)} non-finite left out)" if flat.size > finite.size else ""
    )
    ax.set_title((title or f"influence scores, n={finite.size:,}") + extra, fontsize=10)
    return fig


def ranking_recall(
    rankings: Mapping[str, Any],
    flagged: Sequence[int],
    *,
    max_k: int | None = None,
    title: str | None = None,
) -> Figure:
    """How many ``flagged`` examples (e.g. planted wrong labels) the top ``k`` of each ranking
    finds, against the expected count of a random order (``k · n_flagged / n``).

    ``rankings`` maps a name to one score per example (higher = earlier; e.g. self-influence,
    or the training loss for comparison). The dotted vertical line marks ``k = n_flagged``, where
    a perfect ranking would have found them all.

    Example:
        >>> import numpy as np
        >>> fig = ranking_recall({"score": np.arange(100.0)}, [99, 98, 10])
    """
    from nnstat.plot.frames import ranking_hits

    if not rankings:
        raise ValueError("no ranking to plot")
    n_flagged = len(flagged)
    if n_flagged == 0:
        raise ValueError("no flagged example: recall is undefined")
    sizes = {len(to_numpy(s).ravel()) for s in rankings.values()}
    if len(sizes) != 1:
        raise ValueError(f"rankings differ in length: {sorted(sizes)}")
    (n,) = sizes
    max_k = min(n, max_k or n)
    ks = np.arange(1, max_k + 1)
    fig = new_figure(6.8, 3.9)
    ax = fig.add_subplot()
    colours = ["#4c72b0", "#dd8452", "#55a868", "#8172b2"]
    for i, (name, scores) in enumerate(rankings.items()):
        hits = ranking_hits(scores, flagged)[:max_k]
        at_k = int(hits[min(n_flagged, n) - 1])
        ax.plot(
            ks,
            hits,
            color=colours[i % len(colours)],
            linewidth=1.8,
            label=f"{name}: {at_k}/{n_flagged} in the top {n_flagged}",
        )
    ax.plot(
        ks,
        ks * n_flagged / n,
        color="0.45",
        linestyle="--",
        label=f"random order: {n_flagged * n_flagged / n:.1f} expected in the top {n_flagged}",
    )
    ax.axvline(n_flagged, color="0.3", linestyle=":", linewidth=1.0)
    ax.set_xlim(0, max_k)
    ax.set_ylim(0, n_flagged * 1.05)
    ax.set_xlabel("examples inspected, from the top of the ranking")
    ax.set_ylabel("flagged examples found")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, frameon=True, framealpha=0.9, loc="center right")
    ax.set_title(title or f"recall of {n_flagged} flagged examples among {n:,}", fontsize=11)
    return fig
