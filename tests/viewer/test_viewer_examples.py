"""save_examples / save_queries: what the influence explorer shows, saved beside a store."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from test_viewer import browser  # noqa: F401 (a fixture)

import nnstat
from nnstat.influence import compute_influence_all
from nnstat.store import GradientStore
from nnstat.viewer import load_examples, load_queries, save_examples, save_queries
from nnstat.viewer.examples import query_sets, tiny_store


def make_store(root, n_train: int = 24, n_query: int = 3):
    """A real store (K-FAC statistics, projected rows) of a tiny MLP, and a query log of it."""
    run, log, _, (X, _), _ = logged_mlp(root, n_train, n_query)
    return run.path, log, X


def logged_mlp(root, n_train: int = 24, n_query: int = 3):
    """``(run, query log, model, (X, Y), (Xq, Yq))``: the store of `make_store` and what made it
    (the model and the training and query data, for refinement)."""
    torch.manual_seed(0)
    X, Y = torch.randn(n_train, 6), torch.randint(0, 3, (n_train,))
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))

    def loss_fn(x, y):
        return torch.nn.functional.cross_entropy(model(x), y, reduction="sum")

    run = nnstat.init(project="p", root_dir=root)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac"})
    nnstat.watch(model)
    nnstat.add_projection(rank=3, seed=0)
    for _ in run.schedule():
        for s in range(0, n_train, 8):
            with run(data_id=list(range(s, s + 8))):
                loss_fn(X[s : s + 8], Y[s : s + 8]).backward()
            model.zero_grad()
    nnstat.eval()
    Xq, Yq = torch.randn(n_query, 6), torch.randint(0, 3, (n_query,))
    with run(data_id=[f"q{i}" for i in range(n_query)]):
        loss_fn(Xq, Yq).backward()
    model.zero_grad()
    log = nnstat.get_log()
    run.train()
    return run, log, model, (X, Y), (Xq, Yq)


def test_save_examples_round_trip_and_errors(tmp_path):
    store, log, X = make_store(tmp_path)
    images = np.random.default_rng(0).integers(0, 255, (24, 3, 4, 5)).astype(np.uint8)  # NCHW
    path = save_examples(store, list(range(24)), images=images, labels=list(range(24)))
    rec = json.loads(path.read_text())  # plain JSON, independent of load_examples
    assert rec["ids"] == list(range(24)) and rec["images"]["shape"] == [24, 4, 5, 3]
    ex = load_examples(store)
    np.testing.assert_array_equal(ex.images.numpy(), images.transpose(0, 2, 3, 1))
    assert ex.labels == list(range(24)) and ex.texts is None
    assert not any(p.suffix == ".pkl" for p in (store / "viewer").iterdir())
    GradientStore(store)  # the store still opens with the files beside it

    with pytest.raises(KeyError, match=r"ids not in the store.*\[99\]"):
        save_examples(store, [0, 99])
    with pytest.raises(ValueError, match="images has 2 examples but ids has 3"):
        save_examples(store, [0, 1, 2], images=np.zeros((2, 4, 4)))
    with pytest.raises(ValueError, match="labels has 1 values but ids has 2"):
        save_examples(store, [0, 1], labels=[1])
    with pytest.raises(ValueError, match="ids repeat"):
        save_examples(store, [0, 0])
    with pytest.raises(ValueError, match=r"images must be \[n, H, W\]"):
        save_examples(store, [0, 1], images=np.zeros((2, 16)))
    with pytest.raises(TypeError, match=r"texts\[1\] must be str"):
        save_examples(store, [0, 1], texts=["a", 3])
    with pytest.raises(FileNotFoundError, match="not a gradient store"):
        save_examples(tmp_path, [0])
    # a failed call left the previous examples as they were
    assert load_examples(store).labels == list(range(24))


def test_save_queries_scores_like_the_log(tmp_path):
    store, log, _ = make_store(tmp_path)
    folder = save_queries(log, store)
    assert query_sets(store) == [folder]
    back = load_queries(folder)
    assert back.ids == log.ids
    torch.testing.assert_close(back.rows, log.rows)
    a = compute_influence_all(log, store).scores
    b = compute_influence_all(back, store).scores
    torch.testing.assert_close(a, b)
    save_examples(folder, ["q1"], texts=["the second query"])
    assert load_examples(folder).texts == ["the second query"]
    with pytest.raises(KeyError, match="q9"):
        save_examples(folder, ["q9"])
    with pytest.raises(ValueError, match="name must be"):
        save_queries(log, store, name="../x")
    bad = type(log)(ids=log.ids, rows=log.rows[:, :-1], meta=log.meta)
    with pytest.raises(ValueError, match="wide"):
        save_queries(bad, store)


def _nan_store(root):
    """A 2-wide store whose row of id 1 is NaN (a damaged shard, or nonfinite='keep')."""
    (root / "s").mkdir(parents=True)
    rows = torch.tensor([[1.0, 2.0], [float("nan"), 1.0], [3.0, 4.0]])
    return tiny_store(root / "s", [0, 1, 2], rows)


def test_nan_query_rows_name_their_file(tmp_path, capsys):
    import urllib.error
    import urllib.request

    from safetensors.torch import save_file

    from nnstat.viewer.explorer import Explorer
    from nnstat.viewer.server import main, serve_in_thread

    store, log, _ = make_store(tmp_path)
    bad = log.rows.clone()
    bad[1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"query rows of ids \['q1'\] hold NaN/Inf"):
        save_queries(type(log)(ids=log.ids, rows=bad, meta=log.meta), store)
    # a query set whose rows file was damaged after saving: every message names the file
    folder = save_queries(log, store)
    rows_file = folder / "rows.safetensors"
    save_file({"rows": bad}, str(rows_file))
    with pytest.raises(ValueError, match=rf"{rows_file}: query rows of ids \['q1'\] hold NaN"):
        load_queries(folder)
    srv, url = serve_in_thread(tmp_path)
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "api/influence?store=p&set=queries&q=0")
        msg = err.value.read().decode()
        assert err.value.code == 400 and str(rows_file) in msg and "NaN/Inf" in msg
    finally:
        srv.shutdown()
        srv.server_close()
    assert main([str(tmp_path), "--export", str(tmp_path / "x.html")]) == 1
    assert str(rows_file) in capsys.readouterr().err
    # a training row with NaN as the query (the store against itself): its shard is named
    nan_store = _nan_store(tmp_path / "nan")
    with pytest.raises(ValueError) as err:
        Explorer(tmp_path / "nan").influence("s", "", 1, 2)
    shard = GradientStore(nan_store).shards[0]
    assert str(shard) in str(err.value) and "[1]" in str(err.value)
    assert "gradient rows contains" not in str(err.value)


def _edit(path, edit) -> None:
    rec = json.loads(path.read_text())
    edit(rec)
    path.write_text(json.dumps(rec))


def test_examples_are_bound_to_their_ids(tmp_path):
    from nnstat.viewer.explorer import Explorer

    store, _, _ = make_store(tmp_path)
    rng = np.random.default_rng(0)
    ids = list(range(24))
    labels, texts = [f"L{i}" for i in ids], [f"text of {i}" for i in ids]
    path = save_examples(store, ids, images=rng.random((24, 4, 4)), labels=labels, texts=texts)
    ex = Explorer(tmp_path)
    shown = ex.influence("p", "", 3, k=5)
    assert shown["query"]["label"] == "L3" and shown["query"]["text"] == "text of 3"
    assert all(c["label"] == f"L{c['id']}" for c in shown["helpful"] + shown["harmful"])
    good = path.read_text()

    # ids reversed (labels, texts, images as they were): every id would show another's example
    _edit(path, lambda r: r.update(ids=r["ids"][::-1]))
    with pytest.raises(
        ValueError, match=rf"{path}: ids \[23, 22, 21, 20, 19\] \(24 of 24\) do not"
    ):
        load_examples(store)
    with pytest.raises(ValueError, match="save them again with nnstat.viewer.save_examples"):
        load_examples(store)
    shown = Explorer(tmp_path).influence("p", "", 3, k=5)
    assert all(set(c) <= {"id", "score"} for c in shown["helpful"] + [shown["query"]])
    # one id swapped with another: those two are named
    _edit(path, lambda r: r.update(ids=json.loads(good)["ids"]))
    _edit(path, lambda r: r["ids"].__setitem__(slice(5, 7), [6, 5]))
    with pytest.raises(ValueError, match=r"ids \[6, 5\] \(2 of 24\)"):
        load_examples(store)

    # a file written before digests (version 1) is refused, not trusted
    path.write_text(good)
    _edit(path, lambda r: [r.pop("digests"), r.pop("ids_sha256"), r.update(version=1)])
    with pytest.raises(ValueError, match="did not bind each example to its id"):
        load_examples(store)

    # a file saved for other ids (copied from another store) is refused naming the file
    (tmp_path / "other").mkdir()
    other = tiny_store(tmp_path / "other", ids[::-1])
    (other / "viewer").mkdir()
    (other / "viewer" / "examples.json").write_text(good)
    (other / "viewer" / "examples.safetensors").write_bytes(
        (store / "viewer" / "examples.safetensors").read_bytes()
    )
    with pytest.raises(ValueError, match="saved for other ids than"):
        load_examples(other)
    path.write_text(good)
    assert load_examples(store).labels == labels


def test_explorer_shows_why_examples_are_not_shown(browser, tmp_path):  # noqa: F811
    from test_viewer import Page

    from nnstat.viewer.server import serve_in_thread

    store, _, _ = make_store(tmp_path)
    path = save_examples(store, list(range(24)), labels=[f"L{i}" for i in range(24)])
    _edit(path, lambda r: r.update(ids=r["ids"][::-1]))
    srv, url = serve_in_thread(tmp_path)
    try:
        p = Page(browser, url + "#stores/0")
        p.page.wait_for_selector("#inf-result[data-query=':0']")
        problem = p.page.inner_text("#inf-about .examples-problem")
        assert str(path) in problem and "save them again" in problem
        caps = p.page.eval_on_selector_all(".card .cap", "els => els.map(e => e.textContent)")
        assert caps and not any("label" in c for c in caps)  # ids only, no wrong label
        p.close()
    finally:
        srv.shutdown()
        srv.server_close()


def test_examples_record_the_store_digest_of_non_ascii_ids(tmp_path):
    import hashlib

    from nnstat.store.ids import ids_digest

    ids = ["café", "naïve", "東京"]
    (tmp_path / "s").mkdir()
    store = tiny_store(tmp_path / "s", ids)
    path = save_examples(store, ids, labels=[1, 2, 3])
    # one digest for ids on disk: the store's commit log and the viewer file agree
    escaped = hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()
    assert json.loads(path.read_text())["ids_sha256"] == escaped == ids_digest(ids)
    # a viewer file recording the unescaped UTF-8 form of the same JSON still verifies
    text = json.dumps(ids, separators=(",", ":"), ensure_ascii=False)
    _edit(path, lambda r: r.update(ids_sha256=hashlib.sha256(text.encode("utf-8")).hexdigest()))
    assert load_examples(store).labels == [1, 2, 3]
    # any other digest is refused, naming the file
    _edit(path, lambda r: r.update(ids_sha256=ids_digest(ids[::-1])))
    with pytest.raises(ValueError, match="saved for other ids than"):
        load_examples(store)
