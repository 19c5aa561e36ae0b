"""Series logged at different cadences draw as lines; only a logged NaN/Inf breaks a line.

The demo logs its Tracker every 5 steps and the noise scale every 10: before, the page aligned
every series on the run's steps with null for "not logged here" as for NaN, and uPlot broke the
line at each null, so every noise-scale chart stayed blank.
"""

from __future__ import annotations

import math

from nnstat.integrations import JsonlLogger
from test_viewer import Page, browser  # noqa: F401 (browser is a fixture)

from nnstat.viewer.bundle import load_bundle
from nnstat.viewer.server import serve_in_thread

KINDS = "e => e.nnChart.data[1].map(v => v === undefined ? 'u' : v === null ? 'n' : 'v')"
GAPS = "e => (e.nnChart.series[1]._paths.gaps || []).length"


def _run(folder):
    with JsonlLogger(folder / "runs" / "mixed") as log:
        for step in range(0, 40, 5):
            metrics = {"train/loss": 1.0 / (step + 1)}
            if step % 10 == 0:
                metrics["noise_scale/b_simple"] = 100.0 + step
            if step % 10 == 5:
                metrics["grad/ratio"] = math.nan if step == 15 else float(step)
            log.log(metrics, step=step)


def test_bundle_tells_logged_nan_from_not_logged(tmp_path):
    _run(tmp_path)
    (run,) = load_bundle(tmp_path)["runs"]
    assert run["steps"] == list(range(0, 40, 5))
    assert run["series"]["noise_scale/b_simple"][:4] == [100.0, None, 110.0, None]
    assert run["series"]["grad/ratio"][:4] == [None, 5.0, None, None]
    assert run["nonfinite"] == {"grad/ratio": [3]}  # step 15 logged NaN


def test_every_series_draws_and_only_nan_breaks_a_line(tmp_path, browser):  # noqa: F811
    _run(tmp_path)
    srv, url = serve_in_thread(tmp_path)
    try:
        p = Page(browser, url + "#runs/0")
        p.page.wait_for_selector("#run-body .chart .u-over")
        for details in p.page.query_selector_all("details:not([open]) summary"):
            details.click()
        noise = "#run-body .chart[data-key^='noise_scale']"
        ratio = "#run-body .chart[data-key^='grad']"
        p.page.wait_for_selector(f"{noise} .u-over")
        p.page.wait_for_selector(f"{ratio} .u-over")
        assert p.page.eval_on_selector(noise, KINDS) == list("vuvuvuvu")
        assert p.page.eval_on_selector(noise, GAPS) == 0  # one unbroken line
        assert p.page.eval_on_selector(ratio, KINDS) == list("uvunuvuv")
        assert p.page.eval_on_selector(ratio, GAPS) == 1  # broken at the NaN only
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()
