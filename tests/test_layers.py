"""The package's import structure: concepts in layers, imports pointing down, no circles.

Walks every ``import`` statement of ``nnstat`` and ``nnstat.integrations`` with `ast` (those
inside functions and ``if TYPE_CHECKING:`` blocks too: a lazy import is still a dependency) and
checks the rules ``docs/architecture.md`` states. The layer table below is the one that page
shows; change both together.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "nnstat"
INTEGRATIONS = ROOT / "integrations"

#: Top to bottom. A unit may import from units in lower layers and from itself, nothing else.
LAYERS: list[set[str]] = [
    {"cli"},
    # with the demo: the deprecated aliases of renamed packages (``nnstat.statistics``,
    # ``nnstat.gns``), which resolve the new package by name at import; nothing imports them
    {"demo", "statistics", "gns"},
    {"integrations"},
    {"viewer", "plot"},
    {"run", "influence", "tracker", "gradient_noise", "recorder"},
    {"netdict", "curvature", "store"},
    {"capture", "describe", "background"},
    {"distributed"},
]
#: The files the package root may hold; everything else lives in a subpackage.
ROOT_FILES = {"__init__.py", "cli.py", "distributed.py"}
#: Units that may use the lazy facade ``import nnstat`` / ``nnstat.X`` like a user would.
FACADE_USERS = {"cli", "demo", "integrations"}


def _files() -> dict[str, Path]:
    """Dotted module name -> file, for nnstat and nnstat.integrations (installed under nnstat)."""
    out = {}
    for base, prefix in ((PACKAGE, "nnstat"), (INTEGRATIONS, "nnstat.integrations")):
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = path
    return out


FILES = _files()


def _unit(module: str) -> str:
    """The concept a module belongs to: its subpackage, or the root file's name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    is_pkg = FILES[importer].name == "__init__.py"
    base = importer.split(".") if is_pkg else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every nnstat import in `module`."""
    tree = ast.parse(FILES[module].read_text(), filename=str(FILES[module]))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.startswith("nnstat")]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if target == "nnstat" or target.startswith("nnstat."):
                found.append((target, [a.name for a in node.names], node.lineno))
    return found


def edges() -> dict[str, set[str]]:
    """File-level import graph: ``from pkg import sub`` is an edge to the file ``pkg.sub``."""
    graph: dict[str, set[str]] = {m: set() for m in FILES}
    for module in FILES:
        for target, names, _ in imports_of(module):
            subs = [f"{target}.{n}" for n in names if f"{target}.{n}" in FILES]
            if subs:
                graph[module].update(subs)
            if len(subs) < len(names) or not names:
                # names that are not submodules come from the target's own file (or __init__)
                if target in FILES:
                    graph[module].add(target)
    for module in graph:
        graph[module].discard(module)
    return graph


def _layer(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"unit {unit!r} is in no layer: add it to LAYERS and docs/architecture.md")


def test_package_root_holds_only_the_face():
    assert {p.name for p in PACKAGE.glob("*.py")} == ROOT_FILES
    for sub in PACKAGE.iterdir():
        if sub.is_dir() and sub.name != "__pycache__" and any(sub.glob("*.py")):
            assert (sub / "__init__.py").exists(), f"{sub} is a package without __init__.py"


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in FILES} - {"__init__"}
    for unit in units:
        _layer(unit)


def architecture_layers(text: str) -> dict[str, int]:
    """``{unit: layer number}`` from the table under "## Packages and layers" of
    docs/architecture.md (rows ``| 3 | `run/` | ... |``; a unit cell may name several
    packages ``x/`` and root files ``x.py``)."""
    section = text.split("## Packages and layers", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`(\w+)(?:/|\.py)`", cells[1]):  # `run/`, `cli.py`
            out[name] = int(cells[0])
    return out


def test_architecture_page_shows_the_layer_table():
    """docs/architecture.md numbers the layers bottom-up (0 = lowest) with the units of LAYERS."""
    shown = architecture_layers((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    expected = {unit: len(LAYERS) - 1 - i for i, layer in enumerate(LAYERS) for unit in layer}
    assert shown == expected, (
        "docs/architecture.md's layer table differs from LAYERS: "
        f"missing {sorted(expected.keys() - shown.keys())}, "
        f"extra {sorted(shown.keys() - expected.keys())}, "
        f"other layer {sorted(u for u in expected.keys() & shown.keys() if shown[u] != expected[u])}"
    )


def test_architecture_table_parser():
    text = (
        "## Packages and layers\n| layer | unit | what |\n| --- | --- | --- |\n"
        "| 2 | `cli.py` | x |\n| 1 | `statistics/`, `gns/` | y |\n"
        "| 0 | `integrations/` (installed as `nnstat.integrations`) | z |\n## Next\n| 9 | `a/` | |\n"
    )
    assert architecture_layers(text) == {"cli": 2, "statistics": 1, "gns": 1, "integrations": 0}


def package_map(text: str) -> set[str]:
    """Module paths (``capture/kinds/linear.py``, ``integrations/jsonl.py``) listed in the
    package map: the first ``text`` block of the page's "Packages and layers" section."""
    section = text.split("## Packages and layers", 1)[1]
    block = section.split("```text", 1)[1].split("```", 1)[0]
    out, unit = set(), ""
    for line in block.splitlines():
        head = re.match(r"^(\s*)(\w+/)\s", line + " ")
        if head:  # a unit's first line: `  capture/    build.py ...`, `nnstat/  cli.py ...`
            unit = "" if head.group(2) == "nnstat/" else head.group(2)
        out |= {unit + f for f in re.findall(r"[\w/]+\.py", line)}
    return out


