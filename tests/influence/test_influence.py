"""Streaming scores and preconditioners against explicit formulas on a tiny MLP."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _influence_ref import store_layout, store_rows, tiny_problem

from nnstat.influence import (
    InfluenceResult,
    ModuleSpec,
    Preconditioner,
    TensorSource,
    compute_influence_all,
    compute_self_influence,
)


@pytest.fixture(scope="module")
def rows():
    model, (xt, yt), (xq, yq) = tiny_problem()
    return store_rows(model, xt, yt), store_rows(model, xq, yq)


def _blockdiag_inverse(blocks: list[torch.Tensor], damping) -> torch.Tensor:
    inv = [
        torch.linalg.inv(b + lam * torch.eye(len(b), dtype=b.dtype))
        for b, lam in zip(blocks, damping, strict=True)
    ]
    return torch.block_diag(*inv)


def _fisher_blocks(train: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for m in store_layout():
        g = train[:, m.offset : m.stop]
        out.append(g.T @ g / len(g))
    return out


def test_raw_equals_empirical_fisher(rows):
    train, query = rows
    lam = 1e-3
    res = compute_influence_all(
        TensorSource(query.float(), layout=store_layout()),
        TensorSource(train.float(), layout=store_layout()),
        preconditioner="raw",
        damping=lam,
        progress=False,
    )
    inv = _blockdiag_inverse(_fisher_blocks(train), [lam, lam])
    expected = query @ inv @ train.T
    assert isinstance(res, InfluenceResult)
    torch.testing.assert_close(
        res.scores.double(), expected, rtol=2e-3, atol=1e-3 * expected.abs().max().item()
    )
    assert res.test_ids == list(range(len(query))) and res.train_ids == list(range(len(train)))


def test_default_damping_heuristic_is_tenth_of_mean_eigenvalue(rows):
    """0.1 x the mean of the nonzero eigenvalues (numpy rank), for raw's singular covariances."""
    train, query = rows
    res = compute_influence_all(
        TensorSource(query.float(), layout=store_layout()),
        TensorSource(train.float(), layout=store_layout()),
        preconditioner="raw",
        progress=False,
    )
    blocks = _fisher_blocks(train)
    lams = [0.1 * torch.trace(b).item() / np.linalg.matrix_rank(b.numpy()) for b in blocks]
    expected = query @ _blockdiag_inverse(blocks, lams) @ train.T
    torch.testing.assert_close(
        res.scores.double(), expected, rtol=1e-3, atol=1e-4 * expected.abs().max().item()
    )
    assert res.meta["module_damping"]["0"] == pytest.approx(lams[0], rel=1e-5)


def test_damping_change_never_reuses_stale_inverse(rows):
    train, query = rows
    src_t = TensorSource(train.float(), layout=store_layout())
    src_q = TensorSource(query.float(), layout=store_layout())
    blocks = _fisher_blocks(train)
    previous = None
    for lam in (1e-2, 1.0, 1e-2):
        res = compute_influence_all(src_q, src_t, preconditioner="raw", damping=lam, progress=False)
        expected = query @ _blockdiag_inverse(blocks, [lam, lam]) @ train.T
        torch.testing.assert_close(
            res.scores.double(), expected, rtol=1e-3, atol=1e-4 * expected.abs().max().item()
        )
        if previous is not None:
            assert not torch.allclose(res.scores, previous, rtol=1e-2)
        previous = res.scores


def _psd(n: int, gen: torch.Generator) -> torch.Tensor:
    a = torch.randn(n, n + 3, generator=gen, dtype=torch.float64)
    return a @ a.T / (n + 3)


def _kfac_setup(projected: bool):
    gen = torch.Generator().manual_seed(3)
    d_out, d_in = 4, 6
    r_out, r_in = (3, 4) if projected else (d_out, d_in)
    s_full, a_full = _psd(d_out, gen), _psd(d_in, gen)
    p_out = torch.randn(r_out, d_out, generator=gen, dtype=torch.float64)
    p_in = torch.randn(r_in, d_in, generator=gen, dtype=torch.float64)
    stats = {"fc/backward/covariance": s_full.float(), "fc/forward/covariance": a_full.float()}
    projections = {"fc/p_out": p_out.float(), "fc/p_in": p_in.float()} if projected else {}
    train = torch.randn(30, r_out * r_in, generator=gen, dtype=torch.float64)
    query = torch.randn(4, r_out * r_in, generator=gen, dtype=torch.float64)
    layout = [ModuleSpec("fc", 0, r_out, r_in)]
    t = TensorSource(train.float(), layout=layout, statistics=stats, projections=projections)
    q = TensorSource(query.float(), layout=layout)
    s = p_out @ s_full @ p_out.T if projected else s_full
    a = p_in @ a_full @ p_in.T if projected else a_full
    return t, q, train, query, s, a


