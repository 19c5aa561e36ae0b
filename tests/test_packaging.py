"""Packaging: every sub-package is installed, and `import nnstat` stays light."""

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject():
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "nnstat").rglob("__init__.py")
    }
    on_disk.add("nnstat.integrations")
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"


def test_import_nnstat_does_not_import_optional_dependencies(run_python):
    code = (
        "import sys, nnstat, nnstat.integrations\n"
        "heavy = {'transformers', 'lightning', 'wandb', 'tensorboard', 'matplotlib', 'pytorch_lightning'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    out = run_python("-c", code, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_public_names_resolve():
    import nnstat

    missing = []
    for name in nnstat._EXPORTS:
        try:
            getattr(nnstat, name)
        except (ImportError, AttributeError) as e:
            missing.append(f"{name}: {e}")
    assert not missing, missing
