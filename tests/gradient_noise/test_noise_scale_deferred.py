"""The streaming noise scale reads nothing back inside ``batch()`` on an accelerator.

On CPU the capture's norms are read once per batch (one ``tolist``, counted by the host-read
ledger). With the copy held back (`LocalCopy.ready = False` stands in for a CUDA event not yet
reached) a batch reads nothing: its norms join the averages when read, in order, and the values
equal those of an EMA built by hand from per-sample gradients (torch.func).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _ledger import host_reads
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.background.transfer import LocalCopy
from nnstat.tracker import tracker as tracker_module

BETA, N = 0.7, 8


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 + i)
    return torch.randn(N, 4, generator=g), torch.randint(0, 3, (N,), generator=g)


def _expected(model: nn.Module, steps: int | list[int]) -> tuple[float, float]:
    """EMAs of tr(Sigma) and |G|^2 from per-sample gradients (torch.func), over batches
    ``0 .. steps - 1`` (or the batches listed)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, y):
        return nn.functional.cross_entropy(functional_call(model, p, (x[None],)), y[None])

    num = den = weight = 0.0
    for i in range(steps) if isinstance(steps, int) else steps:
        x, y = _batch(i)
        per = vmap(grad(loss), in_dims=(None, 0, 0))(params, x, y)
        flat = torch.cat([g.reshape(N, -1) for g in per.values()], 1).double()
        small = flat.pow(2).sum(1).mean().item()  # mean_i |g_i|^2 (batch of one)
        big = flat.mean(0).pow(2).sum().item()  # |G_B|^2
        trace = (small - big) / (1 - 1 / N)
        g_sq = (N * big - small) / (N - 1)
        num, den = BETA * num + (1 - BETA) * trace, BETA * den + (1 - BETA) * g_sq
        weight = BETA * weight + (1 - BETA)
    return num / weight, den / weight


def _run(steps: int, reads: list[list[str]]) -> nnstat.NoiseScale:
    model = _model()  # no optimizer step: the parameters stay those of _expected
    gns = nnstat.NoiseScale(beta=BETA)
    gns.watch(model)
    for i in range(steps):
        x, y = _batch(i)
        model.zero_grad()
        counter: list[str] = []
        with host_reads(counter):
            with gns.batch():
                nn.functional.cross_entropy(model(x), y).backward()
        reads.append(counter)
    return gns


def test_batch_reads_once_on_cpu_and_nothing_while_its_copy_is_on_its_way(monkeypatch):
    steps = 4
    now: list[list[str]] = []
    at_once = _run(steps, now)
    assert all(len(r) <= 1 for r in now[1:])  # the first batch also checks the loss (probe)
    trace, g_sq = _expected(_model(), steps)
    assert (at_once.trace_sigma, at_once.grad_sq_norm) == pytest.approx((trace, g_sq), rel=1e-5)

    monkeypatch.setattr(LocalCopy, "ready", False)
    later: list[list[str]] = []
    deferred = _run(steps, later)
    assert later[1:] == [[]] * (steps - 1)  # nothing read inside batch()
    assert deferred._n_updates == 0  # nothing added yet: the norms are on their way
    assert deferred.n_updates == steps  # reading waits for them
    assert deferred.to_dict() == at_once.to_dict()  # same floats, same order (EMA)


def test_a_nan_batch_is_left_out_with_a_warning_when_it_arrives(monkeypatch):
    """Batch 1 holds a NaN (its norms too): nothing is read or warned inside ``batch()``; the
    read that waits for the norms warns and leaves it out, and the EMA is that of batches
    0, 2, 3 (the torch.func reference, and the same floats as a run fed only those)."""
    monkeypatch.setattr(LocalCopy, "ready", False)

    def run(which: list[int]) -> nnstat.NoiseScale:
        model = _model()
        gns = nnstat.NoiseScale(beta=BETA)
        gns.watch(model)
        for i in which:
            x, y = _batch(i)
            if i == 1:
                x[2, 1] = math.nan
            model.zero_grad(set_to_none=True)  # what a skipped step leaves: no stale NaN
            reads: list[str] = []
            with warnings.catch_warnings(), host_reads(reads):
                warnings.simplefilter("error")
                with gns.batch():
                    nn.functional.cross_entropy(model(x), y).backward()
            assert reads == [] or i == which[0]  # the first batch also checks the loss
        assert gns._n_updates == 0  # all on their way
        return gns

    gns = run([0, 1, 2, 3])
    with pytest.warns(RuntimeWarning, match="non-finite gradients"):
        assert gns.n_updates == 3  # the read that waits for the norms
    trace, g_sq = _expected(_model(), [0, 2, 3])
    assert (gns.trace_sigma, gns.grad_sq_norm) == pytest.approx((trace, g_sq), rel=1e-5)
    without = run([0, 2, 3])
    assert gns.to_dict() == without.to_dict()


def test_provider_values_fill_in_when_the_tracker_delivers(monkeypatch):
    """Tracker and noise scale both deferred: the provider does not wait for the noise scale's
    batches (none has been added when the steps return), and each delivered step carries the
    noise scale as of that step."""
    monkeypatch.setattr(tracker_module, "_on_cpu", lambda params: False)
    monkeypatch.setattr(LocalCopy, "ready", False)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the parameters stay put
    gns = nnstat.NoiseScale(beta=BETA)
    gns.watch(model)
    got: list[dict] = []
    tracker = nnstat.Tracker(model, opt, sinks=[lambda m, s: got.append(m)], groups=["grad"])
    tracker.add_provider(gns.as_provider())
    for i in range(3):
        x, y = _batch(i)
        opt.zero_grad()
        with gns.batch():
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        tracker.step()
    assert gns._n_updates == 0 and got == []
    tracker.close()
    for steps, metrics in enumerate(got, start=1):
        trace, g_sq = _expected(_model(), steps)
        assert metrics["noise_scale/trace_sigma"] == pytest.approx(trace, rel=1e-5)
        assert metrics["noise_scale/grad_sq_norm"] == pytest.approx(g_sq, rel=1e-5)
