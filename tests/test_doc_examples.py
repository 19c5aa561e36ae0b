"""Every ```python block in README.md and docs/*.md runs, uses only the public API, and prints
what the page shows.

One case per markdown file: its python blocks run in order in one fresh namespace (like a
notebook), in a temporary working directory, with W&B offline. A block that cannot run here must
not be tagged ``python``: use ``bash`` for shell commands and ``text`` for output. A ```text
block that directly follows a python block (nothing but blank lines between) is that block's
printed output and is compared with it, doctest-style: whitespace is normalised and ``...``
stands for any text, which is how a page marks numbers that vary by machine (timings, sizes).
"""

from __future__ import annotations

import ast
import contextlib
import doctest
import importlib.util
import io
import re
import textwrap
from pathlib import Path

import pytest
import torch

import nnstat

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(\s*)```\s*([\w+-]*)")
# pages that need not open with an example (cost arithmetic, no API to show)
NO_EXAMPLE_REQUIRED = {"docs/scaling.md"}
PAGES = ["README.md"] + [
    p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md"))
]
PUBLIC_INTEGRATIONS = {"wandb", "tensorboard", "huggingface", "lightning"}
NNSTAT_PATH = re.compile(r"\bnnstat((?:\.\w+)+)")


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """``(language, line of the first code line, code)`` of every fenced block, in order."""
    blocks, lang, start, indent, lines = [], None, 0, "", []
    for number, line in enumerate(text.splitlines(), start=1):
        match = FENCE.match(line)
        if lang is None:
            if match:
                lang, start, indent, lines = match.group(2), number + 1, match.group(1), []
        elif line.strip() == "```":
            blocks.append((lang, start, textwrap.dedent("\n".join(lines))))
            lang = None
        else:
            lines.append(line[len(indent) :] if line.startswith(indent) else line)
    assert lang is None, f"unclosed ``` fence opened before line {start}"
    return blocks


