"""Diagonal K-FAC factors (an embedding's one-hot inputs) against dense references.

The forward factor of an embedding is ``diag(token counts) / #positions``; nnstat keeps it as a
``[vocab]`` vector. These tests check the vector equals the dense one-hot Gram (numpy), that
every reader gives what the dense factor gives (K-FAC precondition, influence K-FAC, PCA
projection, spectral summary), that the EK-FAC correction is exact in the identity basis
(torch.func per-sample gradients), and that the vector survives statistics.safetensors with the
store's integrity hash. A GPT-2-sized vocabulary is collected without a ``vocab²`` matrix.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.capture import CaptureEngine
from nnstat.curvature import KFAC, StatisticsCollector, spectrum_stats
from nnstat.influence import ModuleSpec, TensorSource, compute_influence_all
from nnstat.influence.precondition import kfac_factor
from nnstat.store.integrity import tensors_hash
from nnstat.store.projection import _top_eigvecs

VOCAB, DIM, PAD, OUT = 11, 3, 4, 2


def _problem(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Embedding(VOCAB, DIM, padding_idx=PAD), nn.Linear(DIM, OUT))
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for n in (5, 3):
        x = torch.randint(0, VOCAB, (n, 6), generator=gen)
        x[:, -1] = PAD  # padded positions: no gradient for the padding row
        x[0, 0] = 0  # index 0 is an ordinary token
        batches.append((x, torch.randint(0, OUT, (n, 6), generator=gen)))
    return model, batches


def _loss(out, y):
    return F.cross_entropy(out.reshape(-1, OUT), y.reshape(-1), reduction="sum")


def _collect(model, batches, preset: str) -> dict[str, torch.Tensor]:
    engine = CaptureEngine()
    engine.watch(model, name_filter="0")
    col = StatisticsCollector(preset)
    engine.add_consumer(col)
    for _ in col.passes:
        for x, y in batches:
            with engine.batch():
                _loss(model(x), y).backward()
            model.zero_grad()
        col.finalize()
    engine.unwatch()
    return col.state_dict()


def _per_sample_grads(model, batches) -> torch.Tensor:
    """[N, D, V] per-sample gradients of the embedding weight (torch.func, float64)."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    out = []
    for x, y in batches:
        g = vmap(
            grad(lambda p, xi, yi: _loss(functional_call(model, p, (xi[None],)), yi[None])),
            in_dims=(None, 0, 0),
        )(params, x, y)
        out.append(g["0.weight"].transpose(1, 2).double())
    return torch.cat(out)


def _dense_forward(batches) -> np.ndarray:
    """The dense one-hot Gram over all positions (padded rows zero), by numpy."""
    total, positions = np.zeros((VOCAB, VOCAB)), 0
    for x, _ in batches:
        ids = x.numpy().reshape(-1)
        onehot = np.eye(VOCAB)[ids] * (ids != PAD)[:, None]
        total += onehot.T @ onehot
        positions += ids.size
    return total / positions


def test_forward_factor_is_the_diagonal_of_the_dense_one_hot_gram():
    model, batches = _problem()
    st = _collect(model, batches, "kfac")
    a = st["0/forward/covariance"]
    assert a.shape == (VOCAB,)
    dense = _dense_forward(batches)
    assert dense[PAD, PAD] == 0 and dense[0, 0] > 0
    np.testing.assert_allclose(np.diag(a.double().numpy()), dense, rtol=1e-6, atol=1e-9)


def test_ekfac_correction_is_exact_in_the_identity_basis():
    model, batches = _problem(1)
    st = _collect(model, batches, "ekfac")
    assert "0/forward/eigenvectors" not in st  # the identity is never materialised
    torch.testing.assert_close(st["0/forward/eigenvalues"], st["0/forward/covariance"])
    qs = st["0/backward/eigenvectors"].double()
    g = _per_sample_grads(model, batches)
    want = ((qs.T @ g) ** 2).mean(0)  # (1/N) Σ_i (Q_Sᵀ G_i I)²
    got = st["0/ekfac/eigenvalues"].double()
    assert got.shape == (DIM, VOCAB)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8)
    # exact: the corrected eigenvalues are the diagonal of the gradient covariance in that basis
    fisher = torch.einsum("nij,nkl->ijkl", g, g) / len(g)
    rotated = torch.einsum("ai,ijkl,kb->ajbl", qs.T, fisher, qs)
    diag = torch.einsum("ajaj->aj", rotated)
    torch.testing.assert_close(got, diag, rtol=1e-5, atol=1e-8)


def test_kfac_precondition_diagonal_equals_dense():
    model, batches = _problem(2)
    st = _collect(model, batches, "kfac")
    a, s = st["0/forward/covariance"], st["0/backward/covariance"]
    g = torch.randn(4, DIM, VOCAB, generator=torch.Generator().manual_seed(0))
    for damping in (1e-3, 0.1):
        diag = KFAC.precondition(g, a, s, damping)
        dense = KFAC.precondition(g, torch.diag(a), s, damping)
        torch.testing.assert_close(diag, dense, rtol=1e-6, atol=1e-6 * dense.abs().max().item())