def test_architecture_page_lists_every_module():
    """The package map names every module of nnstat and nnstat.integrations, and nothing else."""
    shown = package_map((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    files = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    files |= {
        "integrations/" + str(p.relative_to(INTEGRATIONS)) for p in INTEGRATIONS.rglob("*.py")
    }
    # a subpackage's __init__.py is its public face, not listed (the root's is)
    files = {f for f in files if not f.endswith("/__init__.py")}
    shown = {f for f in shown if not f.endswith("/__init__.py")}
    assert shown == files, (
        f"docs/architecture.md's package map: missing {sorted(files - shown)}, "
        f"extra {sorted(shown - files)}"
    )


def test_imports_point_down():
    wrong = []
    for module in FILES:
        unit = _unit(module)
        if unit == "__init__":
            # the facade resolves names lazily from strings; it imports nothing of nnstat itself
            assert not imports_of(module), "nnstat/__init__.py must stay lazy"
            continue
        for target, names, line in imports_of(module):
            where = f"{FILES[module].relative_to(ROOT)}:{line}"
            if target == "nnstat":
                if unit in FACADE_USERS or names == ["__version__"]:
                    continue
                wrong.append(f"{where} uses the facade `nnstat` (import from the subpackage)")
                continue
            other = _unit(target)
            if other != unit and _layer(other) <= _layer(unit):
                wrong.append(f"{where} ({unit}) imports {target} ({other}): not a lower layer")
    assert not wrong, "\n".join(wrong)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one file (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_between_files():
    assert _cycles(edges()) == []


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, [["a", "b", "c"]]),
    ],
)
def test_cycle_finder(graph, expected):
    assert _cycles(graph) == expected


