"""Everything the viewer page shows, read from what nnstat wrote under a folder into one dict.

`load_bundle` walks the folder (`discover`) and reads what it finds by what the folders hold:
recorder trials (``trial.json``, read here), Tracker runs (``metrics.jsonl``, `runs.py`),
gradient stores (``meta.json`` + ``shards/``, summarised by `explorer.py`) and HTML reports.

A recorder folder may come from anywhere (a colleague's run, a downloaded artefact), so nothing in
it is trusted: every file read must resolve inside the folder, a graph digest must be a sha256 in
hex, and every field the page reads must have the type the recorder writes. A file or record that
fails a check is left out and named in the bundle's ``problems`` (the page lists them); one bad
file never hides the rest of the folder, and no value reaches the page unchecked.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nnstat.recorder.graph import ROLES
from nnstat.viewer.discover import MAX_DEPTH, discover, rel_id
from nnstat.viewer.explorer import store_summary
from nnstat.viewer.runs import load_run
from nnstat.viewer.safe import Refused, inside

DIGEST = re.compile(r"[0-9a-f]{64}")
ITERATION_KEY = re.compile(r"[0-9]{1,6}")
STREAMS = ("forward", "gradient")
# the page builds one <option> per iteration; a forged count must not freeze the browser
MAX_ITERATIONS = 100_000
# raw values the page embeds in all trials together (each one a JSON number, ~20 bytes, and a
# Python float while the bundle is built): a trial recorded with a large raw_max_numel would
# otherwise take tens of GB to open; past it, raw values are left out and reported once
RAW_VALUE_BUDGET = 2_000_000
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "infinity": math.inf}


# ------------------------------------------------------------------------------- checked reads


def _reject_constant(name: str) -> Any:
    raise Refused(f"{name} is not JSON (the recorder writes non-finite numbers as strings)")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def _read_json(root: Path, path: Path) -> Any:
    try:
        return _loads(inside(root, path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise Refused(f"not JSON ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise Refused(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _read_jsonl(root: Path, path: Path, report: Callable[[str], None]) -> Iterator[tuple[int, Any]]:
    """(line number, record) of every complete line; bad lines are reported and skipped."""
    if not path.exists():
        return
    try:
        text = inside(root, path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    lines = text.split("\n")
    # the writer appends whole lines ending in "\n": text after the last one is a line being
    # written right now, read if already complete, otherwise left for the next read
    tail = lines.pop()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield number, _loads(line)
        except (json.JSONDecodeError, Refused) as exc:
            report(f"line {number}: not JSON ({exc})")
    if tail.strip():
        try:
            yield len(lines) + 1, _loads(tail)
        except (json.JSONDecodeError, Refused):
            pass  # a partly written last line, as the storage format allows


# ---------------------------------------------------------------------------- field checks
def _show(value: Any) -> str:
    # the offending value, short, as JSON (the page shows it as text)
    text = json.dumps(value)
    return f"{text[:60]}..." if len(text) > 60 else text


def _dict(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise Refused(f"{what} must be a JSON object, got {_show(value)}")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise Refused(f"{what} must be a JSON list, got {_show(value)}")
    return value


def _str(value: Any, what: str) -> str:
    if not isinstance(value, str):
        raise Refused(f"{what} must be a string, got {_show(value)}")
    return value


def _int(value: Any, what: str, lo: int | None = None, hi: int | None = None) -> int:
    # bool is an int in Python but never what the recorder writes for a count or an index
    if not isinstance(value, int) or isinstance(value, bool):
        raise Refused(f"{what} must be an integer, got {_show(value)}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise Refused(f"{what} must be {bounds}, got {value}")
    return value


def _number(value: Any, what: str) -> float | None:
    """A finite float, or None (shown as a dash) for the recorder's "nan"/"inf" strings."""
    if isinstance(value, str) and value.strip().lower() in _NONFINITE:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise Refused(f"{what} must be a number, got {_show(value)}")
    return _clean(float(value))


def _clean(x: float) -> float | None:
    # JSON has no NaN/Inf; the page shows null as a dash
    return float(x) if math.isfinite(x) else None


def _kpis(value: Any, what: str, report: Callable[[str], None]) -> dict[str, float | None]:
    """KPIs by name; a KPI that is no number is reported and left out, the others kept."""
    out = {}
    for name, v in _dict(value, what).items():
        try:
            out[name] = _number(v, f"{what} {name!r}")
        except Refused as exc:
            report(f"{exc}; the value is left out")
    return out


def _stream(value: Any, what: str) -> str:
    if value not in STREAMS:
        raise Refused(f"{what} must be forward or gradient, got {_show(value)}")
    return value


