"""Factor pairs per module: the ``factors`` setting as one count or a per-module mapping.

``factors=c`` stores every Kronecker module as ``c`` factor pairs (:mod:`.factored`). A mapping
gives each module its own count: ``{"tok": 6, "pos": 6, "head": 6, "*": 1}``. Keys are module
names (as watched) or :mod:`fnmatch` patterns (``*``, ``?``, ``[...]``); an exact name wins over
the patterns, else the first pattern in the mapping's order that matches; a module no key
matches, and a value ``None``, stays dense. Why per module: the bytes a pair costs
(``r_out + r_in``) and the rank a module's gradients have differ per module, e.g. a
transformer's embeddings and head (a 16- or 35-wide side) lose attribution quality at a ``c``
where its 64 × 64 attention and MLP blocks lose none (``docs/influence.md``, factored stores).

Example:
    >>> check_factors({"head": 6, "*": 1})
    {'head': 6, '*': 1}
    >>> factors_for({"head": 6, "*": 1}, ["tok", "qkv", "head"])
    {'tok': 1, 'qkv': 1, 'head': 6}
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from typing import Any

#: what ``factors`` may be: one count, a ``{module name or pattern: count or None}`` mapping,
#: or ``None`` (dense rows)
FactorsSetting = int | Mapping[str, int | None] | None

_FORMS = (
    "a positive int or None (dense rows), or a {module name or pattern: positive int or None} "
    "mapping"
)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_factors(factors: Any) -> int | dict[str, int | None] | None:
    """``factors`` validated: the int or ``None`` as given, a mapping as a plain ``dict``.

    Args:
        factors: the setting (see the module docstring).

    Returns:
        The same setting, a mapping copied into a ``dict`` (its order kept: patterns are tried
        in it).

    Raises:
        ValueError: anything else, a mapping without keys, a key that is not a non-empty
            string, or a value that is not a positive int or ``None``; the message names the
            entry and the valid forms.

    Example:
        >>> check_factors(4), check_factors(None)
        (4, None)
        >>> check_factors({"fc": 0})
        Traceback (most recent call last):
        ...
        ValueError: factors['fc'] must be a positive int or None (dense), got 0; factors is a positive int or None (dense rows), or a {module name or pattern: positive int or None} mapping
    """
    if factors is None or _is_count(factors):
        return factors
    if not isinstance(factors, Mapping):
        raise ValueError(f"factors must be {_FORMS}, got {factors!r}")
    if not factors:
        raise ValueError(f"factors={{}} names no module; factors is {_FORMS}")
    out: dict[str, int | None] = {}
    for key, value in factors.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"factors: key {key!r} must be a module name or pattern (a string)")
        if value is not None and not _is_count(value):
            raise ValueError(
                f"factors[{key!r}] must be a positive int or None (dense), got {value!r}; "
                f"factors is {_FORMS}"
            )
        out[key] = value
    return out


def factors_for(factors: FactorsSetting, names: Sequence[str]) -> dict[str, int | None]:
    """Factor pairs of each module in ``names`` under ``factors`` (``None``: dense).

    Args:
        factors: the setting, as :func:`check_factors` accepts it.
        names: the watched modules' names, in row order.

    Returns:
        ``{name: count or None}`` for every name, in ``names`` order. Whether a count is used
        is the layout's decision (:func:`~nnstat.store.factored.worth_factoring`: a module whose
        factors would be no narrower than its dense row, or without a Kronecker structure,
        stays dense).

    Raises:
        ValueError: ``factors`` is invalid (:func:`check_factors`), or a key matches no module
            (a misspelt name would otherwise leave that module silently dense): the message
            lists the modules.

    Example:
        >>> factors_for({"fc*": 2, "fc2": None}, ["fc1", "fc2", "norm"])
        {'fc1': 2, 'fc2': None, 'norm': None}
        >>> factors_for({"head": 2}, ["fc1"])
        Traceback (most recent call last):
        ...
        ValueError: factors: key 'head' matches no watched module; modules: ['fc1'] (use a name or an fnmatch pattern such as 'fc*' or '*')
    """
    factors = check_factors(factors)
    if not isinstance(factors, dict):
        return {name: factors for name in names}
    unmatched = [k for k in factors if not any(fnmatch.fnmatchcase(n, k) for n in names)]
    if unmatched:
        raise ValueError(
            f"factors: key {unmatched[0]!r} matches no watched module; modules: {list(names)} "
            "(use a name or an fnmatch pattern such as 'fc*' or '*')"
        )
    out: dict[str, int | None] = {}
    for name in names:
        if name in factors:
            out[name] = factors[name]
            continue
        out[name] = next((v for k, v in factors.items() if fnmatch.fnmatchcase(name, k)), None)
    return out
