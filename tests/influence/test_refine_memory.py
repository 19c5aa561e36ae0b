"""Refinement under a memory budget: the plan follows the budget, the scores do not (float64),
the estimate bounds the allocations measured (`measure_peak`), and a budget that one query
cannot fit is refused naming the bytes needed.

A 12-32-6 tanh MLP (614 parameters, unprojected: the logged width is the parameter count),
its per-sample gradients from ``torch.func`` as the store's rows.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat.influence.refine.run as refine_mod
from nnstat.influence import ModuleSpec, Refinement, TensorSource, compute_influence_all
from nnstat.influence.refine.memory import measure_peak
from nnstat.influence.refine.plan import Footprint, footprint

D = torch.float64
LOSS = nn.functional.cross_entropy
N_TRAIN, N_QUERY = 48, 6


def _problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 6))
    x = torch.randn(N_TRAIN + N_QUERY, 12)
    y = torch.randint(0, 6, (N_TRAIN + N_QUERY,))
    params = {k: v.detach() for k, v in model.named_parameters()}

    def rows(xs, ys):  # the store's layout: per Linear [d_out, d_in + 1] (bias last)
        g = vmap(
            grad(lambda p, a, b: LOSS(functional_call(model, p, (a[None],)), b[None])),
            (None, 0, 0),
        )(params, xs, ys)
        return torch.cat(
            [torch.cat([g[f"{m}.weight"], g[f"{m}.bias"][..., None]], -1).flatten(1) for m in "02"],
            1,
        )

    lay = [ModuleSpec("0", 0, 32, 13), ModuleSpec("2", 32 * 13, 6, 33)]
    train = TensorSource(rows(x[:N_TRAIN], y[:N_TRAIN]), layout=lay)
    query = TensorSource(rows(x[N_TRAIN:], y[N_TRAIN:]), layout=lay)
    return model, (x[:N_TRAIN], y[:N_TRAIN]), train, query


def _run(model, data, train, query, **kw):
    kw = {"steps": 3, "curvature": "ggn", "dtype": D, "batch_size": 32, "progress": False} | kw
    res = compute_influence_all(query, train, refine=Refinement(model, LOSS, data, **kw))
    return res, res.meta["refine"]["memory"]


def _need(fp: Footprint, solver: str, block: int, chunk: int) -> int:
    return sum(footprint(fp, solver, block, chunk, host=False).values())


def test_plan_follows_the_budget_and_the_scores_do_not(monkeypatch):
    model, data, train, query = _problem()
    free, plan = _run(model, data, train, query)
    fp = Footprint(**plan["footprint"])
    assert plan["product_measured"] and fp.per_vector > 0
    assert (plan["solver"], plan["block"], plan["chunk"]) == ("block", N_QUERY, N_QUERY + 8)
    # a budget between the estimates of two chunk sizes: the smaller chunk, the same scores
    budget = (_need(fp, "block", N_QUERY, 2) + _need(fp, "block", N_QUERY, 3)) // 2
    small, plan2 = _run(model, data, train, query, memory=budget)
    assert (plan2["block"], plan2["chunk"]) == (N_QUERY, 2) and plan2["estimate"] <= budget
    assert plan2["changed"] == []
    torch.testing.assert_close(small.scores, free.scores, rtol=1e-6, atol=1e-9)
    assert small.meta["refine"]["products"] == free.meta["refine"]["products"]
    # a block of 6 does not fit even one vector per product: blocks of 3 (a warning)
    budget = (_need(fp, "block", N_QUERY, 1) + _need(fp, "block", 3, 5)) // 2
    assert _need(fp, "block", 3, 5) < _need(fp, "block", N_QUERY, 1)
    with pytest.warns(UserWarning, match="block 6 -> 3"):
        _, plan3 = _run(model, data, train, query, memory=budget)
    assert plan3["block"] == 3 and plan3["solver"] == "block"


def test_per_query_cg_when_no_block_fits_converges_to_the_same_scores():
    model, data, train, query = _problem()
    kw = {"steps": 6, "damping": 20.0}  # well conditioned: both converge in 6 steps
    block, plan4 = _run(model, data, train, query, **kw)
    fp = Footprint(**plan4["footprint"])
    budget = (_need(fp, "cg", 1, 1) + _need(fp, "block", 1, 1)) // 2
    assert _need(fp, "cg", 1, 1) < _need(fp, "block", 1, 1)
    with pytest.warns(UserWarning, match="solver 'block' -> 'cg'"):
        cg, plan5 = _run(model, data, train, query, memory=budget, **kw)
    assert plan5["solver"] == "cg" and cg.meta["refine"]["solver"] == "cg"
    assert max(cg.meta["refine"]["max_residual"], block.meta["refine"]["max_residual"]) < 1e-10
    torch.testing.assert_close(cg.scores, block.scores, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("solver", ["block", "cg"])
@pytest.mark.parametrize("chunk", [None, 1])
def test_estimate_bounds_the_measured_peak(monkeypatch, solver, chunk):
    """The allocations the profiler records over the whole refinement (rows, search space,
    preconditioner blocks, products) stay under the plan's estimate, with the product's share
    as measured in a first run (the measurement itself runs the profiler)."""
    model, data, train, query = _problem()
    _, plan = _run(model, data, train, query, solver=solver)
    fp = Footprint(**plan["footprint"])
    memory = None if chunk is None else _need(fp, solver, N_QUERY, chunk)
    measured = (fp.fixed, fp.per_vector, True)
    monkeypatch.setattr(refine_mod, "product_cost", lambda *a, **k: measured)
    (_, plan), peak = measure_peak(
        lambda: _run(model, data, train, query, solver=solver, memory=memory),
        torch.device("cpu"),
    )
    assert chunk is None or plan["chunk"] == chunk
    assert peak is not None and 0 < peak <= plan["estimate"], (peak, plan["parts"])
    assert peak > plan["estimate"] / 20  # an estimate, not a bound of anything whatsoever


def test_a_budget_one_query_cannot_fit_is_refused_with_the_bytes_needed():
    model, data, train, query = _problem()
    _, plan = _run(model, data, train, query)
    need = _need(Footprint(**plan["footprint"]), "cg", 1, 1)
    with pytest.raises(ValueError, match=rf"at least {need} bytes") as e:
        _run(model, data, train, query, memory=need - 1)
    assert "per-query CG" in str(e.value) and "batch_size" in str(e.value)


def test_memory_is_validated():
    model, data, _, _ = _problem()
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="memory must be"):
            Refinement(model, LOSS, data, memory=bad)


def test_plan_order_chunk_then_host_then_block_then_cg():
    """On a GPU the search space moves to the host before blocks shrink: the device then holds
    the products alone; each step down is taken only when the one before does not fit."""
    from nnstat.influence.refine.plan import choose_plan

    fp = Footprint(n=32, width=20_000, params=10**6, itemsize=4, steps=5, start=True, probes=8,
                   fixed=10**7, per_vector=4 * 10**6)  # fmt: skip

    def device_bytes(solver, block, chunk, host):
        parts = footprint(fp, solver, block, chunk, host)
        return sum(v for k, v in parts.items() if not k.startswith("host_"))

    full = device_bytes("block", 32, 64, False)  # 64: the second step's directions
    assert choose_plan(fp, full, "block", 32, cuda=True).chunk == 64
    plan = choose_plan(fp, device_bytes("block", 32, 1, False), "block", 32, cuda=True)
    assert (plan.block, plan.chunk, plan.directions) == (32, 1, "device")
    plan = choose_plan(fp, device_bytes("block", 32, 1, False) - 1, "block", 32, cuda=True)
    assert (plan.block, plan.directions) == (32, "host") and plan.changed == [
        "search space on the host"
    ]
    assert plan.estimate == device_bytes("block", 32, plan.chunk, True)
    plan = choose_plan(fp, device_bytes("block", 32, 1, False) - 1, "block", 32, cuda=False)
    assert plan.block < 32 and plan.directions == "device"