def _pair_list(value: Any, what: str) -> list[list[str]]:
    out = []
    for i, pair in enumerate(_list(value, what)):
        item = _list(pair, f"{what}[{i}]")
        if len(item) != 2:
            raise Refused(f"{what}[{i}] must be a pair, got {_show(item)}")
        out.append([_str(x, f"{what}[{i}]") for x in item])
    return out


# ------------------------------------------------------------------------------ the records
def _graph(root: Path, path: Path) -> dict[str, Any]:
    doc = _dict(_read_json(root, path), "the graph")
    nodes = _pair_list(doc.get("nodes"), "nodes")
    for name, role in nodes:
        if role not in ROLES:
            raise Refused(f"node {name!r} has role {role!r}, not one of {', '.join(ROLES)}")
    return {"nodes": nodes, "edges": _pair_list(doc.get("edges"), "edges")}


class _Graphs:
    """Graph documents by digest, each file read (and a refused one reported) once."""

    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Any]] = {}
        self.refused: set[Path] = set()

    def load(
        self, root: Path, tdir: Path, digest: str, report: Callable[[Path, str], None]
    ) -> None:
        path = tdir / "graphs" / f"{digest}.json"
        if digest in self.docs or path in self.refused:
            return
        try:
            self.docs[digest] = _graph(root, path)
        except (Refused, OSError) as exc:
            self.refused.add(path)
            report(path, f"{exc}; steps using it show their parameters only")


def _rows(value: Any) -> dict[str, list[Any]]:
    rows = _dict(value, "rows")
    cols = {k: _list(rows.get(k), f"rows.{k}") for k in ("tensor", "iteration", "stream", "sample")}
    n = len(cols["tensor"])
    if any(len(c) != n for c in cols.values()):
        sizes = ", ".join(f"{k} {len(c)}" for k, c in cols.items())
        raise Refused(f"rows columns differ in length ({sizes})")
    for i in range(n):
        _str(cols["tensor"][i], f"rows.tensor[{i}]")
        _int(cols["iteration"][i], f"rows.iteration[{i}]", -1, MAX_ITERATIONS)
        _stream(cols["stream"][i], f"rows.stream[{i}]")
        # one <option> per sample index on the page: bounded by the number of rows
        _int(cols["sample"][i], f"rows.sample[{i}]", -1, n)
    return cols


