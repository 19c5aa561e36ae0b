"""Anomaly rules evaluated on device, the first non-finite offender, and indicator correlations.

Every rule turns each registered tensor (or its gradient) into a binary indicator per step, named
``"<rule> @ <tensor>"`` (``"<tensor>.grad"`` for gradients). A hit forces the step to be recorded.
`correlate` then answers comgra's wish list: "high loss co-occurs with tensor 5 close to zero".
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch

from nnstat.curvature.passes import keyword_checked
from nnstat.recorder.reduce import COL

KINDS: tuple[str, ...] = ("nonfinite", "abs_max_above", "norm_below", "norm_ratio_above")
STREAMS: tuple[str, ...] = ("forward", "gradient", "both")


class NonFiniteError(FloatingPointError):
    """Raised (with ``on_nonfinite="raise"``) after a step with NaN/Inf has been recorded.

    Example:
        >>> import tempfile, torch, nnstat
        >>> model = torch.nn.Linear(3, 1)
        >>> rec = nnstat.Recorder(tempfile.mkdtemp(), every=1, on_nonfinite="raise")
        >>> rec.track_module(model)
        >>> rec.start_batch(0)
        >>> x = rec.register_tensor("x", torch.full((2, 3), float("nan")), role="input")
        >>> rec.register_tensor("loss", model(x).pow(2).mean(), role="loss").backward()
        >>> rec.finish_batch()  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        nnstat.recorder.anomalies.NonFiniteError: non-finite values at step 0 ...: x (forward, ...)
    """


@keyword_checked("rule")
@dataclass(frozen=True)
class Rule:
    """One anomaly rule over the batch statistics of matching tensors.

    ``kind``: ``nonfinite`` (count > 0), ``abs_max_above`` (abs max > threshold),
    ``norm_below`` (norm < threshold, vanishing), ``norm_ratio_above`` (norm / previous step's
    norm > threshold, exploding). ``pattern`` is a regex searched in tensor names ("" = all).

    Example:
        >>> Rule("abs_max_above", 10.0, pattern="loss").label
        'abs_max>10'
    """

    kind: str
    threshold: float = 0.0
    pattern: str = ""
    stream: str = "both"
    name: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown rule kind {self.kind!r}; valid kinds are {list(KINDS)}")
        if self.stream not in STREAMS:
            raise ValueError(f"unknown stream {self.stream!r}; valid streams are {list(STREAMS)}")
        if not math.isfinite(float(self.threshold)):
            raise ValueError(f"rule threshold must be finite, got {self.threshold!r}")
        re.compile(self.pattern)

    @property
    def label(self) -> str:
        if self.name:
            return self.name
        sym = {"nonfinite": "nonfinite", "abs_max_above": "abs_max>", "norm_below": "norm<"}
        sym["norm_ratio_above"] = "norm_ratio>"
        return sym[self.kind] + ("" if self.kind == "nonfinite" else f"{self.threshold:g}")

    def applies(self, tensor: str, stream: str) -> bool:
        return self.stream in ("both", stream) and re.search(self.pattern, tensor) is not None


def nonfinite(pattern: str = "", stream: str = "both") -> Rule:
    """Any NaN/Inf in a tensor whose name matches ``pattern`` (regex; ``""``: every tensor).

    Example:
        >>> nonfinite(pattern="^loss$")  # Recorder(root, rules=[nonfinite()])
        Rule(kind='nonfinite', threshold=0.0, pattern='^loss$', stream='both', name=None)
    """
    return Rule("nonfinite", 0.0, pattern, stream)


def abs_max_above(k: float, pattern: str = "", stream: str = "forward") -> Rule:
    """Largest absolute value above ``k`` (forward values by default).

    Example:
        >>> abs_max_above(10, pattern="loss")
        Rule(kind='abs_max_above', threshold=10.0, pattern='loss', stream='forward', name=None)
    """
    return Rule("abs_max_above", float(k), pattern, stream)


def grad_norm_below(eps: float, pattern: str = "") -> Rule:
    """Vanishing gradient: gradient norm below ``eps``.

    Example:
        >>> grad_norm_below(1e-6)
        Rule(kind='norm_below', threshold=1e-06, pattern='', stream='gradient', name=None)
    """
    return Rule("norm_below", float(eps), pattern, "gradient")


def norm_ratio_above(k: float, pattern: str = "", stream: str = "gradient") -> Rule:
    """Exploding: norm grew more than ``k``-fold since the previous evaluated step.

    Example:
        >>> norm_ratio_above(100, pattern="^fc")
        Rule(kind='norm_ratio_above', threshold=100.0, pattern='^fc', stream='gradient', name=None)
    """
    return Rule("norm_ratio_above", float(k), pattern, stream)


def indicator_name(rule: Rule, tensor: str, stream: str) -> str:
    return f"{rule.label} @ {tensor}{'.grad' if stream == 'gradient' else ''}"


def evaluate_rules(
    rules: Sequence[Rule], masks: torch.Tensor, stats: torch.Tensor, prev_norm: torch.Tensor | None
) -> torch.Tensor:
    """Hits ``[len(rules), R]`` (float 0/1, on the device of ``stats``) of rules over batch rows.

    ``masks[r, i]`` says whether rule ``r`` applies to row ``i``; ``prev_norm`` holds each row's
    norm at the previous evaluated step (NaN when unknown).

    Example:
        >>> s = torch.zeros(1, len(COL)); s[0, COL["abs_max"]] = 5.0
        >>> evaluate_rules([abs_max_above(1)], torch.ones(1, 1, dtype=torch.bool), s, None).tolist()
        [[1.0]]
    """
    out = []
    for r, rule in enumerate(rules):
        if rule.kind == "nonfinite":
            hit = stats[:, COL["nonfinite"]] > 0
        elif rule.kind == "abs_max_above":
            hit = stats[:, COL["abs_max"]] > rule.threshold
        elif rule.kind == "norm_below":
            hit = stats[:, COL["norm"]] < rule.threshold
        else:
            if prev_norm is None:
                hit = torch.zeros(stats.shape[0], dtype=torch.bool, device=stats.device)
            else:
                # comparisons with NaN are False, so unknown previous norms never fire
                hit = stats[:, COL["norm"]] > rule.threshold * prev_norm
        out.append(hit & masks[r])
    if not out:
        return torch.zeros(0, stats.shape[0], device=stats.device)
    return torch.stack(out).to(stats.dtype)


def first_offender(
    forward: Sequence[tuple[str, float]], backward: Sequence[tuple[str, float]]
) -> tuple[str, str] | None:
    """The first ``(tensor, stream)`` with a non-finite count > 0: forward order, then backward.

    Example:
        >>> first_offender([("x", 0), ("h", 3)], [("h", 1)])
        ('h', 'forward')
    """
    for stream, seq in (("forward", forward), ("gradient", backward)):
        for name, count in seq:
            if count > 0:
                return name, stream
    return None


def phi_table(indicators: pd.DataFrame) -> pd.DataFrame:
    """Pairs of binary indicator columns: counts, phi coefficient and P(B | A), sorted.

    Rows are observations (recorded steps). Only pairs where both fired at least once (not
    necessarily together) are listed;
    ``phi`` is NaN when either indicator is constant.

    Example:
        >>> df = pd.DataFrame({"a": [1, 1, 0, 0], "b": [1, 1, 0, 1]})
        >>> round(float(phi_table(df).iloc[0]["phi"]), 4)
        0.5774
    """
    cols = list(indicators.columns)
    x = indicators.fillna(0).to_numpy(dtype=float) > 0
    n = x.shape[0]
    rows = []
    for i, a in enumerate(cols):
        na = int(x[:, i].sum())
        if na == 0:
            continue
        for j, b in enumerate(cols):
            if i == j:
                continue
            nb = int(x[:, j].sum())
            if nb == 0:
                continue  # an indicator that never fired says nothing about A
            both = int((x[:, i] & x[:, j]).sum())
            n10, n01 = na - both, nb - both
            n00 = n - na - nb + both
            denom = math.sqrt(na * (n - na) * nb * (n - nb))
            phi = (both * n00 - n10 * n01) / denom if denom > 0 else float("nan")
            rows.append((a, b, both, na, nb, n, phi, both / na))
    out = pd.DataFrame(rows, columns=["a", "b", "count", "n_a", "n_b", "n", "phi", "p_b_given_a"])
    out = out.sort_values(["phi", "count", "a", "b"], ascending=[False, False, True, True])
    return out.reset_index(drop=True)


def correlate(root: str | Path) -> pd.DataFrame:
    """Co-occurrence of anomaly indicators across all recorded steps under ``root``.

    Returns one row per ordered pair ``(a, b)``: ``count`` (steps where both fired), ``n_a``,
    ``n_b``, ``n`` (steps), ``phi`` (Pearson correlation of the two indicators) and
    ``p_b_given_a``, sorted by ``phi`` then ``count``.

    Example:
        >>> df = correlate("runs/recorder")  # doctest: +SKIP
        >>> df.head()  # doctest: +SKIP
    """
    from nnstat.recorder.storage import iter_trials, read_step_meta

    records: list[dict[str, int]] = []
    for trial in iter_trials(Path(root)):
        for meta in read_step_meta(trial):
            records.append({k: int(v) for k, v in meta.get("indicators", {}).items()})
    if not records:
        raise ValueError(f"no recorded steps with anomaly indicators under {root}")
    return phi_table(pd.DataFrame.from_records(records).fillna(0).astype(int))