@pytest.mark.parametrize("projected", [False, True])
@pytest.mark.parametrize("kind", ["kfac", "ekfac"])
def test_influence_with_a_diagonal_factor_equals_the_dense_factor(kind, projected):
    model, batches = _problem(3)
    st = _collect(model, batches, "ekfac")
    g = _per_sample_grads(model, batches).float()
    projections, r_in = {}, VOCAB
    if projected:  # a random p_in: the projected factor P diag(a) Pᵀ is dense r x r
        r_in = 5
        p_in = torch.randn(r_in, VOCAB, generator=torch.Generator().manual_seed(1))
        projections = {"0/p_in": p_in}
        g = g @ p_in.T
    layout = [ModuleSpec("0", 0, DIM, r_in, "embedding")]
    rows = g.reshape(len(g), -1)
    dense_stats = {**st, "0/forward/covariance": torch.diag(st["0/forward/covariance"])}
    dense_stats["0/forward/eigenvectors"] = torch.eye(VOCAB)
    res = {}
    for label, stats in (("diag", st), ("dense", dense_stats)):
        train = TensorSource(rows, layout=layout, statistics=stats, projections=projections)
        query = TensorSource(rows[:3] + 0.5, layout=layout)
        res[label] = compute_influence_all(
            query, train, preconditioner=kind, damping=1e-3, progress=False
        ).scores.double()
    ref = res["dense"]
    assert float((res["diag"] - ref).norm() / ref.norm()) < 1e-6
    if not projected:  # both sides unprojected: the factor is the diagonal itself
        f = kfac_factor(layout[0], st, {})
        assert f.q_in is None and f.eig.shape == (DIM, VOCAB)


def test_pca_projection_of_a_diagonal_factor_picks_the_most_frequent_tokens():
    counts = torch.tensor([0.0, 5.0, 1.0, 9.0, 3.0, 7.0])
    p = _top_eigvecs(counts, 3, "emb/forward/covariance")
    dense = _top_eigvecs(torch.diag(counts), 3, "dense")
    torch.testing.assert_close(p, dense.abs())  # eigenvectors of a diagonal: ± unit vectors
    assert p.argmax(1).tolist() == [3, 5, 1]


def test_spectral_summary_of_a_diagonal_equals_the_dense_matrix():
    v = torch.tensor([0.0, 2.0, 0.5, 1.5])
    got, want = spectrum_stats(v), spectrum_stats(torch.diag(v))
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-9)


def test_gpt2_sized_vocabulary_is_saved_as_a_vector_with_its_hash(tmp_path):
    vocab = 50257
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(vocab, 4), nn.Linear(4, 3))
    x = torch.randint(0, vocab, (6, 5), generator=torch.Generator().manual_seed(0))
    run = nnstat.init(project="emb", root_dir=str(tmp_path))
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "ekfac", "rank": 2})
    nnstat.watch(model)
    try:
        for _ in run.schedule():
            with run(data_id=list(range(6))):
                model(x).sum().backward()
            model.zero_grad()
    finally:
        nnstat.unwatch()
    store = nnstat.GradientStore(tmp_path / "emb")
    stats = store.statistics()
    a = stats["0/forward/covariance"]
    assert a.shape == (vocab,) and "0/forward/eigenvectors" not in stats
    counts = np.bincount(x.numpy().reshape(-1), minlength=vocab) / x.numel()
    np.testing.assert_allclose(a.numpy(), counts, rtol=1e-6)
    assert stats["0/ekfac/eigenvalues"].shape == (4, vocab)
    assert store.meta["statistics_sha256"] == tensors_hash(stats)
    # the projected store scores with the K-FAC factors of the diagonal
    res = compute_influence_all(store, store, preconditioner="kfac", progress=False)
    assert res.scores.shape == (6, 6) and torch.isfinite(res.scores).all()


def test_store_statistics_are_read_one_tensor_at_a_time_and_checked(tmp_path):
    from safetensors.torch import save_file

    from nnstat.influence.sources import LazyStatistics, as_source

    model, batches = _problem(4)
    run = nnstat.init(project="lazy", root_dir=str(tmp_path))
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac", "rank": 2})
    nnstat.watch(model)
    try:
        for x, y in batches:
            with run(data_id=[f"{len(x)}-{i}" for i in range(len(x))]):
                _loss(model(x), y).backward()
            model.zero_grad()
        nnstat.finalize()
    finally:
        nnstat.unwatch()
    root = tmp_path / "lazy"
    whole = nnstat.GradientStore(root).statistics()
    lazy = as_source(str(root)).statistics()
    assert isinstance(lazy, LazyStatistics) and sorted(lazy) == sorted(whole)
    for k, v in whole.items():
        assert torch.equal(lazy[k], v)
    # a file that is not the one meta.json hashed: the reader's own error
    changed = {**whole, "0/forward/covariance": whole["0/forward/covariance"] * 2}
    save_file(changed, str(root / "statistics.safetensors"))
    with pytest.raises(ValueError, match="does not belong to this store"):
        as_source(str(root)).statistics()
    # replaced after the check: every read checks the file is still the hashed one
    with pytest.raises(ValueError, match="changed after it was checked"):
        lazy["0/forward/covariance"]
