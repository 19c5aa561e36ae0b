"""The viewer against a hostile recorder folder: text stays text, paths stay inside, bad files
are reported one by one, and the server answers only requests addressed to itself.

The browser tests drive Debian chromium through the `Page` helper of tests/viewer/test_viewer.py, which
fails a test on any console error or non-loopback request.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_viewer import Page, browser, record  # noqa: F401 (browser is a fixture)

from nnstat.recorder import Recorder, nonfinite
from nnstat.viewer.bundle import load_bundle
from nnstat.viewer.server import STATIC, main, render_page, serve_in_thread

# runs script if it ever becomes markup; the trial folder name cannot hold a "/"
PAYLOAD = '<img src=x onerror="window.__pwned=1"><script>window.__pwned=2</script>'
TRIAL = '<img src=x onerror="window.__pwned=3">'


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _append(path: Path, record: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def hostile_folder(base: Path) -> Path:
    """One trial whose names, notes, KPIs, modules and rules are markup, plus ill-typed fields."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.ones(3))
    rec = Recorder(base, group="g", trial=TRIAL, every=1, rules=[nonfinite()], raw_max_numel=4)
    rec.track_module(torch.nn.ParameterDict({"w": w}))
    for step in range(2):
        rec.start_batch(step)
        h = w * 2 if step == 0 else w * torch.tensor([float("nan"), 1.0, 1.0])
        h = rec.register_tensor(PAYLOAD, h)
        rec.register_tensor("loss", h.sum(), role="loss").backward()
        rec.record_kpi(PAYLOAD, float(step))
        if step == 0:
            rec.add_note(PAYLOAD)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the planted NaN is logged as a warning
            rec.finish_batch()
        w.grad = None
    rec.close()
    tdir = base / "g" / TRIAL

    def modules(meta: dict) -> None:
        meta["modules"].append(
            {"name": PAYLOAD, "type": PAYLOAD, "params_own": 1, "params_total": 2}
        )
        meta["modules"].append(
            {"name": "bad", "type": "Linear", "params_own": PAYLOAD, "params_total": 3}
        )

    _edit_json(tdir / "trial.json", modules)
    _edit_json(
        tdir / "steps" / "train-000000001.json",
        lambda m: [a.update(rule=PAYLOAD) for a in m["anomalies"]],
    )
    _append(tdir / "notes.jsonl", {"step": PAYLOAD, "time": 0.0, "text": "a note"})
    _append(tdir / "kpis.jsonl", {"type": "train", "step": 2, "kpis": {"acc": PAYLOAD}})
    return base / "g"


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    return hostile_folder(tmp_path_factory.mktemp("hostile"))


def _open(browser, root: Path, mode: str, tmp_path: Path):  # noqa: F811 (fixture)
    """The page of ``root`` served or exported; returns (Page, server or None)."""
    if mode == "served":
        srv, url = serve_in_thread(root)
        return Page(browser, url), srv
    out = tmp_path / "report.html"
    assert main([str(root), "--export", str(out)]) == 0
    return Page(browser, out.as_uri()), None


def _texts(p: Page, selector: str) -> list[str]:
    return p.page.eval_on_selector_all(selector, "els => els.map(e => e.textContent)")


