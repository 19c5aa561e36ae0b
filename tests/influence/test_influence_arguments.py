"""The scoring calls refuse a bad damping, top_k or batch_size up front, naming the argument."""

import numpy as np
import pytest
import torch

from nnstat.influence import TensorSource, compute_influence_all, compute_self_influence


def _pair():
    g = torch.Generator().manual_seed(0)
    return TensorSource(torch.randn(2, 5, generator=g)), TensorSource(
        torch.randn(12, 5, generator=g)
    )


@pytest.mark.parametrize("damping", [float("nan"), -1.0, float("inf"), "0.1", True])
@pytest.mark.parametrize("preconditioner", ["identity", "raw"])
def test_bad_damping_is_refused_whatever_the_preconditioner(damping, preconditioner):
    query, train = _pair()
    with pytest.raises(ValueError, match="damping must be a finite number >= 0"):
        compute_influence_all(query, train, preconditioner=preconditioner, damping=damping)
    with pytest.raises(ValueError, match="damping must be a finite number >= 0"):
        compute_self_influence(train, preconditioner=preconditioner, damping=damping)


@pytest.mark.parametrize("name,value", [("top_k", 2.5), ("top_k", True), ("batch_size", 0)])
def test_bad_count_is_refused_naming_it(name, value):
    query, train = _pair()
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
        compute_influence_all(query, train, **{name: value})
    if name == "batch_size":
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            compute_self_influence(train, batch_size=value)


def test_integer_damping_is_the_direct_solve():
    query, train = _pair()
    got = compute_influence_all(query, train, preconditioner="raw", damping=1, progress=False)
    t, q = train.rows.double().numpy(), query.rows.double().numpy()
    want = q @ np.linalg.solve(t.T @ t / len(t) + np.eye(5), t.T)
    np.testing.assert_allclose(got.scores.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("k", [0, 2.5, True])
def test_result_top_k_refuses_a_k_that_is_not_a_positive_integer(k):
    query, train = _pair()
    res = compute_influence_all(query, train, preconditioner="identity", progress=False)
    with pytest.raises(ValueError, match="k must be an integer >= 1"):
        res.top_k(k)


def test_result_top_k_beyond_the_rows_is_every_row_sorted():
    query, train = _pair()
    res = compute_influence_all(query, train, preconditioner="identity", progress=False)
    want = (query.rows.double() @ train.rows.double().T).numpy()
    top = res.top_k(50)
    np.testing.assert_allclose(top.helpful_scores.numpy(), -np.sort(-want, 1), rtol=1e-6)
    np.testing.assert_allclose(top.harmful_scores.numpy(), np.sort(want, 1), rtol=1e-6)


def test_a_numpy_or_tensor_damping_is_its_value():
    query, train = _pair()
    want = compute_influence_all(query, train, preconditioner="raw", damping=0.5).scores
    for damping in (np.float64(0.5), torch.tensor(0.5)):
        got = compute_influence_all(query, train, preconditioner="raw", damping=damping).scores
        torch.testing.assert_close(got, want)
