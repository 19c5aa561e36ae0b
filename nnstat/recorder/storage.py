"""On-disk layout of a recorder folder (npy + JSON, nothing pickled), writer and readers.

```
<root>/<group>/<trial>/
  trial.json                       format version, group, trial, stat names, schedules, rules,
                                   modules [{name, type, params_own, params_total}]
  graphs/<sha256>.json             dependency graphs by content hash
  steps/<type>-<step:09d>.npy      float32 [rows, n_stats] statistics of that step
  steps/<type>-<step:09d>.values.safetensors   raw values of small tensors (optional)
  steps/<type>-<step:09d>.json     rows (columnar), graphs per iteration, KPIs, anomaly hits,
                                   indicators, first non-finite offender, why it was recorded
  notes.jsonl                      one JSON object per note
  kpis.jsonl                       {"type", "step", "kpis"} for every step with KPIs
```
Every step file is written under a temporary name and renamed; a step's JSON is written last, so
a reader that lists ``steps/*.json`` while training runs only sees complete steps. The ``.jsonl``
logs are appended one line per record; readers ignore a partly written last line and refuse a
damaged complete one, naming it.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nnstat.store.files import load_npy, load_safetensors, read_json

FORMAT_VERSION = 1
_OWN = ("trial.json", "notes.jsonl", "kpis.jsonl", "graphs", "steps")


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _dumps(obj: Any) -> bytes:
    # allow_nan=False would reject NaN statistics; JSON readers in the viewer accept NaN via
    # a replacement, so non-finite floats are stored as strings instead of invalid JSON
    return json.dumps(_jsonable(obj), separators=(",", ":"), allow_nan=False).encode("utf-8")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if np.isfinite(obj) else str(obj)
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        if all(type(v) in (str, int) for v in obj):  # the columnar row lists: nothing to convert
            return obj
        return [_jsonable(v) for v in obj]
    return obj


class TrialWriter:
    """Writes one trial folder. Thin: the recorder decides what, this decides where.

    Example:
        >>> w = TrialWriter("/tmp/nnstat-doc", "g", "t", overwrite=True)  # doctest: +SKIP
    """

    def __init__(self, root: str | Path, group: str, trial: str, overwrite: bool) -> None:
        for label, value in (("group", group), ("trial", trial)):
            if not value or "/" in value or "\\" in value or value.startswith("."):
                raise ValueError(f"{label} must be a plain folder name, got {value!r}")
        self.path = Path(root) / group / trial
        existing = [self.path / n for n in _OWN if (self.path / n).exists()]
        if existing and not overwrite:
            raise FileExistsError(
                f"{self.path} already holds a recording; pass overwrite=True or another trial name"
            )
        for p in existing:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        (self.path / "steps").mkdir(parents=True, exist_ok=True)
        (self.path / "graphs").mkdir(exist_ok=True)
        self._graphs: set[str] = set()

    def write_trial(self, meta: dict[str, Any]) -> None:
        _atomic_write(self.path / "trial.json", _dumps({"format_version": FORMAT_VERSION, **meta}))

    def write_graph(self, digest: str, document: dict[str, Any]) -> None:
        if digest not in self._graphs:
            _atomic_write(self.path / "graphs" / f"{digest}.json", _dumps(document))
            self._graphs.add(digest)

    def write_step(
        self,
        stem: str,
        stats: np.ndarray,
        meta: dict[str, Any],
        values: dict[str, torch.Tensor] | None = None,
    ) -> None:
        steps = self.path / "steps"
        tmp = steps / f".{stem}.npy.tmp{os.getpid()}"
        with open(tmp, "wb") as fh:
            np.save(fh, np.ascontiguousarray(stats, dtype=np.float32), allow_pickle=False)
        os.replace(tmp, steps / f"{stem}.npy")
        if values:
            from safetensors.torch import save

            # bytes through the same temporary file as the other files (so the same umask
            # mode: safetensors' save_file creates its file 0600); raw values are small tensors
            blob = save({k: v.contiguous() for k, v in values.items()})
            _atomic_write(steps / f"{stem}.values.safetensors", blob)
        _atomic_write(steps / f"{stem}.json", _dumps(meta))

    def append_kpis(self, records: list[dict[str, Any]]) -> None:
        with open(self.path / "kpis.jsonl", "ab") as fh:
            fh.write(b"".join(_dumps(r) + b"\n" for r in records))

    def append_note(self, record: dict[str, Any]) -> None:
        with open(self.path / "notes.jsonl", "ab") as fh:
            fh.write(_dumps(record) + b"\n")


def iter_trials(root: Path) -> Iterator[Path]:
    """Trial folders under ``root`` (the root itself, a group folder, or a recorder root).

    Example:
        >>> [t.name for t in iter_trials(Path("runs/recorder"))]  # doctest: +SKIP
        ['baseline', 'scaled']
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"recorder folder {root} does not exist")
    if (root / "trial.json").exists():
        yield root
        return
    for child in sorted(root.iterdir()):
        if (child / "trial.json").exists():
            yield child
        elif child.is_dir():
            yield from (g for g in sorted(child.iterdir()) if (g / "trial.json").exists())


def read_step_meta(trial: Path) -> list[dict[str, Any]]:
    """JSON records of every complete step of a trial, ordered by (type, step).

    Example:
        >>> [m["step"] for m in read_step_meta(Path("runs/recorder/g/baseline"))]  # doctest: +SKIP
        [0, 100, 200]
    """
    out = [read_json(p) for p in sorted((Path(trial) / "steps").glob("*.json"))]
    return sorted(out, key=lambda m: (m["type_of_execution"], m["step"]))


def read_step_stats(trial: Path, stem: str) -> np.ndarray:
    """The ``[rows, n_stats]`` statistics array of one step (``allow_pickle=False``).

    Example:
        >>> read_step_stats(Path("runs/recorder/g/baseline"), "train-000000100")  # doctest: +SKIP
    """
    return load_npy(Path(trial) / "steps" / f"{stem}.npy", mmap_mode=None)


def read_step_values(trial: Path, stem: str) -> dict[str, torch.Tensor]:
    """Raw values of small tensors of one step, ``"{iteration}/{stream}/{name}"`` keys.

    Example:
        >>> read_step_values(Path("runs/recorder/g/t"), "train-000000000")["0/forward/loss"]  # doctest: +SKIP
    """
    return load_safetensors(Path(trial) / "steps" / f"{stem}.values.safetensors")


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = path.read_bytes().split(b"\n")
    # text after the last newline is the line being appended right now (or cut short by a kill):
    # left out. A complete line that is not JSON is damage, and skipping it (or everything after
    # it) would return fewer records than were written without saying so
    lines.pop()
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line.decode("utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{path}: line {number} is not JSON ({e}); the file is damaged: repair or delete "
                "that line to read the other records"
            ) from e
    return out


def read_kpis(trial: Path) -> list[dict[str, Any]]:
    """Every step's KPIs (recorded or not); a partly written last line is ignored.

    Raises:
        ValueError: a complete line of ``kpis.jsonl`` is not JSON (naming the file and line).

    Example:
        >>> [r["kpis"]["loss"] for r in read_kpis(Path("runs/recorder/g/t"))][:2]  # doctest: +SKIP
    """
    return _read_jsonl(Path(trial) / "kpis.jsonl")
