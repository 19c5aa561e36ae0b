"""Viewer: served page and static export in a real browser (Debian chromium via Playwright).

Every request that does not go to the loopback server or a file:// / data: URL is blocked and
recorded; the tests assert that none happened.
"""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch

from nnstat.recorder import (
    Recorder,
    nonfinite,
    read_step_meta,
    read_step_stats,
    read_step_values,
)
from nnstat.viewer.server import SCRIPTS, STATIC, main, render_page, serve_in_thread

# overridable so tests/viewer/test_viewer_ci.py can check what happens when the browser is missing
CHROMIUM = os.environ.get("NNSTAT_TEST_CHROMIUM", "/usr/bin/chromium")
NAMES = {"x", "y", "hidden", "out", "loss", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


def record(root: Path, trial: str, scale: float, poison_step: int | None = None) -> Path:
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"fc1": torch.nn.Linear(5, 6), "fc2": torch.nn.Linear(6, 3)})
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    rec = Recorder(
        root, group="g", trial=trial, every=2, rules=[nonfinite()], sample_k=2, raw_max_numel=3
    )
    rec.track_module(model)
    rec.add_note(f"{trial}: input scale {scale}")
    data = torch.randn(24, 5) * scale
    target = torch.randint(0, 3, (24,))
    for step in range(6):
        rec.start_batch(step)
        x = rec.register_tensor("x", data[step * 4 : step * 4 + 4], role="input")
        y = rec.register_tensor("y", target[step * 4 : step * 4 + 4], role="target")
        h = torch.tanh(model["fc1"](x))
        if step == poison_step:
            h = h * torch.tensor([float("nan")] + [1.0] * 5)
        h = rec.register_tensor("hidden", h)
        out = rec.register_tensor("out", model["fc2"](h), role="output")
        loss = rec.register_tensor("loss", torch.nn.functional.cross_entropy(out, y), role="loss")
        rec.add_tensor_connection("x", "hidden")
        rec.add_tensor_connection("y", "loss")
        opt.zero_grad()
        loss.backward()
        rec.record_kpi("loss", loss.detach())
        rec.finish_batch()
        if step != poison_step:
            opt.step()
    return rec.path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("viewer")
    record(base, "baseline", 1.0)
    record(base, "scaled", 3.0, poison_step=3)
    return base / "g"


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        msg = f"browser tests need Debian chromium at {CHROMIUM} (apt-get install chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        import playwright.sync_api as sync_api
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("browser tests need playwright (pip install nnstat[browser])")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        yield b
        b.close()


class Page:
    """A page with console errors and blocked non-loopback requests collected."""

    def __init__(self, browser, url: str) -> None:
        self.errors: list[str] = []
        self.blocked: list[str] = []
        self.page = browser.new_page(viewport={"width": 1400, "height": 1000})
        self.page.route("**/*", self._route)
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.goto(url)
        self.page.wait_for_selector("body[data-ready='1']", timeout=15000)

    def _route(self, route) -> None:
        u = urlparse(route.request.url)
        if u.scheme in ("file", "data") or u.hostname in ("127.0.0.1", "localhost"):
            route.continue_()
        else:
            self.blocked.append(route.request.url)
            route.abort()

    def node_names(self, cls: str = "") -> set[str]:
        sel = f"#graph .node{'.' + cls if cls else ''}"
        return set(self.page.eval_on_selector_all(sel, "els => els.map(e => e.dataset.name)"))

    def cell(self, stat: str, col: int) -> str:
        return self.page.inner_text(f"#stats-table tr[data-stat='{stat}'] td:nth-child({col + 1})")

    def close(self) -> None:
        assert self.errors == [], self.errors
        assert self.blocked == [], self.blocked
        self.page.close()


def graph_of(root: Path, trial: str, step_index: int) -> dict:
    meta = read_step_meta(root / trial)[step_index]
    return json.loads((root / trial / "graphs" / f"{meta['graphs']['0']}.json").read_text())


