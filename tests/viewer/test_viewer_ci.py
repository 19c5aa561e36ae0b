"""Under CI=true a missing browser fails the viewer tests; elsewhere they skip with a reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ci, outcome", [("true", "1 error"), ("", "1 skipped")])
def test_missing_browser_is_an_error_only_in_ci(ci: str, outcome: str, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["NNSTAT_TEST_CHROMIUM"] = str(tmp_path / "no-such-chromium")
    if ci:
        env["CI"] = ci
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
    cmd += ["tests/viewer/test_viewer.py", "-k", "served_page_graph", "-p", "no:randomly"]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert outcome in res.stdout, res.stdout + res.stderr
    assert "need Debian chromium" in res.stdout
    assert (res.returncode != 0) == bool(ci)