@pytest.mark.parametrize("mode", ["served", "export"])
def test_hostile_values_are_shown_as_text_and_run_nothing(
    hostile, browser, tmp_path, mode  # noqa: F811 (fixture)
) -> None:
    p, srv = _open(browser, hostile, mode, tmp_path)
    try:
        # trial id, tensor name (graph node, details, anomaly link), rule, note, module, KPI name
        assert _texts(p, "#sel-trial option") == [TRIAL]
        assert PAYLOAD in p.node_names()
        names = p.page.eval_on_selector_all("#graph .node", "els => els.map(e => e.dataset.name)")
        p.page.locator("#graph .node").nth(names.index(PAYLOAD)).click()
        assert p.page.text_content("#sel-name") == f"{PAYLOAD} (intermediate)"
        anomalies = p.page.text_content("#tab-anomalies")
        assert f"first non-finite {PAYLOAD} (forward)" in anomalies
        assert f"{PAYLOAD} on nonfinite @ {PAYLOAD}" in anomalies
        assert _texts(p, "#tab-notes li") == [f"step 0: {PAYLOAD}"]
        assert [PAYLOAD, PAYLOAD, "1", "2"] in [
            _texts(p, f"#tab-network tr:nth-child({i}) td") for i in range(2, 5)
        ]
        assert PAYLOAD in _texts(p, "#kpis h3")
        # ill-typed fields are refused, and the refusal shows the offending value as text
        problems = p.page.text_content("#problems")
        assert 'modules[2].params_own must be an integer, got "<img src=x onerror=' in problems
        assert 'notes.jsonl: line 2: step must be an integer, got "<img src=x' in problems
        assert "kpis.jsonl: line 3: kpis 'acc' must be a number" in problems
        assert p.page.is_visible("#problems")
        # nothing of the folder became markup: no image, no extra script, nothing ran
        assert p.page.evaluate("window.__pwned") is None
        assert p.page.locator("img").count() == 0
        # the page's own: uPlot, charts, graph, dom, app, explorer, home + the data element
        assert p.page.evaluate("document.scripts.length") == 8
        p.close()
    finally:
        if srv is not None:
            srv.shutdown()
            srv.server_close()


@pytest.mark.parametrize("mode", ["served", "export"])
def test_content_security_policy_blocks_inline_script(
    hostile, browser, tmp_path, mode  # noqa: F811 (fixture)
) -> None:
    # second line of defence: markup that did reach the DOM still could not run
    p, srv = _open(browser, hostile, mode, tmp_path)
    try:
        p.page.evaluate("""() => { const d = document.createElement('div'); document.body.append(d);
            d.setAttribute('onclick', 'window.__pwned = 1'); d.click();
            const s = document.createElement('script'); s.textContent = 'window.__pwned = 2';
            document.body.append(s); }""")
        assert p.page.evaluate("window.__pwned") is None
        assert any("Content Security Policy" in e for e in p.errors), p.errors
        p.errors.clear()  # the violations this test provoked
        p.close()
    finally:
        if srv is not None:
            srv.shutdown()
            srv.server_close()


