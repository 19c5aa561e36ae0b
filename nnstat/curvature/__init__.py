"""nnstat.curvature: Mean, Covariance, KFAC, EKFAC as basic operations over capture streams.

A statistic spec (a preset such as ``"kfac"`` or ``{stream: [statistics]}``) says which
statistics each stream updates; :func:`plan_passes` turns it, with the streams a run extracts
and saves, into the passes over the data (:class:`PassSpec`). The collector takes a spec, a
preset or a run's :class:`nnstat.run.RunConfig` and records what it used beside its factors.

Example:
    >>> from nnstat.curvature import Covariance, StatisticsCollector
    >>> collector = StatisticsCollector({"forward": [Covariance], "backward": [Covariance]})
    >>> collector.current_pass.name
    'statistics'
"""

from nnstat.curvature.collector import StatisticsCollector, spectrum_stats
from nnstat.curvature.operations import (
    EKFAC,
    KFAC,
    MAX_FACTOR_DIM,
    MAX_RAW_DIM,
    STATISTICS,
    Covariance,
    Mean,
    Statistic,
    ekfac_apply,
)
from nnstat.curvature.passes import PRESETS, PassSpec, parse_statistic, plan_passes

__all__ = [
    "EKFAC",
    "KFAC",
    "MAX_FACTOR_DIM",
    "MAX_RAW_DIM",
    "STATISTICS",
    "Covariance",
    "Mean",
    "PRESETS",
    "PassSpec",
    "Statistic",
    "StatisticsCollector",
    "ekfac_apply",
    "parse_statistic",
    "plan_passes",
    "spectrum_stats",
]
