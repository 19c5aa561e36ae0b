"""The demo's HTML report: self-contained (figures inline, nothing fetched), escaped text, and
the quick demo end to end writes it with every section."""

from __future__ import annotations

import base64
import re
import struct

import pytest

pytest.importorskip("matplotlib")

from nnstat.demo.report import HtmlReport  # noqa: E402


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def test_report_is_self_contained_and_escaped(tmp_path):
    from matplotlib.figure import Figure

    rep = HtmlReport("t <1>", "sub & title")
    rep.section("Numbers", "a `code` span and <script>alert(1)</script>")
    rep.table({"accuracy": 0.97, "<k>": "<v>"})
    rep.bullets(["one", "<two>"])
    fig = Figure(figsize=(3, 2))
    fig.add_subplot().plot([0, 1], [1, 0])
    rep.figure(fig, "a line")
    page = rep.write(tmp_path / "sub" / "r.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "<code>code</code>" in page and "&lt;k&gt;" in page and "sub &amp; title" in page
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from a network
    (png,) = _images(page)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (300, 200)
    assert '<a href="#s0">Numbers</a>' in page


def test_quick_demo_writes_the_report(tmp_path, monkeypatch, capsys):
    from nnstat.demo import main

    monkeypatch.setenv("NNSTAT_DEMO_QUICK", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    assert main(["--log-dir", str(tmp_path), "--no-wandb"]) == 0
    out = capsys.readouterr().out
    report = tmp_path / "report.html"
    assert f"HTML report: {report.resolve()}" in out
    page = report.read_text()
    for heading in ("Statistics over training", "Trust ratios", "Noise scale", "wrong?"):
        assert heading in page
    images = _images(page)
    assert len(images) >= 7 and all(len(png) > 5_000 for png in images)
    assert re.search(r"test #\d+: true \d, predicted \d; most helpful #\d+", page) or (
        "classified every test digit correctly" in page
    )
    store = next((tmp_path / "gradients").iterdir())
    assert (store / "meta.json").exists()
