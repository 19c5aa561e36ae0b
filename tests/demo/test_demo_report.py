"""The demo's HTML report: self-contained (figures inline, nothing fetched), escaped text, every
figure titled and readable, and, from one quick demo run end to end (NNSTAT_DEMO_QUICK: 400
digits, 12 epochs of 5 steps, instead of 1797 digits and 8 epochs of 23 steps), a page whose
numbers agree with independent computations: the planted-label recall with
``compute_self_influence`` on the store the demo wrote, the ``describe`` table with torch's own
reductions of the final weights, the wall time with the console's."""

from __future__ import annotations

import base64
import contextlib
import html
import importlib.util
import io
import re
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("matplotlib")

from nnstat.demo.report import HtmlReport  # noqa: E402


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]


def _text(page: str) -> str:
    """The page's text, tags removed, entities decoded."""
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


def test_report_is_self_contained_and_escaped(tmp_path):
    from matplotlib.figure import Figure

    rep = HtmlReport("t <1>", "sub & title")
    rep.section("Numbers", "a `code` span and <script>alert(1)</script>")
    rep.table({"accuracy": 0.97, "<k>": "<v>", "late": lambda: "computed at write time"})
    rep.grid(["layer", "numel", "mean"], [["fc <1>", 1200, 0.123456]])
    rep.bullets(["one", "<two>"])
    fig = Figure(figsize=(3, 2))
    fig.add_subplot().plot([0, 1], [1, 0])
    fig.axes[0].set_title("a line")
    info = rep.figure(fig, "a line")
    page = rep.write(tmp_path / "sub" / "r.html").read_text()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "<code>code</code>" in page and "&lt;k&gt;" in page and "sub &amp; title" in page
    assert "computed at write time" in page
    assert "<th>numel</th>" in page and '<td class="num">1,200</td>' in page
    assert '<td class="num">0.1235</td>' in page and "fc &lt;1&gt;" in page
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from a network
    (png,) = _images(page)
    # saved at 150 dpi, shown at 100 CSS px per inch
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24]) == (450, 300)
    assert 'width="300"' in page and 'data-title="a line"' in page
    assert info.title == "a line" and info.min_text_px == pytest.approx(10 * 100 / 72)
    assert '<a href="#s0">Numbers</a>' in page


