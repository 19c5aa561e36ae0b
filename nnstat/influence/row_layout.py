"""Per-module layout of a gradient row and the compatibility check between two logs.

A row of the gradient store is the concatenation of every watched module's (possibly projected)
per-sample gradient, each flattened row-major as ``vec(P_out G P_inᵀ)`` (``r_out`` major). The
influence maths only needs to know where each module's slice lives and its matrix shape.

Example:
    >>> layout = [ModuleSpec("fc1", 0, 4, 3), ModuleSpec("fc2", 12, 2, 5)]
    >>> row_width(layout)
    22
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from nnstat.capture.kinds import REGISTRY
from nnstat.store.factored import dense_layout, dense_modules, is_factored


@dataclass(frozen=True)
class ModuleSpec:
    """Where one module's slice lives in a gradient row.

    ``r_out * r_in == width`` for Kronecker kinds; other kinds (layernorm) have a flat slice of
    ``width`` columns and ``r_out = 1``.

    Example:
        >>> ModuleSpec("fc", 0, 4, 3).width
        12
    """

    name: str
    offset: int
    r_out: int
    r_in: int
    kind: str = "linear"
    flat_width: int | None = None

    @property
    def width(self) -> int:
        return int(self.flat_width) if self.flat_width is not None else self.r_out * self.r_in

    @property
    def kronecker(self) -> bool:
        kind = REGISTRY.get(self.kind)  # "flat": rows without a module (TensorSource)
        return kind is not None and kind.outer and self.r_out * self.r_in == self.width

    @property
    def stop(self) -> int:
        return self.offset + self.width


def row_width(layout: Sequence[ModuleSpec]) -> int:
    """Total number of columns covered by ``layout``.

    Example:
        >>> row_width([ModuleSpec("a", 0, 2, 2)])
        4
    """
    return max((m.stop for m in layout), default=0)


def validate_layout(layout: Sequence[ModuleSpec], width: int) -> None:
    """Raise ``ValueError`` when modules overlap, leave gaps, or do not cover ``width`` columns.

    Example:
        >>> validate_layout([ModuleSpec("a", 0, 2, 2)], 4)
    """
    pos = 0
    for m in sorted(layout, key=lambda s: s.offset):
        if m.offset != pos:
            raise ValueError(
                f"module {m.name!r} starts at column {m.offset}, expected {pos} "
                "(modules must tile the row without gaps or overlaps)"
            )
        if m.width <= 0:
            raise ValueError(f"module {m.name!r} has width {m.width}")
        pos = m.stop
    if pos != width:
        raise ValueError(f"layout covers {pos} columns but rows have {width}")


def layout_from_meta(meta: Mapping[str, Any]) -> list[ModuleSpec]:
    """Build the layout from a store's ``meta.json`` ``modules`` list (of the dense rows: a
    factored module is ``r_out * r_in`` wide, see :func:`~nnstat.store.factored.densify`).

    Example:
        >>> layout_from_meta({"modules": [{"name": "fc", "kind": "linear", "offset": 0,
        ...                                "r_out": 2, "r_in": 3, "width": 6}]})[0].width
        6
    """
    modules = meta.get("modules")
    if not modules:
        raise ValueError("meta has no 'modules' list: cannot tell where each module's columns are")
    # a store of factored rows is read as dense rows (sources densify each block): its
    # modules as those rows lay them out
    modules = dense_modules(modules) if is_factored(meta) else modules
    out = []
    for m in modules:
        missing = [k for k in ("name", "offset", "width") if k not in m]
        if missing:
            raise ValueError(f"meta module entry {m!r} lacks {missing}")
        width = int(m["width"])
        kind = str(m.get("kind", "linear"))
        r_out, r_in = m.get("r_out"), m.get("r_in")
        if r_out and r_in and int(r_out) * int(r_in) == width:
            spec = ModuleSpec(m["name"], int(m["offset"]), int(r_out), int(r_in), kind)
        else:
            spec = ModuleSpec(m["name"], int(m["offset"]), 1, width, kind, flat_width=width)
        out.append(spec)
    return out


# meta keys whose values must agree between a query log and a training store
_FINGERPRINT_KEYS = (
    "modules",
    "row_width",
    "projection_seed",
    "projection_sha256",
    "projection",
    "format_version",
)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:12]


def meta_differences(query: Mapping[str, Any], train: Mapping[str, Any]) -> list[str]:
    """Human-readable list of what differs between two metas on the keys that matter for scoring.

    Only keys present in at least one meta are compared; a key present on one side only counts as
    a difference (e.g. a projected training store against an unprojected query log).

    Example:
        >>> meta_differences({"row_width": 4}, {"row_width": 6})
        ['row_width: query 4 != train 6']
    """
    diffs = []
    # a factored store pairs with queries logged dense: both compared as dense rows
    query, train = {**query, **dense_layout(query)}, {**train, **dense_layout(train)}
    for key in _FINGERPRINT_KEYS:
        if key not in query and key not in train:
            continue
        q, t = query.get(key), train.get(key)
        if q == t:
            continue
        if key == "modules" and isinstance(q, list) and isinstance(t, list):
            diffs.extend(_module_differences(q, t))
            continue
        qs, ts = json.dumps(q, default=str), json.dumps(t, default=str)
        if len(qs) > 80 or len(ts) > 80:
            qs, ts = f"<sha {_digest(q)}>", f"<sha {_digest(t)}>"
        diffs.append(f"{key}: query {qs} != train {ts}")
    return diffs


def _module_differences(q: list[dict], t: list[dict]) -> list[str]:
    qn = {m.get("name"): m for m in q}
    tn = {m.get("name"): m for m in t}
    diffs = []
    if list(qn) != list(tn):
        only_q = sorted(set(qn) - set(tn))
        only_t = sorted(set(tn) - set(qn))
        diffs.append(f"modules: query-only {only_q}, train-only {only_t} (or a different order)")
    for name in qn.keys() & tn.keys():
        for k in sorted(set(qn[name]) | set(tn[name])):
            if qn[name].get(k) != tn[name].get(k):
                diffs.append(
                    f"module {name!r} {k}: query {qn[name].get(k)!r} != train {tn[name].get(k)!r}"
                )
    return diffs


def check_compatible(query: Mapping[str, Any], train: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` naming every difference when two logs cannot be scored together.

    Example:
        >>> check_compatible({"row_width": 4}, {"row_width": 4})
    """
    diffs = meta_differences(query, train)
    if diffs:
        raise ValueError(
            "query and training logs were made with a different projection or configuration: "
            + "; ".join(diffs)
        )


