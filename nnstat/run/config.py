"""The configuration of a run: one validated dataclass for every ``nnstat.setup(...)`` key.

A :class:`~nnstat.run.Run` composes capture, statistics and the gradient store, so its
configuration holds the keys of all three: the statistics' (``log``, ``save``, ``statistic``,
``max_factor_dim``; their vocabulary and parsers live in :mod:`nnstat.curvature.passes`), the
capture's (``loss_reduction``) and the store's. It lives here, above ``curvature`` and
``store``, which never import it: the collector reads it by attribute, the store gets
:attr:`RunConfig.store`.

``setup`` takes a :class:`RunConfig` or its flat dict form (the seeds' ``{"log": "grad",
"save": "grad", "statistic": "kfac"}``); an unknown key or value raises a ``ValueError`` naming
it and listing the valid ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from nnstat.capture.engine import LOSS_REDUCTIONS
from nnstat.curvature.passes import (
    PassSpec,
    StatisticSpec,
    check_choice,
    check_keys,
    grad_only,
    keyword_checked,
    parse_max_factor_dim,
    parse_statistic,
    parse_streams,
    plan_passes,
    preset_of,
    statistic_json,
)
from nnstat.store.factor_counts import FactorsSetting, check_factors
from nnstat.store.logger import NONFINITE_POLICIES, ON_STORED_ID, StoreSettings
from nnstat.store.shards import STORE_DTYPES

#: store keys that do not change what is stored: meta.json does not record them, so a store
#: resumes whatever they are
OPERATIONAL_KEYS = ("shard_rows", "queue_size", "on_stored_id", "size_budget_bytes", "num_samples")
#: keys meta.json does not record either: how gradients and statistics are computed and kept,
#: not what the rows are (``param_grads``: whether the weights' own gradients were formed;
#: ``max_factor_dim``: how large K-FAC factors are kept)
_NOT_RECORDED = ("param_grads", "max_factor_dim", *OPERATIONAL_KEYS)


@keyword_checked("configuration")
@dataclass(frozen=True)
class RunConfig:
    """Validated configuration of a run (frozen: every value passed the checks of
    ``__post_init__``; :meth:`update` makes a changed copy).

    Attributes:
        log: streams to extract per batch (``forward``, ``backward``, ``grad``): a name, a list
            of names or ``{stream: bool}``.
        save: streams to write to the gradient store (the same forms).
        statistic: a preset (``none | mean | raw | kfac | ekfac``) or ``{stream: (Statistic
            classes...)}``; see :mod:`nnstat.curvature.passes`.
        loss_reduction: how the user reduced the loss over the batch (``sum`` or ``mean``).
        param_grads: ``False`` lets a logging pass skip weight-gradient products.
        nonfinite: store rows with NaN/Inf: ``error`` | ``skip`` (counted) | ``keep``.
        dtype: dtype of stored rows (``float32``, ``float16``, ``bfloat16``).
        rank: default projection rank of the store (``None`` = no projection).
        factors: store each Kronecker module's projected per-sample gradient as this many
            factor pairs (``G ≈ Uᵀ V``, ``U`` ``[c, r_out]``, ``V`` ``[c, r_in]``; exact when a
            sample has at most ``c`` positions, a truncated SVD otherwise) instead of its
            ``r_out * r_in`` entries; one count, or ``{module name or fnmatch pattern: count
            or None}`` (:mod:`nnstat.store.factor_counts`; unmatched modules dense); needs
            ``rank`` (``None``: dense rows).
        max_factor_dim: largest dense K-FAC factor (``None``: ``MAX_FACTOR_DIM``, 16384); a
            larger one is kept in the logged space of its side's projection, else diagonal.
        shard_rows: rows per store shard file (``None``: about 64 MiB per shard).
        queue_size: blocks the store's background writer may hold before training waits.
        on_stored_id: ids already in the store when resuming: ``skip`` | ``error``.
        size_budget_bytes: warn when the projected store size exceeds this (default 8 GiB).
        num_samples: number of samples in the pass, for the up-front store size check.

    Raises:
        ValueError: (construction, :meth:`from_any`, :meth:`update`) an unknown key or an
            invalid value, named in the message.
        TypeError: an unknown keyword argument, named with every valid key (the dict forms'
            message).

    Example:
        >>> cfg = RunConfig.from_any({"log": "grad", "save": "grad", "statistic": "ekfac"})
        >>> [p.name for p in cfg.passes()]
        ['factors', 'eigenvalues']
        >>> RunConfig.from_any({"statistics": "kfac"})
        Traceback (most recent call last):
        ...
        ValueError: unknown configuration key 'statistics'; valid keys: log, save, statistic, loss_reduction, param_grads, nonfinite, dtype, rank, factors, max_factor_dim, shard_rows, queue_size, on_stored_id, size_budget_bytes, num_samples

        ``nnstat.setup`` takes one directly, as well as the dict form:

        >>> import nnstat, tempfile
        >>> run = nnstat.init(project="cfg", root_dir=tempfile.mkdtemp())
        >>> nnstat.setup(nnstat.RunConfig(statistic="kfac", rank=16)).config.rank
        16
    """

    log: dict[str, bool] = field(default_factory=grad_only)
    save: dict[str, bool] = field(default_factory=grad_only)
    statistic: str | StatisticSpec = "none"
    loss_reduction: str = "sum"
    param_grads: bool = True
    nonfinite: str = "error"
    dtype: str = "float32"
    rank: int | None = None
    factors: FactorsSetting = None
    max_factor_dim: int | None = None
    shard_rows: int | None = None
    queue_size: int = 16
    on_stored_id: str = "skip"
    size_budget_bytes: int = 8 * 2**30
    num_samples: int | None = None

    def __post_init__(self) -> None:
        # the one place values are checked; normalized forms are set on the frozen instance
        set_ = object.__setattr__
        set_(self, "log", parse_streams("log", self.log))
        set_(self, "save", parse_streams("save", self.save))
        set_(self, "statistic", parse_statistic(self.statistic))
        parse_max_factor_dim(self.max_factor_dim)
        check_choice("loss_reduction", self.loss_reduction, LOSS_REDUCTIONS)
        check_choice("nonfinite", self.nonfinite, NONFINITE_POLICIES)
        check_choice("dtype", self.dtype, tuple(STORE_DTYPES))
        check_choice("on_stored_id", self.on_stored_id, ON_STORED_ID)
        if not isinstance(self.param_grads, bool):
            raise ValueError(f"param_grads must be True or False, got {self.param_grads!r}")
        _check_int("rank", self.rank, minimum=1, optional=True)
        set_(self, "factors", check_factors(self.factors))
        if self.factors is not None and self.rank is None:
            raise ValueError(
                f"factors={self.factors} factors the projected rows, but rank is None (no "
                "projection): set a projection rank too, e.g. rank=64, factors=8"
            )
        _check_int("shard_rows", self.shard_rows, minimum=1, optional=True)
        _check_int("queue_size", self.queue_size, minimum=1, optional=False)
        _check_int("size_budget_bytes", self.size_budget_bytes, minimum=1, optional=False)
        _check_int("num_samples", self.num_samples, minimum=0, optional=True)

    # ----------------------------------------------------------------- building
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every configuration key, in the order error messages list them."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_any(cls, config: RunConfig | Mapping[str, Any] | str | None = None) -> RunConfig:
        """Build from a ``RunConfig``, the flat dict form, a preset name, or ``None`` (defaults)."""
        if config is None:
            return cls()
        if isinstance(config, RunConfig):
            return config
        if isinstance(config, str):
            return cls(statistic=config)
        if not isinstance(config, Mapping):
            raise TypeError(
                f"configuration must be a dict or RunConfig, got {type(config).__name__}"
            )
        check_keys("configuration", config, cls.keys())
        return cls(**dict(config))

    def update(self, config: Mapping[str, Any]) -> RunConfig:
        """A new config with ``config``'s keys replaced (same validation)."""
        return RunConfig.from_any({**self.to_dict(), **dict(config)})

    def to_dict(self) -> dict[str, Any]:
        """Plain dict; statistic classes stay classes (see :meth:`to_json`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable form; :meth:`from_json` restores it without pickle."""
        d = self.to_dict()
        d["statistic"] = statistic_json(self.spec)
        d["log"], d["save"] = dict(self.log), dict(self.save)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunConfig:
        return cls.from_any(d)

    # ------------------------------------------------------------ what it implies
    @property
    def spec(self) -> StatisticSpec:
        """``statistic`` as the parsed spec (``__post_init__`` made it one)."""
        return self.statistic  # type: ignore[return-value]

    @property
    def preset(self) -> str | None:
        """The preset name when the statistic spec equals one, else ``None``."""
        return preset_of(self.spec)

    def passes(self) -> list[PassSpec]:
        """The passes over the data this configuration needs, in order."""
        return plan_passes(self.spec, self.log, self.save)

    def content(self) -> dict[str, Any]:
        """The configuration meta.json records (and a resumed store must agree on): what
        shapes the stored rows, not how they were computed or written."""
        run = self.to_json()
        for key in _NOT_RECORDED:
            run.pop(key)
        if run["factors"] is None:  # recorded only when set: stores of dense rows keep their meta
            run.pop("factors")
        return {"run": run}

    @property
    def store(self) -> StoreSettings:
        """The store's settings (already validated here)."""
        return StoreSettings(
            dtype=self.dtype,
            nonfinite=self.nonfinite,
            shard_rows=self.shard_rows,
            queue_size=self.queue_size,
            on_stored_id=self.on_stored_id,
            size_budget_bytes=self.size_budget_bytes,
            num_samples=self.num_samples,
        )


def configured(base: RunConfig, config: RunConfig | Mapping[str, Any]) -> RunConfig:
    """The configuration after ``setup(config)`` on a run configured with ``base``: a
    ``RunConfig`` replaces it, a dict updates the keys it names."""
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, Mapping):
        return base.update(config)
    raise TypeError(f"setup() takes a dict or a RunConfig, got {type(config).__name__}")


def _check_int(key: str, value: Any, *, minimum: int, optional: bool) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise ValueError(
            f"{key} must be a {kind} int{' or None' if optional else ''}, got {value!r}"
        )