def test_report_refuses_a_figure_without_title():
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 2))
    fig.add_subplot().plot([0, 1])
    with pytest.raises(ValueError, match="title"):
        HtmlReport("t").figure(fig)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One quick demo run through `main` (W&B offline): its state, console output and page."""
    import nnstat.demo.train as demo_train

    log_dir = tmp_path_factory.mktemp("demo")
    states = []
    original_run = demo_train.run

    def run(config, steps=()):
        states.append(original_run(config, steps))
        return states[-1]

    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NNSTAT_DEMO_QUICK", "1")
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_SILENT", "true")
        mp.setattr(demo_train, "run", run)
        with contextlib.redirect_stdout(out):
            assert demo_train.main(["--log-dir", str(log_dir)]) == 0
    page = (log_dir / "report.html").read_text()
    return SimpleNamespace(state=states[0], out=out.getvalue(), page=page, log_dir=log_dir)


@pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None, reason="wandb is not installed (nnstat[wandb])"
)  # the demo logs to W&B only where wandb is installed; this test counts its run
def test_console_reports_training_and_logs(demo):
    out, log_dir = demo.out, demo.log_dir
    assert "epoch 12/12" in out and "test accuracy" in out
    assert "kurtosis" in out and "4.weight" in out  # describe table
    assert "trust ratio" in out
    assert str(log_dir / "tensorboard") in out
    assert len(list((log_dir / "tensorboard").glob("events.out.tfevents.*"))) == 1
    assert len(list((log_dir / "wandb").glob("offline-run-*"))) == 1
    accuracy = float(out.split("test accuracy")[1].split()[0])
    assert accuracy > 0.5  # it actually trains (10 classes: chance is 0.1)
    assert f"HTML report: {(log_dir / 'report.html').resolve()}" in out


def test_console_and_report_show_one_wall_time(demo):
    (console,) = re.findall(r"demo finished in ([0-9.]+) s", demo.out)
    text = _text(demo.page)
    (summary,) = re.findall(r"wall time, data to report\s+([0-9.]+) s", text)
    (timings,) = re.findall(r"wall time, data to report \(as in the console\)\s+([0-9.]+) s", text)
    assert console == summary == timings == f"{demo.state.wall_seconds:.1f}"


def test_every_figure_is_titled_and_readable(demo):
    figures = re.findall(r'<figure data-title="([^"]*)" data-min-text-px="([0-9.]+)">', demo.page)
    assert len(figures) == len(_images(demo.page)) >= 10
    titles = [html.unescape(t) for t, _ in figures]
    assert all(t.strip() for t in titles) and len(set(titles)) == len(titles)
    assert not any(t.lower() in ("histogram", "figure") for t in titles)
    # no text smaller than 11 CSS px once the page has scaled the figure to its column
    assert min(float(px) for _, px in figures) >= 11.0
    assert all(len(png) > 5_000 for png in _images(demo.page))


def test_report_has_curves_and_the_describe_table(demo):
    page, state = demo.page, demo.state
    titles = re.findall(r'data-title="([^"]*)"', page)
    assert "loss and accuracy, train and test" in titles
    for heading in (
        "How did training go?",
        "Which layers moved?",
        "Which batch size?",
        "Which labels look wrong?",
        "Why did it get these digits wrong?",
        "Do the explanations hold?",
    ):
        assert heading in page
    # every logged step carries the curves' four numbers
    logged = state.extras.history
    assert len(logged) >= 10
    assert all(
        {"train/loss", "test/loss", "train/accuracy", "test/accuracy"} <= set(h) for h in logged
    )
    # the final losses in the summary, against cross_entropy of the final model
    model = state.model
    with torch.no_grad():
        train_loss = torch.nn.functional.cross_entropy(model(state.X_train), state.y_train)
        test_loss = torch.nn.functional.cross_entropy(model(state.X_test), state.y_test)
    (shown,) = re.findall(r"final loss train / test\s+([0-9.]+) / ([0-9.]+)", _text(page))
    assert shown == (f"{float(train_loss):.4f}", f"{float(test_loss):.4f}")
    # the describe table, row by row, against torch's own reductions of the final weights
    table = page.split('<table class="grid">')[1].split("</table>")[0]
    header = re.findall(r"<th>([^<]*)</th>", table)
    assert header[:7] == ["layer", "numel", "mean", "std", "skew", "kurtosis", "l2"]
    rows = re.findall(r"<tr>(<td.*?)</tr>", table)
    params = dict(model.named_parameters())
    assert [re.findall(r"<td>([^<]*)</td>", r)[0] for r in rows] == list(params)
    for row in rows:
        name = re.findall(r"<td>([^<]*)</td>", row)[0]
        cells = [c.replace(",", "") for c in re.findall(r'<td class="num">([^<]*)</td>', row)]
        w = params[name].detach().double()
        assert int(cells[0]) == w.numel()
        assert float(cells[1]) == pytest.approx(float(w.mean()), rel=1e-3, abs=1e-9)
        assert float(cells[2]) == pytest.approx(float(w.std(unbiased=False)), rel=2e-3)
        assert float(cells[5]) == pytest.approx(float(w.norm()), rel=1e-3)
        moved = (w - state.W_init[name].double()).norm() / state.W_init[name].double().norm()
        assert float(cells[6]) == pytest.approx(float(moved), rel=1e-3)


def _saved(demo) -> dict[str, np.ndarray]:
    with np.load(demo.log_dir / "explanations.npz") as f:
        return {k: f[k] for k in f.files}


def _hits(values: np.ndarray, planted: np.ndarray) -> np.ndarray:
    """hits[k-1]: planted positions among the k highest values (stable, written afresh here)."""
    order = np.argsort(-values, kind="stable")
    return np.cumsum(np.isin(order, planted))


def _row(page: str, first: str, second: str | None = None) -> list[str]:
    """The cells after the first (and second) of a grid row of the page, as displayed."""
    head = rf"<tr><t[dh][^>]*>{re.escape(html.escape(first))}</t[dh]>"
    if second is not None:
        head += rf"<td[^>]*>{re.escape(html.escape(second))}</td>"
    m = re.search(head + r"(.*?)</tr>", page)
    assert m, f"no row {first!r} {second!r}"
    return [html.unescape(c) for c in re.findall(r"<td[^>]*>([^<]*)</td>", m[1])]


def test_planted_label_recall_equals_a_direct_computation(demo):
    from nnstat.influence import compute_self_influence

    state, saved = demo.state, _saved(demo)
    n, planted = len(state.y_train), state.planted
    assert len(planted) == round(state.config.mislabel_fraction * n) > 0
    assert bool((state.y_train[planted] != state.y_train_true[planted]).all())
    assert saved["planted"].tolist() == planted
    # self-influence afresh from the store on disk, ranked here (not with the demo's helpers)
    store = demo.log_dir / "gradients" / "digits"
    result = compute_self_influence(store, progress=False)
    ids = torch.tensor([int(i) for i in result.ids])
    top = ids[torch.argsort(result.scores, descending=True, stable=True)[: len(planted)]]
    found = len(set(top.tolist()) & set(planted))
    k = len(planted)
    # the saved training loss is the final model's, and the saved self-influence the store's
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(
            state.model(state.X_train), state.y_train, reduction="none"
        )
    np.testing.assert_allclose(saved["train_loss"], loss.double().numpy(), rtol=1e-5)
    self_hits = _hits(saved["self_influence"], saved["planted"])
    loss_hits = _hits(saved["train_loss"], saved["planted"])
    assert self_hits[k - 1] == found
    loss_found = int(loss_hits[k - 1])
    self_all, loss_all = (int(np.argmax(h == k)) + 1 for h in (self_hits, loss_hits))
    text = _text(demo.page)
    m = re.search(
        r"Recall at k = (\d+) \(the number planted, of n = (\d+)\): self-influence "
        r"\(\w+ preconditioner of the gradient store\) finds (\d+) of the \d+ planted digits "
        r"among its \d+ highest, the training loss (\d+) of \d+, a random order ([0-9.]+) on "
        r"average \(recall ([0-9.]+)\)\. Read down to the end, self-influence has found every "
        r"planted digit by rank (\d+), the training loss by rank (\d+), a random order by rank "
        r"(\d+) on average",
        text,
    )
    assert m, "the self-influence paragraph is missing"
    assert (int(m[1]), int(m[2]), int(m[3]), int(m[4])) == (k, n, found, loss_found)
    assert m[5] == f"{k * k / n:.1f}" and m[6] == f"{k / n:.3f}"
    assert (int(m[7]), int(m[8])) == (self_all, loss_all)
    assert int(m[9]) == round(k * (n + 1) / (k + 1))
    # the comparison table, and the summary table saying the same
    assert _row(demo.page, "self-influence") == [str(found), f"{found / k:.4g}", str(self_all)]
    assert _row(demo.page, "training loss") == [
        str(loss_found),
        f"{loss_found / k:.4g}",
        str(loss_all),
    ]
    assert f"{found} of {k} in the top {k} (training loss: {loss_found} of {k}" in text
    # the verdict follows the numbers
    if found <= loss_found and self_all >= loss_all:
        assert "the training loss alone finds the planted labels as well" in text
    else:
        assert "the training loss alone finds the planted labels as well" not in text
    # the behaviour the section claims: far above a random order's expected k/n
    assert found / k > 5 * k / n


def test_grid_counts_both_sides_from_the_saved_scores(demo):
    state, saved = demo.state, _saved(demo)
    if not state.extras.misclassified:
        pytest.skip("no misclassified test digit")
    text = _text(demo.page)
    planted = set(saved["planted"].tolist())
    q = len(saved["misclassified"])
    assert saved["misclassified"].tolist() == state.extras.misclassified
    # the saved raw scores are the demo's influence result
    np.testing.assert_allclose(
        saved["scores_raw"], state.extras.influence.scores.double().numpy(), rtol=1e-6
    )
    for name, label in (("raw", "raw influence"), ("relatif", "RelatIF")):
        s = saved[f"scores_{name}"]
        assert s.shape == (q, len(state.y_train))
        helpful = np.argsort(-s, axis=1, kind="stable")[:, :3]
        harmful = np.argsort(s, axis=1, kind="stable")[:, :3]
        hel, har = set(helpful.ravel().tolist()), set(harmful.ravel().tolist())
        expected = [
            str(sum(int(i) in planted for i in helpful.ravel())),
            str(sum(int(i) in planted for i in harmful.ravel())),
            f"{3 * q * len(planted) / len(state.y_train):.4g}",
            str(len(hel & har)),
            f"{len(hel)} / {len(har)}",
        ]
        assert _row(demo.page, label) == expected, label
    assert f"planted among most supportive (of {3 * q})" in text
    assert f"planted among most opposing (of {3 * q})" in text


def test_counterfactual_section_has_every_arm_and_picks_the_grid(demo):
    import json

    state, saved = demo.state, _saved(demo)
    if not state.extras.misclassified:
        pytest.skip("no misclassified test digit")
    text = _text(demo.page)
    assert "Do the explanations hold? Remove, retrain, compare" in text
    cf = json.loads((demo.log_dir / "counterfactual.json").read_text())
    names = {
        "raw": "raw influence",
        "relatif": "RelatIF",
        "loss": "highest training loss",
        "random": "random",
    }
    q = len(saved["misclassified"])
    support = {}
    for k, res in cf["by_k"].items():
        k = int(k)
        assert list(res["arms"]) == ["raw", "relatif", "loss", "random"]
        assert res["direction"] == "helpful" and res["k"] == k
        # what each ranking removed, recomputed from the saved arrays
        joint = {n: saved[f"scores_{n}"].sum(0) for n in ("raw", "relatif")}
        joint["loss"] = saved["train_loss"]
        for name, values in joint.items():
            top = sorted(np.argsort(-values, kind="stable")[:k].tolist())
            assert all(r == top for r in res["arms"][name]["removed"]), (k, name)
        for name, arm in res["arms"].items():
            assert len(arm["change"]) == len(res["full_loss"]) >= 2
            assert arm["mean"] == pytest.approx(np.mean(arm["change"]))
            lo, hi = arm["interval"]
            cells = _row(demo.page, f"{k:,}", names[name])
            assert cells[:3] == [
                f"{arm['mean']:.4g}",
                f"[{lo:+.3f}, {hi:+.3f}]",
                f"{np.mean(arm['correct']) * q:.1f} (full data "
                f"{np.mean(res['full_correct']) * q:.1f})",
            ], (k, name)
            removed_planted = np.mean(
                [len(set(r) & set(saved["planted"].tolist())) for r in arm["removed"]]
            )
            assert float(cells[3]) == pytest.approx(round(removed_planted, 1))
        for name in ("raw", "relatif"):
            support.setdefault(name, []).append(res["arms"][name]["mean"])
    chosen = max(("raw", "relatif"), key=lambda n: (np.mean(support[n]), n == "raw"))
    assert cf["chosen"] == chosen
    assert f"The grid shows {names[chosen]}:" in text
    assert f"training digits ({names[chosen]})" in _text(
        " ".join(re.findall(r'data-title="([^"]*)"', demo.page))
    )
    assert f"the score with the larger rise ({np.mean(support[chosen]):+.3f})" in text


def test_batch_size_advice_covers_the_stages_of_training(demo):
    text = _text(demo.page)
    assert "B_simple grew from a median of" in text or "B_simple" in text
    assert "How sure:" in text
    for stage in ("early", "late"):
        assert re.search(rf"\b{stage}\s+\d+–\d+", text)  # a row of the stage table


def test_viewer_can_show_the_examples(demo):
    from nnstat.viewer import load_examples, load_queries

    state = demo.state
    store = demo.log_dir / "gradients" / "digits"
    examples = load_examples(store)
    assert examples.ids == list(range(len(state.y_train)))
    assert examples.labels == state.y_train.tolist()
    np.testing.assert_allclose(examples.images.numpy(), state.images_train.numpy())
    queries = store / "viewer" / "queries" / "misclassified"
    if state.extras.misclassified:
        assert load_queries(queries).ids == state.extras.misclassified
        assert load_examples(queries).ids == state.extras.misclassified
    jsonl = (demo.log_dir / "metrics" / "metrics.jsonl").read_text()
    assert '"test/accuracy"' in jsonl and '"noise_scale/b_simple"' in jsonl


def test_viewer_shows_the_reports_scores_under_their_saved_names(demo):
    """The scores the report used are saved beside the store: equal to the report's arrays, their
    method named in the report, and the explorer's saved lists are the report's bullet lists."""
    from nnstat.viewer import load_scores, method_line
    from nnstat.viewer.explorer import Explorer

    state, saved = demo.state, _saved(demo)
    if not state.extras.misclassified:
        pytest.skip("no misclassified test digit")
    store = demo.log_dir / "gradients" / "digits"
    text = _text(demo.page)
    chosen = state.extras.explanations.chosen
    names = {"raw": ("refined", "raw influence"), "relatif": ("relatif", "RelatIF")}
    for score, (name, label) in names.items():
        sc = load_scores(store, name)
        assert sc.queries == "misclassified" and sc.test_ids == state.extras.misclassified
        np.testing.assert_array_equal(sc.result.scores.double().numpy(), saved[f"scores_{score}"])
        line = method_line(sc.meta)
        # the report names the method of each list and the name the viewer shows it under
        assert (
            f'{label}: {line}; nnstat view shows the same lists under scores "saved: {name}"'
            in (text)
        ), (score)
    assert "refined: 5 conjugate-gradient steps" in method_line(load_scores(store, "refined").meta)
    # the report's bullets (the grid's score) are the explorer's lists of that saved set
    explorer = Explorer(demo.log_dir)
    for r, q in enumerate(state.extras.misclassified):
        res = explorer.influence(
            "gradients/digits", "misclassified", r, k=3, scores=names[chosen][0]
        )
        line = re.search(
            rf"test #{q}: true \d, predicted \d; most supportive (.*?); most opp"
            rf"osing (.*?)(?=  |$|\n)",
            text,
        )
        assert line, q
        got = [re.findall(r"#(\d+)", line[1]), re.findall(r"#(\d+)", line[2])]
        assert got == [[str(e["id"]) for e in res[side]] for side in ("helpful", "harmful")], q
    # computed here with RelatIF is the saved RelatIF (same method): the page says "same"
    here = explorer.influence("gradients/digits", "misclassified", 0, k=3, mode="relatif")
    saved_relatif = next(c for c in here["compare"] if c["source"] == "relatif")
    assert saved_relatif["helpful_ids"][:3] == [e["id"] for e in here["helpful"]]
