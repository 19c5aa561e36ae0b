"""Finding what nnstat wrote under a folder, by what each folder holds.

Example:
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "report.html").write_text("<p>hi</p>")
    >>> [p.name for p in discover(d).reports]
    ['report.html']
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nnstat.store.files import META_FILE, SHARD_DIR
from nnstat.viewer.runs import RUN_FILE  # nnstat.integrations.JsonlLogger's file

# how deep `discover` looks below the folder, and how many folders at most: `nnstat view ~`
# must answer quickly instead of walking a home directory
MAX_DEPTH = 4
MAX_FOLDERS = 5000
TRIAL_FILE = "trial.json"


@dataclass
class Found:
    """What `discover` found under a folder, each list sorted by path."""

    trials: list[Path] = field(default_factory=list)
    runs: list[Path] = field(default_factory=list)
    stores: list[Path] = field(default_factory=list)
    reports: list[Path] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.trials or self.runs or self.stores or self.reports)


def discover(root: str | Path, report: Callable[[Path, str], None] | None = None) -> Found:
    """Folders nnstat wrote under ``root`` (``root`` itself included), by what they hold.

    A folder with ``trial.json`` is a recorder trial, with ``metrics.jsonl`` a Tracker run
    (`nnstat.integrations.JsonlLogger`), with ``meta.json`` and ``shards/`` a gradient store;
    ``*.html`` files outside those are reports (the demo's ``report.html``). The walk goes
    ``MAX_DEPTH`` folders down, skips hidden folders and never enters a symlinked folder (a
    marker file seen through one is still listed, and refused when read if it leads outside).

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp()); _ = (d / "report.html").write_text("<p>hi</p>")
        >>> [p.name for p in discover(d).reports]
        ['report.html']
    """
    root = Path(root)
    found = Found()
    queue: list[tuple[Path, int]] = [(root, 0)]
    seen = 0
    while queue:
        folder, depth = queue.pop(0)
        seen += 1
        if seen > MAX_FOLDERS:
            if report:
                report(folder, f"more than {MAX_FOLDERS} folders: the rest is not searched")
            break
        try:
            if (folder / TRIAL_FILE).exists():
                found.trials.append(folder)
                continue
            if (folder / RUN_FILE).exists():
                found.runs.append(folder)
                continue
            if (folder / META_FILE).is_file() and (folder / SHARD_DIR).is_dir():  # a gradient store
                found.stores.append(folder)
                continue
            if folder != root and folder.is_symlink():
                continue  # a marker seen through it was listed above; never walk into it
            children = sorted(folder.iterdir())
        except OSError as exc:
            if report:
                report(folder, f"cannot list it ({exc})")
            continue
        for child in children:
            if child.name.startswith("."):
                continue
            try:
                if child.suffix == ".html" and child.is_file() and not child.is_symlink():
                    found.reports.append(child)
                elif child.is_dir() and depth < MAX_DEPTH:
                    queue.append((child, depth + 1))
            except OSError:
                continue
    for kind in (found.trials, found.runs, found.stores, found.reports):
        kind.sort()
    return found


def rel_id(root: Path, path: Path) -> str:
    """``path`` relative to ``root`` as the page names it (the folder's own name for ``root``)."""
    return path.relative_to(root).as_posix() if path != root else path.name
