"""Scoring factored rows without their dense form (`FactoredScores`) and the grouped `densify`,
against a float64 numpy reference that multiplies every module out on its own; the host branch
of scoring reads a factored store's blocks as stored."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _factored_ref import dense_numpy, factored_modules

import nnstat.influence.factored_scores as fs
from nnstat.influence import compute_influence_all
from nnstat.influence.factored_scores import FactoredScores, direct_is_cheaper
from nnstat.store.factored import densify, factor_plan

# two shapes of factored module, one of them in three places (two adjacent, one apart), and
# plain (dense) modules in three runs between them
SPEC = [("f", 2, 3, 4), ("p", 5), ("f", 1, 4, 6), ("f", 2, 3, 4), ("f", 2, 3, 4), ("p", 2),
        ("f", 1, 4, 6), ("p", 3), ("p", 1), ("f", 2, 3, 4)]  # fmt: skip


def test_the_plan_groups_modules_by_shape():
    plan = factor_plan(factored_modules(SPEC))
    assert [(g.c, g.r_out, g.r_in, g.modules) for g in plan.groups] == [(2, 3, 4, 4), (1, 4, 6, 2)]
    assert plan.groups[0].stored_span is None and len(plan.plain) == 3
    assert plan.dense_width == 4 * 12 + 2 * 24 + 5 + 2 + 3 + 1


@pytest.mark.parametrize("spec", [SPEC, [("f", 2, 3, 4)] * 3, [("f", 2, 3, 4), ("p", 5)]])
def test_grouped_densify_is_numpy_per_module(spec):
    mods = factored_modules(spec)
    rows = torch.randn(9, sum(m["width"] for m in mods), generator=torch.Generator().manual_seed(0))
    want = dense_numpy(rows, mods)
    np.testing.assert_allclose(densify(rows, mods).double().numpy(), want, rtol=1e-5, atol=1e-5)
    out = torch.full((9, want.shape[1]), float("nan"))
    assert densify(rows, mods, out) is out
    np.testing.assert_allclose(out.double().numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("route", ["auto", "direct", "densify"])
@pytest.mark.parametrize("n_q", [1, 3, 40])
def test_factored_scores_are_numpy_on_every_route(monkeypatch, route, n_q):
    # tiny chunks: a block is scored in several (the last one short)
    monkeypatch.setattr(fs, "SCRATCH_BYTES", 1)
    if route != "auto":
        monkeypatch.setattr(fs, "direct_is_cheaper", lambda *a: route == "direct")
    mods = factored_modules(SPEC)
    g = torch.Generator().manual_seed(n_q)
    rows = torch.randn(37, sum(m["width"] for m in mods), generator=g)
    dense = dense_numpy(rows, mods)
    q = torch.randn(n_q, dense.shape[1], generator=g)
    want = dense @ q.double().numpy().T  # [rows, queries]
    score = FactoredScores(q, mods)
    routes = [direct for _, direct, _, _ in score._parts]  # per shape: (2, 3, 4), (1, 4, 6)
    if route == "auto":  # c = 2: direct for one query only; c = 1: for fewer queries than r_in
        assert routes == [n_q == 1, n_q < 6]
    else:
        assert routes == [route == "direct"] * 2
    tol = {"rtol": 1e-4, "atol": 1e-4 * np.abs(want).max()}
    np.testing.assert_allclose(score(rows).double().numpy(), want, **tol)
    out = torch.full((37, n_q), float("nan"))
    assert score(rows, out) is out
    np.testing.assert_allclose(out.double().numpy(), want, **tol)
    major = score(rows, query_major=True)
    assert major.is_contiguous() and major.shape == (n_q, 37)
    np.testing.assert_allclose(major.double().numpy(), want.T, **tol)
    out = torch.full((n_q, 37), float("nan"))
    np.testing.assert_allclose(score(rows, out, True).double().numpy(), want.T, **tol)


def test_the_direct_route_is_taken_where_it_costs_fewer_multiply_adds():
    # counted by hand: one query and 8 pairs of 64 x 64 cost 8 (64² + 64) against (8 + 1) 64²
    assert direct_is_cheaper(1, 8, 64, 64) and not direct_is_cheaper(32, 8, 64, 64)
    assert direct_is_cheaper(5, 1, 64, 64) and not direct_is_cheaper(64, 1, 64, 64)
    # with c >= 2 and two queries or more, q c >= q + c: never
    assert not any(direct_is_cheaper(q, c, 64, 64) for q in range(2, 9) for c in range(2, 9))


def test_mismatched_queries_are_refused():
    with pytest.raises(ValueError, match="queries have 5 columns"):
        FactoredScores(torch.zeros(2, 5), factored_modules(SPEC))


def test_the_host_branch_scores_a_factored_store_as_stored(tmp_path, monkeypatch):
    from nnstat.influence.sources import StoreSource
    from nnstat.store import GradientLog, GradientStore, StoreWriter
    from nnstat.store.factored import dense_layout

    mods = factored_modules([("f", 2, 3, 4), ("p", 5), ("f", 2, 3, 4)])
    width = sum(m["width"] for m in mods)
    meta = {"format_version": 1, "row_width": width, "dtype": "float32", "modules": mods}
    (tmp_path / "meta.json").write_text(__import__("json").dumps(meta))
    g = torch.Generator().manual_seed(3)
    rows = torch.randn(50, width, generator=g)
    writer = StoreWriter(tmp_path / "shards", row_width=width, shard_rows=20)
    writer.put(list(range(50)), rows)
    writer.close()
    dense = dense_numpy(rows, mods)
    q = torch.randn(4, dense.shape[1], generator=g)
    log = GradientLog(list(range(4)), q, {**meta, **dense_layout(meta)})
    calls = []
    real = StoreSource.dense
    monkeypatch.setattr(StoreSource, "dense", lambda self, r: calls.append(len(r)) or real(self, r))
    got = compute_influence_all(log, GradientStore(tmp_path), preconditioner="identity",
                                batch_size=8, progress=False)  # fmt: skip
    np.testing.assert_allclose(got.scores.double().numpy(), q.double().numpy() @ dense.T,
                               rtol=1e-4, atol=1e-4)  # fmt: skip
    assert calls == []  # no block was multiplied out
    top = compute_influence_all(log, GradientStore(tmp_path), preconditioner="identity",
                                top_k=3, batch_size=8, progress=False)  # fmt: skip
    want = np.argsort(-(q.double().numpy() @ dense.T), axis=1)[:, :3]
    assert [list(r) for r in top.helpful_ids] == want.tolist() and calls == []
    # a mode with norms under identity takes each training row's norm from its factors
    # (`norm_parts_as_stored`): nothing is multiplied out either
    cos = compute_influence_all(log, GradientStore(tmp_path), preconditioner="identity",
                                mode="cosine", batch_size=8, progress=False)  # fmt: skip
    unit = dense / np.linalg.norm(dense, axis=1, keepdims=True)
    qn = q.double().numpy() / np.linalg.norm(q.double().numpy(), axis=1, keepdims=True)
    np.testing.assert_allclose(cos.scores.double().numpy(), qn @ unit.T, rtol=1e-4, atol=1e-5)
    assert calls == []
