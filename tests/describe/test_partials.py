"""The statistics core's one partial-row layout (`nnstat.describe.partials`): `merge` combines
blocks, shards and ranks alike and `finish` gives numpy/scipy's statistics of the whole tensor;
every backend behind `core.partial_table` gives rows that finish to the same statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats
import torch

from nnstat.describe import STAT_NAMES, core, partials
from nnstat.describe.numpy_blocks import block_partials
from nnstat.describe.torch_segments import segment_partials


def _reference(x: np.ndarray) -> dict[str, float]:
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


def _assert_stats(values, x: np.ndarray, rel: float) -> None:
    want = _reference(x)
    for s, v in zip(STAT_NAMES, values, strict=True):
        tol = rel if s not in ("skew", "kurtosis") else 10 * rel
        assert v == pytest.approx(want[s], rel=tol, abs=tol), s


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5003, generator=g, dtype=torch.float64) * 2 + 7  # far from zero mean
    x[100:140] = 0.0
    x[17] = float("nan")
    return x


def test_merging_pieces_one_level_or_as_a_grid_gives_the_whole_tensors_statistics():
    x = _data()
    cuts = [0, 0, 1, 900, 901, 2500, 5003]  # empty and one-element pieces, as shards give
    rows = torch.stack([partials.exact_row(x[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)])
    flat = partials.merge(rows)
    grid = partials.merge(torch.stack([partials.merge(rows[:3]), partials.merge(rows[3:])]))
    torch.testing.assert_close(grid, flat, rtol=1e-12, atol=1e-9)
    for merged in (flat, grid):
        got = partials.finish(merged[None], STAT_NAMES, partials.eps_of(torch.float64))[0]
        _assert_stats(got.tolist(), x.numpy(), 1e-10)


@pytest.mark.parametrize("backend", ["numpy blocks", "torch segments", "dispatcher"])
def test_every_backend_gives_rows_that_finish_to_numpys_statistics(backend):
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(3000, generator=g) * 3 + 1, torch.randn(7, 9, generator=g).double()]
    run = {
        "numpy blocks": block_partials,
        "torch segments": segment_partials,
        "dispatcher": core.partial_table,
    }[backend]
    rows, eps = run(xs, STAT_NAMES, None)
    assert rows.shape == (2, partials.WIDTH) and eps.shape == (2,)
    table = partials.finish(rows, STAT_NAMES, eps)
    for x, row in zip(xs, table, strict=True):
        _assert_stats(row.tolist(), x.double().numpy(), 2e-5)


def test_constant_empty_and_all_nonfinite_tensors_finish_like_summarize():
    rows = torch.stack(
        [
            partials.exact_row(torch.full((10,), 0.1)),
            partials.exact_row(torch.zeros(0)),
            partials.exact_row(torch.full((3,), float("nan"))),
        ]
    )
    got = dict(zip(STAT_NAMES, partials.finish(rows, STAT_NAMES, 1e-7).T, strict=True))
    # a constant tensor: zero variance, undefined skew and kurtosis (scipy's NaN)
    assert got["var"][0].item() == 0.0 and math.isnan(got["skew"][0].item())
    assert math.isnan(got["kurtosis"][0].item())
    assert got["mean"][0].item() == pytest.approx(0.1)
    # nothing finite: counts and norms are 0 (nonfinite counts the NaNs), the rest NaN
    for i, numel in ((1, 0.0), (2, 3.0)):
        assert got["numel"][i].item() == numel and got["nonfinite"][i].item() == numel
        assert got["l1"][i].item() == 0.0 and got["l2"][i].item() == 0.0
        for s in ("mean", "var", "min", "max", "abs_max", "rms", "sparsity", "abs_mean"):
            assert math.isnan(got[s][i].item()), (s, i)


def test_unknown_partial_columns_are_refused_by_name():
    one = torch.ones(1, dtype=torch.float64)
    with pytest.raises(ValueError, match="sumsq"):
        partials.from_columns(one, sumsq=one)


@pytest.mark.parametrize("stats", [("l2", "rms", "abs_max", "nonfinite"), ("l2",)])
def test_half_precision_norms_on_the_cpu_path_are_not_rounded_to_their_dtype(stats):
    """A bfloat16 dot product or norm returns its sum in bfloat16 (up to 0.4% off): the CPU
    norm passes (the Tracker's default statistics, weight/update norms) reduce in float32."""
    import nnstat
    from nnstat.describe.numpy_blocks import weight_update_norms

    torch.manual_seed(0)
    model = torch.nn.Linear(200, 50).bfloat16()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    got = nnstat.get_grad(model).describe_layers(stats=list(stats))
    for name, p in model.named_parameters():
        ref = p.grad.double().norm().item()  # the exact norm of the bfloat16 values
        assert got[f"{name}/l2"] == pytest.approx(ref, rel=1e-5)
    w, prev = model.weight.detach().reshape(-1), torch.randn(10_000).bfloat16()[: 200 * 50]
    row = weight_update_norms([w], [prev])[0]
    assert row[0].item() == pytest.approx(w.double().square().sum().item(), rel=1e-5)
    diff = w - prev  # the difference in bfloat16, as the pass forms it
    assert row[4].item() == pytest.approx(diff.double().square().sum().item(), rel=1e-5)
