"""nnstat.plot: every figure renders to a real PNG, and the data behind it is the right data."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("matplotlib")

import nnstat.plot as nplt  # noqa: E402
from nnstat.plot.frames import matrix_2d, metrics_frame, select_layers  # noqa: E402
from nnstat.plot.influence import _fmt  # noqa: E402


def _png(fig, path: Path) -> tuple[int, int]:
    fig.savefig(path, dpi=100)
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG file"
    assert len(raw) > 5_000, f"suspiciously small PNG ({len(raw)} bytes): empty figure?"
    width, height = struct.unpack(">II", raw[16:24])
    return width, height


def _history(n_steps: int = 12) -> list[dict]:
    out = []
    for s in range(n_steps):
        out.append(
            {
                "step": 10 * s,
                "grad/fc1.weight/l2": 1.0 / (s + 1),
                "grad/fc2.weight/l2": 100.0 / (s + 1),
                "weight/fc1.weight/l2": 3.0,
                "trust_ratio/fc1.weight": 50.0 + s,
                "trust_ratio/fc2.weight": float("inf") if s == 0 else 80.0 + s,
                "noise_scale/b_simple": 20.0 + 3 * s,
                "noise_scale/low": 15.0 + 3 * s,
                "noise_scale/high": 26.0 + 3 * s,
            }
        )
    return out


def test_histogram_and_heatmap_render(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    weights = {n: p.detach() for n, p in model.named_parameters()}
    w, h = _png(nplt.histogram(weights, "0.weight"), tmp_path / "h.png")
    assert (w, h) == (640, 380)
    w, h = _png(nplt.histogram(weights, ["0.weight", "2.weight"], log_y=True), tmp_path / "h2.png")
    assert (w, h) == (640, 380)
    w, h = _png(nplt.weight_heatmap(weights, "0.weight"), tmp_path / "m.png")
    assert 400 <= w <= 900 and 260 <= h <= 750
    conv = torch.nn.Conv2d(3, 8, 3).weight
    _png(nplt.weight_heatmap(conv), tmp_path / "c.png")


def test_histogram_counts_nonfinite_and_rejects_bad_input():
    values = torch.tensor([1.0, 2.0, float("nan"), float("inf"), 3.0])
    fig = nplt.histogram(values)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "nonfinite=2" in legend[0] and "n=5" in legend[0]
    with pytest.raises(ValueError, match="layer="):
        nplt.histogram({"a": torch.ones(3), "b": torch.ones(3)})
    with pytest.raises(KeyError, match="available"):
        nplt.histogram({"a": torch.ones(3)}, "nope")
    with pytest.raises(ValueError, match="finite"):
        nplt.histogram(torch.tensor([float("nan")]))


def test_heatmap_shows_the_matrix_and_block_averages_large_ones():
    w = torch.arange(12.0).reshape(3, 4) - 6
    fig = nplt.weight_heatmap(w)
    shown = np.asarray(fig.axes[0].get_images()[0].get_array())
    np.testing.assert_array_equal(shown, w.numpy())
    lo, hi = fig.axes[0].get_images()[0].get_clim()
    assert lo == -hi == -6.0  # symmetric around zero
    big = np.random.default_rng(0).normal(size=(10, 7))
    small = matrix_2d(big, 4)
    # reference: pad with NaN to a multiple of the block, average each block
    ref_rows = [
        np.nanmean(np.pad(big, ((0, 2), (0, 0)), constant_values=np.nan)[i : i + 3], 0)
        for i in range(0, 12, 3)
    ]
    ref = np.stack(ref_rows)
    ref = np.stack(
        [
            np.nanmean(np.pad(ref, ((0, 0), (0, 1)), constant_values=np.nan)[:, j : j + 2], 1)
            for j in range(0, 8, 2)
        ],
        axis=1,
    )
    np.testing.assert_allclose(small, ref)
    assert matrix_2d(np.ones((4, 2, 3, 3)), 512).shape == (4, 18)


def test_metrics_frame_accepts_lists_pairs_and_frames():
    hist = _history(3)
    frame = metrics_frame(hist)
    assert frame.index.tolist() == [0, 10, 20]
    assert "step" not in frame.columns
    pairs = metrics_frame([(5, {"a": 1.0}), (7, {"a": 2.0, "img": "not a number"})])
    assert pairs["a"].tolist() == [1.0, 2.0] and "img" not in pairs.columns
    long = pd.DataFrame({"step": [1, 1, 2], "tag": ["x", "y", "x"], "value": [1.0, 2.0, 3.0]})
    wide = metrics_frame(long)
    assert wide.loc[2, "x"] == 3.0 and np.isnan(wide.loc[2, "y"])
    with pytest.raises(TypeError, match="history"):
        metrics_frame(42)
    with pytest.raises(ValueError, match="empty"):
        metrics_frame([])


def test_heatmap_ticks_are_round_steps():
    hist = [{"step": s, "grad/a/l2": 1.0} for s in range(5, 125, 5)]
    fig = nplt.stat_heatmap(hist, "l2", prefix="grad/")
    labels = [int(t.get_text()) for t in fig.axes[0].get_xticklabels()]
    assert len(labels) >= 3 and all(v % 10 == 0 for v in labels)


def test_select_layers_uses_the_prefix_and_names_missing_keys():
    frame = metrics_frame(_history(2))
    grads = select_layers(frame, "l2", prefix="grad/")
    assert list(grads.columns) == ["fc1.weight", "fc2.weight"]
    assert grads["fc2.weight"].tolist() == [100.0, 50.0]
    with pytest.raises(KeyError, match="grad/<layer>/rms"):
        select_layers(frame, "rms", prefix="grad/")
    with pytest.raises(KeyError, match="available"):
        select_layers(frame, "l2", prefix="grad/", layers=["fc3.weight"])
    assert list(select_layers(frame, "l2", "grad/", exclude="fc1").columns) == ["fc2.weight"]


def test_stat_heatmap_trust_ratio_and_noise_scale_render(tmp_path):
    hist = _history()
    fig = nplt.stat_heatmap(hist, "l2", prefix="grad/")
    shown = np.asarray(fig.axes[0].get_images()[0].get_array())
    assert shown.shape == (2, 12)
    np.testing.assert_allclose(shown[1], [100.0 / (s + 1) for s in range(12)])
    w, h = _png(fig, tmp_path / "s.png")
    assert w >= 600 and h >= 260
    fig = nplt.trust_ratio_plot(hist)
    lines = fig.axes[0].get_lines()
    assert [ln.get_label() for ln in lines] == ["fc1.weight", "fc2.weight"]
    assert np.isnan(lines[1].get_ydata()[0])  # inf (no update) is not drawn
    w, h = _png(fig, tmp_path / "t.png")
    assert w >= 600 and h >= 380
    only = nplt.trust_ratio_plot(hist, include="fc2")
    assert [ln.get_label() for ln in only.axes[0].get_lines()] == ["fc2.weight"]
    assert only.axes[0].get_yscale() == "linear"  # 80..91: no need for a log scale
    fig = nplt.noise_scale_plot(hist, batch_size=32)
    assert _png(fig, tmp_path / "n.png") == (700, 380)
    fig = nplt.noise_scale_plot([0, 1, 2], [5.0, 6.0, 7.0], ([4, 5, 6], [6, 7, 8]))
    np.testing.assert_array_equal(fig.axes[0].get_lines()[0].get_ydata(), [5.0, 6.0, 7.0])
    with pytest.raises(ValueError, match="shape"):
        nplt.noise_scale_plot([0, 1], [1.0, 2.0, 3.0])


class _Result:
    def __init__(self, scores, test_ids, train_ids):
        self.scores, self.test_ids, self.train_ids = scores, test_ids, train_ids


def test_influence_figure_picks_top_and_bottom_scores(tmp_path):
    rng = np.random.default_rng(1)
    scores = torch.tensor(rng.normal(size=(3, 40)), dtype=torch.float32)
    train_ids = [f"t{i}" for i in range(40)]
    result = _Result(scores, ["a", "b", "c"], train_ids)
    images = torch.rand(40, 8, 8)
    fig = nplt.influence_figure(
        torch.rand(3, 64), images, result, k=3, train_labels=list(range(40))
    )
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    for q in range(3):
        order = np.argsort(scores[q].numpy())
        best, worst = order[::-1][:3], order[:3]
        row = titles[q * 7 : (q + 1) * 7]
        assert row[0].startswith(f"query {'abc'[q]}")
        for title, j in zip(row[1:4], best, strict=True):
            assert f"#t{j} · label {j}" in title and _fmt(scores[q, j].item()) in title
        for title, j in zip(row[4:7], worst, strict=True):
            assert f"#t{j}" in title
    w, h = _png(fig, tmp_path / "i.png")
    assert w == int(100 * (1.25 * 7 + 0.6)) and h == int(100 * (1.55 * 3 + 0.62))


def test_influence_figure_accepts_mappings_and_rejects_bad_images():
    scores = np.array([[0.5, -1.0, 2.0]])
    images = {"x": np.zeros((3, 8, 8)), "y": np.ones((8, 8, 1)), "z": np.eye(8)}
    fig = nplt.influence_figure([np.eye(8)], images, _Result(scores, [0], ["x", "y", "z"]), k=1)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert "#z" in titles[1] and "#y" in titles[2]
    with pytest.raises(ValueError, match="image_shape"):
        nplt.influence_figure([np.zeros(10)], np.zeros((3, 10)), scores, k=1)
    with pytest.raises(ValueError, match="k must"):
        nplt.influence_figure([np.eye(8)], images, scores, k=0)


def test_influence_figure_takes_the_influence_result_types():
    from nnstat.influence import InfluenceResult

    scores = torch.tensor([[0.5, -1.0, 2.0, 0.1], [3.0, 0.0, -2.0, 1.0]])
    full = InfluenceResult(scores, ["a", "b"], [10, 11, 12, 13])
    images = {i: torch.rand(8, 8) for i in (10, 11, 12, 13)}
    queries = {"a": torch.rand(8, 8), "b": torch.rand(8, 8)}
    for result in (full, full.top_k(2)):  # the full matrix and a TopKInfluence
        fig = nplt.influence_figure(queries, images, result, k=2)
        titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
        assert titles[0].startswith("query a") and "#12" in titles[1] and "#11" in titles[3]
        assert titles[5].startswith("query b") and "#10" in titles[6] and "#12" in titles[8]


def test_score_format_is_compact():
    assert [_fmt(v) for v in (2960.4, 275.2, 1.2345, -0.0045123, 1.2e7)] == [
        "+2960", "+275", "+1.23", "-0.00451", "+1.20e+07",
    ]  # fmt: skip


def test_score_distribution(tmp_path):
    scores = np.random.default_rng(0).normal(size=(4, 300))
    fig = nplt.score_distribution(scores)
    heights = sum(p.get_height() for p in fig.axes[0].patches)
    assert heights == 1200  # every score is in a bar
    assert _png(fig, tmp_path / "d.png") == (640, 360)
    self_inf = np.abs(scores[0])
    fig = nplt.score_distribution(self_inf, highlight=[3, 7], log_y=False)
    (marks,) = [ln.get_xdata() for ln in fig.axes[0].get_lines() if ln.get_label() == "highlighted"]
    np.testing.assert_allclose(marks, self_inf[[3, 7]])
    with pytest.raises(ValueError, match="finite"):
        nplt.score_distribution(np.array([np.nan]))


def test_histogram_titles_name_what_is_plotted():
    weights = {"a.weight": torch.randn(50), "b.weight": torch.randn(50)}
    title = nplt.histogram(weights, ["a.weight", "b.weight"]).axes[0].get_title()
    assert title != "histogram" and "a.weight" in title and "b.weight" in title


def test_stat_heatmap_robust_limits_are_percentiles(tmp_path):
    rng = np.random.default_rng(2)
    values = rng.lognormal(size=(3, 40))
    values[0, 0] = 1e4  # one extreme step, like Adam's first update
    hist = [
        {"step": 5 * s, **{f"update/l{i}/rms": values[i, s] for i in range(3)}} for s in range(40)
    ]
    lo, hi = (
        nplt.stat_heatmap(hist, "rms", prefix="update/", robust=True)
        .axes[0]
        .get_images()[0]
        .get_clim()
    )
    np.testing.assert_allclose((lo, hi), np.percentile(values, [2, 98]))
    lo, hi = (
        nplt.stat_heatmap(hist, "rms", prefix="update/", log=True, robust=True)
        .axes[0]
        .get_images()[0]
        .get_clim()
    )
    np.testing.assert_allclose((lo, hi), np.percentile(values, [2, 98]))
    plain = nplt.stat_heatmap(hist, "rms", prefix="update/", log=False).axes[0].get_images()[0]
    assert plain.get_clim() == (values.min(), values.max())


def test_training_curves_plot_the_logged_points():
    hist = [{"step": s, "train/loss": 1 / (s + 1), "test/loss": 2 / (s + 1)} for s in range(6)]
    hist[2].pop("test/loss")  # not logged at that step: the line joins its neighbours
    fig = nplt.training_curves(hist, {"loss": {"train": "train/loss", "test": "test/loss"}})
    train, test = fig.axes[0].get_lines()
    np.testing.assert_allclose(train.get_ydata(), [1 / (s + 1) for s in range(6)])
    np.testing.assert_array_equal(test.get_xdata(), [0, 1, 3, 4, 5])
    assert fig.axes[0].get_title() == "loss over training"
    with pytest.raises(KeyError, match="nope"):
        nplt.training_curves(hist, {"loss": {"x": "nope"}})


def test_receptive_fields_tile_each_unit_as_an_image(tmp_path):
    w = torch.randn(6, 12)
    w[4] *= 10  # the largest norm: first tile
    fig = nplt.receptive_fields(w, image_shape=(3, 4), ncols=4)
    mosaic = np.asarray(fig.axes[0].get_images()[0].get_array().filled(np.nan))
    gap_y = 2  # max(2, round(0.45 * 3))
    order = np.argsort(-w.norm(dim=1).numpy(), kind="stable")
    for i, u in enumerate(order):
        r, c = divmod(i, 4)
        top, left = r * (3 + gap_y) + gap_y, c * 5
        np.testing.assert_allclose(mosaic[top : top + 3, left : left + 4], w[u].reshape(3, 4))
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels == [str(u) for u in order]
    assert "receptive fields" in fig.get_suptitle()
    _png(fig, tmp_path / "rf.png")
    with pytest.raises(ValueError, match="image_shape"):
        nplt.receptive_fields(torch.randn(3, 10), image_shape=(3, 3))


def test_image_grid_captions_and_frames(tmp_path):
    imgs = torch.rand(5, 8, 8)
    fig = nplt.image_grid(
        imgs,
        [f"#{i}" for i in range(5)],
        frame_colours=[None, "red"] * 2 + [None],
        ncols=3,
        title="five",
    )
    assert [ax.get_title() for ax in fig.axes] == [f"#{i}" for i in range(5)]
    np.testing.assert_allclose(fig.axes[3].get_images()[0].get_array(), imgs[3])
    assert fig.get_suptitle() == "five"
    _png(fig, tmp_path / "g.png")
    with pytest.raises(ValueError, match="captions"):
        nplt.image_grid(imgs, ["a"], title="t")


def test_ranking_hits_against_brute_force():
    rng = np.random.default_rng(4)
    scores = rng.normal(size=200)
    scores[[5, 9]] = np.nan  # rank last
    flagged = rng.choice(200, size=7, replace=False).tolist() + [5]
    hits = nplt.ranking_hits(scores, flagged)
    ranked = sorted(range(200), key=lambda i: -np.inf if np.isnan(scores[i]) else -scores[i])
    ranked = [i for i in ranked if not np.isnan(scores[i])] + [5, 9]
    for k in (1, 8, 50, 199, 200):
        assert hits[k - 1] == len(set(ranked[:k]) & set(flagged))
    with pytest.raises(IndexError):
        nplt.ranking_hits(scores, [200])


def test_ranking_recall_draws_each_ranking_and_the_random_baseline(tmp_path):
    scores = np.arange(100.0)
    fig = nplt.ranking_recall({"score": scores, "reverse": -scores}, [99, 98, 10], max_k=20)
    best, worst, random = fig.axes[0].get_lines()[:3]
    np.testing.assert_array_equal(best.get_ydata()[:3], [1, 2, 2])
    assert "2/3 in the top 3" in best.get_label() and "0/3" in worst.get_label()
    np.testing.assert_allclose(random.get_ydata(), np.arange(1, 21) * 3 / 100)
    _png(fig, tmp_path / "r.png")


def test_noise_scale_band_reaches_the_top_when_unbounded():
    fig = nplt.noise_scale_plot(
        [0, 10, 20], [50.0, 80.0, 300.0], ([40.0, 60.0, 200.0], [60.0, 100.0, np.inf])
    )
    (band,) = fig.axes[0].collections
    top = band.get_paths()[0].vertices[:, 1].max()
    assert top > fig.axes[0].get_ylim()[1]  # drawn past the visible top
    assert "no upper bound" in fig.axes[0].get_legend().get_texts()[0].get_text()


def test_complex_values_are_refused_and_bfloat16_is_plotted():
    from nnstat import NetDict
    from nnstat.plot.frames import to_numpy

    z = NetDict({"z": torch.ones(3, 3, dtype=torch.complex64)})
    with pytest.raises(TypeError, match=r"complex64.*x\.abs\(\)"):
        nplt.weight_heatmap(z, "z")
    with pytest.raises(TypeError, match="complex128"):
        to_numpy(np.array([1 + 2j, 3.0]))
    b = torch.tensor([0.5, -1.25, 3.0], dtype=torch.bfloat16)
    np.testing.assert_array_equal(to_numpy(b), b.float().numpy().astype(np.float64))


def test_a_layer_with_no_finite_value_is_named_with_its_counts_and_the_way_to_find_it():
    bad = torch.tensor([float("nan")] * 3 + [float("inf"), float("-inf")])
    weights = {"fc1.weight": torch.ones(4), "fc2.weight": bad}
    counts = r"3 NaN, 2 Inf of 5 values"
    for draw in (nplt.histogram, nplt.weight_heatmap):
        with pytest.raises(ValueError, match=r"layer 'fc2\.weight' holds no finite value") as e:
            draw(weights, "fc2.weight")
        assert counts in str(e.value) and "'nonfinite'" in str(e.value)
        assert "Recorder" in str(e.value)
    with pytest.raises(ValueError, match=r"layers 'fc2\.weight', 'fc3\.weight'.*6 NaN, 4 Inf"):
        nplt.histogram({**weights, "fc3.weight": bad}, ["fc2.weight", "fc3.weight"])
    with pytest.raises(ValueError, match=r"the data holds no finite value: 4 NaN, 0 Inf"):
        nplt.receptive_fields(torch.full((1, 4), float("nan")), image_shape=(2, 2))
    # overlaid with a finite layer, the empty one is drawn as nothing and its legend says why
    fig = nplt.histogram(weights, ["fc1.weight", "fc2.weight"])
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend[1] == f"fc2.weight  no finite value ({counts})"
