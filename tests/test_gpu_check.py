"""`benchmarks/gpu_check.py` without a GPU: its plan fits its budget, the `cuda` part holds
every CUDA test, and the suite's parallel runner (`benchmarks/_suite_shards.py`) names what
passed, what failed and what a time cap cut off, on a small generated suite."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, monkeypatch):
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpu_check(monkeypatch):
    return _load("gpu_check", monkeypatch)


@pytest.fixture
def shards(monkeypatch):
    return _load("_suite_shards", monkeypatch)


@pytest.mark.parametrize("quick", [False, True])
def test_the_caps_fit_the_default_budget(gpu_check, quick):
    parts = gpu_check.parts(argparse.Namespace(quick=quick))
    names = [p.name for p in parts]
    assert len(set(names)) == len(names) and names[-1] == "suite"
    total = sum(p.cap for p in parts)
    assert total <= gpu_check.BUDGET <= 480, {p.name: p.cap for p in parts}
    assert all(p.cap >= 15 for p in parts)  # run_part skips a part with less


def test_the_attribution_part_scores_64_queries_against_100000_factored_rows(gpu_check):
    (part,) = [
        p for p in gpu_check.parts(argparse.Namespace(quick=False)) if p.name == "attribution"
    ]
    cmd = " ".join(part.argv)
    assert "benchmarks/attribution_scale.py" in cmd
    assert "--queries 64" in cmd and "--score-rows 100000" in cmd


def test_the_cuda_part_holds_every_cuda_test(gpu_check):
    """Every file with a test that runs on the GPU (marked ``cuda``, or choosing its device by
    ``torch.cuda.is_available()``) is in the `cuda` part: none of them runs in the suite's
    parallel processes, where each would start CUDA and compile its kernels again."""
    uses = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("test_*.py")
        if "torch.cuda.is_available()" in p.read_text(encoding="utf-8")
    }
    marked = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "tests").rglob("test_*.py")
        if re.search(r"pytest\.mark\.cuda\b", p.read_text(encoding="utf-8"))
    }
    on_gpu = (uses | marked) - {"tests/test_gpu_check.py"}
    assert marked and on_gpu <= set(gpu_check.CUDA_FILES), on_gpu - set(gpu_check.CUDA_FILES)
    assert all((ROOT / f).is_file() for f in gpu_check.CUDA_FILES)


def test_time_left_by_earlier_parts_goes_to_later_ones(gpu_check):
    Part = gpu_check.Part
    todo = [Part("a", ["x"], 100), Part("b", ["x"], 50), Part("c", ["x"], 60)]
    assert gpu_check.caps(todo, 210, 0) == 100  # no slack yet
    assert gpu_check.caps(todo, 170, 1) == 110  # a took 40: b may use it, c keeps its 60
    assert gpu_check.caps(todo, 100, 2) == 100  # the last part: what is left
    assert gpu_check.caps(todo, 30, 1) == 30  # never more than the budget has left


def test_plan_places_every_file_once_heaviest_groups_first(shards):
    costs = {f"tests/test_{i}.py": c for i, c in enumerate([90, 10, 40, 40, 30, 5, 70, 20])}
    groups = shards.plan(costs, 3)
    placed = [f for g in groups for f in g]
    assert sorted(placed) == sorted(costs) and len(groups) == 3
    totals = [sum(costs[f] for f in g) for g in groups]
    assert totals == sorted(totals, reverse=True)
    # longest-first to the lightest group: within the largest file of the optimum (105)
    assert max(totals) <= 105 + max(costs.values())
    assert shards.plan(costs, 20)[0] == ["tests/test_0.py"]  # fewer files than shards


def test_a_file_that_starts_children_is_expected_to_cost_more(shards, tmp_path):
    plain = tmp_path / "a.py"
    plain.write_text("x = 1\n" * 100)
    child = tmp_path / "b.py"
    child.write_text("x = 1\n" * 100 + "subprocess.run(cmd)\n")
    assert shards.expected_cost(child) >= shards.expected_cost(plain) + shards.CHILD_COST


def _suite(root: Path) -> None:
    tests = root / "tests"
    (tests / "sub").mkdir(parents=True)
    (tests / "test_ok.py").write_text("def test_a():\n    pass\n\ndef test_b():\n    pass\n")
    (tests / "sub" / "test_bad.py").write_text(textwrap.dedent("""
            import pytest

            def test_good():
                pass

            def test_wrong():
                assert 1 == 2

            @pytest.mark.skip(reason="not here")
            def test_skipped():
                pass

            @pytest.mark.parametrize("v", [1, 2], ids=["one a", "two b"])
            def test_spaced_ids(v):
                assert v == 1
            """))
    (tests / "test_broken.py").write_text("import no_such_module_here\n")


def test_the_suite_runner_names_each_outcome(shards, tmp_path):
    _suite(tmp_path)
    files = shards.test_files(tmp_path)
    assert files == ["tests/sub/test_bad.py", "tests/test_broken.py", "tests/test_ok.py"]
    lines: list[str] = []
    pytest_cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    res = shards.run(pytest_cmd, files, 2, 120, tmp_path / "logs", tmp_path, lines.append)
    assert res.counts() == {"passed": 4, "failed": 2, "skipped": 1, "error": 1}
    assert sorted(res.failed) == [
        "tests/sub/test_bad.py::test_spaced_ids[two b]",
        "tests/sub/test_bad.py::test_wrong",
        "tests/test_broken.py",
    ]
    assert not res.unfinished and not res.crashed and not res.ok()
    assert "4 passed, 2 failed, 1 error, 1 skipped" in res.summary()
    assert len(lines) == len(list((tmp_path / "logs").glob("shard-*.log")))


def test_a_suite_cut_at_its_cap_names_failures_so_far_and_the_unfinished_files(shards, tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    hangs = "def test_first():\n    pass\n\ndef test_no():\n    assert False\n\n"
    hangs += "def test_hang():\n    import time\n    time.sleep(600)\n"
    (tests / "test_hangs.py").write_text(hangs + "#" * 9000)  # the heaviest: it starts first
    (tests / "test_waits.py").write_text("def test_c():\n    pass\n")
    files = shards.test_files(tmp_path)
    pytest_cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    res = shards.run(pytest_cmd, files, 1, 5, tmp_path / "logs", tmp_path)
    assert res.failed == ["tests/test_hangs.py::test_no"]
    assert res.outcomes["tests/test_hangs.py::test_first"] == "PASSED"
    assert res.unfinished == ["tests/test_hangs.py", "tests/test_waits.py"] and not res.ok()
    assert res.seconds < 60  # the hanging test was killed, not waited for
    assert "1 passed, 1 failed" in res.summary()
    assert "not finished: tests/test_hangs.py, tests/test_waits.py" in res.summary()
