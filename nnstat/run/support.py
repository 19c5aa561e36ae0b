"""Configuration pieces of :class:`nnstat.run.Run` (moving to ``run/config.py``): the parsed
settings, their parser and the statistics collector built from them.

Example:
    >>> settings = parse_config({"log": "grad", "save": "grad", "statistic": "kfac"})
    >>> settings.save_grad, settings.store.nonfinite
    (True, 'error')
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from nnstat.store.logger import StoreOptions

# store-only setup() keys beyond those nnstat.curvature.config.RunConfig already knows
STORE_EXTRA_KEYS = ("shard_rows", "queue_size", "on_stored_id", "size_budget_bytes", "num_samples")
# store options that do not change what is stored (excluded from meta.json's configuration)
_OPERATIONAL = {"shard_rows", "queue_size", "size_budget_bytes", "num_samples", "on_stored_id"}


@dataclass
class RunSettings:
    """The parsed configuration of a run: ``RunConfig`` plus the store's extra options."""

    raw: dict[str, Any] = field(default_factory=dict)
    run_config: Any = None
    store: StoreOptions = field(default_factory=StoreOptions)

    @property
    def param_grads(self) -> bool:
        return bool(self.run_config.param_grads)

    @property
    def default_rank(self) -> int | None:
        return self.run_config.rank

    def passes(self) -> list[Any]:
        return list(self.run_config.passes())

    @property
    def save_grad(self) -> bool:
        return any(bool(p.save.get("grad")) for p in self.passes())

    @property
    def statistics_on(self) -> bool:
        return any(any(p.statistic.values()) for p in self.passes())

    @property
    def loss_reduction(self) -> str:
        return str(self.run_config.loss_reduction)

    def content(self) -> dict[str, Any]:
        """Configuration recorded in meta.json (and compared when resuming)."""
        run = self.run_config.to_json()
        run.pop("param_grads", None)  # how gradients were computed, not what they are
        run.pop("max_factor_dim", None)  # how statistics are kept, not what the rows are
        return {"run": run}


def parse_config(config: Mapping[str, Any], base: RunSettings | None = None) -> RunSettings:
    """Merge ``config`` into ``base`` (or the defaults); unknown keys name all valid ones.

    Keys of :class:`nnstat.curvature.config.RunConfig` plus :data:`STORE_EXTRA_KEYS`.
    """
    from nnstat.curvature.config import RunConfig

    if not isinstance(config, Mapping):
        raise TypeError(f"setup() takes a dict, got {type(config).__name__}")
    base = base or RunSettings()
    raw = {**base.raw, **dict(config)}
    valid = [f.name for f in fields(RunConfig)] + list(STORE_EXTRA_KEYS)
    unknown = [k for k in raw if k not in valid]
    if unknown:
        raise ValueError(
            f"unknown configuration key {unknown[0]!r}; valid keys: {', '.join(valid)}"
        )
    run_config = RunConfig.from_any({k: v for k, v in raw.items() if k not in STORE_EXTRA_KEYS})
    extras = {k: v for k, v in raw.items() if k in STORE_EXTRA_KEYS}
    store = StoreOptions(dtype=run_config.dtype, nonfinite=run_config.nonfinite, **extras)
    return RunSettings(raw, run_config, store)


def make_collector(settings: RunSettings) -> Any:
    """The statistics collector of a run (one for all its passes)."""
    from nnstat.curvature import StatisticsCollector

    return StatisticsCollector(settings.run_config)
