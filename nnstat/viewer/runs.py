"""Tracker runs for the page: ``metrics.jsonl`` as written by `nnstat.integrations.JsonlLogger`.

The viewer sits below the integrations (it may not import them), so this is its own small
reader of that documented format (integrations/jsonl.py): a header line
``{"nnstat_jsonl": 1, ...}``, then ``{"step", "time", "metrics"}`` per line, non-finite numbers
as ``"NaN"``/``"Infinity"``/``"-Infinity"``, histograms as ``{"hist": {"edges", "counts", ...}}``.

For the page, every scalar key becomes one series aligned on the run's sorted steps: ``null``
where the value was not finite or where a step did not log the key; ``nonfinite`` lists, per
key, the positions that were logged as NaN/Inf. Charts break the line at those only and draw
across steps that did not log the key, so series logged at different cadences (a noise scale
every 10 steps in a run logged every 5) still draw. Lines of the same step merge, a key logged
twice for one step (a resumed run) keeping its last value. Histograms keep at most
`MAX_HIST_STEPS` steps per key, evenly spaced, the last one always.

Example:
    >>> import json, tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> lines = [{"nnstat_jsonl": 1}, {"step": 0, "metrics": {"loss": 2.0}},
    ...          {"step": 1, "metrics": {"loss": "NaN", "acc": 0.5}}]
    >>> _ = (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\\n" for x in lines))
    >>> run = load_run(d, d, lambda p, m: None)
    >>> run["steps"], run["series"], run["nonfinite"]
    ([0, 1], {'acc': [None, 0.5], 'loss': [2.0, None]}, {'loss': [1]})
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nnstat.describe.hist_record import check_histogram
from nnstat.viewer.safe import Refused, inside

RUN_FILE = "metrics.jsonl"
FORMAT_VERSION = 1
MAX_HIST_STEPS = 40
# a forged histogram must not make the page draw millions of bars
MAX_BINS = 4096
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _hist(v: dict[str, Any]) -> dict[str, Any]:
    h = v.get("hist")
    if not isinstance(h, dict):
        raise Refused("a histogram must be {'hist': {edges, counts, ...}}")
    edges, counts = h.get("edges"), h.get("counts")
    if not isinstance(edges, list) or not isinstance(counts, list):
        raise Refused("a histogram needs edges and counts lists")
    if len(edges) != len(counts) + 1 or not counts or len(counts) > MAX_BINS:
        raise Refused(f"a histogram needs len(edges) = len(counts) + 1 <= {MAX_BINS + 1}")
    e, c = [_float(x) for x in edges], [_float(x) for x in counts]
    num, lo, hi = (None if h.get(k) is None else _float(h[k]) for k in ("num", "min", "max"))
    try:  # the check read_jsonl makes: what one reader keeps, the other draws
        check_histogram(e, c, num, lo, hi)
    except ValueError as exc:
        raise Refused(
            f"{exc}; the record was edited or written by another tool (JsonlLogger writes "
            "consistent ones)"
        ) from None
    return {"edges": e, "counts": c}


def _float(v: Any) -> float:
    """A number or a non-finite string as a float; anything else is refused (a scalar's
    non-finite value becomes NaN, the histogram check refuses non-finite edges and counts)."""
    if isinstance(v, str) and v in _NONFINITE:
        return _NONFINITE[v]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise Refused(f"value must be a number or NaN/Infinity string, got {json.dumps(v)[:60]}")
    return float(v)


def load_run(root: Path, folder: Path, report: Callable[[Path, str], None]) -> dict | None:
    """One run for the page: ``{"id", "steps", "series", "hists"}``, or None when unreadable.

    ``hists`` maps a key to ``{"steps": [...], "edges": [[...]], "counts": [[...]]}``. Bad lines
    are reported through ``report(path, message)`` and skipped; so is a truncated last line (a
    process killed while writing it), which is reported as such.
    """
    path = folder / RUN_FILE
    rel = folder.relative_to(root).as_posix() if folder != root else folder.name
    try:
        raw = inside(root, path).read_bytes()
    except (Refused, OSError) as exc:
        report(path, f"{exc}; the run is not shown")
        return None
    lines = raw.split(b"\n")
    last_complete = lines[-1] == b""
    if last_complete:
        lines.pop()
    by_step: dict[int, dict[str, Any]] = {}
    header_seen = False
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line.decode("utf-8"), parse_constant=_refuse_constant)
        except (UnicodeDecodeError, json.JSONDecodeError, Refused) as exc:
            if number == len(lines) and not last_complete:
                report(
                    path,
                    f"line {number}: incomplete last line skipped (still being written, or the "
                    "process was killed while writing it)",
                )
            else:
                report(path, f"line {number}: not JSON ({exc}); the line is skipped")
            continue
        if not header_seen:
            header_seen = True
            if not isinstance(obj, dict) or obj.get("nnstat_jsonl") != FORMAT_VERSION:
                report(
                    path,
                    f'not an nnstat JSONL run: the first line must be {{"nnstat_jsonl": '
                    f"{FORMAT_VERSION}, ...}}; the run is not shown",
                )
                return None
            continue
        try:
            if not isinstance(obj, dict) or not isinstance(obj.get("metrics"), dict):
                raise Refused("a line must be {step, time, metrics}")
            step = obj.get("step")
            if isinstance(step, bool) or not isinstance(step, int):
                raise Refused(f"step must be an integer, got {json.dumps(step)[:60]}")
            metrics = {}
            for key, v in obj["metrics"].items():
                if isinstance(v, dict):
                    metrics[key] = _hist(v)
                else:  # NaN marks "logged, not finite", apart from "not logged" (absent)
                    value = _float(v)
                    metrics[key] = value if math.isfinite(value) else math.nan
        except Refused as exc:
            report(path, f"line {number}: {exc}; the line is skipped")
            continue
        # several lines of one step merge (a Tracker sink and a loop's own log() both write
        # step t, like W&B's log); a key logged again (a resumed run) keeps its last value
        by_step.setdefault(step, {}).update(metrics)
    steps = sorted(by_step)
    scalar_keys = sorted(
        {k for m in by_step.values() for k, v in m.items() if not isinstance(v, dict)}
    )
    series = {k: [_scalar(by_step[s].get(k)) for s in steps] for k in scalar_keys}
    nonfinite = {
        k: idx
        for k in scalar_keys
        if (idx := [i for i, s in enumerate(steps) if _is_nan(by_step[s].get(k))])
    }
    hists: dict[str, dict[str, list]] = {}
    for s in steps:
        for k, v in by_step[s].items():
            if isinstance(v, dict):
                h = hists.setdefault(k, {"steps": [], "edges": [], "counts": []})
                h["steps"].append(s)
                h["edges"].append(v["edges"])
                h["counts"].append(v["counts"])
    for h in hists.values():
        n = len(h["steps"])
        if n > MAX_HIST_STEPS:
            keep = sorted(
                {round(i * (n - 1) / (MAX_HIST_STEPS - 1)) for i in range(MAX_HIST_STEPS)}
            )
            for name in ("steps", "edges", "counts"):
                h[name] = [h[name][i] for i in keep]
    return {"id": rel, "steps": steps, "series": series, "nonfinite": nonfinite, "hists": hists}


def _scalar(v: Any) -> float | None:
    return v if isinstance(v, float) and math.isfinite(v) else None


def _is_nan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)


def _refuse_constant(name: str) -> Any:
    raise Refused(f"{name} is not JSON (JsonlLogger writes non-finite numbers as strings)")