def test_served_page_graph_click_and_step_change(root, browser) -> None:
    srv, url = serve_in_thread(root)
    try:
        assert srv.server_address[0] == "127.0.0.1"
        p = Page(browser, url)
        assert p.node_names() == NAMES  # one node per registered tensor, parameters included
        p.page.click("#graph .node[data-name='hidden']")
        doc = graph_of(root, "baseline", 0)
        expected = {a for a, b in doc["edges"] if b == "hidden"}
        expected |= {b for a, b in doc["edges"] if a == "hidden"}
        assert expected == {"x", "fc1.weight", "fc1.bias", "out"}
        assert p.node_names("neighbour") == expected
        assert p.node_names("selected") == {"hidden"}
        assert p.page.locator("#graph .edge.active").count() == 4
        p.page.screenshot(path="/tmp/nnstat_viewer_served.png", full_page=True)
        # the table shows the recorded value; changing the step changes it
        metas = read_step_meta(root / "baseline")
        norm_col = 5
        values = []
        for i in (0, 1):
            p.page.select_option("#sel-step", str(i))
            stats = read_step_stats(root / "baseline", f"train-{metas[i]['step']:09d}")
            r = metas[i]["rows"]
            row = next(
                j
                for j in range(len(r["tensor"]))
                if (r["tensor"][j], r["stream"][j], r["sample"][j]) == ("hidden", "forward", -1)
            )
            shown = float(p.cell("norm", 1))
            assert shown == pytest.approx(float(stats[row, norm_col]), rel=1e-3)
            values.append(shown)
        assert values[0] != values[1]
        # two steps side by side: step 1 with step 0 in the compare column
        p.page.select_option("#sel-compare", "step:0")
        assert float(p.cell("norm", 3)) == values[0] and float(p.cell("norm", 1)) == values[1]
        p.page.select_option("#sel-compare", "none")
        p.page.select_option("#sel-scope", "1")  # sample 1 of the batch
        assert float(p.cell("norm", 1)) < values[1]
        p.page.select_option("#sel-scope", "-1")
        # raw values of a small tensor (3 elements <= raw_max_numel) under the statistics
        p.page.click("#graph .node[data-name='fc2.bias']")
        shown_raw = p.page.eval_on_selector_all(
            "#raw-values td", "tds => tds.map(t => Number(t.textContent))"
        )
        stem = f"train-{metas[1]['step']:09d}"
        raw = read_step_values(root / "baseline", stem)["-1/forward/fc2.bias"]
        assert shown_raw == pytest.approx(raw.tolist(), rel=1e-3)
        p.page.screenshot(path="/tmp/nnstat_viewer_raw.png")
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_export_over_file_url_compare_and_anomaly_link(root, browser, tmp_path) -> None:
    out = tmp_path / "report.html"
    assert main([str(root), "--export", str(out)]) == 0
    html = out.read_text()
    assert 'src="static/' not in html and 'href="static/' not in html
    assert not re.search(r"""(src|href)=["']https?:""", html)
    p = Page(browser, out.as_uri())
    assert p.node_names() == NAMES
    assert p.page.locator("#sel-trial option").count() == 2
    # compare the two trials: two extra columns and a second series in the plot
    p.page.click("#graph .node[data-name='loss']")
    p.page.select_option("#sel-compare", "trial:scaled")
    assert p.page.locator("#stats-table tr").first.locator("th").count() == 5
    # uPlot's legend: the step column, then one entry per trial
    legend = p.page.eval_on_selector_all(
        "#plot .u-legend .u-series .u-label", "els => els.map(e => e.textContent)"
    )
    assert legend == ["step", "baseline", "scaled"]
    p.page.screenshot(path="/tmp/nnstat_viewer_compare.png", full_page=True)
    # the NaN step of the scaled trial was forced into the record; its link opens the node
    p.page.select_option("#sel-trial", "1")
    p.page.select_option("#sel-compare", "none")
    link = p.page.locator("#tab-anomalies a.offender-link")
    assert link.count() == 1 and link.inner_text() == "hidden (forward)"
    link.click()
    assert p.node_names("selected") == {"hidden"}
    assert p.page.locator("#sel-step option:checked").inner_text().startswith("train 3")
    assert p.node_names("offender") == {"hidden"}
    assert int(p.cell("nonfinite", 1)) == 4  # sample column 0 of a 4-sample batch
    for tab in ("notes", "network"):
        p.page.click(f"#tabs button[data-tab='{tab}']")
        assert p.page.is_visible(f"#tab-{tab}")
    assert "scaled: input scale 3.0" in p.page.inner_text("#tab-notes")
    # the loss curve is up front, no tab to open
    assert p.page.is_visible("#kpis .uplot")
    assert p.page.inner_text("#kpis h3") == "loss"
    p.page.click("#tabs button[data-tab='network']")
    assert "fc1" in p.page.inner_text("#tab-network")
    p.page.screenshot(path="/tmp/nnstat_viewer_export.png", full_page=True)
    p.close()