def blocks_with_output(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, shown output or None)`` of every python block: the output is the ```text
    block right after it (only blank lines between)."""
    lines = text.splitlines()
    blocks = fenced_blocks(text)
    out = []
    for i, (lang, start, code) in enumerate(blocks):
        if lang != "python":
            continue
        shown = None
        if i + 1 < len(blocks) and blocks[i + 1][0] == "text":
            end = start + len(code.splitlines())  # the closing fence of this block
            between = lines[end : blocks[i + 1][1] - 2]
            if all(not line.strip() for line in between):
                shown = blocks[i + 1][2]
        out.append((start, code, shown))
    return out


_CHECKER = doctest.OutputChecker()
_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def output_matches(shown: str, printed: str) -> bool:
    """Doctest's comparison: normalised whitespace, ``...`` for any text."""
    return _CHECKER.check_output(shown.strip() + "\n", printed.strip() + "\n", _FLAGS)


def python_blocks(page: str) -> list[tuple[int, str]]:
    blocks = fenced_blocks((ROOT / page).read_text(encoding="utf-8"))
    return [(start, code) for lang, start, code in blocks if lang == "python"]


def private_paths(code: str) -> list[str]:
    """``nnstat.x.y`` paths in ``code`` that are not public API (`nnstat.__all__`)."""
    bad = []
    for match in NNSTAT_PATH.finditer(code):
        parts = match.group(1).lstrip(".").split(".")
        if parts[0] not in nnstat.__all__ or any(p.startswith("_") for p in parts):
            bad.append("nnstat." + ".".join(parts))
        elif parts[0] == "integrations" and len(parts) > 1:
            if parts[1] not in PUBLIC_INTEGRATIONS:
                bad.append("nnstat." + ".".join(parts))
    return bad


def missing_imports(codes: list[str]) -> list[str]:
    """Top-level packages the blocks import that are not installed here (optional ones:
    wandb, scikit-learn, ...), in order of first import."""
    names: list[str] = []
    for code in codes:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.Import):
                names += [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.append(node.module.split(".")[0])
    return [n for n in dict.fromkeys(names) if importlib.util.find_spec(n) is None]


def test_missing_imports() -> None:
    code = (
        "import os, no_such_pkg_a.sub\nfrom no_such_pkg_b import x\nfrom . import y\nimport torch"
    )
    assert missing_imports([code]) == ["no_such_pkg_a", "no_such_pkg_b"]


def test_fence_parser() -> None:
    text = "# t\n\n```python\nx = 1\n```\n\n  ```bash\n  make test\n  ```\n```text\nout\n```\n"
    assert fenced_blocks(text) == [
        ("python", 4, "x = 1"),
        ("bash", 8, "make test"),
        ("text", 11, "out"),
    ]


def test_output_blocks_are_paired_and_compared() -> None:
    text = (
        "```python\nprint(1)\n```\n\n```text\n1\n```\n"
        "```python\nprint(2)\n```\nsome prose\n```text\nnot output\n```\n"
    )
    assert blocks_with_output(text) == [(2, "print(1)", "1"), (9, "print(2)", None)]
    assert output_matches("took ... s\nloss  0.25", "took 3.1 s\nloss 0.25")
    assert not output_matches("raw 0.28", "raw 0.32")


def test_private_paths() -> None:
    code = "import nnstat.stats\nfrom nnstat.integrations import wandb\nnnstat.Tracker"
    assert private_paths(code) == ["nnstat.stats"]
    assert private_paths("from nnstat._gns_math import x; nnstat.influence.exact") == [
        "nnstat._gns_math"
    ]
    assert private_paths("from nnstat.integrations._hooks import x") == [
        "nnstat.integrations._hooks"
    ]


@pytest.mark.parametrize(
    "page", [p for p in PAGES if p != "README.md" and p not in NO_EXAMPLE_REQUIRED]
)
def test_docs_page_opens_with_an_example(page: str) -> None:
    """Title, a sentence, then a runnable example before the first section."""
    text = (ROOT / page).read_text(encoding="utf-8")
    blocks = fenced_blocks(text)
    assert blocks and blocks[0][0] == "python", f"{page}: the first code block is not ```python"
    first_section = next(
        (n for n, line in enumerate(text.splitlines(), 1) if line.startswith("## ")), None
    )
    assert first_section is None or blocks[0][1] < first_section, (
        f"{page}: the first example (line {blocks[0][1]}) comes after the first section "
        f"(line {first_section})"
    )


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocks = python_blocks(page)
    outputs = {
        start: shown
        for start, _, shown in blocks_with_output((ROOT / page).read_text(encoding="utf-8"))
    }
    if page not in NO_EXAMPLE_REQUIRED:
        assert blocks, f"{page} has no ```python block"
    for start, code in blocks:
        assert not private_paths(code), (
            f"{page}: the python block starting at line {start} uses non-public "
            f"{private_paths(code)}; use names exported by nnstat/__init__.py"
        )
    missing = missing_imports([code for _, code in blocks])
    if missing:  # the dev extra installs them all; elsewhere the page cannot run
        pytest.skip(f"{page} imports {missing}, not installed here")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # tiny models: one torch thread is fastest and does not fight other jobs for the cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    namespace: dict = {"__name__": "doc_example"}
    mismatches: list[str] = []
    try:
        for start, code in blocks:
            # pad so that tracebacks give the line numbers of the markdown file
            source = "\n" * (start - 1) + code
            printed = io.StringIO()
            try:
                with contextlib.redirect_stdout(printed):
                    exec(compile(source, str(ROOT / page), "exec"), namespace)
            except Exception as exc:
                raise AssertionError(
                    f"{page}: the python block starting at line {start} raised "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
            shown = outputs[start]
            if shown is not None and not output_matches(shown, printed.getvalue()):
                mismatches.append(
                    f"{page}: the python block at line {start} printed\n"
                    f"{printed.getvalue()}\nbut the page shows\n{shown}\n(mark numbers that "
                    "vary by machine with ...)"
                )
    finally:
        torch.set_num_threads(threads)
    assert not mismatches, "\n\n".join(mismatches)


def test_readme_tracker_block_runs_on_its_own(tmp_path: Path, monkeypatch) -> None:
    """The README's Tracker block is the one users copy alone: it runs in a fresh namespace."""
    monkeypatch.chdir(tmp_path)
    blocks = [
        (line, code)
        for lang, line, code in fenced_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
        if lang == "python" and "nnstat.Tracker(" in code
    ]
    assert len(blocks) == 1, [line for line, _ in blocks]
    line, code = blocks[0]
    source = "\n" * (line - 1) + code
    exec(compile(source, str(ROOT / "README.md"), "exec"), {"__name__": "doc_example"})
    assert any(tmp_path.joinpath("runs", "exp1").iterdir())
