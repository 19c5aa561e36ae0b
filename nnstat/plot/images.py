"""Image figures for :mod:`nnstat.plot`: a first layer's weights as receptive fields, and a
captioned grid of examples (e.g. the training images a ranking puts first).

Example:
    >>> import torch
    >>> from nnstat.plot import receptive_fields
    >>> fig = receptive_fields(torch.randn(32, 64), image_shape=(8, 8))
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from nnstat.plot.canvas import new_figure
from nnstat.plot.frames import no_finite_error, to_numpy

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["receptive_fields", "image_grid"]


def receptive_fields(
    weight: Any,
    image_shape: tuple[int, int],
    *,
    max_units: int = 128,
    ncols: int = 16,
    order: str = "norm",
    cmap: str = "RdBu_r",
    label: str = "weight (shared scale)",
    title: str | None = None,
) -> Figure:
    """Each unit's input weights of a first layer drawn as an image of the input's shape.

    A ``[units, H*W]`` matrix shown as one heatmap hides what a unit looks at; as ``H x W``
    tiles the strokes a unit responds to are visible. One colour scale, symmetric around zero,
    is shared by every tile (limit: the 99th percentile of ``|w|``, so one large weight does not
    wash out the rest); ``order="norm"`` puts the units with the largest weight norm first
    (``"index"`` keeps the layer's order); ``label`` names the colour bar. Each tile is labelled
    with its unit index. The tiles are one mosaic image in one axes (a hundred axes would take
    seconds to lay out).

    Raises:
        ValueError: ``weight`` is not ``[units, H*W]``, ``order`` is unknown, or no weight is
            finite (the message counts the NaN and Inf and says how to find their source).

    Example:
        >>> import torch
        >>> fig = receptive_fields(torch.randn(10, 16), image_shape=(4, 4), ncols=5)
        >>> fig.axes[0].get_images()[0].get_array().shape  # 2 rows of 5 tiles, with gaps
        (12, 24)
    """
    w = to_numpy(weight)
    h, wd = image_shape
    if w.ndim != 2 or w.shape[1] != h * wd:
        raise ValueError(
            f"weight must be [units, {h * wd}] for image_shape {image_shape}, got {w.shape}"
        )
    if order not in ("norm", "index"):
        raise ValueError(f"order must be 'norm' or 'index', got {order!r}")
    if not np.isfinite(w).any():
        raise no_finite_error(w, [])
    units = np.arange(w.shape[0])
    if order == "norm":
        units = np.argsort(-np.linalg.norm(w, axis=1), kind="stable")
    units = units[:max_units]
    finite = np.abs(w[np.isfinite(w)])
    limit = float(np.percentile(finite, 99.0)) if finite.size else 1.0
    limit = limit or 1.0
    ncols = min(ncols, len(units))
    nrows = -(-len(units) // ncols)
    gap_x, gap_y = 1, max(2, round(0.45 * h))  # room above each tile for its unit index
    mosaic = np.full((nrows * (h + gap_y), ncols * (wd + gap_x) - gap_x), np.nan)
    for i, u in enumerate(units):
        r, c = divmod(i, ncols)
        top, left = r * (h + gap_y) + gap_y, c * (wd + gap_x)
        mosaic[top : top + h, left : left + wd] = w[u].reshape(h, wd)
    fig = new_figure(0.6 * ncols + 1.3, 0.6 * ncols * mosaic.shape[0] / mosaic.shape[1] + 0.5)
    ax = fig.add_subplot()
    from matplotlib import colormaps

    colours = colormaps[cmap].with_extremes(bad="white")  # the gaps between tiles
    image = ax.imshow(mosaic, cmap=colours, vmin=-limit, vmax=limit, interpolation="nearest")
    for i, u in enumerate(units):
        r, c = divmod(i, ncols)
        ax.text(
            c * (wd + gap_x) + (wd - 1) / 2,
            r * (h + gap_y) + gap_y - 0.7,
            str(int(u)),
            ha="center",
            va="bottom",
            fontsize=8.5,
            color="0.25",
        )
    ax.set_axis_off()
    fig.colorbar(image, ax=ax, shrink=0.8, label=label, extend="both")
    what = "largest weight norm first" if order == "norm" else "layer order"
    fig.suptitle(
        title or f"first-layer receptive fields: {len(units)} units as {h}×{wd} images ({what})",
        fontsize=12,
    )
    return fig


def image_grid(
    images: Any,
    captions: Sequence[str],
    *,
    frame_colours: Sequence[str | None] | None = None,
    ncols: int = 9,
    cmap: str = "gray_r",
    cell: float = 0.95,
    title: str,
) -> Figure:
    """A grid of captioned images (e.g. the top of a ranking), framed in ``frame_colours``.

    ``images`` is a sequence of ``[H, W]`` arrays/tensors; ``captions`` one string per image
    (lines split by ``\\n``). The title is required: a grid of digits says nothing by itself.

    Example:
        >>> import torch
        >>> fig = image_grid(torch.rand(3, 8, 8), ["a", "b", "c"], title="three")
    """
    imgs = [to_numpy(img) for img in images]
    if len(imgs) != len(captions):
        raise ValueError(f"{len(imgs)} images but {len(captions)} captions")
    if not imgs:
        raise ValueError("no image to show")
    colours = list(frame_colours) if frame_colours is not None else [None] * len(imgs)
    ncols = min(ncols, len(imgs))
    nrows = -(-len(imgs) // ncols)
    lines = max(c.count("\n") + 1 for c in captions)
    pad, caption_h, title_h = 0.22, 0.17 * lines + 0.06, 0.45  # inches
    width = ncols * (cell + pad) + pad
    height = title_h + nrows * (caption_h + cell + pad)
    fig = new_figure(width, height, constrained=False)
    for i, (img, caption, colour) in enumerate(zip(imgs, captions, colours, strict=True)):
        r, c = divmod(i, ncols)
        left = pad + c * (cell + pad)
        bottom = height - title_h - (r + 1) * (caption_h + cell + pad) + pad
        ax = fig.add_axes((left / width, bottom / height, cell / width, cell / height))
        ax.imshow(img, cmap=cmap, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        for spine in ax.spines.values():
            spine.set_edgecolor(colour or "0.6")
            spine.set_linewidth(2.5 if colour else 0.8)
        ax.set_title(caption, fontsize=9, color=colour or "black", pad=2)
    fig.suptitle(title, fontsize=12, y=1 - 0.12 / height, va="top")
    return fig
