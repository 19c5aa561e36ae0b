"""Rows formed from their factors (``nnstat.store.outer``): certificate, bits, and where."""

import threading

import numpy as np
import pytest
import torch
from torch import nn

import nnstat
from nnstat.store import outer


def _factors(b, a, offset=0):
    return outer.OuterFactors(slice(offset, offset + b.shape[1] * a.shape[1]), b, a)


def test_fill_writes_each_modules_outer_products_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    b1, a1 = torch.randn(5, 3, generator=g), torch.randn(5, 4, generator=g)
    b2, a2 = torch.randn(5, 2, generator=g) * 1e-3, torch.randn(5, 6, generator=g) * 1e5
    rows = torch.full((5, 12 + 12 + 1), 7.0)
    outer.fill(rows, [_factors(b1, a1), _factors(b2, a2, offset=12)])
    # numpy float32 products, computed independently of fill
    want1 = (b1.numpy()[:, :, None] * a1.numpy()[:, None, :]).reshape(5, -1)
    want2 = (b2.numpy()[:, :, None] * a2.numpy()[:, None, :]).reshape(5, -1)
    np.testing.assert_array_equal(rows[:, :12].numpy(), want1)
    np.testing.assert_array_equal(rows[:, 12:24].numpy(), want2)
    assert torch.all(rows[:, 24] == 7.0)  # columns outside the factors are untouched


def test_certificate_is_sound_and_refuses_nonfinite_or_overflowing_factors():
    big = float(torch.finfo(torch.float32).max)
    g = torch.Generator().manual_seed(1)
    for _ in range(200):
        # magnitudes straddling the float32 overflow threshold of the products
        scale_b = 10.0 ** torch.randint(-5, 25, (), generator=g).item()
        scale_a = 10.0 ** torch.randint(-5, 25, (), generator=g).item()
        b = torch.randn(3, 4, generator=g) * scale_b
        a = torch.randn(3, 5, generator=g) * scale_a
        f = [_factors(b, a)]
        with np.errstate(over="ignore"):  # overflowing products are the point
            rows = (b.numpy()[:, :, None] * a.numpy()[:, None, :]).reshape(3, -1)
        if outer.certified(f):  # sound: a certified block has no NaN/Inf
            assert np.isfinite(rows).all()
        nb, na = b.double().norm().item(), a.double().norm().item()
        if nb * na > big:
            assert not outer.certified(f)
        elif nb * na <= big / 4 and max(nb, na) ** 2 < big / 4:
            # decided (float32 norms square their entries: larger ones make it say "check")
            assert outer.certified(f)
    nan_b = torch.ones(2, 2)
    nan_b[1, 0] = float("nan")
    assert not outer.certified([_factors(nan_b, torch.ones(2, 2))])
    inf_a = torch.ones(2, 2)
    inf_a[0, 1] = float("inf")
    assert not outer.certified([_factors(torch.ones(2, 2), inf_a)])
    assert outer.certified([])


@pytest.mark.parametrize("idle", [False, True])
def test_logging_forms_one_position_rows_in_the_writer_only_with_an_idle_core(
    tmp_path, monkeypatch, idle
):
    monkeypatch.setattr(outer, "idle_core", lambda: idle)
    threads = []
    fill = outer.fill

    def spy(rows, factors):
        threads.append((threading.current_thread().name, torch.get_num_threads()))
        return fill(rows, factors)

    monkeypatch.setattr(outer, "fill", spy)
    n_threads = torch.get_num_threads()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    x, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    run = nnstat.init(project="w", root_dir=tmp_path)
    nnstat.setup({"statistic": "none"})
    nnstat.watch(model)
    nnstat.add_projection(rank=2)
    for lo in (0, 5):
        with run(data_id=list(range(lo, lo + 5))):
            loss = nn.functional.cross_entropy(
                model(x[lo : lo + 5]), y[lo : lo + 5], reduction="sum"
            )
            loss.backward()
    nnstat.finalize()
    nnstat.unwatch()
    # the writer thread forms rows on one torch thread, beside training's own
    want = ("nnstat-store-writer", 1) if idle else (threading.current_thread().name, n_threads)
    assert threads == [want, want]
    assert nnstat.GradientStore(run.path).ids == list(range(10))


def test_idle_core_counts_torch_threads_of_every_local_process(monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert outer.idle_core()  # 2 of 4 cores
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert not outer.idle_core()  # two processes x 2 threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert outer.idle_core()
