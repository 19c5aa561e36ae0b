"""JSON Lines sink: a Tracker's metrics in a file nnstat reads back without W&B or TensorBoard.

``JsonlLogger(run_dir)`` appends to ``<run_dir>/metrics.jsonl``, one JSON object per line::

    {"nnstat_jsonl": 1, "created": 1732431600.0}                      first line (format header)
    {"step": 0, "time": 1732431600.5, "metrics": {"loss": 2.3, ...}}  one line per log() call

* Scalars (Python/NumPy numbers, one-element tensors, bools as 0/1) are JSON numbers; NaN and
  ±infinity, which JSON cannot spell, are the strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``.
* An `nnstat.describe.Histogram` is the compact object
  ``{"hist": {"edges": [...n+1], "counts": [...n], "min", "max", "num", "sum", "sum_squares"}}``
  (edges and counts as float lists; the summary numbers spelled like scalars above).
* Anything else (strings, lists, images) raises ``TypeError`` naming the key: a metric that was
  silently dropped would look like a metric that was never logged.

Each line is written with one ``write`` and flushed, so a killed process loses at most the line
it was writing; the readers (`read_jsonl` here, `nnstat view`) skip a truncated last line and
say so. Opening an existing run appends (a resumed run continues the same file).

Example:
    >>> import tempfile
    >>> from nnstat.integrations.jsonl import JsonlLogger, read_jsonl
    >>> d = tempfile.mkdtemp()
    >>> with JsonlLogger(d) as log:
    ...     log.log({"loss": 0.5, "acc": float("nan")}, step=0)
    >>> rows, problems = read_jsonl(d)
    >>> rows[0]["step"], rows[0]["metrics"]["loss"], problems
    (0, 0.5, [])
"""

from __future__ import annotations

import json
import math
import numbers
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from nnstat.integrations._owners import FlushOwners

from nnstat.describe import Histogram, metric_scalar
from nnstat.describe.hist_record import check_histogram
from nnstat.describe.scalars import held_item

__all__ = ["FORMAT_VERSION", "METRICS_FILE", "JsonlLogger", "read_jsonl"]

METRICS_FILE = "metrics.jsonl"
FORMAT_VERSION = 1
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def _number(value: float) -> float | str:
    if math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")


def _encode(key: str, value: Any) -> Any:
    if isinstance(value, Histogram):
        return {
            "hist": {
                "edges": [_number(float(x)) for x in value.edges.tolist()],
                "counts": [_number(float(x)) for x in value.counts.tolist()],
                **{
                    name: _number(float(getattr(value, name)))
                    for name in ("min", "max", "num", "sum", "sum_squares")
                },
            }
        }
    number = metric_scalar(value)
    if number is not None:
        return number if isinstance(number, int) else _number(number)
    held = held_item(value)  # a one-element complex tensor is refused as "complex"
    raise TypeError(
        f"JsonlLogger cannot log {key!r} of type {type(value if held is None else held).__name__} "
        "(expected a number, a one-element tensor/array or nnstat.describe.Histogram)"
    )


class JsonlLogger:
    """Append metrics dicts to ``<run_dir>/metrics.jsonl`` (a Tracker sink, or call it directly).

    Args:
        run_dir: folder of the run; created when missing. ``nnstat view`` finds the run by the
            ``metrics.jsonl`` file in it.

    Raises:
        NotADirectoryError: ``run_dir`` exists and is not a folder.

    Example:
        >>> import tempfile, torch, nnstat
        >>> from nnstat.integrations import JsonlLogger
        >>> logger = JsonlLogger(tempfile.mkdtemp())
        >>> with nnstat.Tracker(torch.nn.Linear(2, 1), sinks=[logger]) as tracker:
        ...     _ = tracker.step()
        >>> logger.close()
    """

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise NotADirectoryError(f"JsonlLogger: {self.run_dir} exists and is not a folder")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        new = not self.path.exists() or self.path.stat().st_size == 0
        # line-buffered text would still split a long line over several writes; each line is
        # one write() of the whole encoded line, then flush, so a crash cuts at most that line
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if not new:
            self._terminate_partial_line()
        else:
            self._write({"nnstat_jsonl": FORMAT_VERSION, "created": time.time()})
        self._owners = FlushOwners()

    def _terminate_partial_line(self) -> None:
        # a previous process killed mid-line left no newline at the end: start on a fresh line so
        # the appended rows stay readable (the reader reports the broken line in the middle)
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                self._file.write("\n")
                self._file.flush()

    def _write(self, obj: dict[str, Any]) -> None:
        line = json.dumps(obj, allow_nan=False, separators=(",", ":")) + "\n"
        self._file.write(line)
        self._file.flush()

    def attach(self, flush: Callable[[], None]) -> None:
        """Call ``flush`` (a Tracker's) when this logger closes, so no background step is lost."""
        self._owners.add(flush)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Append one line: ``step``, the wall time and every metric of ``metrics``.

        Raises:
            TypeError: a value is not a number, one-element tensor/array or Histogram, or a key
                is not a string.
            ValueError: the logger is closed.
        """
        if self._file.closed:
            raise ValueError(f"JsonlLogger for {self.path} is closed")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an int, got {type(step).__name__}")
        encoded = {}
        for key, value in metrics.items():
            if not isinstance(key, str):
                raise TypeError(f"metric keys must be strings, got {key!r}")
            encoded[key] = _encode(key, value)
        self._write({"step": int(step), "time": time.time(), "metrics": encoded})

    def flush(self) -> None:
        """Flush to the OS (every `log` already does) and fsync to disk."""
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        """Deliver attached Trackers' pending steps, then close the file (idempotent)."""
        if self._file.closed:
            return
        try:
            self._owners.flush()
        finally:
            self.flush()
            self._file.close()

    def __enter__(self) -> JsonlLogger:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _decode(value: Any) -> Any:
    if isinstance(value, str):
        if value in _NONFINITE:
            return _NONFINITE[value]
        raise ValueError(f"unexpected string value {value!r}")
    if isinstance(value, dict) and set(value) == {"hist"}:
        return _decode_hist(value["hist"])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"unexpected value {value!r}")
    return float(value)


