"""The chart helpers of the viewer (static/charts.js) in a real browser: tick labels exact for
the tick values, non-finite values counted, distinct colours for many lines, example text with
its newlines."""

from __future__ import annotations

import math
import re

import pytest
from test_viewer import browser  # noqa: F401  (the chromium fixture)

from nnstat.viewer.server import STATIC


@pytest.fixture(scope="module")
def page(browser):  # noqa: F811
    p = browser.new_page(viewport={"width": 900, "height": 700})
    vendor = (STATIC / "vendor" / "uPlot.iife.min.js").read_text(encoding="utf-8")
    charts = (STATIC / "charts.js").read_text(encoding="utf-8")
    css = (STATIC / "style.css").read_text(encoding="utf-8")
    p.set_content(f"<style>{css}</style><body><div id='box' style='width:600px'></div></body>")
    p.add_script_tag(content=vendor)
    p.add_script_tag(content=charts)
    yield p
    p.close()


def labels(page, vals: list[float], incr: float) -> list[str]:
    return page.evaluate("([v, i]) => v.map((x) => NNChart.tickLabel(x, i))", [vals, incr])


@pytest.mark.parametrize(
    "lo, incr, n",
    [(0.0, 0.25, 5), (0.0, 25.0, 5), (0.001, 0.0001, 4), (-1.0, 0.5, 5), (0.0, 2e-5, 4),
     (1e6, 2.5e5, 4), (3.0, 2.0, 4), (0.0, 0.2, 6), (10.0, 0.05, 5)],
)  # fmt: skip
def test_tick_labels_read_back_as_the_tick_values(page, lo, incr, n):
    vals = [lo + i * incr for i in range(n)]
    got = labels(page, vals, incr)
    for v, text in zip(vals, got, strict=True):
        assert float(text) == pytest.approx(v, rel=1e-12, abs=1e-15), (vals, got)
    assert len(set(got)) == len(got)


def test_quarter_and_twenty_five_ticks_are_not_rounded(page):
    assert labels(page, [0.25, 0.5, 0.75], 0.25) == ["0.25", "0.50", "0.75"]
    assert labels(page, [25, 50, 75], 25) == ["25", "50", "75"]


def test_non_finite_values_are_counted_under_the_chart(page):
    text = page.evaluate("""() => { const box = document.getElementById('box');
        NNChart.line(box, {title: 'b_simple', x: [1, 2, 3, 4, 5],
          series: [{label: 'a', values: [1, Infinity, 2, NaN, 3]},
                   {label: 'b', values: [1, 2, -Infinity, 4, undefined]}]});
        return box.innerText; }""")
    assert "3 non-finite values (Inf/NaN) not drawn" in text


def test_many_lines_get_distinct_colours(page):
    colours = page.evaluate("() => Array.from({length: 28}, (_, i) => NNChart.color(i))")
    rgb = page.evaluate(
        """(cs) => cs.map((c) => { const d = document.createElement('div'); d.style.color = c;
        document.body.append(d); const v = getComputedStyle(d).color; d.remove(); return v; })""",
        colours,
    )
    triples = [tuple(int(x) for x in re.findall(r"\d+", c)[:3]) for c in rgb]
    assert len(set(triples)) == 28
    closest = min(
        sum(abs(a - b) for a, b in zip(p, q, strict=True))
        for i, p in enumerate(triples)
        for q in triples[i + 1 :]
    )
    assert closest >= 20, closest


def test_example_text_keeps_its_newlines(page):
    height = page.evaluate("""() => { const c = document.createElement('div'); c.className = 'card';
        const t = document.createElement('div'); t.className = 'text';
        t.textContent = 'def f():\\n    return 1\\n'; c.append(t); document.body.append(c);
        const lines = t.innerText.split('\\n').length; c.remove(); return lines; }""")
    assert height >= 2


def test_runs_page_counts_logged_inf_and_keeps_the_top_layers_by_change(
    tmp_path, browser  # noqa: F811
):
    from nnstat.integrations import JsonlLogger
    from test_viewer import Page

    from nnstat.viewer.server import serve_in_thread

    # layer i grows by a factor 1 + i/10 over the run: the top 5 by change are layers 23-27
    with JsonlLogger(tmp_path / "runs" / "deep") as log:
        for step in range(4):
            metrics = {f"weight/layer{i}/l2": 1.0 + step * i / 30 for i in range(28)}
            metrics["loss"] = math.inf if step in (1, 2) else 1.0 / (step + 1)
            log.log(metrics, step=step)
    srv, url = serve_in_thread(tmp_path)
    try:
        p = Page(browser, url + "#runs/0")
        loss = "#run-body .chart[data-key='loss']"
        p.page.wait_for_selector(f"{loss} .u-over")
        assert "2 non-finite values (Inf/NaN) not drawn" in p.page.inner_text(loss)
        for details in p.page.query_selector_all("details:not([open]) summary"):
            details.click()
        chart = "#run-body .chart[data-key='weight/*/l2']"
        p.page.wait_for_selector(f"{chart} .u-over")
        labels = "e => e.nnChart.series.slice(1).map(s => s.label)"
        assert len(p.page.eval_on_selector(chart, labels)) == 28
        p.page.select_option("#run-top", "5")
        p.page.wait_for_selector(f"{chart} .u-over")
        top = p.page.eval_on_selector(chart, labels)
        assert sorted(top) == sorted(f"layer{i}" for i in range(23, 28))
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()
