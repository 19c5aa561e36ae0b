"""The shard-combination maths (`nnstat.describe.partials`, `nnstat.describe.sharded`) against
numpy/scipy on the whole tensor."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch
import torch.distributed as dist

from nnstat import distributed as nd
from nnstat.describe import STAT_NAMES, partials, summarize
from nnstat.describe.sharded import norms_sharded, summarize_sharded


def _numpy_row(x: np.ndarray) -> dict[str, float]:
    f = x[np.isfinite(x)]
    return {
        "numel": float(x.size),
        "nonfinite": float(x.size - f.size),
        "mean": f.mean(),
        "var": f.var(),
        "std": f.std(),
        "skew": scipy.stats.skew(f),
        "kurtosis": scipy.stats.kurtosis(f),
        "min": f.min(),
        "max": f.max(),
        "abs_mean": np.abs(f).mean(),
        "abs_max": np.abs(f).max(),
        "l1": np.abs(f).sum(),
        "l2": np.linalg.norm(f),
        "rms": np.sqrt((f * f).mean()),
        "sparsity": (f == 0).mean(),
    }


def test_uneven_shards_with_nonfinite_and_empty_pieces_combine_to_the_whole():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(101, generator=g) * 3 + 5  # a large mean stresses the moment shifts
    x[[3, 50]] = float("nan")
    x[77] = float("inf")
    x[10:14] = 0.0
    pieces = [x[:0], x[:40], x[40:41], x[41:41], x[41:]]  # empty shards, as FSDP gives
    rows = torch.stack([partials.exact_row(p) for p in pieces])
    combined = partials.merge(rows.unsqueeze(1))
    got = partials.finish(combined, STAT_NAMES, torch.finfo(torch.float32).eps)[0].tolist()
    want = _numpy_row(x.double().numpy())
    for s, v in zip(STAT_NAMES, got, strict=True):
        assert v == pytest.approx(want[s], rel=1e-9, abs=1e-12), s
    # and the unsharded path of nnstat agrees (float32 moment pass there)
    ref = summarize([x], STAT_NAMES)[0].tolist()
    for s, a, b in zip(STAT_NAMES, got, ref, strict=True):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batched_partial_rows_combine_to_the_whole_like_numpy(dtype):
    """`describe.core.local_partial_rows` (the statistics core on every shard at once)
    gives the rows `partials.exact_row` gives one tensor at a time, and they combine to numpy's
    statistics of the whole tensor."""
    from nnstat.describe.core import local_partial_rows

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3001, generator=g) * 3 + 5).to(dtype)
    x[[3, 50]] = float("nan")
    x[777] = float("inf")
    x[10:14] = 0.0
    x[2000:2100] = 1.5  # a constant shard below
    pieces = [x[:0], x[:1000], x[1000:1001], x[1001:2000], x[2000:2100], x[2100:]]
    batched = local_partial_rows(pieces, STAT_NAMES)
    one_by_one = torch.stack([partials.exact_row(p) for p in pieces])
    exact = [partials.COLUMNS.index(c) for c in ("numel", "n", "min", "max", "amax", "zeros")]
    torch.testing.assert_close(batched[:, exact], one_by_one[:, exact], rtol=0, atol=0)
    torch.testing.assert_close(batched, one_by_one, rtol=2e-6, atol=1e-9)
    combined = partials.merge(batched.unsqueeze(1))
    eps = torch.finfo(dtype).eps
    got = partials.finish(combined, STAT_NAMES, eps)[0].tolist()
    want = _numpy_row(x.double().numpy())
    for s, v in zip(STAT_NAMES, got, strict=True):
        # float32 data: moments to float32 rounding; skew/kurtosis (order-1 ratios) absolutely
        tol = 2e-6 if s in ("skew", "kurtosis") else 1e-9
        assert v == pytest.approx(want[s], rel=2e-6, abs=tol), s


def test_all_nonfinite_and_empty_tensors_match_summarize():
    xs = [torch.full((3,), float("nan")), torch.zeros(0), torch.tensor([2.0, 2.0])]
    got = summarize_sharded(xs, STAT_NAMES)
    ref = summarize(xs, STAT_NAMES)
    torch.testing.assert_close(got, ref, equal_nan=True)


@pytest.mark.parametrize("p", [1, 2, 3, math.inf, -math.inf, 0])
def test_norms_match_numpy(p):
    x = torch.tensor([3.0, -4.0, 0.0, 0.5])
    want = float(np.linalg.norm(x.numpy(), ord=p))
    assert norms_sharded([x], p)[0] == pytest.approx(want)


@pytest.fixture
def single_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_partial_placement_is_refused_and_shard_equals_plain(single_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    assert nd.rank_world() == (0, 1)
    mesh = init_device_mesh("cpu", (1,))
    x = torch.randn(5, 3)
    sharded = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
    torch.testing.assert_close(
        summarize([sharded], STAT_NAMES), summarize([x], STAT_NAMES), rtol=1e-4, atol=1e-6
    )
    pending = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    with pytest.raises(ValueError, match="Partial"):
        summarize([pending], ["l2"])


@pytest.mark.parametrize("n", [1_000, 200_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_shards_have_nan_skew_and_kurtosis_like_scipy(n, dtype):
    """A constant tensor split into shards: scipy gives var 0 and NaN skew/kurtosis (the
    deviations about the rounded shard mean must not leave their residue in the moments)."""
    x = torch.full((n,), 0.1, dtype=dtype)
    pieces = [x[: n // 3], x[n // 3 :]]
    rows = torch.stack([partials.exact_row(p) for p in pieces])
    combined = partials.merge(rows.unsqueeze(1))
    values = partials.finish(combined, STAT_NAMES, torch.finfo(dtype).eps)[0].tolist()
    got = dict(zip(STAT_NAMES, values, strict=True))
    f = x.double().numpy()
    assert got["var"] == pytest.approx(float(np.var(f)), abs=1e-30)
    assert math.isnan(scipy.stats.skew(f)) and math.isnan(got["skew"])
    assert math.isnan(scipy.stats.kurtosis(f)) and math.isnan(got["kurtosis"])
    assert got["mean"] == pytest.approx(float(f.mean()), rel=1e-12)
