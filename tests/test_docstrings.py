"""Every docstring example in the package runs and prints what it shows."""

import doctest
import importlib
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
