"""The fused row kernels of `nnstat.describe.triton_rows` (CUDA; on CPU under Triton's
interpreter) against numpy float64 references and against the torch kernels they replace."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_segments import assert_histograms, assert_stats, hard_tensors, reference

import nnstat.describe.torch_segments as segments
from nnstat.describe import STAT_NAMES, core, summarize, triton_rows
from nnstat.describe.torch_segments import HistSpec, segment_table

pytest.importorskip("triton", reason="the dev extra installs triton (Linux x86_64)")


@pytest.fixture
def fused(monkeypatch):
    """The device the fused kernels run on here, with the accelerator branch of `summarize`,
    and a counter of their launches (a test fails if the path was not taken)."""
    if torch.cuda.is_available():
        device = "cuda"
    else:
        monkeypatch.setenv("NNSTAT_TRITON", "interpret")
        device = "cpu"
        if not triton_rows.available(torch.device("cpu")):
            pytest.fail("TRITON_INTERPRET=1 must be set before triton is imported (conftest)")
    monkeypatch.setattr(core, "_host_path", lambda tensors: False)
    calls = {"a": 0, "b": 0, "gather": 0}
    for name, key in (("pass_a", "a"), ("pass_b", "b"), ("gather", "gather")):
        real = getattr(triton_rows, name)

        def counted(*args, _real=real, _key=key, **kwargs):
            calls[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(triton_rows, name, counted)
    return device, calls


def test_row_table_places_each_row_in_its_tensor():
    numels = [5, 2, 8, 1]
    t = triton_rows.RowTable.build(numels, 4, torch.device("cpu"))
    want_t, want_s = [], []
    for i, n in enumerate(numels):
        for start in range(0, n, 4):
            want_t.append(i)
            want_s.append(start)
    assert (t.rows, t.row_t.tolist(), t.row_s.tolist()) == (len(want_t), want_t, want_s)
    assert t.numels.tolist() == numels


def test_every_statistic_matches_numpy_float64(fused):
    device, calls = fused
    xs = hard_tensors()
    table = summarize([x.to(device) for x in xs], STAT_NAMES)
    assert calls["a"] >= 3 and calls["b"] >= 3  # float32, float64 and bf16 groups
    for i, (x, row) in enumerate(zip(xs, table.tolist(), strict=True)):
        ref = reference(x)
        assert_stats(dict(zip(STAT_NAMES, row, strict=True)), ref, f"tensor {i}")


@pytest.mark.parametrize("stats", [("l2", "rms", "abs_max", "nonfinite"), ("l1", "abs_mean")])
def test_norm_statistics_match_numpy_to_float64_accuracy(fused, stats):
    device, calls = fused
    xs = hard_tensors()
    table = summarize([x.to(device) for x in xs], stats)
    assert calls["a"] >= 3 and calls["b"] == 0  # one read per group, no moment pass
    for i, (x, row) in enumerate(zip(xs, table.tolist(), strict=True)):
        ref = reference(x)
        for s, v in zip(stats, row, strict=True):
            if math.isnan(ref[s]):
                assert math.isnan(v), (i, s)
            else:
                assert v == pytest.approx(ref[s], rel=1e-12), (i, s)


def test_fused_and_torch_kernels_give_the_same_table(fused, monkeypatch):
    device, calls = fused
    g = torch.Generator().manual_seed(3)
    xs = [torch.randn(6000, generator=g) * 3 + 1, torch.randn(17, 40, generator=g) * 1e-3]
    xs = [x.to(device) for x in xs]
    got = segment_table(xs, STAT_NAMES)[0]
    assert calls["a"] == 1
    monkeypatch.setenv("NNSTAT_TRITON", "0")
    if device == "cpu":  # the flat pass with pairwise sums (the CPU's accurate torch path)
        monkeypatch.setattr(segments, "_norm_kernels", lambda device: False)
    want = segment_table(xs, STAT_NAMES)[0]
    # sums to float32 rounding of the power sums; skew/kurtosis (order-1 ratios) absolutely
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6, equal_nan=True)
    exact = [STAT_NAMES.index(s) for s in ("numel", "min", "max", "abs_max", "sparsity")]
    assert torch.equal(got[:, exact].cpu(), want[:, exact].cpu())


@pytest.mark.parametrize("max_elements", [None, 3000])
def test_histogram_counts_equal_numpy_over_the_sample(fused, max_elements):
    device, calls = fused
    g = torch.Generator().manual_seed(1)
    xs = [
        torch.randn(20_000, generator=g),
        torch.rand(4100, generator=g) * 3 + 7,
        torch.randn(37, generator=g).double(),
        torch.full((5,), 2.0),
        torch.randn(3, 1500, generator=g) * 1e-3 + 100,
        torch.randn(2100, generator=g).to(torch.bfloat16),
    ]
    bins = 16
    _, hist, sampled = segment_table(
        [x.to(device) for x in xs], ("mean",), None, HistSpec(bins, max_elements)
    )
    assert calls["gather"] == 3  # float32, float64 and bf16 groups
    assert_histograms(xs, hist, sampled, bins, max_elements)


def test_strided_and_offset_tensors_are_read_as_their_values(fused):
    device, calls = fused
    g = torch.Generator().manual_seed(4)
    base = torch.randn(64, 130, generator=g)
    xs = [base.t(), base[3:, 5:], base.reshape(-1)[7:5000], base[::2]]
    table = summarize([x.to(device) for x in xs], STAT_NAMES)
    assert calls["a"] == 1 and calls["b"] == 1
    for i, (x, row) in enumerate(zip(xs, table.tolist(), strict=True)):
        assert_stats(dict(zip(STAT_NAMES, row, strict=True)), reference(x), f"tensor {i}")


def _broken_kernels():
    raise RuntimeError("no compiler for this device")


def test_kernels_that_fail_on_first_use_fall_back_to_torch_with_one_warning(fused, monkeypatch):
    device, _ = fused
    monkeypatch.setattr(triton_rows, "_LAUNCHED", set())
    monkeypatch.setattr(triton_rows, "_STATE", {"broken": False})
    monkeypatch.setattr(triton_rows, "_kernels", _broken_kernels)
    xs = hard_tensors()
    with pytest.warns(RuntimeWarning, match="fused statistics kernels failed on first use"):
        table = summarize([x.to(device) for x in xs], STAT_NAMES)
    for i, (x, row) in enumerate(zip(xs, table.tolist(), strict=True)):
        assert_stats(dict(zip(STAT_NAMES, row, strict=True)), reference(x), f"tensor {i}")
    assert not triton_rows.available(torch.device(device))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the torch path serves from now on
        again = summarize([x.to(device) for x in xs], STAT_NAMES)
    torch.testing.assert_close(again, table, rtol=0, atol=0, equal_nan=True)


def test_a_failure_once_the_kernels_have_run_is_raised(fused, monkeypatch):
    device, _ = fused
    monkeypatch.setattr(triton_rows, "_LAUNCHED", {"pass_a", "pass_b", "gather"})
    monkeypatch.setattr(triton_rows, "_STATE", {"broken": False})
    monkeypatch.setattr(triton_rows, "_kernels", _broken_kernels)
    with pytest.raises(RuntimeError, match="no compiler"):
        summarize([torch.randn(100).to(device)], STAT_NAMES)