def test_server_routes_and_cli_errors(root, tmp_path, capsys) -> None:
    srv, url = serve_in_thread(root)
    try:
        assert main([str(root), "--port", str(srv.server_address[1])]) == 2  # port taken
        assert "cannot listen on 127.0.0.1" in capsys.readouterr().err
        data = json.loads(urllib.request.urlopen(url + "api/data").read())
        assert [t["id"] for t in data["trials"]] == ["baseline", "scaled"]
        for bad in ("static/../server.py", "static/index.html.bak", "etc/passwd"):
            with pytest.raises(urllib.error.HTTPError) as err:
                urllib.request.urlopen(url + bad)
            assert err.value.code == 404
    finally:
        srv.shutdown()
        srv.server_close()
    assert main([str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    # the console script dispatches `nnstat view` here
    from nnstat.cli import main as cli_main

    out = tmp_path / "cli.html"
    assert cli_main(["view", str(root), "--export", str(out)]) == 0
    assert out.read_text().count('id="nnstat-data"') == 1
    assert 'id="graph"' in render_page()


def test_bundle_of_a_trial_still_without_steps(tmp_path) -> None:
    from nnstat.viewer.bundle import load_bundle

    rec = Recorder(tmp_path, group="g", trial="fresh", every=None)
    rec.add_note("started")
    bundle = load_bundle(tmp_path / "g")
    assert [(t["id"], t["steps"], t["notes"][0]["text"]) for t in bundle["trials"]] == [
        ("fresh", [], "started")
    ]
    with pytest.raises(FileNotFoundError, match="no recorder trials"):
        load_bundle(tmp_path / "g" / "fresh" / "steps")


def test_page_and_export_load_every_script_in_order() -> None:
    # the served page and an export run the same scripts in the same order: dom.js (the shared
    # DOM helper) before the views that use it, and no script of static/ left out
    assert set(SCRIPTS) >= {p.name for p in STATIC.glob("*.js")}
    assert SCRIPTS.index("dom.js") < min(
        SCRIPTS.index(v) for v in ("app.js", "explorer.js", "home.js")
    )
    page = render_page()
    assert re.findall(r'<script src="static/([^"]+)"></script>', page) == list(SCRIPTS)
    exported = render_page({"trials": []})
    assert "<script src=" not in exported
    starts = [exported.index((STATIC / name).read_text()[:200]) for name in SCRIPTS[1:]]
    assert starts == sorted(starts)


def test_export_survives_hostile_tensor_names(browser, tmp_path) -> None:
    name = "h</script><!--<b>x</b>"
    rec = Recorder(tmp_path, group="g", trial="t", every=1)
    rec.start_batch(0)
    w = torch.ones(3, requires_grad=True)
    rec.register_tensor("w", w, role="parameter")
    h = rec.register_tensor(name, w * 2)
    rec.register_tensor("loss", h.sum(), role="loss")
    rec.finish_batch()
    out = tmp_path / "report.html"
    assert main([str(tmp_path / "g"), "--export", str(out)]) == 0
    p = Page(browser, out.as_uri())
    assert p.node_names() == {"w", name, "loss"}
    assert p.page.locator("#graph .node b").count() == 0  # shown as text, never as markup
    p.close()


def test_served_page_refresh_shows_steps_written_meanwhile(browser, tmp_path) -> None:
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(3))
    rec = Recorder(tmp_path, group="g", trial="live", every=1)
    rec.track_module(torch.nn.ParameterDict({"w": w}))

    def step(i: int) -> None:
        rec.start_batch(i)
        h = rec.register_tensor("h", w * (i + 1))
        rec.register_tensor("loss", h.pow(2).sum(), role="loss").backward()
        rec.finish_batch()
        w.grad = None

    step(0)
    srv, url = serve_in_thread(tmp_path / "g")
    try:
        p = Page(browser, url)
        assert p.page.locator("#sel-step option").count() == 1
        step(1)  # "training" writes a step while the page is open
        p.page.click("#refresh")
        p.page.wait_for_selector("body[data-refreshed]")
        assert p.page.locator("#sel-step option").count() == 2
        p.page.select_option("#sel-step", "1")
        p.page.click("#graph .node[data-name='h']")
        assert float(p.cell("norm", 1)) == pytest.approx(float((w * 2).detach().norm()), rel=1e-3)
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()
    rec.close()


def test_raw_values_past_the_page_budget_are_left_out_and_reported_once(tmp_path, monkeypatch):
    import nnstat.viewer.bundle as bundle_mod
    from nnstat.recorder import Recorder

    # 3 steps of 2 x 30 raw values each; the budget holds the first two steps
    monkeypatch.setattr(bundle_mod, "RAW_VALUE_BUDGET", 130)
    rec = Recorder(tmp_path, group="g", trial="t", every=1, raw_max_numel=64)
    xs = []
    for step in range(3):
        rec.start_batch(step)
        xs.append(torch.randn(5, 6))
        rec.register_tensor("x", xs[-1])
        rec.register_tensor("y", xs[-1] * 2)
        rec.finish_batch()
    rec.close()
    bundle = bundle_mod.load_bundle(tmp_path / "g")
    (trial,) = bundle["trials"]
    values = [s["values"] for s in trial["steps"]]
    for x, v in zip(xs[:2], values[:2], strict=True):
        assert v["0/forward/x"]["data"] == pytest.approx(x.reshape(-1).double().tolist())
        assert v["0/forward/y"]["shape"] == [5, 6]
    assert values[2] == {}
    (problem,) = bundle["problems"]
    assert problem["file"].endswith("train-000000002.values.safetensors")
    assert "60 raw values would take the page past its 130-value limit" in problem["message"]
