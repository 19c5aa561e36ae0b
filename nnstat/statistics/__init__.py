"""nnstat.statistics: Mean, Covariance, KFAC, EKFAC as basic operations over capture streams.

Example:
    >>> from nnstat.statistics import Covariance, StatisticsCollector
    >>> collector = StatisticsCollector({"forward": [Covariance], "backward": [Covariance]})
    >>> collector.current_pass.name
    'statistics'
"""

from nnstat.statistics.collector import StatisticsCollector, spectrum_stats
from nnstat.statistics.stats import (
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
    "Statistic",
    "StatisticsCollector",
    "ekfac_apply",
    "spectrum_stats",
]