def test_viewer_scripts_have_no_markup_sinks() -> None:
    # every value enters the DOM as text; these would parse a string as HTML
    sinks = ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(")
    found = [
        f"{f.name}:{i}: {line.strip()}"
        for f in sorted(STATIC.glob("*.js"))
        for i, line in enumerate(f.read_text().splitlines(), start=1)
        if any(sink in line for sink in sinks)
    ]
    assert found == []


def test_export_data_cannot_close_its_script_element(hostile) -> None:
    html = render_page(load_bundle(hostile))
    blob = html.split('<script id="nnstat-data" type="application/json">', 1)[1]
    blob = blob.split("</script>", 1)[0]  # where the browser ends the element
    assert "<" not in blob
    assert json.loads(blob)["trials"][0]["notes"][0]["text"] == PAYLOAD


# --------------------------------------------------------------------------------- paths
def _small_trial(base: Path, trial: str = "t") -> Path:
    rec = Recorder(base, group="g", trial=trial, every=1)
    w = torch.ones(3, requires_grad=True)
    rec.start_batch(0)
    rec.register_tensor("w", w, role="parameter")
    rec.register_tensor("loss", (w * 2).sum(), role="loss").backward()
    rec.record_kpi("loss", 1.5)
    rec.finish_batch()
    rec.close()
    return base / "g" / trial


def _secret(base: Path) -> Path:
    # a valid graph document outside the recorder folder: only a path escape can read it
    path = base / "secret.json"
    path.write_text(json.dumps({"nodes": [["SECRET", "input"]], "edges": []}))
    return path


def _problems(bundle: dict) -> list[str]:
    return [f"{p['file']}: {p['message']}" for p in bundle["problems"]]


def test_graph_digest_that_climbs_out_of_the_folder_is_refused(tmp_path) -> None:
    tdir = _small_trial(tmp_path)
    _secret(tmp_path)
    step = tdir / "steps" / "train-000000000.json"
    # tdir/graphs/../../../secret.json is tmp_path/secret.json, outside the root tmp_path/g
    _edit_json(step, lambda m: m["graphs"].update({"0": "../../../secret"}))
    bundle = load_bundle(tmp_path / "g")
    assert "SECRET" not in json.dumps(bundle)
    assert bundle["trials"][0]["steps"] == []
    assert _problems(bundle) == [
        "t/steps/train-000000000.json: graphs['0'] must be a sha256 digest (64 hex digits), "
        'got "../../../secret"; the step is not shown'
    ]


def test_symlinks_out_of_the_folder_are_refused(tmp_path) -> None:
    tdir = _small_trial(tmp_path)
    secret = _secret(tmp_path)
    (graph,) = (tdir / "graphs").glob("*.json")
    graph.unlink()
    graph.symlink_to(secret)  # a well-formed digest whose file points outside
    outside = _small_trial(tmp_path / "elsewhere", "o")
    (tmp_path / "g" / "linked").symlink_to(outside)  # a whole trial outside
    bundle = load_bundle(tmp_path / "g")
    assert "SECRET" not in json.dumps(bundle) and bundle["graphs"] == {}
    assert [t["id"] for t in bundle["trials"]] == ["t"]
    # the step stays, drawn with its parameters only
    assert [s["key"] for s in bundle["trials"][0]["steps"]] == ["train-000000000"]
    assert bundle["trials"][0]["steps"][0]["graphs"] == {}
    msgs = _problems(bundle)
    assert len(msgs) == 2
    assert msgs[0].startswith("linked/trial.json: resolves to ")
    assert "outside the recorder folder" in msgs[0] and "the trial is not shown" in msgs[0]
    assert msgs[1].startswith(f"t/graphs/{graph.name}: resolves to {secret}")


def test_step_record_cannot_name_another_file(tmp_path) -> None:
    # the .npy and .safetensors names come from the listed file name, never from its content
    tdir = _small_trial(tmp_path)
    _edit_json(
        tdir / "steps" / "train-000000000.json",
        lambda m: m.update(type_of_execution="../../../x"),
    )
    bundle = load_bundle(tmp_path / "g")
    assert bundle["trials"][0]["steps"] == []
    assert _problems(bundle) == [
        "t/steps/train-000000000.json: the file name says 'train-000000000' but the record says "
        "'../../../x' step 0; the step is not shown"
    ]


# ------------------------------------------------------------------------------ server
def _get(url: str, path: str, host: str | None) -> tuple[int, bytes]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
    conn.putrequest("GET", path, skip_host=True)
    if host is not None:
        conn.putheader("Host", host)
    conn.endheaders()
    res = conn.getresponse()
    body = res.read()
    conn.close()
    return res.status, body


def test_server_answers_only_its_own_host(tmp_path) -> None:
    _small_trial(tmp_path)
    srv, url = serve_in_thread(tmp_path / "g")
    port = srv.server_address[1]
    try:
        for path in ("/", "/api/data", "/static/app.js"):
            for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"LOCALHOST:{port}"):
                assert _get(url, path, host)[0] == 200, (path, host)
            # DNS rebinding: the browser sends the attacker's name
            for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1:{port + 1}"):
                code, body = _get(url, path, host)
                assert code == 403 and b"trial" not in body, (path, host)
                assert body.startswith(b"Host '") and b"is not this server" in body
            assert _get(url, path, None) == (400, b"missing Host header")
        # the page states what it allows: its own scripts, styles and data only
        res = urllib.request.urlopen(url)
        assert "script-src 'self'" in res.headers["Content-Security-Policy"]
        assert res.headers["X-Content-Type-Options"] == "nosniff"
    finally:
        srv.shutdown()
        srv.server_close()