def test_checker_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    """The walker finds imports inside functions and TYPE_CHECKING blocks, and resolves
    ``from pkg import submodule`` to the submodule's file (a checker that missed them would
    pass on the circles this test exists for)."""
    files = dict(FILES)
    (tmp_path / "a.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from nnstat.store.reader import GradientStore\n"
        "def f():\n    from nnstat.tracker import tracker\n    from . import b\n"
    )
    (tmp_path / "b.py").write_text("")
    files["nnstat.describe.fake_a"] = tmp_path / "a.py"
    files["nnstat.describe.b"] = tmp_path / "b.py"
    monkeypatch.setitem(globals(), "FILES", files)
    found = {(t, tuple(n)) for t, n, _ in imports_of("nnstat.describe.fake_a")}
    assert ("nnstat.store.reader", ("GradientStore",)) in found
    assert ("nnstat.tracker", ("tracker",)) in found
    assert ("nnstat.describe", ("b",)) in found
    graph = edges()
    assert {"nnstat.store.reader", "nnstat.tracker.tracker", "nnstat.describe.b"} <= graph[
        "nnstat.describe.fake_a"
    ]


#: Old package name -> new one; the old name is a shim that warns once and forwards.
RENAMED = {"nnstat.statistics": "nnstat.curvature", "nnstat.gns": "nnstat.gradient_noise"}


@pytest.mark.parametrize("old, new", sorted(RENAMED.items()))
def test_renamed_packages_forward_with_one_deprecation_warning(old, new):
    """What users wrote before a rename keeps working: the same objects, one warning that
    names the new package and points at the user's import line (not importlib's)."""
    import subprocess
    import sys

    code = (
        "import warnings, importlib, json\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        f"    import {old} as old\n"
        f"    import {old}\n"
        f"    new = importlib.import_module('{new}')\n"
        "    same = all(getattr(old, n) is getattr(new, n) for n in new.__all__)\n"
        "print(json.dumps([same, len(new.__all__), [(str(x.category.__name__), str(x.message),"
        " x.filename) for x in w]]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    import json

    same, n_names, warned = json.loads(out.stdout.strip().splitlines()[-1])
    assert same and n_names > 3
    assert len(warned) == 1, warned
    category, message, filename = warned[0]
    assert category == "DeprecationWarning" and new in message and old in message
    assert filename == "<string>"  # the importing line, not the import machinery


#: A module longer than this holds several jobs; split it, or say at its top why it may not be.
MAX_LINES = 600
#: within this many lines of MAX_LINES a module says why too (a file cut to fit is not split)
NEAR_LIMIT = 30
SIZE_REASON = "# size:"  # e.g. "# size: one state machine; splitting it would scatter ..."


def oversized(files: dict[str, Path], limit: int = MAX_LINES) -> list[str]:
    """Modules over ``limit`` lines whose first 15 lines have no ``# size:`` comment saying why."""
    out = []
    for _module, path in sorted(files.items()):
        lines = path.read_text().splitlines()
        if len(lines) > limit and not any(line.startswith(SIZE_REASON) for line in lines[:15]):
            out.append(
                f"{path.name if not path.is_relative_to(ROOT) else path.relative_to(ROOT)}: {len(lines)} lines"
            )
    return out


def test_no_module_over_the_size_limit_without_a_reason():
    assert oversized(FILES) == []


def test_no_module_near_the_size_limit_without_a_reason():
    assert oversized(FILES, MAX_LINES - NEAR_LIMIT) == []


def test_size_check_sees_long_files(tmp_path):
    long = tmp_path / "long.py"
    long.write_text('"""Doc."""\n' + "x = 1\n" * MAX_LINES)
    reasoned = tmp_path / "reasoned.py"
    reasoned.write_text('"""Doc."""\n# size: one table of constants\n' + "x = 1\n" * MAX_LINES)
    short = tmp_path / "short.py"
    short.write_text("x = 1\n")
    found = oversized({"a": long, "b": reasoned, "c": short})
    assert len(found) == 1 and "long.py" in found[0] and str(MAX_LINES + 1) in found[0]
    near = tmp_path / "near.py"
    near.write_text('"""Doc."""\n' + "x = 1\n" * (MAX_LINES - NEAR_LIMIT))
    assert oversized({"d": near}) == []
    assert oversized({"d": near}, MAX_LINES - NEAR_LIMIT) == [
        f"near.py: {MAX_LINES - NEAR_LIMIT + 1} lines"
    ]