@pytest.mark.parametrize("projected", [False, True])
def test_kfac_equals_explicit_kronecker_product(projected):
    t, q, train, query, s, a = _kfac_setup(projected)
    lam = 0.05
    h = torch.kron(s, a)  # row-major vec(G) with G [r_out, r_in]
    expected = query @ torch.linalg.inv(h + lam * torch.eye(len(h), dtype=h.dtype)) @ train.T
    res = compute_influence_all(q, t, preconditioner="kfac", damping=lam, progress=False)
    torch.testing.assert_close(
        res.scores.double(), expected, rtol=1e-3, atol=1e-4 * expected.abs().max().item()
    )


@pytest.mark.parametrize("projected", [False, True])
def test_ekfac_equals_explicit_corrected_eigenbasis(projected):
    t, q, train, query, s, a = _kfac_setup(projected)
    lam = 0.05
    _, qs = torch.linalg.eigh(s)
    _, qa = torch.linalg.eigh(a)
    basis = torch.kron(qs, qa)
    fisher = train.T @ train / len(train)
    corrected = torch.diagonal(basis.T @ fisher @ basis)
    h = basis @ torch.diag(corrected) @ basis.T
    expected = query @ torch.linalg.inv(h + lam * torch.eye(len(h), dtype=h.dtype)) @ train.T
    res = compute_influence_all(q, t, preconditioner="ekfac", damping=lam, progress=False)
    torch.testing.assert_close(
        res.scores.double(), expected, rtol=1e-3, atol=1e-4 * expected.abs().max().item()
    )


def test_default_preconditioner_follows_what_the_run_collected():
    t, q, *_ = _kfac_setup(True)
    assert compute_influence_all(q, t, progress=False).meta["preconditioner"] == "ekfac"
    plain = TensorSource(torch.randn(10, 12), layout=[ModuleSpec("fc", 0, 3, 4)])
    res = compute_influence_all(plain, plain, progress=False)
    assert res.meta["preconditioner"] == "raw"


def test_kfac_without_statistics_names_the_missing_key():
    src = TensorSource(torch.randn(10, 12), layout=[ModuleSpec("fc", 0, 3, 4)])
    with pytest.raises(ValueError, match="fc/backward/covariance"):
        compute_influence_all(src, src, preconditioner="kfac", progress=False)


@pytest.mark.parametrize("mode", ["relatif", "cosine", "l2"])
def test_relatif_cosine_and_l2_closed_forms(rows, mode):
    train, query = rows
    lam = 1e-2
    m = _blockdiag_inverse(_fisher_blocks(train), [lam, lam])
    res = compute_influence_all(
        TensorSource(query.float(), layout=store_layout()),
        TensorSource(train.float(), layout=store_layout()),
        preconditioner="raw",
        damping=lam,
        mode=mode,
        progress=False,
    )
    if mode == "relatif":
        tn = torch.sqrt(torch.einsum("ij,jk,ik->i", train, m, train))
        expected = (query @ m @ train.T) / tn[None, :]
        top = compute_influence_all(
            TensorSource(query.float(), layout=store_layout()),
            TensorSource(train.float(), layout=store_layout()),
            preconditioner="raw",
            damping=lam,
            mode=mode,
            top_k=3,
            progress=False,
        )
        ranked = expected.argsort(dim=1, descending=True)[:, :3]
        assert top.helpful_ids == ranked.tolist()  # the top-k path normalises too
    elif mode == "cosine":
        qn = torch.sqrt(torch.einsum("ij,jk,ik->i", query, m, query))
        tn = torch.sqrt(torch.einsum("ij,jk,ik->i", train, m, train))
        expected = (query @ m @ train.T) / qn[:, None] / tn[None, :]
        assert res.scores.abs().max() <= 1 + 1e-4
    else:
        diff = query[:, None, :] - train[None, :, :]
        expected = -torch.einsum("qij,jk,qik->qi", diff, m, diff)
        assert (res.scores <= 1e-3).all()
    torch.testing.assert_close(
        res.scores.double(), expected, rtol=2e-3, atol=1e-3 * expected.abs().max().item()
    )


