"""The counterfactual check against a known answer: ridge regression solved exactly, where the
exact influence predicts the retrained loss change to first order."""

from __future__ import annotations

import pytest
import torch

from nnstat.influence import counterfactual

N, D, LAM = 200, 3, 1e-3


def _problem():
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(N, D, generator=gen, dtype=torch.float64)
    y = X @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    y = y + 0.5 * torch.randn(N, generator=gen, dtype=torch.float64)
    y[:6] += 4.0  # a few corrupted targets: large, harmful gradients
    Xq = torch.randn(4, D, generator=gen, dtype=torch.float64)
    yq = Xq @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    # queries the model gets wrong: with a near-zero query gradient the loss change is second
    # order in the removal and no first-order prediction applies (measured: ratios 0.1 to 2.5)
    yq = yq + 2.0 * torch.randn(len(yq), generator=torch.Generator().manual_seed(1), dtype=X.dtype)
    return X, y, Xq, yq


def _fit(X, y):
    """argmin (1/n) Σ (xᵀw - y)² / 2 + λ/2 |w|²: the exact optimum, no training noise."""
    n = len(X)
    return torch.linalg.solve(X.T @ X / n + LAM * torch.eye(D, dtype=X.dtype), X.T @ y / n)


def _exact_scores(X, y, Xq, yq):
    """score(q, i) = g_qᵀ H⁻¹ g_i, H the Hessian of the mean training objective (float64)."""
    w = _fit(X, y)
    H = X.T @ X / len(X) + LAM * torch.eye(D, dtype=X.dtype)
    g = X * (X @ w - y)[:, None]
    gq = Xq * (Xq @ w - yq)[:, None]
    return gq @ torch.linalg.solve(H, g.T)


@pytest.mark.parametrize("direction", ["harmful", "helpful"])
def test_exact_influence_predicts_the_retrained_change_and_beats_random(direction):
    X, y, Xq, yq = _problem()
    scores = _exact_scores(X, y, Xq, yq)

    def query_loss(w):
        return (Xq @ w - yq) ** 2 / 2

    res = counterfactual(
        lambda idx: _fit(X[idx], y[idx]),
        query_loss,
        scores,
        k=4,
        direction=direction,
        repeats=3,
        baselines={"loss": (X @ _fit(X, y) - y) ** 2 / 2},
    )
    arm = res.arms["scores"]
    # removal set: the top 4 of the queries' summed scores, lowest first for "harmful"
    joint = scores.sum(0)
    expected = joint.argsort(descending=direction == "helpful")[:4].sort().values.tolist()
    assert arm.removed == [expected] * 3
    # independent measurement: retrain by hand without those examples
    keep = torch.ones(N, dtype=torch.bool)
    keep[expected] = False
    measured = float(query_loss(_fit(X[keep], y[keep])).mean() - query_loss(_fit(X, y)).mean())
    assert arm.change == pytest.approx([measured] * 3, rel=1e-9)
    # first order: removing i moves the query loss by +score(q, i) / n
    predicted = float(scores[:, expected].sum(1).mean()) / N
    assert arm.predicted == pytest.approx(predicted, rel=1e-9)
    assert measured == pytest.approx(predicted, rel=0.25)
    sign = -1 if direction == "harmful" else 1
    assert sign * measured > 0
    # and it beats removing k random examples, by far
    assert sign * arm.mean > 5 * abs(res.arms["random"].mean)
    lo, hi = res.arms["random"].interval
    assert (
        lo <= res.arms["random"].mean <= hi and len(set(map(tuple, res.arms["random"].removed))) > 1
    )
    # the loss baseline removes the highest-loss examples: the corrupted ones
    assert set(res.arms["loss"].removed[0]) <= set(range(6))
    assert "scores" in res.table() and res.to_dict()["arms"]["scores"]["removed"][0] == expected


def test_repeats_are_paired_and_correct_fn_is_reported():
    seen = []

    def train_fn(idx):
        noise = torch.rand(1).item()  # the seeded random state at the start of training
        seen.append((len(idx), noise))
        return noise

    res = counterfactual(
        train_fn,
        lambda m: torch.tensor([m, 2 * m]),
        torch.arange(10.0)[None].repeat(2, 1),
        k=2,
        repeats=2,
        correct_fn=lambda m: torch.tensor([m > 0.5, True]),
    )
    # per repeat: full, scores, random all start from the same state; repeats differ
    states = [noise for _, noise in seen]
    assert states[0] == states[1] == states[2] and states[3] == states[4] == states[5]
    assert states[0] != states[3]
    assert [n for n, _ in seen] == [10, 8, 8] * 2
    assert res.arms["scores"].change == [0.0, 0.0]  # the model ignores the data here
    assert res.full_correct == res.arms["scores"].correct


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"k": 0}, "k must be an int"),
        ({"k": 10}, "k must be an int"),
        ({"direction": "up"}, "unknown direction"),
        ({"repeats": 0}, "repeats must be"),
        ({"queries": [5]}, "queries must be row indices"),
        ({"baselines": {"loss": torch.ones(3)}}, "baseline 'loss' must be 10"),
        ({"baselines": {"random": torch.ones(10)}}, "is taken"),
    ],
)
def test_bad_arguments_are_refused(kwargs, message):
    args = {"k": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        counterfactual(lambda idx: 0.0, lambda m: torch.zeros(2), torch.zeros(2, 10), **args)


def test_nonfinite_scores_are_refused():
    with pytest.raises(ValueError, match="finite"):
        counterfactual(
            lambda i: 0, lambda m: torch.zeros(1), torch.tensor([[1.0, float("nan")]]), k=1
        )


@pytest.mark.parametrize("n_losses", [1, 3])
def test_query_losses_of_the_wrong_length_are_refused(n_losses):
    # shorter: before, a bare IndexError; longer: other queries' losses, averaged silently
    with pytest.raises(ValueError, match=rf"returned {n_losses} losses, but scores has 2 query"):
        counterfactual(
            lambda idx: 0.0, lambda m: torch.zeros(n_losses), torch.zeros(2, 10), k=2, queries=[1]
        )