def test_api_data_says_why_when_the_folder_is_gone(tmp_path) -> None:
    _small_trial(tmp_path)
    srv, url = serve_in_thread(tmp_path / "g")
    try:
        shutil.rmtree(tmp_path / "g")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "api/data")
        assert err.value.code == 500
        assert err.value.read().decode() == (
            f"cannot read {tmp_path / 'g'}: folder {tmp_path / 'g'} does not exist"
        )
    finally:
        srv.shutdown()
        srv.server_close()


# ------------------------------------------------------------------------ malformed files
def _write(path: Path, text: str) -> None:
    path.write_text(text)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)  # reading it would block until a writer comes: forever


STEP = "t/steps/train-000000000.json"
MALFORMED = {
    "trial.json not JSON": (
        lambda t: _write(t / "trial.json", "{nope"),
        "t/trial.json: not JSON (Expecting property name enclosed in double quotes: line 1 "
        "column 2 (char 1)); the trial is not shown",
    ),
    "trial.json a list": (
        lambda t: _write(t / "trial.json", "[1, 2]"),
        "t/trial.json: trial.json must be a JSON object, got [1, 2]; the trial is not shown",
    ),
    "stat_names of numbers": (
        lambda t: _edit_json(t / "trial.json", lambda m: m.update(stat_names=[1, 2])),
        "t/trial.json: stat_names[0] must be a string, got 1; the trial is not shown",
    ),
    "step not UTF-8": (
        lambda t: (t / "steps" / "train-000000000.json").write_bytes(b"\xff\xfe"),
        f"{STEP}: not UTF-8 text (invalid start byte at byte 0); the step is not shown",
    ),
    "step with a NaN literal": (
        lambda t: _write(t / "steps" / "train-000000000.json", '{"step": NaN}'),
        f"{STEP}: NaN is not JSON (the recorder writes non-finite numbers as strings); "
        "the step is not shown",
    ),
    "step number a string": (
        lambda t: _edit_json(t / "steps" / "train-000000000.json", lambda m: m.update(step="0")),
        f'{STEP}: step must be an integer, got "0"; the step is not shown',
    ),
    "rows of unequal length": (
        lambda t: _edit_json(
            t / "steps" / "train-000000000.json", lambda m: m["rows"]["sample"].pop()
        ),
        f"{STEP}: rows columns differ in length (tensor 4, iteration 4, stream 4, sample 3); "
        "the step is not shown",
    ),
    "sample index that would build a billion options": (
        lambda t: _edit_json(
            t / "steps" / "train-000000000.json",
            lambda m: m["rows"]["sample"].__setitem__(0, 10**9),
        ),
        f"{STEP}: rows.sample[0] must be in [-1, 4], got 1000000000; the step is not shown",
    ),
    "statistics not an array": (
        lambda t: _write(t / "steps" / "train-000000000.npy", "not npy"),
        f"{STEP}: train-000000000.npy: cannot read the statistics",
    ),
    "statistics a named pipe": (
        lambda t: _fifo(t / "steps" / "train-000000000.npy"),
        f"{STEP}: train-000000000.npy: cannot read the statistics (is not a regular file); "
        "the step is not shown",
    ),
    "statistics of another shape": (
        lambda t: np.save(t / "steps" / "train-000000000.npy", np.zeros((4, 3), np.float32)),
        f"{STEP}: train-000000000.npy holds float32 [4, 3], expected float [4, 8] "
        "(rows x stat names); the step is not shown",
    ),
    "graph not JSON": (
        lambda t: [_write(g, "]") for g in (t / "graphs").glob("*.json")],
        "t/graphs/",
    ),
    "KPI not a number": (
        lambda t: _append(t / "kpis.jsonl", {"type": "train", "step": 1, "kpis": {"loss": "x"}}),
        "t/kpis.jsonl: line 2: kpis 'loss' must be a number, got \"x\"; the value is left out",
    ),
    "KPI line not JSON": (
        lambda t: (
            _write(t / "kpis.jsonl", (t / "kpis.jsonl").read_text() + "{oops\n"),
            _append(t / "kpis.jsonl", {"type": "train", "step": 5, "kpis": {"loss": 2.0}}),
        ),
        "t/kpis.jsonl: line 2: not JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))",
    ),
    "note text a number": (
        lambda t: _append(t / "notes.jsonl", {"step": 0, "text": 5}),
        "t/notes.jsonl: line 1: text must be a string, got 5; the line is skipped",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_file_is_reported_and_the_rest_is_kept(tmp_path, case) -> None:
    tdir = _small_trial(tmp_path)
    _small_trial(tmp_path, "u")  # an untouched second trial
    reference = load_bundle(tmp_path / "g")
    assert reference["problems"] == []
    mutate, expected = MALFORMED[case]
    mutate(tdir)
    bundle = load_bundle(tmp_path / "g")
    msgs = _problems(bundle)
    assert len(msgs) == 1 and msgs[0].startswith(expected), msgs
    # the untouched trial is exactly as before
    assert bundle["trials"][-1] == reference["trials"][-1]
    json.dumps(bundle, allow_nan=False)  # the page can still be served


def test_kpi_nan_strings_are_missing_values_and_a_partial_last_line_is_not_a_problem(
    tmp_path,
) -> None:
    tdir = _small_trial(tmp_path)
    _append(tdir / "kpis.jsonl", {"type": "train", "step": 1, "kpis": {"loss": "nan"}})
    _append(tdir / "kpis.jsonl", {"type": "train", "step": 2, "kpis": {"loss": "-inf"}})
    with open(tdir / "kpis.jsonl", "a") as fh:
        fh.write('{"type": "train", "st')  # the writer is appending right now
    bundle = load_bundle(tmp_path / "g")
    assert bundle["problems"] == []
    # the recorder writes non-finite KPIs as strings; the page shows them as gaps (null)
    assert [(r["step"], r["kpis"]) for r in bundle["trials"][0]["kpis"]] == [
        (0, {"loss": 1.5}),
        (1, {"loss": None}),
        (2, {"loss": None}),
    ]


@pytest.mark.parametrize("mode", ["served", "export"])
def test_page_with_a_broken_trial_shows_the_others_and_the_error(
    browser, tmp_path, mode, capsys  # noqa: F811 (fixture)
) -> None:
    record(tmp_path, "baseline", 1.0)
    broken = _small_trial(tmp_path, "broken")
    (broken / "trial.json").write_text("this is not JSON")
    p, srv = _open(browser, tmp_path / "g", mode, tmp_path)
    try:
        assert _texts(p, "#sel-trial option") == ["baseline"]
        assert "fc1.weight" in p.node_names()
        assert p.page.is_visible("#problems")
        assert _texts(p, "#problems li") == [
            "broken/trial.json: not JSON (Expecting value: line 1 column 1 (char 0)); "
            "the trial is not shown"
        ]
        p.close()
    finally:
        if srv is not None:
            srv.shutdown()
            srv.server_close()
    if mode == "export":  # the command line names the skipped file too
        assert "nnstat view: skipped broken/trial.json: not JSON" in capsys.readouterr().err


def test_page_with_only_broken_trials_lists_them(browser, tmp_path) -> None:  # noqa: F811
    tdir = _small_trial(tmp_path)
    srv, url = serve_in_thread(tmp_path / "g")
    try:
        (tdir / "trial.json").write_text("{}")
        p = Page(browser, url)
        assert p.page.locator("#sel-trial option").count() == 0
        assert _texts(p, "#problems li") == [
            "t/trial.json: stat_names must be a JSON list, got null; the trial is not shown"
        ]
        assert p.page.text_content("#details") == "No readable trial: see the skipped files above."
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()
