"""Checked reads shared by the viewer's readers: every file they open resolves inside the folder.

A folder given to ``nnstat view`` may come from anywhere (a colleague's run, a downloaded
artefact), so no path in it is trusted: symlinks and ``..`` must not reach files outside it,
and a FIFO or device would block the server's read forever.

Example:
    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp()); _ = (d / "a.txt").write_text("x")
    >>> inside(d, d / "a.txt").name
    'a.txt'
"""

from __future__ import annotations

from pathlib import Path


class Refused(ValueError):
    """A file or record of the folder that does not have the format nnstat writes."""


def inside(root: Path, path: Path) -> Path:
    """``path`` resolved, if it is a regular file inside ``root``; every read goes through here."""
    real = path.resolve()
    if not real.is_relative_to(root.resolve()):
        raise Refused(f"resolves to {real}, outside the recorder folder {root}")
    if not real.is_file():
        raise Refused("is missing" if not real.exists() else "is not a regular file")
    return real
