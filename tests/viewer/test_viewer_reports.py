"""HTML reports in an ``nnstat view --export`` page: embedded in a sandboxed frame, never a
``file://`` link. A hostile report runs no script (neither in the page's origin nor its own),
makes no request (Playwright records every request the page and its frames make), and its
styles still apply. A report too large to carry is left out with a note.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_viewer import CHROMIUM, Page, browser  # noqa: F401 (browser is a fixture)
from test_viewer_kinds import REPORT, tracker_run

from nnstat.viewer.server import export_bundle, main, render_page

HOSTILE = """<!DOCTYPE html><html><head>
<meta http-equiv="refresh" content="0;url=http://evil.example/refresh">
<link rel="stylesheet" href="http://evil.example/style.css">
<base href="http://evil.example/">
<style>h1 { color: rgb(200, 0, 0); }</style>
<script>parent.__pwned = 1; window.top.__pwned = 2; document.title = "ran";</script>
<script src="http://evil.example/x.js"></script>
</head><body>
<h1>Hostile report</h1><p id="styled" style="color: rgb(0, 0, 200)">styled by attribute</p>
<img src="http://evil.example/pixel.png" onerror="parent.__pwned = 3">
<img src="file:///etc/passwd"><iframe src="http://evil.example/frame"></iframe>
<form action="http://evil.example/post" method="post"><input name="a" value="b"></form>
<object data="http://evil.example/obj"></object>
</body></html>"""


def _folder(base: Path) -> Path:
    tracker_run(base / "runs" / "exp1", steps=3)
    (base / "hostile.html").write_text(HOSTILE)
    (base / "report.html").write_text(REPORT)
    return base


def test_export_embeds_reports_sandboxed(browser, tmp_path) -> None:  # noqa: F811
    root = _folder(tmp_path / "f")
    out = tmp_path / "view.html"
    assert main([str(root), "--export", str(out)]) == 0
    html = out.read_text()
    assert root.resolve().as_uri() not in html  # no file:// link to a report
    assert "evil.example" in html  # the report travels as data
    requests: list[str] = []
    p = Page.__new__(Page)  # Page's checks, but every request recorded from the very first
    p.errors, p.blocked = [], []
    p.page = browser.new_page(viewport={"width": 1400, "height": 1000})
    p.page.on("request", lambda r: requests.append(r.url))
    # Chromium sometimes emits "request" for a load the policy then refuses (a race: most runs
    # show none of them), so what must hold is that nothing but the page itself *loaded*
    # ("requestfinished") and that every other request failed inside the browser
    finished: list[str] = []
    failed: dict[str, str] = {}
    p.page.on("requestfinished", lambda r: finished.append(r.url))
    p.page.on("requestfailed", lambda r: failed.__setitem__(r.url, r.failure or ""))
    p.page.route("**/*", p._route)
    p.page.on("console", lambda m: p.errors.append(m.text) if m.type == "error" else None)
    p.page.on("pageerror", lambda e: p.errors.append(str(e)))
    p.page.goto(out.as_uri() + "#home")
    p.page.wait_for_selector("body[data-ready='1']")
    assert p.page.locator("a.report-link").count() == 0  # no link to open the file on its own
    frames = p.page.locator("iframe.report-frame")
    assert frames.count() == 2
    for i in range(2):
        assert frames.nth(i).get_attribute("sandbox") == ""  # no allow-scripts, no origin
    p.page.click("details.report:has(iframe[title='hostile.html']) summary")
    p.page.wait_for_timeout(1500)  # the frame's refresh, images and scripts would have fired
    frame = next(f for f in p.page.frames if f.parent_frame and "Hostile" in f.content())
    assert frame.inner_text("h1") == "Hostile report"
    # the report's own styles apply (allowed by their hashes in the page's policy)
    color = "el => getComputedStyle(el).color"
    assert frame.eval_on_selector("h1", color) == "rgb(200, 0, 0)"
    assert frame.eval_on_selector("#styled", color) == "rgb(0, 0, 200)"
    # nothing ran: not in the page, not in the frame (sandboxed without allow-scripts)
    assert p.page.evaluate("window.__pwned") is None
    assert frame.evaluate("document.title") != "ran"  # evaluate runs as the test, not the page
    # and nothing was requested but the page itself: no http(s), no other file
    page_urls = {out.as_uri() + "#home", out.as_uri()}
    assert set(finished) <= page_urls and len(finished) == 1, finished
    others = [u for u in requests if u not in page_urls]
    assert all(u in failed for u in others), (others, failed)
    # an http(s) load is refused by the page's CSP, never by the test's network guard below
    assert all(failed[u] == "csp" for u in others if u.startswith("http")), failed
    assert p.blocked == []
    p.errors.clear()  # CSP reports the refused loads on the console
    p.page.close()


def test_export_leaves_out_a_report_too_large(tmp_path, monkeypatch) -> None:
    from nnstat.viewer import reports

    root = _folder(tmp_path / "f")
    monkeypatch.setattr(reports, "EXPORT_REPORT_MAX", len(REPORT.encode()) + 10)
    bundle = export_bundle(root)
    by_id = {r["id"]: r for r in bundle["reports"]}
    assert by_id["report.html"]["srcdoc"] == REPORT
    assert "over the" in by_id["hostile.html"]["omitted"] and "srcdoc" not in by_id["hostile.html"]
    assert all("href" not in r for r in bundle["reports"])
    assert root.resolve().as_uri() not in render_page(bundle)


@pytest.mark.parametrize(
    "html, n_el, n_attr",
    [("<style>a{}</style><style>b{}</style>", 2, 0), ('<p style="x:y"><br style="z">', 0, 2)],
)
def test_style_hashes(html, n_el, n_attr) -> None:
    from nnstat.viewer import reports

    els, attrs = reports.style_hashes(html)
    assert (len(els), len(attrs)) == (n_el, n_attr)
