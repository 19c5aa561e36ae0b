"""Statistic reductions against numpy/scipy."""

import math

import numpy as np
import pytest
import scipy.stats
import torch

from nnstat.describe import STAT_NAMES, Description, histograms, summarize


def reference(x: np.ndarray) -> dict[str, float]:
    """Independent numpy/scipy version of every statistic, over the finite elements."""
    x = np.asarray(x, dtype=np.float64).ravel()
    fin = x[np.isfinite(x)]
    n = fin.size
    return {
        "numel": float(x.size),
        "mean": fin.mean(),
        "var": fin.var(),
        "std": fin.std(),
        "skew": scipy.stats.skew(fin, bias=True),
        "kurtosis": scipy.stats.kurtosis(fin, bias=True),
        "min": fin.min(),
        "max": fin.max(),
        "abs_mean": np.abs(fin).mean(),
        "abs_max": np.abs(fin).max(),
        "l1": np.abs(fin).sum(),
        "l2": np.linalg.norm(fin),
        "rms": np.sqrt((fin**2).mean()),
        "sparsity": float((fin == 0).sum()) / n,
        "nonfinite": float(x.size - n),
    }


def check(row, x, rtol=1e-5, atol=1e-6):
    ref = reference(x)
    for s, v in zip(STAT_NAMES, row, strict=True):
        assert v == pytest.approx(ref[s], rel=rtol, abs=atol), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_statistic_matches_numpy_and_scipy(dtype):
    torch.manual_seed(0)
    xs = [
        torch.randn(40, 30, dtype=dtype),
        (torch.rand(500, dtype=dtype) ** 3) * 5 + 2,  # skewed, far from zero mean
        torch.tensor([0.0, 0.0, 1.0, -2.0, 0.0], dtype=dtype),
        torch.randn(3, 4, 5, dtype=dtype).relu(),  # sparse
    ]
    table = summarize(xs, STAT_NAMES)
    assert table.shape == (4, len(STAT_NAMES)) and table.dtype == torch.float64
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    for row, x in zip(table.tolist(), xs, strict=True):
        check(row, x.numpy(), rtol=tol, atol=tol)


def test_integer_and_half_tensors_are_upcast():
    x = torch.tensor([1, 2, 3, 10], dtype=torch.int64)
    h = torch.tensor([0.5, -1.5, 2.0], dtype=torch.float16)
    table = summarize([x, h], STAT_NAMES).tolist()
    check(table[0], x.numpy())
    check(table[1], h.float().numpy(), rtol=1e-3)


def test_nonfinite_counted_and_stats_use_finite_part():
    x = torch.tensor([1.0, float("nan"), 3.0, float("inf"), -float("inf"), 0.0, 8.0])
    row = summarize([x], STAT_NAMES)[0].tolist()
    check(row, x.numpy())
    assert row[STAT_NAMES.index("nonfinite")] == 3
    assert row[STAT_NAMES.index("numel")] == 7


def test_default_cheap_stats_count_nonfinite():
    x = torch.tensor([1.0, float("nan"), 2.0])
    l2, rms, amax, nf = summarize([x, torch.ones(4)]).tolist()[0]
    assert nf == 1 and l2 == pytest.approx(math.sqrt(5)) and amax == 2.0
    assert rms == pytest.approx(math.sqrt(5 / 2))


def test_float32_overflow_is_recomputed_in_float64():
    x = torch.tensor([3e20, 4e20], dtype=torch.float32)
    l2, nf = summarize([x], ["l2", "nonfinite"])[0].tolist()
    assert nf == 0 and l2 == pytest.approx(5e20, rel=1e-6)


def test_constant_and_empty_tensors():
    row = dict(
        zip(STAT_NAMES, summarize([torch.full((6,), 2.5)], STAT_NAMES)[0].tolist(), strict=True)
    )
    assert row["var"] == 0 and row["mean"] == 2.5
    assert math.isnan(row["skew"]) and math.isnan(row["kurtosis"])  # as scipy: undefined
    empty = dict(zip(STAT_NAMES, summarize([torch.empty(0)], STAT_NAMES)[0].tolist(), strict=True))
    assert empty["numel"] == 0 and empty["nonfinite"] == 0 and math.isnan(empty["mean"])
    nan_only = dict(
        zip(
            STAT_NAMES, summarize([torch.full((2,), math.nan)], STAT_NAMES)[0].tolist(), strict=True
        )
    )
    assert nan_only["nonfinite"] == 2 and math.isnan(nan_only["mean"])


