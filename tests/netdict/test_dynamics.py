"""Trust ratio and update ratio against hand-computed norms."""

import math

import numpy as np
import pytest
import torch

import nnstat
from nnstat import NetDict


def test_trust_ratio_uses_the_new_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    W_prev = nnstat.get_weight(model)
    model(torch.randn(8, 4)).pow(2).sum().backward()
    opt.step()
    W_curr = nnstat.get_weight(model)
    tr = nnstat.trust_ratio(W_prev, W_curr)
    ur = nnstat.update_ratio(W_prev, W_curr)
    assert list(tr) == list(W_curr)
    for n, p in model.named_parameters():
        new = p.detach().double().numpy().ravel()
        old = W_prev[n].double().numpy().ravel()
        expected = np.linalg.norm(new) / np.linalg.norm(new - old)
        assert tr[n] == pytest.approx(expected, rel=1e-5)
        assert ur[n] == pytest.approx(1 / expected, rel=1e-5)
        # the seed's documented formula divides the NEW weights' norm; the old ones give another number
        assert tr[n] != pytest.approx(np.linalg.norm(old) / np.linalg.norm(new - old), rel=1e-7)


def test_zero_update_gives_inf_not_a_crash():
    W = NetDict({"a": torch.tensor([1.0, 2.0]), "zero": torch.zeros(3)})
    tr = nnstat.trust_ratio(W, W.clone())
    assert tr["a"] == math.inf
    assert math.isnan(tr["zero"])  # 0/0: zero layer that did not move
    assert nnstat.update_ratio(W, W.clone())["a"] == 0.0


def test_mismatched_snapshots_raise():
    with pytest.raises(ValueError, match="only in left"):
        nnstat.trust_ratio(
            NetDict({"a": torch.ones(1), "b": torch.ones(1)}), NetDict({"a": torch.ones(1)})
        )
    with pytest.raises(TypeError, match="two NetDicts"):
        nnstat.trust_ratio({"a": torch.ones(1)}, NetDict({"a": torch.ones(1)}))
