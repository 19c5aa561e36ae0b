"""nnstat.describe: the statistics of tensors, reduced on device with one host transfer.

`summarize` (norms, moments, sparsity, NaN/Inf counts), `histograms`, the one-pass
weight/update norms a Tracker needs (`nnstat.describe.numpy_blocks`) and the ratio conventions
of the trust ratio. Everything here works on plain tensors: NetDict, the Tracker and the
recorder build on it. Every statistic comes from one partial-row layout (`partials`: `merge`,
`finish`), computed by the backend `core.partial_table` picks (CPU blocks, torch segments,
Triton rows).

Example:
    >>> import torch
    >>> from nnstat.describe import summarize
    >>> summarize([torch.tensor([3.0, 4.0])], ("l2", "max")).tolist()
    [[5.0, 4.0]]
"""

from nnstat.describe.histogram import DEFAULT_MAX_ELEMENTS, HIST_SUMMARY, Histogram, histograms
from nnstat.describe.moments import Workspace
from nnstat.describe.ratios import ratio_from_norms
from nnstat.describe.scalars import as_float, metric_scalar
from nnstat.describe.summary import (
    DEFAULT_STATS,
    SIGNED_STATS,
    STAT_NAMES,
    Description,
    cpu_single_thread,
    summarize,
    validate_stats,
)

__all__ = [
    "DEFAULT_MAX_ELEMENTS",
    "DEFAULT_STATS",
    "HIST_SUMMARY",
    "SIGNED_STATS",
    "STAT_NAMES",
    "Description",
    "Histogram",
    "Workspace",
    "as_float",
    "cpu_single_thread",
    "histograms",
    "metric_scalar",
    "ratio_from_norms",
    "summarize",
    "validate_stats",
]
