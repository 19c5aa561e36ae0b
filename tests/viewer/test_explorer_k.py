"""The explorer API honours ``k``: exactly ``k`` entries, the top ``k`` by scores computed here.

Reference scores by numpy from the store's rows: an unprojected store without statistics uses
the ``raw`` preconditioner, ``g_qᵀ (F + λI)⁻¹ g_i`` with ``F = GᵀG / n`` (one module) and
``λ = 0.1 x`` the mean nonzero eigenvalue of ``F``; self-influence is its diagonal.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nnstat
from nnstat.store import GradientStore
from nnstat.viewer.explorer import SELF, Explorer


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("explorer")
    torch.manual_seed(0)
    x, y = torch.randn(20, 3), torch.randint(0, 2, (20,))
    model = torch.nn.Linear(3, 2)
    run = nnstat.init(project="p", root_dir=root)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "none"})
    nnstat.watch(model)
    for _ in run.schedule():
        for s in range(0, 20, 5):
            with run(data_id=list(range(s, s + 5))):
                torch.nn.functional.cross_entropy(
                    model(x[s : s + 5]), y[s : s + 5], reduction="sum"
                ).backward()
            model.zero_grad()
    return root, run.path


def _scores(path) -> tuple[np.ndarray, list]:
    store = GradientStore(path)
    g = store.rows(0, len(store)).double().numpy()
    f = g.T @ g / len(g)
    ev = np.linalg.eigvalsh(f)
    lam = 0.1 * ev[ev > 1e-10 * ev.max()].mean()
    return g @ np.linalg.solve(f + lam * np.eye(len(f)), g.T), store.ids


@pytest.mark.parametrize("k", [1, 3])
def test_influence_api_returns_exactly_k_top_entries(store_dir, k):
    root, path = store_dir
    scores, ids = _scores(path)
    ex = Explorer(root)
    store_id = path.relative_to(root).as_posix()
    for q in (0, 7):
        out = ex.influence(store_id, SELF, q, k=k)
        assert out["preconditioner"] == "raw"
        order = np.argsort(-scores[q])
        for side, want in (("helpful", order[:k]), ("harmful", order[::-1][:k])):
            got = out[side]
            assert len(got) == k, side
            assert [e["id"] for e in got] == [ids[j] for j in want], side
            assert [e["score"] for e in got] == pytest.approx(scores[q, want], rel=1e-4)


def test_self_influence_api_returns_exactly_k_top_entries(store_dir):
    root, path = store_dir
    scores, ids = _scores(path)
    diag = np.diag(scores)
    out = Explorer(root).self_influence(path.relative_to(root).as_posix(), k=3)
    order = np.argsort(-diag)
    for side, want in (("highest", order[:3]), ("lowest", order[::-1][:3])):
        assert [e["id"] for e in out[side]] == [ids[j] for j in want], side
        assert [e["score"] for e in out[side]] == pytest.approx(diag[want], rel=1e-4)
