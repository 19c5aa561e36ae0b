"""nnstat.recorder: record named tensors and gradients at chosen steps, trace anomalies.

Example:
    >>> from nnstat.recorder import Recorder, nonfinite, correlate  # doctest: +SKIP
"""

from nnstat.recorder.anomalies import (
    NonFiniteError,
    Rule,
    abs_max_above,
    correlate,
    grad_norm_below,
    nonfinite,
    norm_ratio_above,
    phi_table,
)
from nnstat.recorder.graph import autograd_edges, graph_document, graph_hash
from nnstat.recorder.recorder import Recorder
from nnstat.recorder.reduce import STAT_NAMES, segment_stats
from nnstat.recorder.schedule import Schedule
from nnstat.recorder.storage import (
    iter_trials,
    read_kpis,
    read_step_meta,
    read_step_stats,
    read_step_values,
)

__all__ = [
    "Recorder",
    "Schedule",
    "Rule",
    "NonFiniteError",
    "nonfinite",
    "abs_max_above",
    "grad_norm_below",
    "norm_ratio_above",
    "correlate",
    "phi_table",
    "autograd_edges",
    "graph_document",
    "graph_hash",
    "segment_stats",
    "STAT_NAMES",
    "iter_trials",
    "read_step_meta",
    "read_step_stats",
    "read_step_values",
    "read_kpis",
]
