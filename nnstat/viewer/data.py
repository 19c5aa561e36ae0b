"""Everything the viewer page shows, read from a recorder folder into one JSON-ready dict."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from nnstat.recorder.storage import (
    iter_trials,
    read_json,
    read_kpis,
    read_notes,
    read_step_meta,
    read_step_stats,
    read_step_values,
)


def _clean(x: float) -> float | None:
    # JSON has no NaN/Inf; the page shows null as a dash
    return float(x) if math.isfinite(x) else None


def _clean_kpi(record: dict[str, Any]) -> dict[str, Any]:
    kpis = {}
    for k, v in record.get("kpis", {}).items():
        kpis[k] = _clean(float(v)) if isinstance(v, int | float | str) else None
    return {"type": record.get("type"), "step": record.get("step"), "kpis": kpis}


def load_bundle(root: str | Path) -> dict[str, Any]:
    """Trials, recorded steps (rows + statistics), graphs, notes, KPIs and anomalies under ``root``.

    Re-read on every call so the viewer shows steps written while training still runs.

    Example:
        >>> bundle = load_bundle("runs/recorder/default")  # doctest: +SKIP
        >>> [t["id"] for t in bundle["trials"]]  # doctest: +SKIP
        ['baseline']
    """
    root = Path(root)
    trials, graphs, stat_names = [], {}, None
    for tdir in iter_trials(root):
        meta = read_json(tdir / "trial.json")
        stat_names = stat_names or meta["stat_names"]
        steps = []
        for step in read_step_meta(tdir):
            stem = f"{step['type_of_execution']}-{step['step']:09d}"
            try:
                stats = read_step_stats(tdir, stem)
            except FileNotFoundError:
                continue  # JSON is written last, so this only happens if files were deleted
            step["key"] = stem
            step["stats"] = [[_clean(v) for v in row] for row in stats.tolist()]
            step["values"] = {
                key: {"shape": list(t.shape), "data": [_clean(v) for v in t.reshape(-1).tolist()]}
                for key, t in read_step_values(tdir, stem).items()
            }
            for digest in step.get("graphs", {}).values():
                if digest not in graphs:
                    graphs[digest] = read_json(tdir / "graphs" / f"{digest}.json")
            steps.append(step)
        rel = tdir.relative_to(root).as_posix() if tdir != root else tdir.name
        trials.append(
            {
                "id": rel,
                "group": meta.get("group"),
                "trial": meta.get("trial"),
                "modules": meta.get("modules", []),
                "rules": meta.get("rules", []),
                "notes": read_notes(tdir),
                "kpis": [_clean_kpi(r) for r in read_kpis(tdir)],
                "steps": steps,
            }
        )
    if not trials:
        raise FileNotFoundError(f"no recorder trials (trial.json) under {root}")
    return {"root": str(root), "stat_names": stat_names, "trials": trials, "graphs": graphs}
