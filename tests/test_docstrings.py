"""Every docstring example in the package runs and prints what it shows."""

import doctest
import importlib
import inspect
import pkgutil
import warnings

import pytest

import nnstat
from nnstat import integrations

with warnings.catch_warnings():
    # walking imports every package, the deprecated aliases (nnstat.statistics, nnstat.gns)
    # too; their warning is tested in test_layers.py
    warnings.simplefilter("ignore", DeprecationWarning)
    MODULES = sorted(
        m.name
        for pkg in (nnstat, integrations)
        for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
        if not m.name.rsplit(".", 1)[-1] == "__main__"
    )


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"


#: public API whose docstring carries these sections (what a caller passes, gets and must handle)
SECTIONS = {
    "nnstat.tracker.tracker.Tracker.step": ("Args:", "Returns:", "Raises:"),
    "nnstat.tracker.tracker.Tracker.flush": ("Raises:",),
    "nnstat.tracker.tracker.Tracker.close": ("Raises:",),
    "nnstat.capture.capture.ModuleCapture.indices": ("Raises:",),
    "nnstat.capture.capture.ModuleCapture.per_sample_grad": ("Returns:",),
    "nnstat.capture.capture.ModuleCapture.project": ("Args:", "Returns:", "Raises:"),
    "nnstat.capture.capture.ModuleCapture.row_factors": ("Args:", "Returns:", "Raises:"),
    "nnstat.capture.capture.ModuleCapture.forward_gram": ("Raises:",),
    "nnstat.capture.capture.ModuleCapture.backward_gram": ("Raises:",),
    "nnstat.run.core.Run.setup": ("Raises:",),
    "nnstat.run.core.Run.watch": ("Raises:",),
    "nnstat.run.core.Run.add_projection": ("Raises:",),
    "nnstat.run.core.Run.__call__": ("Raises:",),
    "nnstat.run.core.Run.schedule": ("Raises:",),
    "nnstat.run.core.Run.eval": ("Raises:",),
    "nnstat.run.core.Run.get_log": ("Raises:",),
    "nnstat.run.core.Run.build_log_dataloader": ("Raises:",),
    "nnstat.run.core.Run.finalize": ("Raises:",),
}


def _resolve(path: str):
    module, qualname = path.rsplit(".", 2)[0], path.rsplit(".", 2)[1:]
    obj = importlib.import_module(module)
    for part in qualname:
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    return obj.fget if isinstance(obj, property) else obj


@pytest.mark.parametrize("path", sorted(SECTIONS))
def test_public_api_documents_args_returns_raises(path):
    func = inspect.unwrap(_resolve(path))
    doc = inspect.getdoc(func) or ""
    missing = [s for s in SECTIONS[path] if f"\n{s}\n" not in f"\n{doc}\n"]
    assert not missing, f"{path}: its docstring has no {missing} section"
    if "Args:" in SECTIONS[path]:
        args = doc.split("\nArgs:\n", 1)[1].split("\n\n", 1)[0]
        names = [p for p in inspect.signature(func).parameters if p != "self"]
        undocumented = [n for n in names if f"{n}:" not in args]
        assert not undocumented, f"{path}: Args does not name {undocumented}"
