"""nnstat.curvature: Mean, Covariance, KFAC, EKFAC as basic operations over capture streams.

`RunConfig` (what ``nnstat.setup`` takes) says which streams each pass extracts and saves and
which statistics it updates; the collector is built from it and stores it beside its factors.

Example:
    >>> from nnstat.curvature import Covariance, StatisticsCollector
    >>> collector = StatisticsCollector({"forward": [Covariance], "backward": [Covariance]})
    >>> collector.current_pass.name
    'statistics'
"""

from nnstat.curvature.collector import StatisticsCollector, spectrum_stats
from nnstat.curvature.config import PassSpec, RunConfig
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

__all__ = [
    "EKFAC",
    "KFAC",
    "MAX_FACTOR_DIM",
    "MAX_RAW_DIM",
    "STATISTICS",
    "Covariance",
    "Mean",
    "PassSpec",
    "RunConfig",
    "Statistic",
    "StatisticsCollector",
    "ekfac_apply",
    "spectrum_stats",
]
