"""`nnstat view DIR` on a folder holding every kind nnstat writes: a Tracker JSONL run, a
recorder trial, a gradient store (the influence explorer) and a report.

Browser checks go through the `Page` helper of tests/viewer/test_viewer.py (Debian chromium, every
non-loopback request blocked and recorded, console errors collected; both must stay empty).
Expected values come from independent readers: `nnstat.integrations.jsonl.read_jsonl` for the
run, `nnstat.influence.compute_influence_all` / `compute_self_influence` for the explorer.
"""

from __future__ import annotations

import fnmatch
import json
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch
from nnstat.integrations import JsonlLogger
from nnstat.integrations.jsonl import read_jsonl
from test_viewer import Page, browser, record  # noqa: F401 (browser is a fixture)
from test_viewer_examples import make_store

import nnstat
from nnstat.influence import compute_influence_all, compute_self_influence
from nnstat.store import GradientStore
from nnstat.viewer import load_queries, save_examples, save_queries
from nnstat.viewer.bundle import load_bundle
from nnstat.viewer.server import main, serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
REPORT = "<!DOCTYPE html><html><head><style>h1{color:#333}</style></head><body><h1>Demo report</h1></body></html>"


def tracker_run(run_dir: Path, steps: int = 12, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logger = JsonlLogger(run_dir)
    tracker = nnstat.Tracker(model, opt, sinks=[logger], histograms=True)
    for step in range(steps):
        loss = model(torch.randn(16, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        tracker.step()
        # the loop's own metrics at the same step, as a demo passes its W&B dict
        logger.log({"train/loss": loss.item(), "neg": -1.0 - step}, step=step)
    tracker.close()
    logger.close()
    return run_dir


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("everything")
    tracker_run(base / "runs" / "exp1")
    tracker_run(base / "runs" / "exp2", steps=6, seed=1)
    record(base / "recorder", "baseline", 1.0)
    store, log, _ = make_store(base / "gradients")
    save_queries(log, store)
    rng = np.random.default_rng(0)
    save_examples(
        store, list(range(24)), images=rng.random((24, 8, 8)), labels=[i % 3 for i in range(24)]
    )
    save_examples(store / "viewer" / "queries" / "queries", log.ids, texts=["qa", "qb", "qc"])
    (base / "report.html").write_text(REPORT)
    return base


def _store(folder: Path) -> Path:
    return folder / "gradients" / "p"


def _cards(p: Page, selector: str) -> list[tuple[object, float]]:
    got = p.page.eval_on_selector_all(
        f"{selector} .card",
        "cs => cs.map(c => [c.dataset.id, c.querySelector('.score').textContent])",
    )
    return [(json.loads(i), float(s)) for i, s in got]


def _expect_top(scores: torch.Tensor, ids: list, k: int) -> tuple[list, list]:
    order = torch.argsort(scores, descending=True).tolist()
    return [(ids[j], float(scores[j])) for j in order[:k]], [
        (ids[j], float(scores[j])) for j in order[::-1][:k]
    ]


def _same(shown: list, expected: list) -> None:
    assert [i for i, _ in shown] == [i for i, _ in expected]
    assert [s for _, s in shown] == pytest.approx([s for _, s in expected], rel=2e-3, abs=1e-6)


def test_bundle_finds_every_kind(folder) -> None:
    b = load_bundle(folder)
    assert [t["id"] for t in b["trials"]] == ["recorder/g/baseline"]
    assert [r["id"] for r in b["runs"]] == ["runs/exp1", "runs/exp2"]
    assert [s["id"] for s in b["stores"]] == ["gradients/p"]
    assert [r["id"] for r in b["reports"]] == ["report.html"]
    assert b["problems"] == []
    s = b["stores"][0]
    assert s["preconditioner"] == "ekfac" and [q["name"] for q in s["query_sets"]] == [
        "",
        "queries",
    ]
    # the run's series equal an independent read of the file (same step merged from 2 lines)
    rows, problems = read_jsonl(folder / "runs" / "exp1")
    assert problems == []
    run = b["runs"][0]
    assert run["steps"] == sorted({r["step"] for r in rows})
    loss = {r["step"]: r["metrics"]["train/loss"] for r in rows if "train/loss" in r["metrics"]}
    assert run["series"]["train/loss"] == [loss[s] for s in run["steps"]]
    l2 = {
        r["step"]: r["metrics"]["weight/0.weight/l2"]
        for r in rows
        if "weight/0.weight/l2" in r["metrics"]
    }
    assert run["series"]["weight/0.weight/l2"] == [l2[s] for s in run["steps"]]
    assert "weight/0.weight/hist" in run["hists"]


def test_home_lists_every_kind_and_opens_the_report(folder, browser) -> None:  # noqa: F811
    srv, url = serve_in_thread(folder)
    try:
        p = Page(browser, url)
        assert p.page.is_visible("#view-home")
        home = p.page.inner_text("#home-body")
        for name in ("report.html", "runs/exp1", "gradients/p", "recorder/g/baseline"):
            assert name in home
        p.page.screenshot(path="/tmp/nnstat_view_home.png", full_page=True)
        with p.page.context.expect_page() as new:
            p.page.click("a.report-link")
        report = new.value
        report.wait_for_load_state()
        assert report.inner_text("h1") == "Demo report"
        report.close()
        # shown in a sandbox: its own inline style only, no script, no origin
        res = urllib.request.urlopen(url + "report/report.html")
        assert res.read().decode() == REPORT
        assert res.headers["Content-Security-Policy"].startswith("sandbox;")
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(url + "report/..%2Fetc%2Fpasswd")
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_run_charts_hover_values_overlay_and_log_scale(folder, browser) -> None:  # noqa: F811
    rows, _ = read_jsonl(folder / "runs" / "exp1")
    loss = {r["step"]: r["metrics"]["train/loss"] for r in rows if "train/loss" in r["metrics"]}
    srv, url = serve_in_thread(folder)
    try:
        p = Page(browser, url + "#runs/0")
        chart = "#run-body .chart[data-key='*/loss']"
        p.page.wait_for_selector(f"{chart} .u-over")
        # the loss is the first chart; hovering puts the step and its value in the legend
        assert p.page.eval_on_selector("#run-body .chart", "e => e.dataset.key") == "*/loss"
        box = p.page.locator(f"{chart} .u-over").bounding_box()
        p.page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        values = p.page.eval_on_selector_all(
            f"{chart} .u-legend .u-series .u-value", "els => els.map(e => e.textContent)"
        )
        step = int(values[0])
        assert float(values[1]) == pytest.approx(loss[step], rel=1e-3)
        # another run overlaid, dashed, on the union of the steps
        rows2, _ = read_jsonl(folder / "runs" / "exp2")
        loss2 = {
            r["step"]: r["metrics"]["train/loss"] for r in rows2 if "train/loss" in r["metrics"]
        }
        p.page.select_option("#run-compare", "1")
        p.page.wait_for_selector(f"{chart} .u-over")
        labels = p.page.eval_on_selector_all(
            f"{chart} .u-legend .u-series .u-label", "els => els.map(e => e.textContent)"
        )
        assert labels == ["step", "train", "runs/exp2: train"]
        box = p.page.locator(f"{chart} .u-over").bounding_box()
        p.page.mouse.move(box["x"] + box["width"] * 0.25, box["y"] + box["height"] * 0.5)
        values = p.page.eval_on_selector_all(
            f"{chart} .u-legend .u-series .u-value", "els => els.map(e => e.textContent)"
        )
        step = int(values[0])
        assert step in loss2
        assert float(values[1]) == pytest.approx(loss[step], rel=1e-3)
        assert float(values[2]) == pytest.approx(loss2[step], rel=1e-3)
        p.page.select_option("#run-compare", "-1")
        # several layers on one chart: one line per parameter of the Tracker's weight l2
        p.page.click("details[data-section='weight'] summary")
        overlay = "#run-body .chart[data-key='weight/*/l2']"
        p.page.wait_for_selector(f"{overlay} .u-over")
        labels = p.page.eval_on_selector_all(
            f"{overlay} .u-legend .u-series .u-label", "els => els.map(e => e.textContent)"
        )
        assert labels == ["step", "0.bias", "0.weight", "2.bias", "2.weight"]
        p.page.screenshot(path="/tmp/nnstat_view_runs.png", full_page=True)
        # log scale: the y scale becomes logarithmic; a series of negative values says why
        # it is not drawn instead of drawing nothing silently
        distr = "e => e.nnChart.scales.y.distr"
        assert p.page.eval_on_selector(chart, distr) == 1
        p.page.check("#run-log")
        assert p.page.eval_on_selector(chart, distr) == 3
        assert "no finite values above 0 (log scale)" in p.page.inner_text(
            "#run-body .chart[data-key='neg']"
        )
        p.page.uncheck("#run-log")
        assert p.page.eval_on_selector(chart, distr) == 1
        # the filter keeps matching charts only
        p.page.fill("#run-filter", "update_ratio")
        keys = p.page.eval_on_selector_all("#run-body .chart", "es => es.map(e => e.dataset.key)")
        assert keys == ["update_ratio/*"]
        # words naming a layer keep that layer's line only
        p.page.fill("#run-filter", "weight/ l2 0.weight")
        keys = p.page.eval_on_selector_all("#run-body .chart", "es => es.map(e => e.dataset.key)")
        assert keys == ["weight/*/l2"]
        labels = p.page.eval_on_selector_all(
            f"{overlay} .u-legend .u-series .u-label", "els => els.map(e => e.textContent)"
        )
        assert labels == ["step", "0.weight"]
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_recorder_trial_opens_with_a_default_selection(folder, browser) -> None:  # noqa: F811
    srv, url = serve_in_thread(folder)
    try:
        p = Page(browser, url + "#recorder")
        # before any click: the loss node is selected and its curve drawn, the KPI chart up front
        assert p.page.text_content("#sel-name") == "loss (loss)"
        assert p.page.is_visible("#plot .uplot") and p.page.is_visible("#kpis .uplot")
        assert "no finite values" not in p.page.inner_text("#side")
        p.page.screenshot(path="/tmp/nnstat_view_recorder.png", full_page=True)
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_influence_explorer_top_k_matches_the_api(folder, browser) -> None:  # noqa: F811
    store_dir = _store(folder)
    store = GradientStore(store_dir)
    queries = load_queries(store_dir / "viewer" / "queries" / "queries")
    expected = compute_influence_all(queries, store).scores  # [3, 24], independent of the viewer
    srv, url = serve_in_thread(folder)
    try:
        p = Page(browser, url + "#stores/0")
        p.page.wait_for_selector("#inf-result[data-query='queries:0']")
        p.page.click("#inf-query-list .card[data-q='1']")
        p.page.wait_for_selector("#inf-result[data-query='queries:1']")
        helpful, harmful = _expect_top(expected[1], store.ids, 10)
        _same(_cards(p, "#inf-result .helpful"), helpful)
        _same(_cards(p, "#inf-result .harmful"), harmful)
        assert p.page.inner_text("#inf-result .query .text") == "qb"
        assert p.page.locator("#inf-result .helpful img").count() == 10  # images saved
        p.page.screenshot(path="/tmp/nnstat_view_influence.png", full_page=True)
        # self-influence ranking
        p.page.wait_for_selector("#inf-self[data-ready='1']")
        self_scores = compute_self_influence(store).scores
        top, low = _expect_top(self_scores, store.ids, 10)
        _same(_cards(p, "#self-highest"), top)
        _same(_cards(p, "#self-lowest"), low[:10])
        # a training example as the query: the store against itself
        first = top[0][0]
        p.page.click(f"#self-highest .card[data-id='{first}']")
        p.page.wait_for_selector(f"#inf-result[data-query=':{store.ids.index(first)}']")
        row = compute_influence_all(store, store).scores[store.ids.index(first)]
        helpful, harmful = _expect_top(row, store.ids, 10)
        _same(_cards(p, "#inf-result .helpful"), helpful)
        _same(_cards(p, "#inf-result .harmful"), harmful)
        p.page.select_option("#inf-k", "5")
        p.page.wait_for_selector(f"#inf-result[data-query=':{store.ids.index(first)}']")
        assert len(_cards(p, "#inf-result .helpful")) == 5
        p.close()
        # a wrong request gets a clear 400
        for bad, msg in (
            ("api/influence?store=nope&q=0", "no gradient store 'nope'"),
            ("api/influence?store=gradients/p&set=queries&q=9", "query 9 out of range"),
            ("api/influence?store=gradients/p&q=0&k=0", "k must be 1-50"),
            (
                "api/influence?store=gradients/p&q=abc",
                "parameter 'q' must be a whole number, got 'abc'",
            ),
            ("api/influence?store=gradients/p&q=0&k=1.5", "parameter 'k' must be a whole number"),
            ("api/self?store=gradients/p&k=x", "parameter 'k' must be a whole number"),
        ):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(url + bad)
            assert err.value.code == 400 and msg in err.value.read().decode()
    finally:
        srv.shutdown()
        srv.server_close()


def test_export_carries_every_kind(folder, browser, tmp_path) -> None:  # noqa: F811
    out = tmp_path / "view.html"
    assert main([str(folder), "--export", str(out)]) == 0
    html = out.read_text()
    assert "static/" not in html.split("<body>", 1)[1].split('id="nnstat-data"', 1)[0]
    assert "uPlot" in html  # the vendored library inlined
    p = Page(browser, out.as_uri() + "#stores/0")
    p.page.wait_for_selector("#inf-result[data-query='queries:0']")
    queries = load_queries(_store(folder) / "viewer" / "queries" / "queries")
    store = GradientStore(_store(folder))
    helpful, _ = _expect_top(compute_influence_all(queries, store).scores[0], store.ids, 10)
    _same(_cards(p, "#inf-result .helpful"), helpful)
    assert p.page.locator("#inf-result .helpful img").count() == 10  # shared images resolved
    # the store against itself: the first training rows are carried too
    p.page.select_option("#inf-set", "")
    p.page.wait_for_selector("#inf-result[data-query=':0']")
    helpful, harmful = _expect_top(compute_influence_all(store, store).scores[0], store.ids, 10)
    _same(_cards(p, "#inf-result .helpful"), helpful)
    _same(_cards(p, "#inf-result .harmful"), harmful)
    p.page.goto(out.as_uri() + "#runs/0")
    p.page.wait_for_selector("#run-body .chart[data-key='*/loss'] .u-over")
    p.page.goto(out.as_uri() + "#home")
    # the report is embedded in a sandboxed frame, not linked by file:// URL
    assert p.page.locator("a.report-link").count() == 0
    p.page.click("details.report summary")
    frame = p.page.frame_locator("iframe.report-frame[title='report.html']")
    assert frame.locator("h1").inner_text() == "Demo report"
    p.page.screenshot(path="/tmp/nnstat_view_export_home.png", full_page=True)
    p.close()


def test_truncated_last_line_of_a_run_is_reported(tmp_path) -> None:
    run = tracker_run(tmp_path / "r", steps=3)
    data = (run / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").write_bytes(data[:-20])
    b = load_bundle(tmp_path)
    assert b["runs"][0]["steps"] == [0, 1, 2]  # step 2's Tracker line is still whole
    assert len(b["problems"]) == 1
    assert b["problems"][0]["file"] == "r/metrics.jsonl"
    assert "incomplete last line skipped" in b["problems"][0]["message"]
    (run / "metrics.jsonl").write_text('{"not": "a run"}\n')
    b = load_bundle(tmp_path)
    assert b["runs"] == [] and "not an nnstat JSONL run" in b["problems"][0]["message"]


def test_nothing_nnstat_wrote_is_a_clear_error(tmp_path, capsys) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nothing nnstat wrote under" in err and "metrics.jsonl" in err


def test_package_data_ships_every_viewer_asset() -> None:
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["nnstat"]
    # the repository's assets (the installed copy may live in site-packages: a non-editable
    # install is what this test checks the configuration of)
    static = ROOT / "nnstat" / "viewer" / "static"
    files = [p.relative_to(ROOT / "nnstat").as_posix() for p in static.rglob("*") if p.is_file()]
    missing = [
        f
        for f in files
        if not any(fnmatch.fnmatch(f, g) and "/" not in f[len(g) - 1 :] for g in globs)
    ]
    assert "viewer/static/vendor/uPlot.iife.min.js" in files
    assert missing == []
    readme = (static / "vendor" / "README.md").read_text()
    assert (
        "| 1.6.32 |" in readme
        and "/*! https://github.com/leeoniya/uPlot (v1.6.32) */"
        in (static / "vendor" / "uPlot.iife.min.js").read_text()
    )


@pytest.mark.parametrize("shape", [(5, 7), (5, 7, 1), (5, 7, 3), (5, 7, 4)])
def test_png_data_url_decodes_to_the_scaled_pixels(shape) -> None:
    import base64
    import io

    from PIL import Image

    from nnstat.viewer.explorer import png_data_url

    torch.manual_seed(0)
    x = torch.rand(shape) * 4 - 1
    url = png_data_url(x, -1.0, 3.0)
    img = np.asarray(Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))))
    expected = np.round((x.double().numpy() + 1) * 255 / 4).clip(0, 255).astype(np.uint8)
    np.testing.assert_array_equal(img, expected.squeeze(-1) if shape[-1:] == (1,) else expected)


def test_thumbnail_averages_blocks() -> None:
    from nnstat.viewer.explorer import thumbnail

    x = torch.rand(192, 96, 3)
    expected = x.numpy().reshape(96, 2, 48, 2, 3).mean(axis=(1, 3))
    np.testing.assert_allclose(thumbnail(x).numpy(), expected, rtol=1e-5)
    assert thumbnail(x[:, :, 0]).shape == (96, 48)
    assert thumbnail(torch.rand(8, 8)).shape == (8, 8)  # small images are left as they are


PAYLOAD = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'


def test_hostile_run_keys_and_example_texts_stay_text(browser, tmp_path) -> None:  # noqa: F811
    run = tmp_path / "run"
    with JsonlLogger(run) as log:
        for step in range(3):
            log.log({PAYLOAD: float(step), f"weight/{PAYLOAD}/l2": 1.0 + step}, step=step)
    store, log_q, _ = make_store(tmp_path / "gradients")
    save_examples(store, list(range(24)), labels=[PAYLOAD] * 24, texts=[PAYLOAD] * 24)
    # a damaged examples file is reported, and the store still opens with ids only
    q = save_queries(log_q, store)
    (q / "examples.json").write_text('{"format": "nnstat-examples", "ids": "no list"}')
    srv, url = serve_in_thread(tmp_path)
    try:
        p = Page(browser, url + "#runs/0")
        keys = p.page.eval_on_selector_all("#run-body .chart", "es => es.map(e => e.dataset.key)")
        assert PAYLOAD in keys
        legend = p.page.eval_on_selector_all(
            "#run-body .u-legend .u-label", "els => els.map(e => e.textContent)"
        )
        assert PAYLOAD in legend
        p.page.goto(url + "#stores/0")
        p.page.wait_for_selector("body[data-ready='1']")
        p.page.wait_for_selector("#inf-result[data-query='queries:0']")
        texts = p.page.eval_on_selector_all(
            "#inf-result .helpful .text", "els => els.map(e => e.textContent)"
        )
        assert texts and set(texts) == {PAYLOAD}
        assert p.page.evaluate("window.__pwned") is None
        assert p.page.locator("img").count() == 0  # no image saved, none made from markup
        problems = p.page.inner_text("#problems")
        assert "ids must be a list of ints and strings" in problems
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()