@pytest.mark.parametrize("kind", ["identity", "raw", "ekfac"])
def test_self_influence_is_diagonal_of_all_pairs(kind):
    t, _, train, *_ = _kfac_setup(True)
    pairs = compute_influence_all(t, t, preconditioner=kind, damping=0.1, progress=False)
    self_inf = compute_self_influence(t, preconditioner=kind, damping=0.1, progress=False)
    torch.testing.assert_close(self_inf.scores, torch.diagonal(pairs.scores), rtol=1e-4, atol=1e-5)
    assert self_inf.ids == t.ids
    if kind == "identity":
        torch.testing.assert_close(
            self_inf.scores.double(), (train**2).sum(1), rtol=1e-4, atol=1e-5
        )


def test_top_k_streaming_equals_argsort_of_full_matrix():
    gen = torch.Generator().manual_seed(1)
    layout = [ModuleSpec("a", 0, 2, 3), ModuleSpec("b", 6, 1, 5, "layernorm", flat_width=5)]
    ids = [f"ex{i}" for i in range(53)]
    train = TensorSource(torch.randn(53, 11, generator=gen), ids=ids, layout=layout, shard_rows=13)
    query = TensorSource(torch.randn(4, 11, generator=gen), ids=["q0", 1, "q2", 3], layout=layout)
    full = compute_influence_all(
        query, train, preconditioner="raw", damping=0.1, batch_size=7, progress=False
    )
    top = compute_influence_all(
        query, train, preconditioner="raw", damping=0.1, top_k=5, batch_size=7, progress=False
    )
    order = torch.argsort(full.scores, dim=1, descending=True)
    assert top.helpful_ids == [[ids[j] for j in row[:5]] for row in order.tolist()]
    assert top.harmful_ids == [[ids[j] for j in reversed(row[-5:])] for row in order.tolist()]
    torch.testing.assert_close(top.helpful_scores, full.scores.gather(1, order[:, :5]))
    assert top.test_ids == ["q0", 1, "q2", 3]
    # the in-memory top_k of the full result agrees too
    assert full.top_k(5).helpful_ids == top.helpful_ids
    frame = top.to_frame()
    assert list(frame.columns) == ["test_id", "kind", "rank", "train_id", "score"]
    assert len(frame) == 4 * 5 * 2


def test_result_frame_is_long_format():
    res = InfluenceResult(torch.arange(6.0).view(2, 3), ["a", "b"], [10, 11, 12])
    frame = res.to_frame()
    assert frame["test_id"].tolist() == ["a"] * 3 + ["b"] * 3
    assert frame["train_id"].tolist() == [10, 11, 12] * 2
    assert frame["score"].tolist() == list(range(6))


def test_bad_inputs_raise_clear_errors():
    layout = [ModuleSpec("fc", 0, 2, 2)]
    src = TensorSource(torch.randn(5, 4), layout=layout)
    with pytest.raises(ValueError, match="valid"):
        compute_influence_all(src, src, mode="angle", progress=False)
    with pytest.raises(ValueError, match="valid"):
        compute_influence_all(src, src, preconditioner="shampoo", progress=False)
    with pytest.raises(ValueError, match="NaN"):
        TensorSource(torch.tensor([[1.0, float("nan"), 0.0, 0.0]]), layout=layout)
    other = TensorSource(torch.randn(5, 6), layout=[ModuleSpec("fc", 0, 2, 3)])
    with pytest.raises(ValueError, match="fc"):
        compute_influence_all(other, src, progress=False)
    with pytest.raises(ValueError, match="damping"):
        compute_influence_all(src, src, preconditioner="raw", damping=-1.0, progress=False)


def test_query_with_other_projection_is_refused():
    layout = [ModuleSpec("fc", 0, 2, 2)]
    meta_t = {
        "modules": [{"name": "fc", "offset": 0, "r_out": 2, "r_in": 2, "width": 4}],
        "projection_sha256": {"fc/p_in": "aaa"},
        "projection_seed": 0,
    }
    meta_q = {**meta_t, "projection_seed": 1, "projection_sha256": {"fc/p_in": "bbb"}}
    t = TensorSource(torch.randn(5, 4), layout=layout, meta=meta_t)
    q = TensorSource(torch.randn(2, 4), layout=layout, meta=meta_q)
    with pytest.raises(ValueError, match="projection_seed: query 1 != train 0"):
        compute_influence_all(q, t, progress=False)


