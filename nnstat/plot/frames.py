"""Plain-data helpers for :mod:`nnstat.plot`: metric histories to frames, tensors to arrays.

Kept apart from the drawing code so that it is testable without matplotlib.

Example:
    >>> frame = metrics_frame([{"grad/fc.weight/l2": 1.0}, {"grad/fc.weight/l2": 2.0}])
    >>> frame["grad/fc.weight/l2"].tolist()
    [1.0, 2.0]
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd

# keys that carry the step of a logged dict rather than a metric
STEP_KEYS = ("step", "_step", "global_step", "trainer/global_step")


def to_numpy(x: Any) -> np.ndarray:
    """A float64 numpy copy of a tensor, array or nested sequence.

    Raises:
        TypeError: complex values (a float copy would drop the imaginary part).

    Example:
        >>> to_numpy([1, 2]).dtype
        dtype('float64')
    """
    if hasattr(x, "detach"):
        x = x.detach()
        # numpy has no bfloat16; a complex tensor stays complex to be refused below
        x = (x if x.is_complex() else x.float()).cpu().numpy()
    x = np.asarray(x)
    if np.iscomplexobj(x):
        raise TypeError(
            f"cannot plot complex values ({x.dtype}): pass their magnitude (x.abs()) or the real "
            "or imaginary part (x.real, x.imag)"
        )
    return x.astype(np.float64)


def nonfinite_note(values: np.ndarray) -> str:
    """How many of ``values`` are NaN and how many are +-Inf, in words.

    Example:
        >>> nonfinite_note(np.array([np.nan, np.inf, -np.inf, 1.0]))
        '1 NaN, 2 Inf of 4 values'
    """
    n_nan = int(np.isnan(values).sum())
    n_inf = int(np.isinf(values).sum())
    return f"{n_nan:,} NaN, {n_inf:,} Inf of {values.size:,} values"


def no_finite_error(values: np.ndarray, names: Sequence[str]) -> ValueError:
    """The error of a figure asked to draw layers that hold no finite value: it names each
    layer, says how many of its values are NaN and Inf, and how to find where they came from.

    ``names`` are the layers drawn (``""`` for data passed without a name).

    Example:
        >>> str(no_finite_error(np.array([np.nan, np.inf]), ["fc.weight"])).split(":")[0]
        "layer 'fc.weight' holds no finite value"
    """
    named = [n for n in names if n]
    what = (
        ("layer " if len(named) == 1 else "layers ") + ", ".join(repr(n) for n in named)
        if named
        else "the data"
    )
    return ValueError(
        f"{what} holds no finite value: {nonfinite_note(values)}, nothing to plot. The values "
        "diverged (or were never set); to find the first step and tensor that went non-finite, "
        "read the 'nonfinite' statistic the Tracker logs per layer by default, or record the run with nnstat.Recorder(..., rules=[nnstat.recorder.nonfinite()]), whose "
        "steps name the first offender; then lower the learning rate, clip the gradients or "
        "fix the input that produced them there"
    )


def metrics_frame(history: Any) -> pd.DataFrame:
    """A wide frame (index: step, one column per metric key) from a metric history.

    Accepted: a list of flat dicts (the step is read from ``step``/``_step``/``global_step`` when
    present, else the position), a list of ``(step, dict)`` pairs, a ``{step: dict}`` mapping, a
    wide DataFrame (``step`` column or index), or a long DataFrame with ``step``, ``key`` (or
    ``tag``) and ``value`` columns.

    Example:
        >>> metrics_frame([(10, {"a": 1.0}), (20, {"a": 3.0})]).index.tolist()
        [10, 20]
    """
    if isinstance(history, pd.DataFrame):
        frame = history
        key_col = next((c for c in ("key", "tag", "metric") if c in frame.columns), None)
        if key_col is not None and "value" in frame.columns and "step" in frame.columns:
            frame = frame.pivot_table(index="step", columns=key_col, values="value", aggfunc="last")
        elif "step" in frame.columns:
            frame = frame.set_index("step")
        frame = frame.sort_index()
        frame.columns = [str(c) for c in frame.columns]
        return frame
    if isinstance(history, Mapping):
        items: Iterable[tuple[Any, Mapping]] = history.items()
    elif isinstance(history, Sequence) and not isinstance(history, (str, bytes)):
        items = []
        for i, entry in enumerate(history):
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], Mapping):
                items.append(entry)
            elif isinstance(entry, Mapping):
                step = next((entry[k] for k in STEP_KEYS if k in entry), i)
                items.append((step, entry))
            else:
                raise TypeError(
                    f"history entry {i} is {type(entry).__name__}; expected a dict of metrics "
                    "or a (step, dict) pair"
                )
    else:
        raise TypeError(
            "history must be a list of metric dicts, a {step: dict} mapping or a pandas "
            f"DataFrame, got {type(history).__name__}"
        )
    rows, steps = [], []
    for step, metrics in items:
        row = {}
        for key, value in metrics.items():
            if key in STEP_KEYS:
                continue
            try:
                row[str(key)] = float(value)
            except (TypeError, ValueError):
                continue  # histograms, strings and media are not scalar metrics
        rows.append(row)
        steps.append(int(step))
    if not rows:
        raise ValueError("history is empty: nothing to plot")
    frame = pd.DataFrame(rows, index=pd.Index(steps, name="step"))
    return frame[~frame.index.duplicated(keep="last")].sort_index()


def select_layers(
    frame: pd.DataFrame,
    stat: str | None,
    prefix: str = "",
    layers: Sequence[str] | None = None,
    include: str | None = None,
    exclude: str | None = None,
) -> pd.DataFrame:
    """Columns ``{prefix}{layer}/{stat}`` (or ``{prefix}{layer}`` when ``stat`` is None), renamed
    to the layer name, in the order they first appear; ``include``/``exclude`` are regexes on
    the layer name (``re.search``).

    Example:
        >>> f = metrics_frame([{"grad/a/l2": 1.0, "grad/b/l2": 2.0, "weight/a/l2": 5.0}])
        >>> list(select_layers(f, "l2", prefix="grad/").columns)
        ['a', 'b']
    """
    suffix = "" if stat is None else f"/{stat}"
    pattern = re.compile(re.escape(prefix) + r"(?P<layer>.+)" + re.escape(suffix) + r"$")
    chosen: dict[str, str] = {}
    for col in frame.columns:
        m = pattern.fullmatch(col)
        if not m or (stat is None and "/" in m.group("layer")):
            continue
        name = m.group("layer")
        if include is not None and not re.search(include, name):
            continue
        if exclude is not None and re.search(exclude, name):
            continue
        chosen.setdefault(name, col)
    if layers is not None:
        missing = [name for name in layers if name not in chosen]
        if missing:
            raise KeyError(f"no metric for layers {missing}; available: {sorted(chosen)}")
        chosen = {name: chosen[name] for name in layers}
    if not chosen:
        want = f"{prefix}<layer>{suffix}"
        sample = ", ".join(list(frame.columns)[:8])
        raise KeyError(f"no metric key matches {want!r}; keys look like: {sample}")
    out = frame[list(chosen.values())].copy()
    out.columns = list(chosen)
    return out


def matrix_2d(weight: Any, max_size: int) -> np.ndarray:
    """A 2-D view of a weight for a heatmap: conv kernels flattened per output channel, vectors as
    one row, then block-averaged so neither side exceeds ``max_size``.

    Example:
        >>> matrix_2d(np.ones((4, 2, 3, 3)), 512).shape
        (4, 18)
    """
    arr = to_numpy(weight)
    if arr.ndim == 0:
        raise ValueError("a scalar has no heatmap; pass a matrix")
    arr = arr.reshape(1, -1) if arr.ndim == 1 else arr.reshape(arr.shape[0], -1)
    for axis in (0, 1):
        n = arr.shape[axis]
        if n > max_size:
            factor = -(-n // max_size)
            pad = (-n) % factor
            widths = [(0, 0), (0, 0)]
            widths[axis] = (0, pad)
            padded = np.pad(arr, widths, constant_values=np.nan)
            shape = list(padded.shape)
            shape[axis : axis + 1] = [shape[axis] // factor, factor]
            arr = np.nanmean(padded.reshape(shape), axis=axis + 1)
    return arr


def score_matrix(result: Any) -> tuple[np.ndarray, list, list]:
    """Scores ``[n_query, n_train]`` and the two id lists from an influence result or an array.

    Example:
        >>> s, q, t = score_matrix(np.zeros((2, 3)))
        >>> s.shape, q, t
        ((2, 3), [0, 1], [0, 1, 2])
    """
    scores = to_numpy(getattr(result, "scores", result))
    if scores.ndim == 1:
        scores = scores[None, :]
    if scores.ndim != 2:
        raise ValueError(f"scores must be [n_query, n_train], got shape {scores.shape}")
    test_ids = list(getattr(result, "test_ids", None) or range(scores.shape[0]))
    train_ids = list(getattr(result, "train_ids", None) or range(scores.shape[1]))
    return scores, test_ids, train_ids


def ranking_hits(scores: Any, flagged: Sequence[int]) -> np.ndarray:
    """``hits[k-1]``: how many of the ``flagged`` positions are among the ``k`` highest scores.

    Ties are broken by position (a stable sort) and NaN scores rank last, so the count never
    depends on the sort's whims; ``hits[k-1] / len(flagged)`` is the recall at ``k``.

    Example:
        >>> ranking_hits([0.1, 0.9, 0.5, 0.7], [2, 3]).tolist()
        [0, 1, 2, 2]
    """
    values = to_numpy(scores).ravel()
    flags = np.zeros(values.size, dtype=bool)
    idx = np.asarray(list(flagged), dtype=int)
    if idx.size and (idx.min() < 0 or idx.max() >= values.size):
        raise IndexError(f"flagged positions must lie in [0, {values.size}), got {idx.tolist()}")
    flags[idx] = True
    order = np.argsort(-np.where(np.isnan(values), -np.inf, values), kind="stable")
    return np.cumsum(flags[order])
