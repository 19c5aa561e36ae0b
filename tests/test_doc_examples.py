"""Every ```python block in README.md and docs/*.md runs, and uses only the public API.

One case per markdown file: its python blocks run in order in one fresh namespace (like a
notebook), in a temporary working directory, with W&B offline. A block that cannot run here must
not be tagged ``python``: use ``bash`` for shell commands and ``text`` for output.
"""

from __future__ import annotations

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


def test_fence_parser() -> None:
    text = "# t\n\n```python\nx = 1\n```\n\n  ```bash\n  make test\n  ```\n```text\nout\n```\n"
    assert fenced_blocks(text) == [
        ("python", 4, "x = 1"),
        ("bash", 8, "make test"),
        ("text", 11, "out"),
    ]


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
    if page not in NO_EXAMPLE_REQUIRED:
        assert blocks, f"{page} has no ```python block"
    for start, code in blocks:
        assert not private_paths(code), (
            f"{page}: the python block starting at line {start} uses non-public "
            f"{private_paths(code)}; use names exported by nnstat/__init__.py"
        )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # tiny models: one torch thread is fastest and does not fight other jobs for the cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    namespace: dict = {"__name__": "doc_example"}
    try:
        for start, code in blocks:
            # pad so that tracebacks give the line numbers of the markdown file
            source = "\n" * (start - 1) + code
            try:
                exec(compile(source, str(ROOT / page), "exec"), namespace)
            except Exception as exc:
                raise AssertionError(
                    f"{page}: the python block starting at line {start} raised "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
    finally:
        torch.set_num_threads(threads)
