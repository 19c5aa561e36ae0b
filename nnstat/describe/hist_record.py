"""Histogram records handed to sinks and read back: :func:`own_copy` gives each sink arrays of
its own, and :func:`check_histogram` is the one check of a record read back from a file (a
run's ``metrics.jsonl``) that ``nnstat.integrations.read_jsonl`` and the viewer's reader share,
so what one keeps the other draws.

A record whose parts disagree would be shown as some other distribution: decreasing or NaN
edges, NaN/Inf or negative counts, counts whose total is not ``num`` (the finite elements the
counts were rescaled to, :mod:`nnstat.describe.histogram`), ``min > max``.

Example:
    >>> check_histogram([0.0, 1.0, 2.0], [1.0, 2.0], num=3.0, lo=0.0, hi=2.0)
    >>> check_histogram([0.0, 2.0, 1.0], [1.0, 2.0])
    Traceback (most recent call last):
    ValueError: histogram edges decrease (edge 2 is 1.0 after 2.0)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from nnstat.describe.histogram import Histogram

# counts are float32 values rescaled to num: their total matches it to float32 rounding
_TOTAL_RTOL = 1e-4


def check_histogram(
    edges: Sequence[float],
    counts: Sequence[float],
    num: float | None = None,
    lo: float | None = None,
    hi: float | None = None,
) -> None:
    """Refuse a histogram record whose parts disagree (see the module docstring).

    Args:
        edges: ``n + 1`` bin edges.
        counts: ``n`` counts.
        num: the number of finite elements counted (``None``: not checked).
        lo: the record's ``min`` (``None``: not checked).
        hi: the record's ``max`` (``None``: not checked).

    Raises:
        ValueError: saying which part is wrong (the caller names the file and line).
    """
    if len(edges) != len(counts) + 1 or not counts:
        raise ValueError(
            f"histogram has {len(counts)} counts but {len(edges)} edges (needs counts + 1)"
        )
    for i, e in enumerate(edges):
        if not math.isfinite(e):
            raise ValueError(f"histogram edge {i} is {e}: edges must be finite")
        if i and e < edges[i - 1]:
            raise ValueError(f"histogram edges decrease (edge {i} is {e} after {edges[i - 1]})")
    for i, c in enumerate(counts):
        if not math.isfinite(c):
            raise ValueError(f"histogram count {i} is {c}: counts must be finite")
        if c < 0:
            raise ValueError(f"histogram has a negative count (count {i} is {c})")
    if num is not None:
        total = math.fsum(counts)
        if not math.isfinite(num) or abs(total - num) > _TOTAL_RTOL * max(num, 1.0):
            raise ValueError(f"histogram counts total {total:g}, but its num is {num:g}")
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(f"histogram min {lo} is above its max {hi}")


def own_copy(value: Any) -> Any:
    """``value``, or a :class:`~nnstat.describe.histogram.Histogram` with arrays of its own: a
    sink that zeroes or reuses them in place changes no other sink's data.

    Args:
        value: a metric's value.

    Returns:
        ``value`` itself, or its histogram copy.

    Example:
        >>> import numpy as np
        >>> h = Histogram(np.ones(2), np.arange(3.0), 0.0, 2.0, 2.0, 2.0, 2.0)
        >>> own_copy(h).counts is h.counts, own_copy(1.5)
        (False, 1.5)
    """
    if isinstance(value, Histogram):
        return dataclasses.replace(value, counts=value.counts.copy(), edges=value.edges.copy())
    return value
