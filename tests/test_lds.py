"""LDS against a direct scipy computation, and the retraining protocol's determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from nnstat.influence import lds, run_lds_protocol
from nnstat.influence.lds import lds_per_query


def _hand_made():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(3, 8))
    masks = rng.random((10, 8)) < 0.5
    losses = rng.normal(size=(10, 3))
    losses[2, 0] = losses[5, 0]  # a tie in the outcomes: average ranks, as scipy does
    return scores, masks, losses


def test_lds_equals_direct_scipy_spearman():
    scores, masks, losses = _hand_made()
    direct = []
    for q in range(3):
        predicted = [scores[q, masks[j]].sum() for j in range(10)]
        direct.append(spearmanr(predicted, -losses[:, q]).statistic)
    assert lds(scores, masks, losses) == pytest.approx(np.mean(direct), abs=1e-12)
    np.testing.assert_allclose(lds_per_query(scores, masks, losses), direct, atol=1e-12)
    # torch inputs give the same number
    assert lds(torch.tensor(scores), torch.tensor(masks), torch.tensor(losses)) == pytest.approx(
        np.mean(direct), abs=1e-6
    )


def test_higher_is_better_does_not_negate():
    scores, masks, losses = _hand_made()
    assert lds(scores, masks, losses, higher_is_better=True) == pytest.approx(
        -lds(scores, masks, losses), abs=1e-12
    )


def test_lds_errors():
    scores, masks, losses = _hand_made()
    with pytest.raises(ValueError, match="n_query"):
        lds(scores, masks, losses.T)
    with pytest.raises(ValueError, match="subset_masks cover"):
        lds(scores, masks[:, :5], losses)
    with pytest.raises(ValueError, match="NaN"):
        lds(scores * np.nan, masks, losses)
    with pytest.raises(ValueError, match="undefined"):
        lds(scores, masks, np.ones_like(losses))


def _protocol(seed: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(24, 3, generator=gen)
    y = x @ torch.tensor([1.0, -2.0, 0.5]) + 0.1 * torch.randn(24, generator=gen)
    xq, yq = x[:3] + 0.1, y[:3]

    def train_fn(idx):
        model = torch.nn.Linear(3, 1)  # random init from the protocol's seed
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(20):
            batch = idx[torch.randperm(len(idx))[:6]]  # random minibatches, also seeded
            opt.zero_grad()
            ((model(x[batch]).squeeze(1) - y[batch]) ** 2).mean().backward()
            opt.step()
        return model

    def query_loss_fn(model):
        return (model(xq).squeeze(1) - yq) ** 2

    return run_lds_protocol(train_fn, 24, query_loss_fn, alpha=0.5, m=6, seed=seed, progress=False)


def test_retraining_protocol_is_deterministic_with_seeds():
    a, b, c = _protocol(7), _protocol(7), _protocol(8)
    assert torch.equal(a.subset_masks, b.subset_masks)
    assert torch.equal(a.subset_losses, b.subset_losses)
    assert not torch.equal(a.subset_masks, c.subset_masks)
    assert a.subset_masks.shape == (6, 24) and a.subset_losses.shape == (6, 3)
    assert (a.subset_masks.sum(1) == 12).all()
    scores = torch.randn(3, 24)
    assert a.evaluate(scores) == pytest.approx(lds(scores, a.subset_masks, a.subset_losses))
