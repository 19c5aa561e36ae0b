"""Command-line usage errors: exit status 2, argparse's usage line and one line saying what is
wrong, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nnstat.cli import main
from nnstat.recorder import Recorder

INFLUENCE_USAGE = "usage: nnstat influence "
VIEW_USAGE = "usage: nnstat view "


def run(argv: list[str], capsys) -> tuple[int, list[str]]:
    """Exit status and stderr lines of the `nnstat` console script's entry point."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's own errors exit; the rest are returned
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


def assert_usage_error(code: int, err: list[str], usage: str, message: str) -> None:
    assert code == 2, err
    assert err[0].startswith(usage), err
    assert err[-1] == message, err
    assert not any("Traceback" in line for line in err), err


@pytest.fixture
def recorder_root(tmp_path) -> Path:
    rec = Recorder(tmp_path, group="g", trial="t", every=1)
    rec.start_batch(0)
    w = torch.ones(2, requires_grad=True)
    rec.register_tensor("w", w, role="parameter")
    rec.register_tensor("loss", w.sum(), role="loss").backward()
    rec.finish_batch()
    return tmp_path / "g"


@pytest.fixture
def fake_store(tmp_path) -> Path:
    # enough to pass the "is this a gradient store" check, which comes before any reading
    path = tmp_path / "store"
    path.mkdir()
    (path / "meta.json").write_text("{}")
    return path


@pytest.mark.parametrize(
    "port, shown", [("99999", "'99999'"), ("65536", "'65536'"), ("-1", "'-1'"), ("abc", "'abc'")]
)
def test_view_rejects_a_port_outside_0_65535(recorder_root, capsys, port, shown) -> None:
    code, err = run(["view", str(recorder_root), "--port", port], capsys)
    assert_usage_error(
        code,
        err,
        VIEW_USAGE,
        f"nnstat view: error: argument --port: must be a port number 0-65535 (0: any free), "
        f"got {shown}",
    )


def test_view_missing_folder_and_unwritable_export(recorder_root, tmp_path, capsys) -> None:
    missing = tmp_path / "missing"
    code, err = run(["view", str(missing)], capsys)
    assert_usage_error(
        code, err, VIEW_USAGE, f"nnstat view: error: folder {missing} does not exist"
    )
    out = tmp_path / "no-such-dir" / "report.html"
    code, err = run(["view", str(recorder_root), "--export", str(out)], capsys)
    assert_usage_error(
        code,
        err,
        VIEW_USAGE,
        f"nnstat view: error: argument --export: cannot write {out}: "
        f"[Errno 2] No such file or directory: '{out}'",
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--damping", "-1"], "argument --damping: must be a finite number >= 0, got '-1'"),
        (["--damping", "nan"], "argument --damping: must be a finite number >= 0, got 'nan'"),
        (["--damping", "x"], "argument --damping: must be a finite number >= 0, got 'x'"),
        (["--top-k", "0"], "argument --top-k: must be an integer >= 1, got '0'"),
        (["--top-k", "2.5"], "argument --top-k: must be an integer >= 1, got '2.5'"),
        (["--batch-size", "-3"], "argument --batch-size: must be an integer >= 1, got '-3'"),
        (
            ["--preconditioner", "shampoo"],
            "argument --preconditioner: invalid choice: 'shampoo' "
            "(choose from 'identity', 'raw', 'kfac', 'ekfac')",
        ),
        (["--out", "scores.xlsx"], "--out must end in .parquet or .csv, got 'scores.xlsx'"),
        (["--out", "/no/such/dir/s.csv"], "--out: directory /no/such/dir does not exist"),
        ([], "--query is required (or --self)"),
        (["--self", "--query", "{store}"], "--self takes no --query"),
        (["--self", "--top-k", "3"], "--self takes no --top-k"),
        (["--self", "--mode", "cosine"], "--self takes no --mode"),
    ],
)
def test_influence_argument_errors(fake_store, capsys, argv, message) -> None:
    argv = [a.replace("{store}", str(fake_store)) for a in argv]
    code, err = run(["influence", str(fake_store), *argv], capsys)
    assert_usage_error(code, err, INFLUENCE_USAGE, f"nnstat influence: error: {message}")


def test_influence_store_paths_are_checked_before_any_work(fake_store, tmp_path, capsys) -> None:
    missing, plain = tmp_path / "missing", tmp_path / "plain"
    plain.mkdir()
    cases = [
        ([str(missing), "--self"], f"STORE: no gradient store at {missing}"),
        ([str(plain), "--self"], f"STORE: {plain} is not a gradient store (no meta.json)"),
        ([str(fake_store), "--query", str(missing)], f"--query: no gradient store at {missing}"),
    ]
    for argv, message in cases:
        code, err = run(["influence", *argv], capsys)
        assert_usage_error(code, err, INFLUENCE_USAGE, f"nnstat influence: error: {message}")


def test_a_folder_holding_stores_names_them(fake_store, tmp_path, capsys) -> None:
    """`nnstat influence nnstat_logs --self` (the root_dir, not the project): the error lists
    the stores below it."""
    root = fake_store.parent
    code, err = run(["influence", str(root), "--self"], capsys)
    message = f"STORE: {root} is not a gradient store (no meta.json); stores in it: {fake_store}"
    assert_usage_error(code, err, INFLUENCE_USAGE, f"nnstat influence: error: {message}")


def test_top_level_usage_errors(capsys) -> None:
    code, err = run([], capsys)
    assert code == 2 and err[0] == "usage: nnstat <command> [options]"
    assert err[-1] == "nnstat: error: a command is required"
    code, err = run(["serve"], capsys)
    assert code == 2 and err[0] == "usage: nnstat <command> [options]"
    assert err[-1] == "nnstat: error: unknown command 'serve' (choose from demo, influence, view)"
    assert run(["--help"], capsys)[0] == 0


def test_console_script_exits_2_without_traceback(tmp_path) -> None:
    # the process as a user runs it: exit status and stderr, nothing from Python's excepthook
    cmd = [sys.executable, "-m", "nnstat.cli", "view", str(tmp_path), "--port", "99999"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [
        "usage: nnstat view [-h] [--port PORT] [--export HTML] root",
        "nnstat view: error: argument --port: must be a port number 0-65535 (0: any free), "
        "got '99999'",
    ]
