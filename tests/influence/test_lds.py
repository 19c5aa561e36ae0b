"""LDS against a direct scipy computation, and the retraining protocol's determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from nnstat.influence import lds, run_lds_protocol
from nnstat.influence.lds import lds_per_query, subset_masks


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


# -- the protocol's subsets, repeats and per-run seeding ----------------------------------------


def _recording_protocol(seed: int, m: int, repeats: int, extra_draws: int = 0):
    """A protocol whose 'model' is the first draw of each global RNG inside its training run;
    `query_loss_fn` reports those draws and the subset's index sum, and every run is logged."""
    import random

    log = []

    def train_fn(idx):
        draws = (torch.rand(()).item(), float(np.random.rand()), random.random())
        # RNG consumed after the draws: must not leak into later runs (each run is seeded)
        torch.rand(extra_draws), np.random.rand(extra_draws), [random.random()] * extra_draws
        log.append((idx.clone(), draws))
        return draws, idx

    def query_loss_fn(model):
        draws, idx = model
        return torch.tensor([*draws, float(idx.sum())], dtype=torch.float64)

    proto = run_lds_protocol(
        train_fn,
        30,
        query_loss_fn,
        alpha=0.4,
        m=m,
        seed=seed,
        seeds_per_subset=repeats,
        progress=False,
    )
    return proto, log


def test_protocol_averages_repeats_each_seeded_from_seed_subset_and_repeat():
    m, k = 4, 3
    proto, log = _recording_protocol(seed=7, m=m, repeats=k)
    assert len(log) == m * k and proto.subset_losses.shape == (m, 4)
    # the masks are the public subset_masks of the protocol's seed
    assert torch.equal(proto.subset_masks, subset_masks(30, m, 0.4, seed=7))
    draws = np.array([d for _, d in log]).reshape(m, k, 3)  # [subset, repeat, rng]
    for j in range(m):
        # every repeat trains on subset j, and the recorded loss is the mean over the repeats
        for idx, _ in log[j * k : (j + 1) * k]:
            assert torch.equal(idx, proto.subset_masks[j].nonzero().flatten())
        expected = torch.tensor(
            [*draws[j].mean(0), float(log[j * k][0].sum())], dtype=torch.float64
        )
        torch.testing.assert_close(proto.subset_losses[j], expected, rtol=1e-15, atol=0)
    # torch, numpy and random are each reseeded per run: all m*k runs draw differently...
    for r in range(3):
        assert len(set(draws[:, :, r].ravel().tolist())) == m * k
    # ... reproducibly, whatever the runs consume after their draws ...
    again, log2 = _recording_protocol(seed=7, m=m, repeats=k, extra_draws=5)
    assert torch.equal(again.subset_losses, proto.subset_losses)
    assert [d for _, d in log2] == [d for _, d in log]
    # ... and run (j, r) does not depend on how many repeats or subsets there are
    single, log1 = _recording_protocol(seed=7, m=m + 2, repeats=1)
    assert [d for _, d in log1][:m] == [tuple(draws[j, 0]) for j in range(m)]
    assert torch.equal(single.subset_masks[:m], proto.subset_masks)
    # another protocol seed changes every run's training randomness
    _, log8 = _recording_protocol(seed=8, m=m, repeats=k)
    assert not set(d for _, d in log8) & set(d for _, d in log)


def test_subset_masks_are_distinct_uniform_and_seed_reproducible():
    n, m, alpha = 20, 400, 0.5
    a = subset_masks(n, m, alpha, seed=3)
    assert torch.equal(a, subset_masks(n, m, alpha, seed=3))
    assert not torch.equal(a, subset_masks(n, m, alpha, seed=4))
    assert (a.sum(1) == 10).all()
    # subsets are drawn independently: (almost) all distinct (C(20, 10) = 184756 possible)
    assert len({tuple(row) for row in a.int().tolist()}) >= m - 2
    # every example is included with probability alpha: Binomial(400, 0.5), s.d. 10
    counts = a.sum(0).numpy()
    assert np.all(np.abs(counts - m * alpha) < 45), counts
    # a prefix of subsets does not depend on how many are drawn
    assert torch.equal(subset_masks(n, 7, alpha, seed=3), a[:7])
