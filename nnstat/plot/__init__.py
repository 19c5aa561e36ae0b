"""nnstat.plot: figures of what nnstat measured, each a matplotlib Figure built without pyplot.

Layer histograms and heatmaps, statistics over training, trust ratios, the noise scale with its
interval, and influence (query images beside their most helpful and harmful training images).
matplotlib is imported only when a function is called (``pip install 'nnstat[viz]'``).

Example:
    >>> import torch, nnstat.plot as nplt
    >>> fig = nplt.histogram(torch.randn(1000), title="w")
    >>> fig.savefig("/tmp/hist.png")  # doctest: +SKIP
"""

from nnstat.plot.data import metrics_frame
from nnstat.plot.figures import (
    histogram,
    noise_scale_plot,
    stat_heatmap,
    trust_ratio_plot,
    weight_heatmap,
)
from nnstat.plot.influence import influence_figure, score_distribution

__all__ = [
    "histogram",
    "influence_figure",
    "metrics_frame",
    "noise_scale_plot",
    "score_distribution",
    "stat_heatmap",
    "trust_ratio_plot",
    "weight_heatmap",
]
