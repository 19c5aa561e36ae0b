"""A test script run in a child Python with the stop signals at their defaults, for tests of
what nnstat does when a process is stopped by a signal."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path


def default_signals() -> None:
    """Put SIGINT, SIGHUP and SIGTERM back to their defaults in the child: a test launched under
    ``nohup`` or as a background job inherits them ignored, and nnstat rightly leaves an
    ignored signal so."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def run_script(script: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``python script *args`` with the default stop signals; stdout and stderr captured as
    text."""
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        preexec_fn=default_signals,
        text=True,
        timeout=timeout,
    )
