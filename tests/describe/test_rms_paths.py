"""``rms = sqrt(mean(x^2))`` on every path that computes it, against numpy.

`summarize` picks its kernels by the statistics asked for: norms only (``_foreach_norm``), norms
with ``abs_max`` (the blocked sum of squares, min and max), with ``l1``, the moment pass, the
exact recomputation of a tensor holding NaN/Inf (finite elements only), and `pair_tables`
(weights and their update in one read); `light_rows` and `partials.finish` build the Tracker's
light columns from sums of squares. Each derives ``rms`` from a norm and a count.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nnstat.describe import summarize
from nnstat.describe.numpy_blocks import LIGHT_STATS, light_rows, sumsq_min_max, weight_update_norms
from nnstat.describe.partials import finish
from nnstat.describe.summary import pair_tables


def _tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # sizes above one block and odd sizes; scales far from 1 so rms != l2 / n != l2
    return [
        torch.randn(7, 13, generator=g) * 3.0,
        torch.randn(70_001, generator=g) * 0.2 + 0.1,
        torch.randn(5, generator=g, dtype=torch.float64) * 11.0,
    ]


def _rms(x: torch.Tensor) -> float:
    a = x.detach().double().numpy().ravel()
    a = a[np.isfinite(a)]
    return float(np.sqrt(np.mean(a * a)))


@pytest.mark.parametrize(
    "stats",
    [("rms",), ("l2", "rms"), ("rms", "abs_max"), ("rms", "abs_mean"), ("rms", "std")],
)
def test_summarize_rms_is_root_mean_square(stats):
    xs = _tensors()
    table = summarize(xs, stats)
    got = table[:, stats.index("rms")].tolist()
    assert got == pytest.approx([_rms(x) for x in xs], rel=1e-6)


@pytest.mark.parametrize("stats", [("rms",), ("rms", "abs_max"), ("rms", "std")])
def test_summarize_rms_of_a_tensor_with_nan_counts_finite_elements(stats):
    xs = _tensors()
    xs[0][2, 3] = float("nan")
    xs[1][10] = float("inf")
    table = summarize(xs, stats)
    got = table[:, stats.index("rms")].tolist()
    assert got == pytest.approx([_rms(x) for x in xs], rel=1e-6)


@pytest.mark.parametrize("stats", [("l2", "rms"), ("rms", "std")])
def test_pair_tables_rms_of_weights_and_update(stats):
    cur = [x.float() for x in _tensors()]
    g = torch.Generator().manual_seed(5)
    prev = [c - 0.01 * torch.randn(c.shape, generator=g) for c in cur]
    tw, tu = pair_tables(cur, prev, stats)
    j = stats.index("rms")
    assert tw[:, j].tolist() == pytest.approx([_rms(c) for c in cur], rel=1e-6)
    assert tu[:, j].tolist() == pytest.approx(
        [_rms(c.double() - p.double()) for c, p in zip(cur, prev, strict=True)], rel=1e-5
    )


def light_columns(numel, *norms):
    """`light_rows` finished into a dict of the `LIGHT_STATS` columns."""
    stats = sorted(LIGHT_STATS)
    table = finish(light_rows(numel, torch.stack(norms, dim=1)), stats, 0.0)
    return dict(zip(stats, table.unbind(1), strict=True))


def test_light_rows_rms_from_sums_of_squares():
    xs = [x.float() for x in _tensors()]
    numel = torch.tensor([x.numel() for x in xs], dtype=torch.float64)
    smm = sumsq_min_max(xs)
    cols = light_columns(numel, smm[:, 0], smm[:, 1], smm[:, 2])
    assert cols["rms"].tolist() == pytest.approx([_rms(x) for x in xs], rel=1e-6)
    # the fused weight/update pass's rows: [w sumsq, min, max, nonfinite, u sumsq, ...]
    prev = [x - 0.5 for x in xs]
    rows = weight_update_norms(xs, [p.clone() for p in prev], refresh=False)
    for lo, ref in ((0, xs), (4, [x - p for x, p in zip(xs, prev, strict=True)])):
        c = light_columns(numel, *(rows[:, lo + k] for k in range(4)))
        assert c["rms"].tolist() == pytest.approx([_rms(t) for t in ref], rel=1e-5)
