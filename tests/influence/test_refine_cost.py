"""What a refinement tells its user: its cost before it runs (passes, products, an estimated
time), what a memory budget multiplied, nothing at all when its progress is off, and a refusal
of a loss whose reduction is not the declared one.

A 12-32-6 tanh MLP, its per-sample gradients from ``torch.func`` as the store's rows; the
passes it states are checked against the passes the refinement counts.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from nnstat.influence import ModuleSpec, Refinement, TensorSource, compute_influence_all
from nnstat.influence.refine import refinement_plan

D = torch.float64
N_TRAIN, N_QUERY = 48, 6


def mean_loss(out, y):
    return nn.functional.cross_entropy(out, y)


def sum_loss(out, y):
    return nn.functional.cross_entropy(out, y, reduction="sum")


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 6))
    x = torch.randn(N_TRAIN + N_QUERY, 12)
    y = torch.randint(0, 6, (N_TRAIN + N_QUERY,))
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = vmap(
        grad(lambda p, a, b: mean_loss(functional_call(model, p, (a[None],)), b[None])),
        (None, 0, 0),
    )(params, x, y)
    rows = torch.cat(
        [torch.cat([g[f"{m}.weight"], g[f"{m}.bias"][..., None]], -1).flatten(1) for m in "02"], 1
    )
    lay = [ModuleSpec("0", 0, 32, 13), ModuleSpec("2", 32 * 13, 6, 33)]
    train = TensorSource(rows[:N_TRAIN], layout=lay)
    query = TensorSource(rows[N_TRAIN:], layout=lay)
    return model, (x[:N_TRAIN], y[:N_TRAIN]), train, query


def _refine(model, data, loss=mean_loss, **kw):
    kw = {"steps": 3, "curvature": "ggn", "dtype": D, "batch_size": 16, "progress": False} | kw
    return Refinement(model, loss, data, **kw)


def test_nothing_is_printed_when_progress_is_off(capfd):
    """Not a line on stdout or stderr, the memory probe's included (it starts no profiler)."""
    model, data, train, query = _problem()
    capfd.readouterr()
    res = compute_influence_all(query, train, refine=_refine(model, data))
    out, err = capfd.readouterr()
    assert res.meta["refine"]["passes"] == 3
    assert (out, err) == ("", "")


def test_the_cost_is_stated_before_the_first_pass_and_matches_the_passes_spent(capfd):
    model, data, train, query = _problem()
    capfd.readouterr()
    res = compute_influence_all(
        query, train, refine=_refine(model, data, progress=True, query_batch=2, damping=0.1)
    )
    _, err = capfd.readouterr()
    line = next(x for x in err.splitlines() if "nnstat: refining 6 queries" in x)
    cost = res.meta["refine"]["cost"]
    spent = res.meta["refine"]["passes"]
    assert spent == 3 * 3  # 3 blocks of 2 queries, 3 steps each (none converges this early)
    assert cost["passes"] == spent and f"{spent} passes over 3 training batches" in line
    assert cost["products"] == res.meta["refine"]["products"] == 6 * 3
    assert cost["batches"] == 3 and "per vector" in line and "in all (an estimate)" in line
    assert cost["seconds"] > 0 and math.isfinite(cost["seconds"])
    assert err.index(line) < err.index("refine (ggn)")  # before the progress bar
    assert cost["multiplied"] == ""


def test_a_memory_budget_that_multiplies_the_passes_says_so():
    model, data, train, query = _problem()
    full = refinement_plan(_refine(model, data, damping=0.1), query, train)
    assert full.block == N_QUERY and full.cost.passes == 3
    # room for the products and rows, not for a search space of 6 queries' directions
    parts = full.parts
    memory = full.estimate - parts["search_space"] // 2
    with pytest.warns(UserWarning, match="x the passes"):
        res = compute_influence_all(
            query, train, refine=_refine(model, data, damping=0.1, memory=memory)
        )
    cost, plan = res.meta["refine"]["cost"], res.meta["refine"]["memory"]
    blocks = -(-N_QUERY // plan["block"])
    assert plan["block"] < N_QUERY and cost["passes"] == res.meta["refine"]["passes"] == 3 * blocks
    assert f"holds blocks of {plan['block']} queries, not {N_QUERY}" in cost["multiplied"]
    assert f"{blocks:.1f} x the passes" in cost["multiplied"]


@pytest.mark.parametrize("kind", ["loss_fn", "batch_loss"])
def test_a_summed_loss_declared_a_mean_is_refused_with_the_fix(kind):
    """The README's summed ``loss_fn`` under the default ``loss_reduction="mean"``: the curvature
    would be the batch size times too large against the rows and the preconditioner."""
    model, data, train, query = _problem()
    if kind == "loss_fn":
        refine = _refine(model, data, loss=sum_loss)
    else:
        batches = [(data[0][i : i + 16], data[1][i : i + 16]) for i in range(0, N_TRAIN, 16)]
        refine = Refinement(
            model, None, batches, batch_loss=lambda b: sum_loss(model(b[0]), b[1]), steps=1,
            curvature="ggn", dtype=torch.float32, progress=False,
        )  # fmt: skip
    with pytest.raises(ValueError, match=f"{kind} reduces a batch by its sum") as e:
        compute_influence_all(query, train, refine=refine)
    assert "loss_reduction='sum'" in str(e.value) and "(8 x)" in str(e.value)  # 8 examples


def test_a_mean_declared_a_sum_is_refused_and_the_declared_sum_is_accepted():
    model, data, train, query = _problem()
    with pytest.raises(ValueError, match="loss_fn reduces a batch by its mean"):
        compute_influence_all(
            query, train, refine=_refine(model, data, loss=mean_loss, loss_reduction="sum")
        )
    summed = compute_influence_all(
        query, train, refine=_refine(model, data, loss=sum_loss, loss_reduction="sum")
    )
    mean = compute_influence_all(query, train, refine=_refine(model, data))
    torch.testing.assert_close(summed.scores, mean.scores, rtol=1e-5, atol=1e-7)
