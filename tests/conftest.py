"""Shared fixtures."""

import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # under pytest-xdist (-n N) every worker is its own process: one torch thread each, so N
    # workers do not fight over the cores (tests are small: one thread is fastest anyway)
    torch.set_num_threads(1)


@pytest.fixture(params=["training thread", "writer thread"])
def rows_formed_in(request, monkeypatch):
    """Run a logging test with one-position rows formed on either side of the writer queue.

    The store forms outer-product rows in its writer thread only when torch leaves a core idle
    (``nnstat.store.outer.idle_core``); both paths must store the same rows.
    """
    from nnstat.store import outer

    monkeypatch.setattr(outer, "idle_core", lambda: request.param == "writer thread")
    return request.param