def test_preconditioner_apply_matches_explicit_inverse():
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(40, 6, generator=gen, dtype=torch.float64)
    pre = Preconditioner.fit(TensorSource(rows.float(), layout=[ModuleSpec("m", 0, 2, 3)]), "raw")
    x = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    fisher = rows.T @ rows / 40
    expected = x @ torch.linalg.inv(fisher + 0.3 * torch.eye(6, dtype=torch.float64))
    torch.testing.assert_close(pre.apply(x.float(), 0.3).double(), expected, rtol=1e-4, atol=1e-5)


def test_nonfinite_training_rows_are_named():
    layout = [ModuleSpec("fc", 0, 2, 2)]
    train = TensorSource(torch.randn(6, 4), ids=list("abcdef"), layout=layout)
    train.rows[3, 1] = float("inf")
    train.finite = False  # as a store written with nonfinite="keep" reports
    query = TensorSource(torch.randn(2, 4), layout=layout)
    with pytest.raises(ValueError, match=r"\['d'\]"):
        compute_influence_all(query, train, preconditioner="identity", progress=False)


def test_top_k_chunked_selection_matches_numpy_sort():
    # blocks large enough for the chunked pre-selection (with a tail shorter than a chunk)
    import numpy as np

    from nnstat.influence.topk import TOPK_CHUNK, block_candidates

    gen = torch.Generator().manual_seed(3)
    n, width, k = 1500, 6, 4
    train = torch.randn(n, width, generator=gen)
    query = torch.randn(5, width, generator=gen)
    ids = [f"t{i}" for i in range(n)]
    block = 11 * TOPK_CHUNK + 17
    top = compute_influence_all(
        TensorSource(query),
        TensorSource(train, ids=ids),
        preconditioner="identity",
        top_k=k,
        batch_size=block,
        progress=False,
    )
    ref = query.double().numpy() @ train.double().numpy().T
    order = np.argsort(-ref, axis=1, kind="stable")
    assert top.helpful_ids == [[ids[j] for j in row[:k]] for row in order]
    assert top.harmful_ids == [[ids[j] for j in row[::-1][:k]] for row in order]
    want = np.take_along_axis(ref, order[:, :k], 1)
    np.testing.assert_allclose(top.helpful_scores.numpy(), want, rtol=1e-5, atol=1e-5)
    # the candidates of one block hold each query's exact top-k and bottom-k scores
    s = torch.randn(5, block, generator=gen)
    hv, hr, lv, lr = block_candidates(s, k)
    assert hv.shape[1] < block  # something was pruned
    for q in range(5):
        row = s[q].numpy()
        np.testing.assert_array_equal(np.sort(hv[q].numpy())[-k:], np.sort(row)[-k:])
        np.testing.assert_array_equal(np.sort(lv[q].numpy())[:k], np.sort(row)[:k])
        assert torch.equal(s[q, hr[q]], hv[q]) and torch.equal(s[q, lr[q]], lv[q])


@pytest.mark.parametrize("mode", ["cosine", "l2"])
def test_top_k_chunked_modes_match_full_matrix(mode):
    from nnstat.influence.topk import TOPK_CHUNK

    gen = torch.Generator().manual_seed(4)
    train = TensorSource(torch.randn(900, 5, generator=gen))
    query = TensorSource(torch.randn(3, 5, generator=gen))
    kw = dict(mode=mode, preconditioner="raw", damping=0.1, progress=False)
    full = compute_influence_all(query, train, **kw)
    top = compute_influence_all(query, train, top_k=3, batch_size=8 * TOPK_CHUNK, **kw)
    want = torch.topk(full.scores, 3, dim=1)
    torch.testing.assert_close(top.helpful_scores, want.values, rtol=1e-5, atol=1e-5)
    assert top.helpful_ids == want.indices.tolist()
    low = torch.topk(full.scores, 3, dim=1, largest=False)
    assert top.harmful_ids == low.indices.tolist()


def test_tensor_source_refuses_duplicate_ids_naming_them():
    rows = torch.randn(6, 4)
    with pytest.raises(
        ValueError, match=r"duplicate ids in TensorSource: \['b', 'c'\].*unique"
    ) as e:
        TensorSource(rows, ids=["a", "b", "b", "c", "c", "c"])
    assert "3 repeats" in str(e.value) and "positions" in str(e.value)
    assert TensorSource(rows, ids=list("abcdef")).ids == list("abcdef")  # unique ids still pass