def _as_dict(row):
    return dict(zip(STAT_NAMES, row, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n", [1000, 200_000])
@pytest.mark.filterwarnings("ignore:Precision loss:RuntimeWarning")
def test_constant_tensor_has_nan_skew_and_kurtosis_like_scipy(dtype, n):
    """A constant tensor has undefined skew and kurtosis (NaN, as scipy says), however many
    copies it holds: the rounding residues of the block means must not be divided by a zeroed or
    tiny variance (that would give skew=-inf/kurtosis=+inf, or finite nonsense)."""
    from nnstat.netdict import NetDict

    for value in (0.1, 1e-10, 1e6, 0.0):
        t = torch.full((n,), value, dtype=dtype)
        x = t.double().numpy()  # the values actually stored, exactly
        ref_skew, ref_kurt = scipy.stats.skew(x, bias=True), scipy.stats.kurtosis(x, bias=True)
        assert math.isnan(ref_skew) and math.isnan(ref_kurt)  # the reference calls it undefined
        for row in (
            _as_dict(summarize([t], STAT_NAMES)[0].tolist()),
            dict(NetDict({"a": t}).describe()),  # the public entry point
        ):
            assert math.isnan(row["skew"]) and math.isnan(row["kurtosis"]), (value, row)
            assert row["var"] == 0.0 and row["std"] == 0.0
            assert row["mean"] == pytest.approx(x.mean(), rel=1e-12, abs=0)
            assert row["min"] == row["max"] == x[0]
            assert row["l2"] == pytest.approx(np.linalg.norm(x), rel=1e-9)


@pytest.mark.filterwarnings("ignore:Precision loss:RuntimeWarning")
def test_ulp_spread_tensor_is_numerically_constant_like_scipy():
    """Values one ulp apart have m2 below scipy's (eps * mean)^2: undefined skew/kurtosis, while
    a spread of a few thousand ulps is an ordinary distribution and matches scipy."""
    rng = np.random.default_rng(3)
    for v in (0.1, 3.0, 1e6):
        x = np.where(rng.random(200_000) < 0.3, np.nextafter(v, 2 * v), v)
        assert math.isnan(scipy.stats.skew(x)) and math.isnan(scipy.stats.kurtosis(x))
        row = _as_dict(summarize([torch.from_numpy(x)], STAT_NAMES)[0].tolist())
        assert math.isnan(row["skew"]) and math.isnan(row["kurtosis"]) and row["var"] == 0.0
        wide = v + v * 1e-12 * rng.standard_normal(200_000)
        row = _as_dict(summarize([torch.from_numpy(wide)], STAT_NAMES)[0].tolist())
        assert row["var"] == pytest.approx(wide.var(), rel=1e-6)
        assert row["skew"] == pytest.approx(scipy.stats.skew(wide), abs=1e-3)
        assert row["kurtosis"] == pytest.approx(scipy.stats.kurtosis(wide), abs=1e-3)


@pytest.mark.parametrize("n", [768, 200_000])
def test_float32_moments_of_a_narrow_spread_match_scipy(n):
    """A LayerNorm weight near 1 with a spread of ~1e-6 (a few ulps) has each block centred on a
    rounded mean whose residue is as large as the spread: the combination must keep that
    first-moment term, or skew is off by ~0.1 and kurtosis by as much."""
    rng = np.random.default_rng(4)
    for rel in (1e-4, 1e-6):
        x32 = (1.0 + rel * rng.standard_normal(n)).astype(np.float32)
        x = x32.astype(np.float64)
        row = _as_dict(summarize([torch.from_numpy(x32)], STAT_NAMES)[0].tolist())
        assert row["mean"] == pytest.approx(x.mean(), rel=1e-12)
        assert row["var"] == pytest.approx(x.var(), rel=1e-4)
        assert row["skew"] == pytest.approx(scipy.stats.skew(x), abs=1e-3)
        assert row["kurtosis"] == pytest.approx(scipy.stats.kurtosis(x), abs=1e-3)


def test_bad_input():
    with pytest.raises(ValueError, match="valid names are .*kurtosis"):
        summarize([torch.ones(2)], ["l2", "kurtossis"])
    with pytest.raises(TypeError, match="item 1"):
        summarize([torch.ones(2), [1.0, 2.0]], ["l2"])
    assert summarize([], ["l2", "mean"]).shape == (0, 2)


def test_histograms_match_numpy():
    torch.manual_seed(0)
    x = torch.randn(1000)
    (h,) = histograms([x], bins=16)
    counts, edges = np.histogram(x.numpy(), bins=16, range=(x.min().item(), x.max().item()))
    np.testing.assert_allclose(h.edges, edges, rtol=1e-6)
    # histc and numpy may disagree on an element sitting exactly on an inner edge
    assert np.abs(h.counts - counts).sum() <= 2 and h.counts.sum() == 1000
    assert h.num == 1000 and h.sum == pytest.approx(x.double().sum().item(), rel=1e-5)
    assert h.sum_squares == pytest.approx((x.double() ** 2).sum().item(), rel=1e-5)
    (hn,) = histograms([torch.tensor([1.0, float("nan"), 2.0])], bins=4)
    assert hn.num == 2 and hn.counts.sum() == 2


def test_description_repr_and_frame():
    d = Description({"a.weight": {"l2": 1.0, "mean": 0.25}, "b": {"l2": 2.0, "mean": -1.0}})
    text = repr(d)
    assert text.splitlines()[0].split() == ["layer", "l2", "mean"]
    assert "a.weight" in text and "0.25" in text
    frame = d.to_frame()
    assert list(frame.index) == ["a.weight", "b"] and frame.loc["b", "mean"] == -1.0
    whole = Description({"l2": 3.0})
    assert list(whole.to_frame().columns) == ["l2"]


@pytest.mark.parametrize("chunk", [7, 64, 1 << 16])
def test_blocked_moments_combine_exactly(monkeypatch, chunk):
    import nnstat.describe as st
    import nnstat.describe.moments

    monkeypatch.setattr(nnstat.describe.moments, "CHUNK", chunk)
    torch.manual_seed(1)
    # far-from-zero mean and heavy skew: the block combination must not lose precision
    x = torch.distributions.Gamma(2.0, 3.0).sample((1000,)) + 50.0
    x[::13] = 0.0
    big = torch.randn(200_003) * 0.01 + 0.3
    for t in (x, big):
        row = st.summarize([t], STAT_NAMES)[0].tolist()
        check(row, t.numpy(), rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("chunk", [64, 1 << 16])
def test_moments_of_tiny_and_mixed_magnitudes(monkeypatch, chunk):
    """Values near 1e-10 (Adam's exp_avg_sq) have float32-denormal fourth powers; the pass
    rescales by a power of two taken from the first block, and falls back when a later block is
    so much larger that the rescaled powers overflow."""
    import nnstat.describe.moments

    monkeypatch.setattr(nnstat.describe.moments, "CHUNK", chunk)
    torch.manual_seed(2)
    tiny = torch.rand(5000) ** 3 * 1e-10
    mixed = torch.cat([torch.rand(64) * 1e-12, torch.randn(3000) * 1e4])
    for t in (tiny, mixed):
        row = summarize([t], STAT_NAMES)[0].tolist()
        check(row, t.numpy(), rtol=2e-4, atol=0.0)


def test_summarize_restores_the_thread_count():
    from nnstat.describe import cpu_single_thread

    before = torch.get_num_threads()
    summarize([torch.randn(100)], STAT_NAMES)
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError):
        with cpu_single_thread():
            assert torch.get_num_threads() == 1
            raise RuntimeError("boom")
    assert torch.get_num_threads() == before


def _light_reference(x: np.ndarray) -> list[float]:
    """[sumsq, min, max, nonfinite] over the finite elements, numpy in float64."""
    x = np.asarray(x, dtype=np.float64).ravel()
    fin = x[np.isfinite(x)]
    if not fin.size:
        return [0.0, math.inf, -math.inf, float(x.size)]
    return [float(fin @ fin), fin.min(), fin.max(), float(x.size - fin.size)]


@pytest.mark.parametrize("use_numpy", [True, False])
@pytest.mark.parametrize("refresh", [False, True])
def test_fused_weight_update_pass_is_exact_with_nonfinite_blocks(monkeypatch, refresh, use_numpy):
    import nnstat.describe.moments
    import nnstat.describe.numpy_blocks as sf

    monkeypatch.setattr(sf, "BLOCK", 64)  # several blocks per tensor
    if not use_numpy:  # the torch path (accelerators, half precision)
        monkeypatch.setattr(nnstat.describe.moments, "numpy_ok", lambda t: False)
    torch.manual_seed(0)
    cur = [torch.randn(300), torch.randn(7, 20), torch.randn(0), torch.full((5,), 1e25)]
    prev = [c + 0.01 * torch.randn_like(c) for c in cur]
    cur[0][10] = float("nan")  # weight and update non-finite in block 0
    prev[0][200] = float("inf")  # only the update non-finite, in block 3
    cur[1][0, 0] = float("-inf")
    # cur[3] is finite but its float32 sum of squares overflows: exact float64 path
    old = [p.clone() for p in prev]
    table = sf.weight_update_norms(cur, prev, refresh=refresh)
    assert table.shape == (4, 8) and table.dtype == torch.float64
    for i, (c, p) in enumerate(zip(cur, old, strict=True)):
        c64, p64 = c.double().numpy(), p.double().numpy()
        expected = _light_reference(c64) + _light_reference(c64 - p64)
        np.testing.assert_allclose(table[i].numpy(), expected, rtol=1e-5)
        # refresh rewrites the snapshot with the current weights, else it is left alone
        torch.testing.assert_close(prev[i], c if refresh else p, rtol=0, atol=0, equal_nan=True)
    from nnstat.describe.partials import finish

    stats = ("rms", "nonfinite", "abs_max")
    numel = torch.tensor([300.0, 0.0], dtype=torch.float64)
    rows = finish(sf.light_rows(numel, table[[0, 2], :4]), stats, 0.0)
    cols = dict(zip(stats, rows.unbind(1), strict=True))
    fin = cur[0][torch.isfinite(cur[0])].double()
    assert cols["rms"][0].item() == pytest.approx(fin.pow(2).mean().sqrt().item(), rel=1e-6)
    assert cols["nonfinite"][0].item() == 1
    assert math.isnan(cols["abs_max"][1].item()) and math.isnan(cols["rms"][1].item())
    with pytest.raises(ValueError, match="differ"):
        sf.weight_update_norms([torch.zeros(2)], [torch.zeros(3)])


@pytest.mark.parametrize("use_numpy", [True, False])
def test_blocked_sumsq_min_max(monkeypatch, use_numpy):
    import nnstat.describe.moments
    import nnstat.describe.numpy_blocks as sf

    monkeypatch.setattr(sf, "BLOCK", 64)
    if not use_numpy:
        monkeypatch.setattr(nnstat.describe.moments, "numpy_ok", lambda t: False)
    torch.manual_seed(1)
    xs = [torch.randn(500) * 3, torch.randn(3, 7).double(), torch.full((130,), 1e25)]
    table = sf.sumsq_min_max(xs)
    for row, x in zip(table.tolist(), xs, strict=True):
        ref = _light_reference(x.double().numpy())[:3]
        if not use_numpy and x.abs().max().item() > 1e20:
            # the torch path leaves the float32 overflow visible (callers then recompute)
            assert math.isinf(row[0]) and row[1:] == ref[1:]
            continue
        np.testing.assert_allclose(row, ref, rtol=1e-5)
    bad = torch.randn(200)
    bad[150] = float("nan")
    # a non-finite element leaves a non-finite sum of squares: callers recompute exactly
    assert math.isnan(sf.sumsq_min_max([bad])[0, 0].item())


def test_statistics_of_a_model_on_meta_name_the_device_and_the_fix():
    """Parameters built on ``meta`` by mistake hold no values: the statistics say so and how to
    fix it (torch's own error, "Cannot copy out of meta tensor", names neither)."""
    from nnstat.netdict import get_weight

    weights = get_weight(torch.nn.Linear(3, 2, device="meta"))
    for describe in (weights.describe, weights.describe_layers):
        with pytest.raises(
            RuntimeError, match="on the meta device and have no values.*build the model on a real"
        ):
            describe()


def test_weight_update_pass_refuses_to_refresh_a_non_contiguous_snapshot():
    """Refreshing writes through a flat view, which for a non-contiguous tensor is a copy:
    the refresh would be lost without a word. Without refresh the pair is read correctly."""
    from nnstat.describe.block_passes import run_passes
    from nnstat.describe.numpy_blocks import weight_update_pass

    w = torch.randn(4, 3)
    prev = torch.randn(3, 4).t()
    with pytest.raises(ValueError, match="previous must be contiguous"):
        weight_update_pass([w], [prev], refresh=True)
    row = run_passes([weight_update_pass([w], [prev])])[0][0]
    assert float(row[4]) == pytest.approx(float((w - prev).double().pow(2).sum()), rel=1e-6)
