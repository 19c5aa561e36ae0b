"""The ``raw`` preconditioner's low-rank (Woodbury) path against dense float64 references.

A module wider than the number of training rows keeps its rows and the eigendecomposition of
their Gram matrix; these tests check it gives the dense damped inverse (numpy, and the dense
path of nnstat itself) with the same default damping, and that narrower modules still take the
dense path, a few per pass over the rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nnstat.influence import (
    ModuleSpec,
    Preconditioner,
    TensorSource,
    compute_influence_all,
    compute_self_influence,
)
from nnstat.influence.precondition import (
    DenseFactor,
    LowRankFactor,
    fit_from_rows,
    symmetric_eig,
)

# a Kronecker module (6 x 8 = 48 columns) and a flat one (layernorm-like, 10 columns)
LAYOUT = [ModuleSpec("fc", 0, 6, 8), ModuleSpec("ln", 48, 1, 10, "layernorm", flat_width=10)]
WIDTH = 58


def _rows(n: int, seed: int) -> torch.Tensor:
    """Rows with an uneven spectrum (column scales 0.05..3), so the damping rule matters."""
    gen = np.random.default_rng(seed)
    x = gen.standard_normal((n, WIDTH)) * np.linspace(0.05, 3.0, WIDTH)
    return torch.from_numpy(x.astype(np.float32))


def _numpy_inverse(rows: torch.Tensor, damping: float | None) -> list[np.ndarray]:
    """Per module ``(XᵀX/n + λI)⁻¹`` by a dense numpy solve; ``None``: 0.1 × mean nonzero eig."""
    x = rows.double().numpy()
    out = []
    for m in LAYOUT:
        g = x[:, m.offset : m.stop]
        h = g.T @ g / len(g)
        lam = damping
        if lam is None:
            ev = np.linalg.eigvalsh(h)
            lam = 0.1 * ev[ev > 1e-10 * ev.max()].mean()
        out.append(np.linalg.solve(h + lam * np.eye(len(h)), np.eye(len(h))))
    return out


def _apply_numpy(x: torch.Tensor, inverses: list[np.ndarray]) -> np.ndarray:
    xs = x.double().numpy()
    return np.concatenate(
        [xs[:, m.offset : m.stop] @ inv for m, inv in zip(LAYOUT, inverses, strict=True)], 1
    )


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("n", [5, 30, 200])
@pytest.mark.parametrize("damping", [None, 0.05])
def test_raw_equals_dense_numpy_solve(n, damping):
    rows = _rows(n, seed=n)
    pre = Preconditioner.fit(TensorSource(rows, layout=LAYOUT), "raw")
    # n < width takes the low-rank path, n >= width the dense one
    for m in LAYOUT:
        expected = LowRankFactor if n < m.width else DenseFactor
        assert isinstance(pre.factors[m.name], expected), (n, m.name)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((7, WIDTH)).astype(np.float32))
    got = pre.apply(x, damping)
    assert _rel(got, _apply_numpy(x, _numpy_inverse(rows, damping))) < 1e-6


def test_woodbury_equals_nnstat_dense_path_and_keeps_the_damping_rule():
    rows = _rows(8, seed=3)
    src = TensorSource(rows, layout=LAYOUT)
    low = Preconditioner.fit(src, "raw")
    assert all(isinstance(f, LowRankFactor) for f in low.factors.values())
    # the dense path on the same rows, built explicitly (what the fit did before)
    dense = {}
    for m in LAYOUT:
        g = rows[:, m.offset : m.stop].double()
        dense[m.name] = DenseFactor(*symmetric_eig(g.T @ g / len(g)))
    ref = Preconditioner("raw", LAYOUT, dense)
    # 0.1 x mean of the nonzero eigenvalues: the n eigenvalues of the Gram matrix / n
    lam_low, lam_ref = low.module_dampings(None), ref.module_dampings(None)
    for name in lam_ref:
        assert lam_low[name] == pytest.approx(lam_ref[name], rel=1e-9)
    x = torch.randn(5, WIDTH, generator=torch.Generator().manual_seed(2))
    for damping in (None, 1e-3, 0.7):
        assert _rel(low.apply(x, damping), ref.apply(x, damping)) < 1e-6


def test_rank_deficient_rows_match_the_dense_inverse():
    # duplicated rows: the Gram matrix is singular too, its zeros must not enter the damping
    base = _rows(4, seed=9)
    rows = torch.cat([base, base, base[:2]])
    pre = Preconditioner.fit(TensorSource(rows, layout=LAYOUT), "raw")
    assert isinstance(pre.factors["fc"], LowRankFactor)
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(4))
    assert _rel(pre.apply(x, None), _apply_numpy(x, _numpy_inverse(rows, None))) < 1e-6


def test_zero_damping_on_a_singular_curvature_is_refused():
    pre = Preconditioner.fit(TensorSource(_rows(5, seed=0), layout=LAYOUT), "raw")
    with pytest.raises(ValueError, match="singular"):
        pre.apply(torch.ones(1, WIDTH), 0.0)


def test_low_rank_factor_holds_no_width_squared_matrix():
    n, width = 16, 1024
    rows = torch.randn(n, width, generator=torch.Generator().manual_seed(0))
    pre = Preconditioner.fit(TensorSource(rows, layout=[ModuleSpec("w", 0, 32, 32)]), "raw")
    f = pre.factors["w"]
    assert isinstance(f, LowRankFactor)
    assert f.rows.shape == (n, width) and f.gram_evecs.shape == (n, n)
    # one damped block: the rows and an n x n core, never width x width
    (block,) = pre._blocks(0.1)
    assert block.matrix is None and block.core.shape == (n, n)
    x = torch.randn(2, width, generator=torch.Generator().manual_seed(1))
    h = rows.double().T @ rows.double() / n
    expected = torch.linalg.solve(h + 0.1 * torch.eye(width, dtype=torch.float64), x.double().T).T
    assert _rel(pre.apply(x, 0.1), expected) < 1e-6


class _CountingSource(TensorSource):
    passes = 0

    def iter_blocks(self, batch_size):
        type(self).passes += 1
        yield from super().iter_blocks(batch_size)


def test_dense_covariances_are_fitted_a_group_per_pass():
    rows = _rows(100, seed=5)
    layout = [
        ModuleSpec("a", 0, 4, 5),
        ModuleSpec("b", 20, 4, 5),
        ModuleSpec("c", 40, 3, 6, "layernorm", flat_width=18),
    ]
    one = fit_from_rows(TensorSource(rows, layout=layout), layout, {}, 7)
    src = _CountingSource(rows, layout=layout)
    # room for one 20x20 float64 covariance per pass: three passes
    split = fit_from_rows(src, layout, {}, 7, budget=8 * 20 * 20)
    assert _CountingSource.passes == 3
    for m in layout:
        assert isinstance(split[m.name], DenseFactor)
        torch.testing.assert_close(split[m.name].evals, one[m.name].evals, rtol=0, atol=0)


@pytest.mark.parametrize("n", [9, 120])
def test_scores_and_self_influence_match_numpy(n):
    rows = _rows(n, seed=11)
    query = _rows(4, seed=12)
    train = TensorSource(rows, layout=LAYOUT)
    res = compute_influence_all(TensorSource(query, layout=LAYOUT), train, progress=False)
    assert res.meta["preconditioner"] == "raw"  # the default without K-FAC statistics
    inverses = _numpy_inverse(rows, None)
    expected = _apply_numpy(query, inverses) @ rows.double().numpy().T
    assert _rel(res.scores, expected) < 1e-6
    self_inf = compute_self_influence(train, progress=False).scores
    expected_self = (_apply_numpy(rows, inverses) * rows.double().numpy()).sum(1)
    assert _rel(self_inf, expected_self) < 1e-6