_HIST_SCALARS = ("min", "max", "num", "sum", "sum_squares")


def _decode_hist(h: Any) -> dict[str, Any]:
    """A histogram record, checked whole: n counts, n + 1 edges, the five summary numbers.

    A record whose parts disagree would be drawn as some other distribution, so it is refused
    (the line is skipped and named in ``problems``) rather than kept.
    """
    if not isinstance(h, dict) or set(h) != {"edges", "counts", *_HIST_SCALARS}:
        keys = sorted(h) if isinstance(h, dict) else type(h).__name__
        raise ValueError(
            f"histogram must hold edges, counts, {', '.join(_HIST_SCALARS)}; got {keys}"
        )
    edges, counts = h["edges"], h["counts"]
    if not isinstance(edges, list) or not isinstance(counts, list) or not counts:
        raise ValueError("histogram edges and counts must be non-empty lists")
    if len(edges) != len(counts) + 1:
        raise ValueError(
            f"histogram has {len(counts)} counts but {len(edges)} edges (needs {len(counts) + 1})"
        )
    out: dict[str, Any] = {"edges": [_decode(x) for x in edges]}
    out["counts"] = [_decode(x) for x in counts]
    out.update({k: _decode(h[k]) for k in _HIST_SCALARS})
    try:  # the check the viewer's reader makes too
        check_histogram(out["edges"], out["counts"], out["num"], out["min"], out["max"])
    except ValueError as e:
        raise ValueError(
            f"{e}; the record was edited or written by another tool (JsonlLogger writes "
            "consistent ones)"
        ) from None
    return out


def read_jsonl(run_dir: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Read a `JsonlLogger` run back: ``(rows, problems)``.

    ``rows`` are ``{"step": int, "time": float, "metrics": {key: float | hist dict}}`` in file
    order (non-finite strings decoded to floats; histograms as plain dicts of lists). A line
    that does not parse (a truncated last line after a crash) is skipped and described in
    ``problems``; a missing file or a wrong header raises.

    Args:
        run_dir: the folder holding ``metrics.jsonl``.

    Returns:
        ``(rows, problems)``.

    Raises:
        FileNotFoundError: no ``metrics.jsonl`` in ``run_dir``.
        ValueError: a header that is not a JsonlLogger's.

    Example:
        >>> read_jsonl("runs/exp1")  # doctest: +SKIP
        ([{'step': 0, 'time': ..., 'metrics': {'loss': 2.3}}], [])
    """
    path = Path(run_dir)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {run_dir}: not a JsonlLogger run")
    lines = path.read_bytes().split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for i, raw in enumerate(lines):
        where = f"{path}:{i + 1}"
        last = i == len(lines) - 1
        try:
            obj = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            if not raw.strip():
                continue
            problems.append(
                f"{where}: truncated last line skipped (the process was probably killed while "
                "writing it)"
                if last
                else f"{where}: line is not valid JSON, skipped"
            )
            continue
        if i == 0:
            if not isinstance(obj, dict) or obj.get("nnstat_jsonl") != FORMAT_VERSION:
                raise ValueError(
                    f"{where}: not an nnstat JSONL run (header must be "
                    f'{{"nnstat_jsonl": {FORMAT_VERSION}, ...}})'
                )
            continue
        try:
            if not isinstance(obj, dict) or not isinstance(obj.get("metrics"), dict):
                raise ValueError("expected {step, time, metrics}")
            step = obj["step"]
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError(f"step must be an int, got {step!r}")
            metrics = {str(k): _decode(v) for k, v in obj["metrics"].items()}
        except (ValueError, KeyError) as exc:
            problems.append(f"{where}: {exc}; line skipped")
            continue
        rows.append({"step": step, "time": obj.get("time"), "metrics": metrics})
    return rows, problems
