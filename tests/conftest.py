"""Shared fixtures."""

import pytest


@pytest.fixture(params=["training thread", "writer thread"])
def rows_formed_in(request, monkeypatch):
    """Run a logging test with one-position rows formed on either side of the writer queue.

    The store forms outer-product rows in its writer thread only when torch leaves a core idle
    (``nnstat.store.outer.idle_core``); both paths must store the same rows.
    """
    from nnstat.store import outer

    monkeypatch.setattr(outer, "idle_core", lambda: request.param == "writer thread")
    return request.param