def _offender(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    off = _dict(value, "first_offender")
    return {
        "tensor": _str(off.get("tensor"), "first_offender.tensor"),
        "iteration": _int(off.get("iteration"), "first_offender.iteration", -1, MAX_ITERATIONS),
        "stream": _stream(off.get("stream"), "first_offender.stream"),
    }


def _anomaly(value: Any, i: int) -> dict[str, Any]:
    a = _dict(value, f"anomalies[{i}]")
    out: dict[str, Any] = {
        k: _str(a.get(k), f"anomalies[{i}].{k}") for k in ("rule", "indicator", "tensor")
    }
    out["stream"] = _stream(a.get("stream"), f"anomalies[{i}].stream")
    out["iteration"] = _int(a.get("iteration"), f"anomalies[{i}].iteration", -1, MAX_ITERATIONS)
    out["value"] = _number(a.get("value"), f"anomalies[{i}].value")
    return out


class _RawBudget:
    """Raw values the page may still embed (`RAW_VALUE_BUDGET` across every trial)."""

    def __init__(self) -> None:
        self.left = RAW_VALUE_BUDGET
        self.reported = False


def _values(root: Path, path: Path, budget: _RawBudget) -> dict[str, Any]:
    if not path.exists() or (budget.reported and budget.left <= 0):
        return {}  # the first step past the budget said that later raw values are left out
    from safetensors import SafetensorError, safe_open

    try:
        # the header gives every shape: the values are read only when they fit the budget
        with safe_open(str(inside(root, path)), framework="pt") as fh:
            keys = list(fh.keys())
            total = sum(math.prod(fh.get_slice(k).get_shape()) for k in keys)
            if total > budget.left:
                budget.left, budget.reported = 0, True
                raise Refused(
                    f"{total:,} raw values would take the page past its {RAW_VALUE_BUDGET:,}-value "
                    "limit (record fewer with a smaller raw_max_numel), nor are later steps'"
                )
            budget.left -= total
            tensors = {k: fh.get_tensor(k) for k in keys}
    except SafetensorError as exc:
        raise Refused(f"not a safetensors file ({exc})") from exc
    out = {}
    for key, t in tensors.items():
        if t.is_complex():
            raise Refused(f"raw values {key!r} are complex ({t.dtype}); the recorder writes reals")
        flat = t.detach().to(torch.float64).reshape(-1).tolist()
        out[key] = {"shape": list(t.shape), "data": [_clean(v) for v in flat]}
    return out


def _step(
    root: Path,
    tdir: Path,
    stem: str,
    stat_names: list[str],
    graphs: _Graphs,
    report: Callable[[Path, str], None],
    budget: _RawBudget,
) -> dict[str, Any]:
    steps = tdir / "steps"
    meta = _dict(_read_json(root, steps / f"{stem}.json"), "the step record")
    toe = _str(meta.get("type_of_execution"), "type_of_execution")
    number = _int(meta.get("step"), "step")
    # the key names the step's other files: it comes from the listed file name, and the record
    # must agree with it, so no field of the record ever becomes part of a path
    if stem != f"{toe}-{number:09d}":
        raise Refused(f"the file name says {stem!r} but the record says {toe!r} step {number}")
    rows = _rows(meta.get("rows"))
    iterations = _int(meta.get("iterations"), "iterations", 0, MAX_ITERATIONS)
    roles = _dict(meta.get("roles", {}), "roles")
    for name, role in roles.items():
        if role not in ROLES:
            raise Refused(f"roles[{name!r}] is {_show(role)}, not one of {', '.join(ROLES)}")
    step_graphs = _dict(meta.get("graphs", {}), "graphs")
    for it, digest in step_graphs.items():
        if not ITERATION_KEY.fullmatch(it):
            raise Refused(f"graphs key {it!r} must be an iteration number")
        # the digest names a file: anything but 64 hex digits ("../", "/") is refused
        if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
            raise Refused(
                f"graphs[{it!r}] must be a sha256 digest (64 hex digits), got {_show(digest)}"
            )
    anomalies = []
    for i, a in enumerate(_list(meta.get("anomalies", []), "anomalies")):
        try:
            anomalies.append(_anomaly(a, i))
        except Refused as exc:
            report(steps / f"{stem}.json", f"{exc}; this anomaly is not listed")
    step_file = steps / f"{stem}.json"
    kpis = _kpis(meta.get("kpis", {}), "kpis", lambda m: report(step_file, m))
    try:
        stats = np.load(inside(root, steps / f"{stem}.npy"), allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        # ValueError: not an .npy array or one holding pickled objects (never loaded)
        raise Refused(f"{stem}.npy: cannot read the statistics ({exc})") from exc
    expected = (len(rows["tensor"]), len(stat_names))
    if stats.ndim != 2 or stats.shape != expected or not np.issubdtype(stats.dtype, np.floating):
        raise Refused(
            f"{stem}.npy holds {stats.dtype} {list(stats.shape)}, expected float "
            f"{list(expected)} (rows x stat names)"
        )
    try:
        values = _values(root, steps / f"{stem}.values.safetensors", budget)
    except (Refused, OSError) as exc:
        report(steps / f"{stem}.values.safetensors", f"{exc}; raw values are not shown")
        values = {}
    for digest in step_graphs.values():
        graphs.load(root, tdir, digest, report)
    return {
        "key": stem,
        "type_of_execution": toe,
        "step": number,
        "iterations": iterations,
        "rows": rows,
        "stats": [[_clean(v) for v in row] for row in stats.astype(np.float64).tolist()],
        "values": values,
        # a refused graph is left out, so the page draws its parameters-only fallback
        "graphs": {k: d for k, d in step_graphs.items() if d in graphs.docs},
        "roles": roles,
        "first_offender": _offender(meta.get("first_offender")),
        "anomalies": anomalies,
        "kpis": kpis,
    }


def _module(value: Any, i: int) -> dict[str, Any]:
    m = _dict(value, f"modules[{i}]")
    return {
        "name": _str(m.get("name"), f"modules[{i}].name"),
        "type": _str(m.get("type"), f"modules[{i}].type"),
        "params_own": _int(m.get("params_own"), f"modules[{i}].params_own", 0),
        "params_total": _int(m.get("params_total"), f"modules[{i}].params_total", 0),
    }


def _note(value: Any, report: Callable[[str], None]) -> dict[str, Any]:
    n = _dict(value, "the note")
    step = n.get("step")
    return {
        "step": None if step is None else _int(step, "step"),
        "text": _str(n.get("text"), "text"),
    }


def _kpi_record(value: Any, report: Callable[[str], None]) -> dict[str, Any]:
    r = _dict(value, "the KPI record")
    return {
        "type": _str(r.get("type"), "type"),
        "step": _int(r.get("step"), "step"),
        "kpis": _kpis(r.get("kpis"), "kpis", report),
    }


def load_bundle(root: str | Path) -> dict[str, Any]:
    """Everything nnstat wrote under ``root``, checked, as one JSON-ready dict for the page.

    Keys: ``root``, the recorder's ``stat_names``, ``trials``, ``graphs``; ``runs`` (Tracker
    JSONL runs, `nnstat.viewer.runs`), ``stores`` (gradient stores, `nnstat.viewer.explorer`),
    ``reports`` (HTML files, ``{"id"}``) and ``problems`` (``{"file", "message"}`` for every file
    or record skipped, the file relative to ``root``). Re-read on every call so the page shows
    what training wrote meanwhile.

    Raises:
        FileNotFoundError: ``root`` is no folder or nnstat wrote nothing under it.

    Example:
        >>> bundle = load_bundle("runs/recorder/default")  # doctest: +SKIP
        >>> [t["id"] for t in bundle["trials"]]  # doctest: +SKIP
        ['baseline']
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"folder {root} does not exist")
    problems: list[dict[str, str]] = []

    def report(path: Path, message: str) -> None:
        problems.append({"file": rel_id(root, path), "message": message})

    found = discover(root, report)
    if not found:
        raise FileNotFoundError(
            f"nothing nnstat wrote under {root}: no recorder trials (trial.json), Tracker runs "
            f"(metrics.jsonl), gradient stores (meta.json + shards/) or reports (*.html) within "
            f"{MAX_DEPTH} folders"
        )
    bundle = _load_trials(root, found.trials, report)
    bundle["runs"] = [r for r in (load_run(root, d, report) for d in found.runs) if r]
    bundle["stores"] = [s for s in (store_summary(root, d, report) for d in found.stores) if s]
    bundle["reports"] = [{"id": rel_id(root, f)} for f in found.reports]
    bundle["problems"] = problems
    return bundle


def _load_trials(
    root: Path, trial_dirs: list[Path], report: Callable[[Path, str], None]
) -> dict[str, Any]:
    """Trials, recorded steps (rows + statistics), graphs, notes, KPIs and anomalies."""
    trials, graphs, stat_names, budget = [], _Graphs(), None, _RawBudget()
    for tdir in trial_dirs:
        rel = tdir.relative_to(root).as_posix() if tdir != root else tdir.name
        try:
            meta = _dict(_read_json(root, tdir / "trial.json"), "trial.json")
            raw_names = _list(meta.get("stat_names"), "stat_names")
            names = [_str(s, f"stat_names[{i}]") for i, s in enumerate(raw_names)]
            if not names:
                raise Refused("stat_names is empty")
            if stat_names is not None and names != stat_names:
                raise Refused(
                    f"stat_names {names} differ from the first trial's {stat_names}; "
                    "view this trial on its own folder"
                )
            group, trial = meta.get("group"), meta.get("trial")
            group = None if group is None else _str(group, "group")
            trial = None if trial is None else _str(trial, "trial")
            raw_modules = _list(meta.get("modules", []), "modules")
        except (Refused, OSError) as exc:
            report(tdir / "trial.json", f"{exc}; the trial is not shown")
            continue
        stat_names = names
        modules = []
        for i, m in enumerate(raw_modules):
            try:
                modules.append(_module(m, i))
            except Refused as exc:
                report(tdir / "trial.json", f"{exc}; this module is not listed")
        steps = []
        try:
            # listed names only: a step's key comes from here, never from a file's content
            step_files = sorted((tdir / "steps").glob("*.json"))
        except OSError as exc:
            report(tdir / "steps", f"cannot list it ({exc}); the trial shows no step")
            step_files = []
        for path in step_files:
            try:
                steps.append(_step(root, tdir, path.name[:-5], names, graphs, report, budget))
            except (Refused, OSError) as exc:
                report(path, f"{exc}; the step is not shown")
        steps.sort(key=lambda s: (s["type_of_execution"], s["step"]))
        trials.append(
            {
                "id": rel,
                "group": group,
                "trial": trial,
                "modules": modules,
                "notes": _records(root, tdir / "notes.jsonl", _note, report),
                "kpis": _records(root, tdir / "kpis.jsonl", _kpi_record, report),
                "steps": steps,
            }
        )
    return {
        "root": str(root),
        "stat_names": stat_names or [],
        "trials": trials,
        "graphs": graphs.docs,
    }


def _records(
    root: Path,
    path: Path,
    check: Callable[[Any, Callable[[str], None]], dict[str, Any]],
    report: Callable[[Path, str], None],
) -> list[dict[str, Any]]:
    """Checked records of a ``.jsonl`` log; a bad line is reported and skipped."""
    out = []
    try:
        for number, record in _read_jsonl(root, path, lambda m: report(path, m)):
            try:
                out.append(check(record, lambda m, n=number: report(path, f"line {n}: {m}")))
            except Refused as exc:
                report(path, f"line {number}: {exc}; the line is skipped")
    except (Refused, OSError) as exc:
        report(path, f"{exc}; the file is skipped")
    return out
