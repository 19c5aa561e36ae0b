"""Smoke-run every example in its quick mode (``NNSTAT_EXAMPLE_QUICK=1``) and check what it
prints: each example demonstrates something, so its key line must be there."""

from __future__ import annotations

import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# example -> (modules it needs, strings its output must contain)
CASES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "wandb_loop.py": (("wandb", "sklearn"), ("2.weight", "W&B run")),
    "batch_size_noise_scale.py": (("sklearn",), ("| 0 | per_sample |", "| 0 | fit |", "| 16 |")),
    "influence_cnn.py": (("sklearn", "matplotlib"), ("most helpful training digits", "flipped")),
    "hf_trainer.py": (("transformers",), ("helped by training #", "self-influence", "B_simple")),
    "hf_journey.py": (
        ("transformers",),
        ("callback: step 16", "noise_scale: B_simple", "most helpful #", "nnstat view hf_journey"),
    ),
    "lightning_module.py": (("lightning", "sklearn"), ("B_simple", "highest self-influence")),
    "recorder_planted_bug.py": (("sklearn",), ("'tensor': 'normalized'", "fixed trial: clean")),
}


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        NNSTAT_EXAMPLE_QUICK="1",
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        TENSORBOARD_LOGGING_DIR=str(tmp_path / "tb"),
        PYTHONWARNINGS="ignore",
        TMPDIR=str(tmp_path),
    )
    return env


def _missing(modules: tuple[str, ...]) -> list[str]:
    import importlib.util

    return [m for m in modules if importlib.util.find_spec(m) is None]


def test_every_example_is_covered():
    on_disk = {p.name for p in EXAMPLES.glob("*.py")}
    assert on_disk == set(CASES) | {"ddp_noise_scale.py"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_example_runs_quick(name, tmp_path, monkeypatch, capsys):
    # in-process (runpy) so torch, transformers and lightning are imported once for all
    modules, expected = CASES[name]
    missing = _missing(modules)
    if missing:
        pytest.skip(f"{name} needs {missing}")
    for key, value in _env(tmp_path).items():
        if key != "PYTHONWARNINGS":
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    stdout = capsys.readouterr().out
    for text in expected:
        assert text in stdout, f"{text!r} not in the output of {name}:\n{stdout[-2000:]}"
    if name == "hf_journey.py":
        _check_journey(tmp_path / "hf_journey", stdout)
    if name == "influence_cnn.py":
        png = tmp_path / "influence_cnn.png"
        assert png.exists() and png.stat().st_size > 20_000


def _check_journey(out: Path, stdout: str) -> None:
    """What `nnstat view` opens: the training run's metrics (a finite noise scale under the
    Trainer's clipping from the first logged step) and the store with its texts and queries."""
    import math

    from nnstat.viewer.discover import discover
    from nnstat.viewer.examples import load_examples, query_sets
    from nnstat.viewer.runs import load_run

    found = discover(out)
    assert [p.name for p in found.runs] == ["train"] and len(found.stores) == 1
    run = load_run(out, found.runs[0], lambda p, m: None)
    b_simple = run["series"]["noise_scale/b_simple"]
    assert b_simple and all(v is not None and math.isfinite(v) and v > 0 for v in b_simple)
    store = found.stores[0]
    examples = load_examples(store)
    assert examples is not None and all(isinstance(t, str) and t for t in examples.texts)
    assert any("\n" in t for t in examples.texts)  # source text, lines kept
    (queries,) = query_sets(store)
    assert len(load_examples(queries).texts) == 3


def test_ddp_example_with_torchrun(tmp_path):
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which(
        "torchrun"
    )
    assert torchrun, "torchrun (from torch) is not on PATH"
    out = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", str(EXAMPLES / "ddp_noise_scale.py")],
        cwd=tmp_path,
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "B_simple" in out.stdout and "all 256 ids: True" in out.stdout, out.stdout
