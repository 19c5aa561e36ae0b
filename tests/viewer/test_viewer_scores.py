"""save_scores / load_scores and the explorer's sources: scores made elsewhere (refined, as the
demo report's) saved beside a store, shown with the method behind every list, and the page saying
when the lists computed from the store differ from them."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_viewer import browser  # noqa: F401 (a fixture)
from test_viewer_examples import logged_mlp

from nnstat.influence import Refinement, compute_influence_all
from nnstat.store import GradientStore
from nnstat.viewer import load_scores, method_line, save_queries, save_scores
from nnstat.viewer.explorer import SELF, Explorer


def make_run(root, n_train: int = 24, n_query: int = 3):
    """A real store (K-FAC statistics, projected rows) of a tiny MLP, a saved query set, and
    what refinement needs (the model, the training and query data)."""
    run, log, model, (X, Y), (Xq, Yq) = logged_mlp(root, n_train, n_query)
    save_queries(log, run.path, name="wrong")
    refine = Refinement(
        model,
        torch.nn.functional.cross_entropy,
        (X, Y),
        query_data=(Xq, Yq),
        steps=3,
        curvature="ggn",
        progress=False,
    )
    refined = compute_influence_all(log, run.path, refine=refine, progress=False)
    return run.path, log, refined


def test_saved_scores_round_trip_exactly(tmp_path):
    store, log, refined = make_run(tmp_path)
    path = save_scores(store, "refined", refined, queries="wrong", label="the report's lists")
    back = load_scores(store, "refined")
    assert torch.equal(back.result.scores, refined.scores.contiguous())
    assert back.result.test_ids == refined.test_ids and back.result.train_ids == refined.train_ids
    assert back.meta["refine"]["steps"] == 3 and back.meta["preconditioner"] == "refined"
    assert back.meta == json.loads(json.dumps(refined.meta))  # the meta as JSON, every key kept
    assert back.label == "the report's lists" and back.queries == "wrong"
    rec = json.loads(path.read_text())  # plain JSON beside a safetensors file, no pickle
    assert rec["format"] == "nnstat-scores" and rec["kind"] == "full"
    assert sorted(p.name for p in path.parent.iterdir()) == ["scores.json", "scores.safetensors"]
    # top-k results round-trip too; training rows as queries (queries=None)
    top = compute_influence_all(GradientStore(store), store, top_k=4, progress=False)
    save_scores(store, "self-top", top)
    t = load_scores(store, "self-top").result
    assert torch.equal(t.helpful_scores, top.helpful_scores) and t.helpful_ids == top.helpful_ids
    assert torch.equal(t.harmful_scores, top.harmful_scores) and t.harmful_ids == top.harmful_ids
    # columns in another order are saved in the store's order
    perm = list(reversed(range(len(refined.train_ids))))
    shuffled = type(refined)(
        refined.scores[:, perm], refined.test_ids, [refined.train_ids[i] for i in perm], {}
    )
    save_scores(store, "shuffled", shuffled, queries="wrong")
    assert torch.equal(load_scores(store, "shuffled").result.scores, refined.scores)
    with pytest.raises(ValueError, match="not the ids of query set 'wrong'"):
        save_scores(store, "x", top, queries="wrong")
    with pytest.raises(KeyError, match="no query set 'nope'"):
        save_scores(store, "x", refined, queries="nope")
    with pytest.raises(ValueError, match="name must be"):
        save_scores(store, "../x", refined, queries="wrong")


def test_scores_bound_to_the_ids_are_refused_naming_the_file(tmp_path):
    from nnstat.viewer.bundle import load_bundle
    from nnstat.viewer.examples import tiny_store

    store, log, refined = make_run(tmp_path / "a")
    path = save_scores(store, "refined", refined, queries="wrong")
    # copied beside another store with other ids
    (tmp_path / "b").mkdir()
    other = tiny_store(tmp_path / "b", list(range(24))[::-1])
    shutil.copytree(store / "viewer", other / "viewer")
    copied = other / "viewer" / "scores" / "refined" / "scores.json"
    with pytest.raises(ValueError, match="saved for other ids than") as err:
        load_scores(other, "refined")
    assert str(copied) in str(err.value) and "save_scores" in str(err.value)
    problems = load_bundle(tmp_path / "b")["problems"]
    assert any("saved for other ids than" in p["message"] for p in problems)
    # the query set saved again with other queries
    save_queries(type(log)(log.ids[::-1], log.rows.flip(0), log.meta), store, name="wrong")
    with pytest.raises(ValueError, match="other query ids") as err:
        load_scores(store, "refined")
    assert str(path) in str(err.value)
    save_queries(log, store, name="wrong")
    assert load_scores(store, "refined").test_ids == log.ids
    # tensors not the ones the JSON was saved with
    save_scores(store, "other", compute_influence_all(log, store), queries="wrong")
    tensors = path.with_name("scores.safetensors")
    shutil.copy(store / "viewer" / "scores" / "other" / "scores.safetensors", tensors)
    with pytest.raises(ValueError, match="tensors_sha256 differs") as err:
        load_scores(store, "refined")
    assert str(tensors) in str(err.value)


def test_explorer_names_the_method_and_compares_with_saved_scores(tmp_path):
    store, log, refined = make_run(tmp_path)
    save_scores(store, "refined", refined, queries="wrong", label="the report's lists")
    ex = Explorer(tmp_path)
    here = ex.influence("p", "wrong", 1, k=5)
    plain = compute_influence_all(log, store, progress=False)
    assert here["method"]["source"] == "here" and here["method"]["mode"] == "dot"
    assert here["method"]["preconditioner"] == plain.meta["preconditioner"] == "ekfac"
    assert here["method"]["line"] == method_line(plain.meta)
    assert "not refined" in here["method"]["line"]
    (cmp,) = here["compare"]
    want = refined.top_k(50)
    assert cmp["source"] == "refined" and cmp["helpful_ids"] == want.helpful_ids[1]
    assert "refined: 3 conjugate-gradient steps on the exact Gauss-Newton curvature" in cmp["why"]
    saved = ex.influence("p", "wrong", 1, k=5, scores="refined")
    assert saved["method"]["line"] == method_line(refined.meta)
    assert saved["method"]["refine"]["steps"] == 3 and saved["method"]["label"] == cmp["label"]
    assert [e["id"] for e in saved["helpful"]] == want.helpful_ids[1][:5]
    assert [e["score"] for e in saved["helpful"]] == want.helpful_scores[1, :5].tolist()
    assert [e["id"] for e in saved["harmful"]] == want.harmful_ids[1][:5]
    assert saved["compare"][0]["source"] == "here"  # and back: the lists computed here
    with pytest.raises(ValueError, match="are for query set 'wrong'"):
        ex.influence("p", SELF, 0, scores="refined")
    with pytest.raises(KeyError, match="no saved scores 'nope'"):
        ex.influence("p", "wrong", 0, scores="nope")
    summary = next(s for s in ex_summary(tmp_path) if s["id"] == "p")
    assert summary["score_sets"] == [
        {
            "name": "refined",
            "label": "the report's lists",
            "queries": "wrong",
            "n": 3,
            "method": method_line(refined.meta),
        }
    ]
    line = ex.self_influence("p", 3)["method"]["line"]
    assert line.startswith("self-influence") and "ekfac" in line


def ex_summary(root):
    from nnstat.viewer.bundle import load_bundle

    return load_bundle(root)["stores"]


@pytest.mark.parametrize("set_name", ["wrong", SELF])
def test_relatif_lists_are_the_top_k_of_compute_influence_all(tmp_path, set_name):
    store, log, _ = make_run(tmp_path)
    query = log if set_name else GradientStore(store)
    want = compute_influence_all(query, store, mode="relatif", progress=False).top_k(5)
    ex = Explorer(tmp_path)
    for q in (0, 2):
        got = ex.influence("p", set_name, q, k=5, mode="relatif")
        assert got["method"]["mode"] == "relatif" and "RelatIF" in got["method"]["line"]
        assert [e["id"] for e in got["helpful"]] == want.helpful_ids[q]
        assert [e["id"] for e in got["harmful"]] == want.harmful_ids[q]
        torch.testing.assert_close(
            torch.tensor([e["score"] for e in got["helpful"]]), want.helpful_scores[q]
        )
    with pytest.raises(ValueError, match="mode must be one of dot, relatif"):
        ex.influence("p", set_name, 0, mode="l2")


def test_explorer_page_shows_the_method_the_saved_lists_and_the_difference(
    tmp_path, browser  # noqa: F811
):
    from test_viewer import Page

    from nnstat.viewer.server import main, serve_in_thread

    store, log, refined = make_run(tmp_path)
    # lists that surely differ from those computed here: the refined scores, negated
    flipped = type(refined)(-refined.scores, refined.test_ids, refined.train_ids, refined.meta)
    save_scores(store, "refined", flipped, queries="wrong", label="the report's lists")
    want = flipped.top_k(10)
    srv, url = serve_in_thread(tmp_path)
    try:
        p = Page(browser, url + "#stores/0")
        p.page.wait_for_selector("#inf-result[data-query='wrong:0']")
        method = p.page.inner_text("#inf-result .method")
        assert "computed here" in method and "preconditioner ekfac" in method
        assert "not refined" in method
        note = p.page.inner_text("#inf-result .compare.differs")
        assert 'the saved scores "refined" (the report\'s lists)' in note
        assert "Why: refined: 3 conjugate-gradient steps" in note
        p.page.select_option("#inf-source", "saved:refined")
        p.page.wait_for_selector("#inf-result[data-query='wrong:0'][data-source='saved:refined']")
        method = p.page.inner_text("#inf-result .method")
        assert 'saved scores "refined"' in method and "refined: 3 conjugate-gradient" in method
        cards = p.page.eval_on_selector_all(
            "#inf-result .helpful .card", "els => els.map(e => JSON.parse(e.dataset.id))"
        )
        assert cards == want.helpful_ids[0]
        assert "computed here" in p.page.inner_text("#inf-result .compare.differs")
        p.page.select_option("#inf-source", "here:relatif")
        p.page.wait_for_selector("#inf-result[data-query='wrong:0'][data-source='here:relatif']")
        assert "RelatIF" in p.page.inner_text("#inf-result .method")
        p.page.screenshot(path="/tmp/nnstat_view_scores.png", full_page=True)
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()
    # the export carries the saved lists too
    out = tmp_path / "view.html"
    assert main([str(tmp_path), "--export", str(out)]) == 0
    p = Page(browser, out.as_uri() + "#stores/0")
    p.page.wait_for_selector("#inf-result[data-query='wrong:0']")
    p.page.select_option("#inf-source", "saved:refined")
    p.page.wait_for_selector("#inf-result[data-query='wrong:0'][data-source='saved:refined']")
    cards = p.page.eval_on_selector_all(
        "#inf-result .helpful .card", "els => els.map(e => JSON.parse(e.dataset.id))"
    )
    assert cards == want.helpful_ids[0]
    p.close()
