"""Run configuration: the three levels of ``nnstat.setup(...)`` in one dataclass.

* low: ``{"log": {"forward": False, "backward": False, "grad": True}, "save": {...},
  "statistic": {"forward": [Covariance], "backward": [Covariance], "grad": []}}``
* mid: ``{"log": "grad", "save": "grad", "statistic": "kfac"}`` with presets
  ``none | mean | raw | kfac | ekfac`` (``raw`` = covariance of the per-sample gradients);
  ``"log"``/``"save"`` also accept lists such as ``["grad", "forward"]``.
* high: :meth:`RunConfig.passes` lists the passes a configuration needs (EK-FAC: ``factors``
  then ``eigenvalues``); ``Run.schedule()`` iterates them.

Other keys: ``loss_reduction`` (``"sum"`` default, or ``"mean"``), ``max_factor_dim`` (largest
dense K-FAC factor; larger ones are kept projected or diagonal), and the gradient store's
``param_grads``, ``nonfinite``, ``dtype``, ``rank``. An unknown key or value raises a
``ValueError`` naming it and listing the valid ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from nnstat.curvature.operations import (
    EKFAC,
    KFAC,
    STATISTICS,
    STREAMS,
    Covariance,
    Mean,
    Statistic,
)

PRESETS = ("none", "mean", "raw", "kfac", "ekfac")
NONFINITE = ("error", "skip", "keep")
DTYPES = ("float32", "float16", "bfloat16")
LOSS_REDUCTIONS = ("sum", "mean")

StatisticSpec = dict[str, tuple[type[Statistic], ...]]


@dataclass(frozen=True)
class PassSpec:
    """One pass over the data: which streams to extract and save, which statistics to update.

    ``kfac`` marks K-FAC semantics: modules without Kronecker structure (layernorm) then get
    their full gradient covariance instead of forward/backward factors.
    """

    name: str
    statistic: StatisticSpec
    log: dict[str, bool]
    save: dict[str, bool]
    kfac: bool = False


def _none() -> dict[str, bool]:
    return {s: False for s in STREAMS}


def _grad_only() -> dict[str, bool]:
    return {"forward": False, "backward": False, "grad": True}


@dataclass
class RunConfig:
    """Validated configuration of a run (see the module docstring for the three levels).

    Attributes:
        log: streams to extract per batch (``forward``, ``backward``, ``grad``).
        save: streams to write to the gradient store.
        statistic: a preset name or ``{stream: (Statistic classes...)}``.
        loss_reduction: how the user reduced the loss over the batch (``sum`` or ``mean``).
        max_factor_dim: largest dense K-FAC factor (``None``: ``MAX_FACTOR_DIM``, 16384); a
            larger one is kept in the logged space of its side's projection, else diagonal.
        param_grads: store only; ``False`` lets a logging pass skip weight-gradient products.
        nonfinite: store only; rows with NaN/Inf: ``error`` | ``skip`` | ``keep``.
        dtype: store only; dtype of stored rows.
        rank: store only; default projection rank (``None`` = no projection).

    Example:
        >>> cfg = RunConfig.from_any({"log": "grad", "save": "grad", "statistic": "ekfac"})
        >>> [p.name for p in cfg.passes()]
        ['factors', 'eigenvalues']
        >>> RunConfig.from_any({"statistics": "kfac"})
        Traceback (most recent call last):
        ...
        ValueError: unknown configuration key 'statistics'; valid keys: log, save, statistic, loss_reduction, param_grads, nonfinite, dtype, rank, max_factor_dim
    """

    log: dict[str, bool] = field(default_factory=_grad_only)
    save: dict[str, bool] = field(default_factory=_grad_only)
    statistic: str | StatisticSpec = "none"
    loss_reduction: str = "sum"
    param_grads: bool = True
    nonfinite: str = "error"
    dtype: str = "float32"
    rank: int | None = None
    max_factor_dim: int | None = None

    def __post_init__(self) -> None:
        self.log = _streams_flags("log", self.log)
        self.save = _streams_flags("save", self.save)
        self.statistic = _statistic_spec(self.statistic)
        _choice("loss_reduction", self.loss_reduction, LOSS_REDUCTIONS)
        _choice("nonfinite", self.nonfinite, NONFINITE)
        _choice("dtype", self.dtype, DTYPES)
        if not isinstance(self.param_grads, bool):
            raise ValueError(f"param_grads must be True or False, got {self.param_grads!r}")
        if self.rank is not None and (not isinstance(self.rank, int) or self.rank <= 0):
            raise ValueError(f"rank must be a positive int or None, got {self.rank!r}")
        limit = self.max_factor_dim
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ValueError(f"max_factor_dim must be a positive int or None, got {limit!r}")

    @classmethod
    def from_any(cls, config: RunConfig | Mapping[str, Any] | str | None = None) -> RunConfig:
        """Build from a ``RunConfig``, a dict (any level), a preset name, or ``None`` (defaults)."""
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
        valid = [f.name for f in fields(cls)]
        for k in config:
            if k not in valid:
                raise ValueError(f"unknown configuration key {k!r}; valid keys: {', '.join(valid)}")
        return cls(**dict(config))

    def update(self, config: Mapping[str, Any]) -> RunConfig:
        """A new config with ``config``'s keys replaced (same validation)."""
        merged = {**self.to_dict(), **dict(config)}
        return RunConfig.from_any(merged)

    @property
    def preset(self) -> str | None:
        """The preset name when the statistic spec equals one, else ``None``."""
        for name in PRESETS:
            if _statistic_spec(name) == self.statistic:
                return name
        return None

    def to_dict(self) -> dict[str, Any]:
        """Plain dict; statistic classes stay classes (see :meth:`to_json`)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def to_json(self) -> dict[str, Any]:
        """JSON-serialisable form; :meth:`from_json` restores it without pickle."""
        d = self.to_dict()
        d["statistic"] = {s: [c.__name__ for c in cs] for s, cs in self.statistic.items()}
        d["log"], d["save"] = dict(self.log), dict(self.save)
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> RunConfig:
        return cls.from_any(d)

    def passes(self) -> list[PassSpec]:
        """The passes over the data this configuration needs, in order."""
        spec: StatisticSpec = dict(self.statistic)  # type: ignore[arg-type]
        grad = list(spec.get("grad", ()))
        kfac = KFAC in grad or EKFAC in grad
        fwd, bwd = list(spec.get("forward", ())), list(spec.get("backward", ()))
        if kfac:
            fwd += [] if Covariance in fwd else [Covariance]
            bwd += [] if Covariance in bwd else [Covariance]
            grad = [c for c in grad if c is not KFAC]
        if EKFAC not in grad:
            first = {"forward": tuple(fwd), "backward": tuple(bwd), "grad": tuple(grad)}
            name = "statistics" if any(first.values()) else "log"
            return [PassSpec(name, first, dict(self.log), dict(self.save), kfac)]
        factors = {"forward": tuple(fwd), "backward": tuple(bwd), "grad": ()}
        extract = {"forward": True, "backward": True, "grad": False}
        second = {"forward": (), "backward": (), "grad": tuple(grad)}
        return [
            PassSpec("factors", factors, extract, _none(), True),
            PassSpec("eigenvalues", second, dict(self.log, grad=True), dict(self.save), True),
        ]


def _choice(key: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {key} {value!r}; valid: {', '.join(valid)}")


def _streams_flags(key: str, value: Any) -> dict[str, bool]:
    if value is None or value is False:
        return _none()
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping):
        for s, v in value.items():
            _choice(f"stream in {key!r}", s, STREAMS)
            if not isinstance(v, bool):
                raise ValueError(f"{key}[{s!r}] must be True or False, got {v!r}")
        return {s: bool(value.get(s, False)) for s in STREAMS}
    if isinstance(value, (list, tuple, set)):
        for s in value:
            _choice(f"stream in {key!r}", s, STREAMS)
        return {s: s in value for s in STREAMS}
    raise ValueError(f"{key} must be a stream name, a list of them or a dict, got {value!r}")


def _statistic_class(v: Any, stream: str) -> type[Statistic]:
    cls = v if isinstance(v, type) else type(v) if isinstance(v, Statistic) else None
    if isinstance(v, str):
        cls = STATISTICS.get(v) or {c.name: c for c in STATISTICS.values()}.get(v.lower())
        if v.lower() == "kfac":
            cls = KFAC
        if v.lower() == "ekfac":
            cls = EKFAC
    if cls is None or not issubclass(cls, Statistic) or cls is Statistic:
        raise ValueError(
            f"unknown statistic {v!r} for stream {stream!r}; valid: {', '.join(STATISTICS)}"
        )
    if stream not in cls.streams:
        raise ValueError(
            f"{cls.__name__} applies to the {'/'.join(cls.streams)} stream, not {stream!r}"
        )
    return cls


def _statistic_spec(value: Any) -> StatisticSpec:
    if value is None:
        value = "none"
    if isinstance(value, str):
        presets: dict[str, dict[str, list]] = {
            "none": {},
            "mean": {"grad": [Mean]},
            "raw": {"grad": [Covariance]},
            "kfac": {"forward": [Covariance], "backward": [Covariance]},
            "ekfac": {"forward": [Covariance], "backward": [Covariance], "grad": [EKFAC]},
        }
        if value not in presets:
            raise ValueError(f"unknown statistic preset {value!r}; valid: {', '.join(PRESETS)}")
        value = presets[value]
        # presets keep K-FAC semantics for layers without Kronecker structure
        if "forward" in value:
            value = {**value, "grad": [KFAC, *value.get("grad", [])]}
    if not isinstance(value, Mapping):
        raise ValueError(
            f"statistic must be a preset ({', '.join(PRESETS)}) or a dict of streams, got {value!r}"
        )
    out: StatisticSpec = {}
    for stream in value:
        _choice("stream in 'statistic'", stream, STREAMS)
    for stream in STREAMS:
        items = value.get(stream) or []
        if not isinstance(items, (list, tuple)):
            items = [items]
        classes: list[type[Statistic]] = []
        for v in items:
            c = _statistic_class(v, stream)
            if c not in classes:
                classes.append(c)
        out[stream] = tuple(classes)
    return out
