"""The offline truncations of ``benchmarks/factored_truncation.py``: the plain one is what a
factored store keeps (``nnstat.store.factored``), the K-FAC-metric one is the best rank-``c``
approximation in that metric (numpy's SVD of the whitened matrix, and no rank-``c`` matrix does
better there)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from nnstat.influence.precondition import KronFactor
from nnstat.influence.row_layout import ModuleSpec
from nnstat.store.factored import factor_rows, unfactor

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))  # the script imports its sibling benchmark modules
    try:
        import factored_truncation

        yield factored_truncation
    finally:
        sys.path.remove(str(BENCH))


def _orthogonal(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]


def test_plain_truncation_is_the_factored_store_rows(bench):
    gen = torch.Generator().manual_seed(0)
    n, t, c = 5, 7, 2
    layout = [ModuleSpec("a", 0, 6, 5), ModuleSpec("b", 30, 3, 2)]  # b: 2·5 ≥ 6, kept dense
    blocks, expected = [], []
    for m in layout:
        bp = torch.randn(n, t, m.r_out, generator=gen)
        ap = torch.randn(n, t, m.r_in, generator=gen)
        dense = torch.bmm(bp.transpose(1, 2), ap).reshape(n, -1)
        blocks.append(dense)
        if m.name == "a":
            rows, _ = factor_rows(bp, ap, c)
            expected.append(unfactor(rows, c, m.r_out, m.r_in))
        else:
            expected.append(dense)
    out = bench.truncate(torch.cat(blocks, 1).double(), layout, c)
    torch.testing.assert_close(out.float(), torch.cat(expected, 1), rtol=1e-4, atol=1e-4)


def test_kfac_metric_truncation_is_the_best_rank_c_there(bench):
    gen = torch.Generator().manual_seed(1)
    r_out, r_in, c, lam = 6, 4, 2, 0.3
    s = torch.rand(r_out, generator=gen, dtype=torch.float64) * 3 + 0.1
    a = torch.rand(r_in, generator=gen, dtype=torch.float64) * 2 + 0.1
    q_out, q_in = _orthogonal(r_out, gen), _orthogonal(r_in, gen)
    factor = KronFactor(q_out, q_in, torch.outer(s, a))
    g = torch.randn(3, r_out, r_in, generator=gen, dtype=torch.float64)
    got = bench.whitened_rank_c(g, c, factor, lam)
    # numpy reference: whiten with the damped factors, truncate by SVD, unwhiten
    pi = np.sqrt(s.mean().item() / a.mean().item())
    ws = q_out.numpy() @ np.diag(np.sqrt(s.numpy() + np.sqrt(lam) * pi)) @ q_out.numpy().T
    wa = q_in.numpy() @ np.diag(np.sqrt(a.numpy() + np.sqrt(lam) / pi)) @ q_in.numpy().T
    for i in range(len(g)):
        w = np.linalg.solve(ws, g[i].numpy()) @ np.linalg.inv(wa)
        u, sv, vt = np.linalg.svd(w)
        ref = ws @ (u[:, :c] * sv[:c]) @ vt[:c] @ wa
        np.testing.assert_allclose(got[i].numpy(), ref, rtol=1e-9, atol=1e-9)
        assert np.linalg.matrix_rank(got[i].numpy()) == c
        # no other rank-c matrix is closer in that metric (Eckart-Young, checked on a random one)
        other = ws @ np.random.default_rng(i).standard_normal((r_out, c)) @ vt[:c] @ wa

        gi = g[i].numpy()
        errors = [
            np.linalg.norm(np.linalg.solve(ws, gi - x) @ np.linalg.inv(wa))
            for x in (got[i].numpy(), other)
        ]
        assert errors[0] < errors[1]


def test_per_module_counts_truncate_each_module_to_its_own_rank(bench):
    gen = torch.Generator().manual_seed(2)
    n, t = 4, 9
    flat = ModuleSpec("n", 72, 1, 3, kind="layernorm", flat_width=3)
    layout = [ModuleSpec("a", 0, 6, 5), ModuleSpec("b", 30, 6, 7), flat]
    counts = {"a": 1, "b": 3}
    blocks, expected = [], []
    for m in layout[:2]:
        bp = torch.randn(n, t, m.r_out, generator=gen)
        ap = torch.randn(n, t, m.r_in, generator=gen)
        blocks.append(torch.bmm(bp.transpose(1, 2), ap).reshape(n, -1))
        rows, _ = factor_rows(bp, ap, counts[m.name])
        expected.append(unfactor(rows, counts[m.name], m.r_out, m.r_in))
    flat = torch.randn(n, 3, generator=gen)
    out = bench.truncate(torch.cat([*blocks, flat], 1).double(), layout, counts)
    torch.testing.assert_close(out.float(), torch.cat([*expected, flat], 1), rtol=1e-4, atol=1e-4)
    # columns: a 1 * (6 + 5) = 11, b 3 * (6 + 7) = 39 (< 42 dense), the flat module its 3
    assert bench.stored_columns(layout, counts) == 11 + 39 + 3
    assert bench.stored_columns(layout, {"a": 1}) == 11 + 42 + 3  # b unnamed: dense
    assert bench.stored_columns(layout, None) == 30 + 42 + 3
    assert bench.stored_columns(layout, 3) == 30 + 39 + 3  # a: 3 * 11 = 33 >= 30, dense


def test_the_energy_greedy_allocation_buys_the_best_energy_per_column(bench):
    layout = [ModuleSpec("a", 0, 8, 8), ModuleSpec("b", 64, 2, 30)]  # a pair: 16 or 32 cols
    # kept energy after c = 0, 1, 2, ... pairs
    curves = {"a": np.array([0, 0.5, 0.9, 0.95, 1, 1, 1, 1, 1]), "b": np.array([0, 0.8, 1.0])}
    # from one pair each (16 + 32 = 48 columns): a's 2nd pair +0.4 / 16, b's next step is its
    # dense row (60 columns, +28: +0.2 / 28); a 3rd pair +0.05 / 16
    assert bench.greedy_allocation(layout, curves, 64) == {"a": 2, "b": 1}
    assert bench.greedy_allocation(layout, curves, 92) == {"a": 2, "b": None}
    assert bench.greedy_allocation(layout, curves, 47) == {"a": 1, "b": 1}  # nothing fits
    # >= 0.9 kept: a 2 pairs; b 2 pairs (64 columns) are no narrower than its 60: dense
    assert bench.threshold_allocation(layout, curves, 0.9) == {"a": 2, "b": None}
