"""nnstat.plot: figures of what nnstat measured, each a matplotlib Figure built without pyplot.

Layer histograms and heatmaps, statistics over training, training curves, trust ratios, the
noise scale with its interval, a first layer's receptive fields, image grids, and influence
(query images beside their most helpful and harmful training images, how well a ranking finds
flagged examples). matplotlib is imported only when a function is called
(``pip install 'nnstat[viz]'``).

Example:
    >>> import torch, nnstat.plot as nplt
    >>> fig = nplt.histogram(torch.randn(1000), title="w")
    >>> fig.savefig("/tmp/hist.png")  # doctest: +SKIP
"""

from nnstat.plot.figures import (
    histogram,
    noise_scale_plot,
    stat_heatmap,
    training_curves,
    trust_ratio_plot,
    weight_heatmap,
)
from nnstat.plot.frames import metrics_frame, ranking_hits
from nnstat.plot.images import image_grid, receptive_fields
from nnstat.plot.influence import influence_figure, ranking_recall, score_distribution

__all__ = [
    "histogram",
    "image_grid",
    "influence_figure",
    "metrics_frame",
    "noise_scale_plot",
    "ranking_hits",
    "ranking_recall",
    "receptive_fields",
    "score_distribution",
    "stat_heatmap",
    "training_curves",
    "trust_ratio_plot",
    "weight_heatmap",
]
