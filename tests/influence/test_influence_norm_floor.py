"""relatif and cosine on well-fitted examples: a training row of ~1e-29 (its float32 ``gᵀ M g``
underflows) is scored as numpy float64 scores it, a cosine stays in [-1, 1], and a numerically
zero row scores 0 rather than first by a division."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _influence_ref import store_layout, store_rows, tiny_problem

from nnstat.influence import TensorSource, compute_influence_all

LAM = 1e-2
TINY_ROW, ZERO_ROW = 3, 5


@pytest.fixture(scope="module")
def rows():
    model, (xt, yt), (xq, yq) = tiny_problem()
    train, query = store_rows(model, xt, yt), store_rows(model, xq, yq)
    train[TINY_ROW] *= 1e-29  # fitted with a large margin
    train[ZERO_ROW] = 0.0
    return train, query


def _reference(train: torch.Tensor, query: torch.Tensor, mode: str) -> np.ndarray:
    """The scores in float64 numpy, M the damped inverse of the block-diagonal empirical Fisher."""
    t, q = train.double().numpy(), query.double().numpy()
    blocks = []
    for m in store_layout():
        g = t[:, m.offset : m.stop]
        blocks.append(np.linalg.inv(g.T @ g / len(g) + LAM * np.eye(g.shape[1])))
    m = np.zeros((t.shape[1], t.shape[1]))
    for spec, b in zip(store_layout(), blocks, strict=True):
        m[spec.offset : spec.stop, spec.offset : spec.stop] = b
    dot = q @ m @ t.T
    tn = np.sqrt(np.einsum("ij,jk,ik->i", t, m, t))
    with np.errstate(divide="ignore", invalid="ignore"):
        out = dot / tn[None, :]
        if mode == "cosine":
            out /= np.sqrt(np.einsum("ij,jk,ik->i", q, m, q))[:, None]
    out[:, tn == 0] = 0.0  # the floor: a zero row scores 0
    return out


def _scores(train, query, mode, **kw):
    return compute_influence_all(
        TensorSource(query.float(), layout=store_layout()),
        TensorSource(train.float(), layout=store_layout()),
        preconditioner="raw",
        damping=LAM,
        mode=mode,
        progress=False,
        **kw,
    )


@pytest.mark.parametrize("mode", ["relatif", "cosine"])
def test_a_well_fitted_row_is_scored_as_float64_scores_it(rows, mode):
    train, query = rows
    expected = _reference(train, query, mode)
    got = _scores(train, query, mode).scores.double().numpy()
    assert np.isfinite(got).all()
    # before: ~1e9 in the well-fitted row's column, for every query
    np.testing.assert_allclose(got, expected, rtol=2e-3, atol=1e-3 * np.abs(expected).max())
    assert (got[:, ZERO_ROW] == 0).all()
    if mode == "cosine":
        assert np.abs(got).max() <= 1.0


@pytest.mark.parametrize("mode", ["relatif", "cosine"])
def test_top_k_ranks_a_well_fitted_row_by_its_direction(rows, mode):
    train, query = rows
    expected = _reference(train, query, mode)
    top = _scores(train, query, mode, top_k=3)
    # ties aside, the float64 ranking (before: the tiny row was first for every query)
    assert top.helpful_ids == np.argsort(-expected, axis=1, kind="stable")[:, :3].tolist()
    assert not all(ids[0] == TINY_ROW for ids in top.helpful_ids)
    assert all(ZERO_ROW not in ids for ids in top.helpful_ids)


def test_a_zero_query_has_cosine_zero(rows):
    train, query = rows
    query = query.clone()
    query[0] = 0.0
    got = _scores(train, query, "cosine").scores
    assert (got[0] == 0).all() and torch.isfinite(got).all()
