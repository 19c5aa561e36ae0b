"""The statistics vocabulary of a run: presets, the statistic-spec parser and the passes.

A statistic spec is ``{stream: (Statistic classes...)}`` over the capture streams
``forward``/``backward``/``grad``. It is written at three levels:

* low: ``{"forward": [Covariance], "backward": [Covariance], "grad": []}`` (classes, instances
  or their names);
* mid: a preset ``none | mean | raw | kfac | ekfac`` (``raw`` = covariance of the per-sample
  gradients);
* high: :func:`plan_passes` lists the passes over the data a spec needs (EK-FAC: ``factors``
  then ``eigenvalues``); ``Run.schedule()`` iterates them.

The run's whole configuration (these keys plus capture and store keys) is
:class:`nnstat.run.RunConfig`, which calls the parsers here; the statistics collector calls
them too, so both refuse the same values with the same messages.

:func:`check_keys` is the one check of configuration keys (an unknown one is named with the
valid ones): the dict forms call it, and :func:`keyword_checked` makes a configuration
dataclass (``RunConfig``, the recorder's ``Schedule`` and ``Rule``, ``Refinement``) give the
same message for an unknown keyword argument.

Example:
    >>> spec = parse_statistic("ekfac")
    >>> [p.name for p in plan_passes(spec, grad_only(), grad_only())]
    ['factors', 'eigenvalues']
    >>> preset_of(parse_statistic({"grad": ["Mean"]}))
    'mean'
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any, TypeVar

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

StatisticSpec = dict[str, tuple[type[Statistic], ...]]


@dataclass(frozen=True)
class PassSpec:
    """One pass over the data: which streams to extract and save, which statistics to update.

    ``kfac`` marks K-FAC semantics: modules without Kronecker structure (layernorm) then get
    their full gradient covariance instead of forward/backward factors.

    Example:
        >>> p = PassSpec("log", parse_statistic("none"), grad_only(), grad_only())
        >>> p.name, p.save["grad"], any(p.statistic.values()), p.kfac
        ('log', True, False, False)
    """

    name: str
    statistic: StatisticSpec
    log: dict[str, bool]
    save: dict[str, bool]
    kfac: bool = False


def no_streams() -> dict[str, bool]:
    """Stream flags with every stream off."""
    return {s: False for s in STREAMS}


def grad_only() -> dict[str, bool]:
    """Stream flags with only ``grad`` on (the default of ``log`` and ``save``)."""
    return {"forward": False, "backward": False, "grad": True}


def check_choice(key: str, value: Any, valid: tuple[str, ...]) -> None:
    """``ValueError`` naming ``key`` and the valid values unless ``value`` is one of them."""
    if value not in valid:
        raise ValueError(f"unknown {key} {value!r}; valid: {', '.join(valid)}")


def check_keys(
    what: str, keys: Iterable[str], valid: Iterable[str], error: type[Exception] = ValueError
) -> None:
    """Refuse the first of ``keys`` not in ``valid``, naming it and listing the valid keys (the
    one check of configuration keys: dict forms and, through `keyword_checked`, keyword forms).

    Args:
        what: what the keys configure, for the message (``"configuration"``, ``"schedule"``).
        keys: the keys given.
        valid: the accepted keys, in the order the message lists them; names starting with
            ``_`` are accepted but not listed (a dataclass's private fields).
        error: the exception type (``TypeError`` for keyword arguments, as Python's own).

    Raises:
        ValueError: (or ``error``) an unknown key, named with every valid one.

    Example:
        >>> check_keys("schedule", ["evry"], ["every", "start"])
        Traceback (most recent call last):
        ...
        ValueError: unknown schedule key 'evry'; valid keys: every, start
    """
    valid = tuple(valid)
    for k in keys:
        if k not in valid:
            shown = ", ".join(v for v in valid if not v.startswith("_"))
            raise error(f"unknown {what} key {k!r}; valid keys: {shown}")


C = TypeVar("C", bound=type)


def keyword_checked(what: str) -> Callable[[C], C]:
    """Class decorator (above ``@dataclass``): an unknown keyword argument to the dataclass's
    ``__init__`` raises `check_keys`'s ``TypeError``, naming the valid keys, where Python's own
    names only the bad one. The class stays a plain dataclass.

    Args:
        what: what the class configures, for the message.

    Returns:
        The decorator, which returns the class with its ``__init__`` wrapped.

    Example:
        >>> @keyword_checked("point")
        ... @dataclass
        ... class Point:
        ...     x: int = 0
        >>> Point(y=1)
        Traceback (most recent call last):
        ...
        TypeError: unknown point key 'y'; valid keys: x
    """

    def decorate(cls: C) -> C:
        init = cls.__init__
        valid = tuple(f.name for f in fields(cls) if f.init)

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            check_keys(what, kwargs, valid, error=TypeError)
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        return cls

    return decorate


def parse_streams(key: str, value: Any) -> dict[str, bool]:
    """``{stream: bool}`` from a stream name, a list of them, a dict, or ``None``/``False``."""
    if value is None or value is False:
        return no_streams()
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping):
        for s, v in value.items():
            check_choice(f"stream in {key!r}", s, STREAMS)
            if not isinstance(v, bool):
                raise ValueError(f"{key}[{s!r}] must be True or False, got {v!r}")
        return {s: bool(value.get(s, False)) for s in STREAMS}
    if isinstance(value, (list, tuple, set)):
        for s in value:
            check_choice(f"stream in {key!r}", s, STREAMS)
        return {s: s in value for s in STREAMS}
    raise ValueError(f"{key} must be a stream name, a list of them or a dict, got {value!r}")


def parse_max_factor_dim(value: Any) -> int | None:
    """The largest dense K-FAC factor: a positive int, or ``None`` for the default."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_factor_dim must be a positive int or None, got {value!r}")
    return value


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


def parse_statistic(value: Any) -> StatisticSpec:
    """The statistic spec of a preset name, a ``{stream: [statistics]}`` dict or ``None``.

    Idempotent: a parsed spec parses to itself (and the names :func:`statistic_json` writes
    parse back to the classes).

    Example:
        >>> spec = parse_statistic("kfac")
        >>> {stream: [c.__name__ for c in spec[stream]] for stream in spec}
        {'forward': ['Covariance'], 'backward': ['Covariance'], 'grad': ['KFAC']}
        >>> parse_statistic(spec) == spec and parse_statistic(None) == parse_statistic("none")
        True
    """
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
        check_choice("stream in 'statistic'", stream, STREAMS)
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


def preset_of(spec: StatisticSpec) -> str | None:
    """The preset name whose spec equals ``spec``, else ``None``."""
    for name in PRESETS:
        if parse_statistic(name) == spec:
            return name
    return None


def statistic_json(spec: StatisticSpec) -> dict[str, list[str]]:
    """``spec`` with class names for classes (JSON; :func:`parse_statistic` reads it back)."""
    return {s: [c.__name__ for c in cs] for s, cs in spec.items()}


def plan_passes(
    statistic: StatisticSpec, log: Mapping[str, bool], save: Mapping[str, bool]
) -> list[PassSpec]:
    """The passes over the data that ``statistic`` needs, in order, given the streams each
    batch extracts (``log``) and stores (``save``); all three as the parsers return them.

    Example:
        >>> [p.name for p in plan_passes(parse_statistic("kfac"), grad_only(), grad_only())]
        ['statistics']
        >>> passes = plan_passes(parse_statistic("ekfac"), grad_only(), grad_only())
        >>> [(p.name, p.save["grad"]) for p in passes]  # the rows are saved in the second pass
        [('factors', False), ('eigenvalues', True)]
    """
    grad = list(statistic.get("grad", ()))
    kfac = KFAC in grad or EKFAC in grad
    fwd, bwd = list(statistic.get("forward", ())), list(statistic.get("backward", ()))
    if kfac:
        fwd += [] if Covariance in fwd else [Covariance]
        bwd += [] if Covariance in bwd else [Covariance]
        grad = [c for c in grad if c is not KFAC]
    if EKFAC not in grad:
        first = {"forward": tuple(fwd), "backward": tuple(bwd), "grad": tuple(grad)}
        name = "statistics" if any(first.values()) else "log"
        return [PassSpec(name, first, dict(log), dict(save), kfac)]
    factors = {"forward": tuple(fwd), "backward": tuple(bwd), "grad": ()}
    extract = {"forward": True, "backward": True, "grad": False}
    second = {"forward": (), "backward": (), "grad": tuple(grad)}
    return [
        PassSpec("factors", factors, extract, no_streams(), True),
        PassSpec("eigenvalues", second, dict(log, grad=True), dict(save), True),
    ]
