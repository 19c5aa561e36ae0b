"""Refinement on the model's device: products, block solves and the refined rows where the model
is, the host read once per solver step, whatever the number of training batches.

The device branch runs on the CPU under the host-read ledger (``tests/_ledger.py``: every
``item``/``bool``/``float``/``tolist``/``cpu`` would wait for a GPU's queue) and an op counter
for the data-dependent ops that would too (``nonzero``, ``masked_select``, ``unique``). Where a
GPU exists the same refinement runs there too and must give the CPU's scores (float64), with the
device's synchronisations counted by ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from _ledger import host_reads
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._python_dispatch import TorchDispatchMode

from nnstat.influence import ModuleSpec, Refinement, TensorSource, compute_influence_all

D = torch.float64
LOSS = nn.functional.cross_entropy
CUDA = pytest.param("cuda", marks=pytest.mark.cuda)
DEVICES = ["cpu"] + ([CUDA] if torch.cuda.is_available() else [])
SYNCING_OPS = ("nonzero", "masked_select", "unique", "_local_scalar_dense")


class _SyncOps(TorchDispatchMode):
    """Counts the ops whose output size (or value) the host must wait for."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def _problem(device: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3)).to(device)
    # drawn on the CPU for every device (a GPU's generator draws other numbers)
    x = torch.randn(60, 6).to(device)
    y = torch.randint(0, 3, (60,)).to(device)
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = vmap(
        grad(lambda p, a, b: LOSS(functional_call(model, p, (a[None],)), b[None])), (None, 0, 0)
    )(params, x, y)
    rows = torch.cat(
        [torch.cat([g[f"{m}.weight"], g[f"{m}.bias"][..., None]], -1).flatten(1) for m in "02"], 1
    ).cpu()
    lay = [ModuleSpec("0", 0, 10, 7), ModuleSpec("2", 70, 3, 11)]
    return (
        model,
        (x[:48], y[:48]),
        TensorSource(rows[:48], layout=lay),
        TensorSource(rows[48:], layout=lay),
    )


def _refine(device, steps, solver, batch_size=16, **kw):
    model, data, train, query = _problem(device)
    refine = Refinement(
        model, LOSS, data, steps=steps, solver=solver, dtype=D, batch_size=batch_size,
        preconditioner="raw", curvature="ggn", progress=False, **kw,
    )  # fmt: skip
    return compute_influence_all(query, train, refine=refine)


@pytest.mark.parametrize("solver", ["block", "cg"])
def test_one_host_read_per_step_whatever_the_number_of_batches(solver):
    counts = {}
    for steps, batch in ((2, 16), (5, 16), (5, 6)):
        reads: list[str] = []
        ops = _SyncOps()
        with host_reads(reads), ops:
            res = _refine("cpu", steps, solver, batch)
        assert res.meta["refine"]["passes_per_block"] == steps
        counts[steps, batch] = (len(reads), len(ops.seen))
    (r2, o2), (r5, o5), (r5b, o5b) = counts[2, 16], counts[5, 16], counts[5, 6]
    assert r5 - r2 == 3 and o5 == o2, counts  # one read per step, nothing else grows
    assert (r5b, o5b) == (r5, o5), counts  # 8 training batches a pass, not 3: no more reads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("solver", ["block", "cg"])
def test_refinement_runs_where_the_model_is_and_gives_the_cpu_scores(device, solver):
    cpu = _refine("cpu", 4, solver)
    found: list[str] = []
    if device == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                res = _refine(device, 4, solver)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    else:
        res = _refine(device, 4, solver)
    assert res.meta["refine"]["device"].startswith(device)
    assert res.meta["refine"]["memory"]["directions"] == "device"
    torch.testing.assert_close(res.scores, cpu.scores, rtol=1e-5, atol=1e-7)
    # per step: the solver's read, and on a GPU the small eigh/SVD's own checks; setup: a few
    assert len(found) <= 4 * 4 + 12, found