def check_same_weights(
    query: Mapping[str, Any], train: Mapping[str, Any], query_name: str, train_name: str
) -> None:
    """Raise ``ValueError`` when the query rows were captured from other weights than the store.

    Compares ``params_sha256`` (the watched parameters' fingerprint at capture) and
    ``model_sha256`` (every parameter and buffer of the model, and of the modules holding a
    watched submodule: an unwatched backbone changed since the store was logged changes the
    query rows too) when both metas record them; logs written before nnstat recorded them are
    not compared.

    Args:
        query: the query log's meta.
        train: the store's meta.
        query_name: how the message names the query side.
        train_name: how the message names the store.

    Raises:
        ValueError: a fingerprint differs; the message names both and the fix.

    Example:
        >>> check_same_weights({"params_sha256": "a"}, {}, "query", "store")
    """
    for key, what in (("params_sha256", "watched parameters"), ("model_sha256", "whole model")):
        q, t = query.get(key), train.get(key)
        if q is None or t is None or q == t:
            continue
        raise ValueError(
            f"{query_name} ({key} {str(q)[:16]}...) and {train_name} ({key} {str(t)[:16]}...) "
            f"were captured from different weights of the {what}: gradients of two models do "
            "not score against each other. Re-capture the queries with the weights the store "
            "was logged with, or log a new store with the current weights"
        )
