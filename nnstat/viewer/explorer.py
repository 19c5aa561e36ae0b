"""The influence explorer: a gradient store's most helpful and harmful training examples per query.

Which pair is scored: every query set saved beside the store (`nnstat.viewer.save_queries`,
``<store>/viewer/queries/<name>/``) against that store, and the store against itself (any
training example as the query) whether or not a query set exists. Scores are
``nnstat.influence.compute_influence_all(query, store, top_k=k)`` with the store's default
preconditioner (EK-FAC when the run saved K-FAC statistics, else raw), so they equal what the
Python API returns; self-influence is ``compute_self_influence(store)``. ``mode`` is ``dot``
(the default) or ``relatif`` (RelatIF). Scores saved beside the store (`nnstat.viewer.save_scores`:
refined, or made with a model and data the store does not hold) are a source of their own; every
answer names the method behind its lists (``method``) and, for each other source that scores the
same query, its lists and why they can differ (``compare``). Results are cached for the life of
the server (one `Explorer` per ``nnstat view``).

Examples (images, labels, texts) come from `nnstat.viewer.save_examples`; images are sent as PNG
``data:`` URLs (the page's Content-Security-Policy allows images from ``data:`` only), scaled
from the smallest to the largest value of the saved set.

Example:
    >>> ex = Explorer("runs/nnstat_logs")  # doctest: +SKIP
    >>> ex.influence("my_project", "", 0, k=5)["helpful"][0]["score"]  # doctest: +SKIP
"""

from __future__ import annotations

import base64
import struct
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from nnstat.influence import (
    InfluenceResult,
    TopKInfluence,
    compute_influence_all,
    compute_self_influence,
)
from nnstat.influence.cache import default_preconditioner
from nnstat.influence.sources import all_finite, as_source, nonfinite_error
from nnstat.store import GradientLog, GradientStore
from nnstat.viewer.discover import discover, rel_id
from nnstat.viewer.examples import (
    VIEWER_DIR,
    Examples,
    load_examples,
    load_queries,
    query_sets,
    read_query_ids,
)
from nnstat.viewer.scores import (
    SavedScores,
    json_plain,
    load_scores,
    method_difference,
    method_line,
    score_sets,
)

SELF = ""  # query set name of "the store against itself"
MAX_K = 50
MODES = ("dot", "relatif")  # what the explorer computes itself
# the export has no server to ask: it carries this many queries per query set
EXPORT_QUERIES = 24
# the page lists at most this many queries to pick from (the rest by index)
LIST_QUERIES = 500


THUMB = 96  # the page shows examples 96 px wide: larger images are sent shrunk to this


def thumbnail(image: torch.Tensor, side: int = THUMB) -> torch.Tensor:
    """``image`` ``[H, W(, C)]`` shrunk by area averaging so its longer side is at most ``side``.

    Example:
        >>> tuple(thumbnail(torch.zeros(300, 150, 3)).shape)
        (96, 48, 3)
    """
    h, w = image.shape[0], image.shape[1]
    if max(h, w) <= side:
        return image
    scale = side / max(h, w)
    size = (max(1, round(h * scale)), max(1, round(w * scale)))
    x = image if image.ndim == 3 else image[:, :, None]
    x = torch.nn.functional.interpolate(x.permute(2, 0, 1)[None].float(), size=size, mode="area")
    x = x[0].permute(1, 2, 0)
    return x if image.ndim == 3 else x[:, :, 0]


def png_data_url(image: torch.Tensor, lo: float, hi: float) -> str:
    """A ``data:image/png`` URL of ``image`` ``[H, W]`` or ``[H, W, C]`` (C = 1, 3, 4),
    values mapped linearly from ``[lo, hi]`` to 0-255.

    Example:
        >>> png_data_url(torch.zeros(2, 2), 0.0, 1.0)[:22]
        'data:image/png;base64,'
    """
    x = image.to(torch.float64)
    scale = 255.0 / (hi - lo) if hi > lo else 0.0
    px = ((x - lo) * scale).round().clamp(0, 255).to(torch.uint8)
    if px.ndim == 3 and px.shape[2] == 1:
        px = px[:, :, 0]
    h, w = px.shape[0], px.shape[1]
    color = {2: 0, 3: {3: 2, 4: 6}.get(px.shape[-1], 0)}[px.ndim]
    raw = b"".join(b"\x00" + bytes(px[r].reshape(-1).tolist()) for r in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        body = tag + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, color, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw, 6))
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _examples(folder: Path) -> Examples | None:
    # a damaged examples file must not take the scores down with it: ids only (the page's
    # problems box names the file, from store_summary)
    try:
        return load_examples(folder)
    except (ValueError, OSError):
        return None


class _Shown:
    """What the page shows for an id: the saved example (image, label, text), else the id."""

    def __init__(self, ex: Examples | None) -> None:
        self.ex = ex
        self.index = {} if ex is None else {i: n for n, i in enumerate(ex.ids)}
        self.lo = self.hi = 0.0
        if ex is not None and ex.images is not None and ex.images.numel():
            # one scale for the whole set, so brightness compares across examples
            self.lo, self.hi = float(ex.images.min()), float(ex.images.max())

    def __call__(self, id_: Any) -> dict[str, Any]:
        out: dict[str, Any] = {"id": id_}
        n = self.index.get(id_)
        if n is None:
            return out
        ex = self.ex
        if ex.labels is not None:
            out["label"] = ex.labels[n]
        if ex.texts is not None:
            out["text"] = ex.texts[n]
        if ex.images is not None:
            out["image"] = png_data_url(thumbnail(ex.images[n]), self.lo, self.hi)
        return out


def store_summary(root: Path, folder: Path, report: Callable[[Path, str], None]) -> dict | None:
    """A store for the page's home and explorer: id, rows, modules, preconditioner, query sets."""
    rel = folder.relative_to(root).as_posix() if folder != root else folder.name
    if not folder.resolve().is_relative_to(root.resolve()):
        report(folder, f"resolves to {folder.resolve()}, outside the folder; not shown")
        return None
    try:
        store = GradientStore(folder)
        pre = _preconditioner(store)
    except Exception as exc:  # the store's own errors name the file and the fix
        report(folder, f"{exc}; the store is not shown")
        return None
    sets = [
        {"name": SELF, "label": "training examples (the store against itself)", "n": len(store)}
    ]
    for q in query_sets(folder):
        try:
            n = len(read_query_ids(q))
        except (ValueError, OSError) as exc:
            report(q, f"{exc}; the query set is not offered")
            continue
        entry = {"name": q.name, "label": f"query set {q.name}", "n": n}
        try:
            load_examples(q)
        except (ValueError, OSError) as exc:
            report(q, f"{exc}; its queries are shown as ids")
            entry["examples_problem"] = str(exc)
        sets.append(entry)
    saved, saved_problems = [], []
    for f in score_sets(folder):
        try:
            sc = load_scores(folder, f.name)
        except (ValueError, OSError, KeyError) as exc:
            msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            report(f / "scores.json", f"{msg}; the saved scores are not offered")
            saved_problems.append(str(msg))
            continue
        saved.append(
            {
                "name": sc.name,
                "label": sc.label,
                "queries": sc.queries,
                "n": len(sc.test_ids),
                "method": method_line(sc.meta),
            }
        )
    problem = None
    try:
        ex = load_examples(folder)
    except (ValueError, OSError) as exc:
        # the explorer shows this above the results: ids only, never another example's content
        problem = str(exc)
        report(folder, f"{exc}; examples are shown as ids")
        ex = None
    return {
        "examples_problem": problem,
        "id": rel,
        "rows": len(store),
        "row_width": store.row_width,
        "modules": [m["name"] for m in store.modules],
        "preconditioner": pre,
        "query_sets": sets,
        "score_sets": saved,
        "scores_problems": saved_problems,
        "examples": None if ex is None else len(ex.ids),
        "images": ex is not None and ex.images is not None,
    }


def _stamp(*files: Path) -> tuple:
    """Modification time and size of each existing file: a cache key part that changes when a
    file is rewritten while the server runs (a new training run, examples saved again)."""
    out = []
    for f in files:
        try:
            st = f.stat()
        except OSError:
            continue
        out.append((f.name, st.st_mtime_ns, st.st_size))
    return tuple(out)


def _store_stamp(store: GradientStore) -> tuple:
    return _stamp(store.path / "meta.json", store.path / "statistics.safetensors", *store.shards)


_PRECONDITIONERS: dict[tuple, str] = {}


def _preconditioner(store: GradientStore) -> str:
    """The store's default preconditioner kind, remembered per version of its files: finding it
    loads (and hashes) the statistics, which the page's every refresh must not do again."""
    files = (store.path / "meta.json", store.path / "statistics.safetensors")
    key = (str(store.path.resolve()),) + tuple(
        (p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files if p.exists()
    )
    if key not in _PRECONDITIONERS:
        _PRECONDITIONERS[key] = default_preconditioner(as_source(store))
    return _PRECONDITIONERS[key]


class Explorer:
    """Scores and examples of the stores under ``root``, computed on demand and cached.

    Every request names a store by its id (its path relative to ``root``) and a query set by
    name; both are looked up among what `discover` found, never joined into a path.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()  # one computation at a time; the server is threaded
        self._cache: dict[tuple, Any] = {}

    def _store_dir(self, store_id: str) -> Path:
        for d in discover(self.root).stores:
            if rel_id(self.root, d) == store_id:
                return d
        raise KeyError(f"no gradient store {store_id!r} under {self.root}")

    def _set_dir(self, store_dir: Path, name: str) -> Path | None:
        if name == SELF:
            return None
        for q in query_sets(store_dir):
            if q.name == name:
                return q
        raise KeyError(f"no query set {name!r} beside the store {store_dir}")

    def _cached(self, key: tuple, make: Callable[[], Any]) -> Any:
        with self._lock:
            if key not in self._cache:
                self._cache[key] = make()
            return self._cache[key]

    def _shown(self, folder: Path) -> _Shown:
        # the examples' files, and the ids they are bound to (a store or query set written again)
        files = (folder / "examples.json", folder / VIEWER_DIR / "examples.json")
        files += (folder / "query.json", folder / "meta.json", *sorted(folder.glob("shards/*")))
        return self._cached(
            ("shown", str(folder), _stamp(*files)), lambda: _Shown(_examples(folder))
        )

    def queries(self, store_id: str, set_name: str) -> dict[str, Any]:
        """The queries of a set for the picker: ``{"n", "items": [shown example, ...]}``
        (at most `LIST_QUERIES`; the rest are reached by index)."""
        store_dir = self._store_dir(store_id)
        folder = self._set_dir(store_dir, set_name)
        ids = GradientStore(store_dir).ids if folder is None else load_queries(folder).ids
        shown = self._shown(store_dir if folder is None else folder)
        return {"n": len(ids), "items": [shown(i) for i in ids[:LIST_QUERIES]]}

    def _saved(self, store_dir: Path, name: str) -> tuple[SavedScores, TopKInfluence]:
        """Saved scores ``name`` of a store, and their top-`MAX_K` (cached per file version)."""
        folder = store_dir / VIEWER_DIR / "scores" / name
        if not (folder / "scores.json").is_file():
            raise KeyError(f"no saved scores {name!r} beside the store {store_dir}")
        files = [*folder.iterdir(), store_dir / "meta.json", *sorted(store_dir.glob("shards/*"))]
        for q in query_sets(store_dir):
            files.append(q / "query.json")

        def make() -> tuple[SavedScores, TopKInfluence]:
            sc = load_scores(store_dir, name)
            res = sc.result
            top = res.top_k(MAX_K) if isinstance(res, InfluenceResult) else res
            return sc, top

        return self._cached(("saved", str(store_dir), name, _stamp(*files)), make)

    def _lists(
        self, store_id: str, set_name: str, q: int, mode: str, scores: str
    ) -> tuple[TopKInfluence, int, Any, dict, str]:
        """(top-`MAX_K`, its row of query ``q``, the query's id, meta, label) of one source:
        computed here with ``mode``, or the saved scores ``scores``."""
        store_dir = self._store_dir(store_id)
        folder = self._set_dir(store_dir, set_name)
        store = GradientStore(store_dir)
        ids = store.ids if folder is None else read_query_ids(folder)
        if not 0 <= q < len(ids):
            what = "the store has" if folder is None else "the set has"
            raise IndexError(
                f"query {q} out of range: {what} {len(ids)} {'rows' if folder is None else 'queries'}"
            )
        qid = ids[q]
        if scores:
            sc, top = self._saved(store_dir, scores)
            if sc.queries != set_name:
                for_ = f"query set {sc.queries!r}" if sc.queries else "training rows"
                raise ValueError(f"saved scores {scores!r} are for {for_}, not this query set")
            try:
                row = sc.test_ids.index(qid)
            except ValueError:
                raise ValueError(f"saved scores {scores!r} do not score query {qid!r}") from None
            return top, row, qid, sc.meta, sc.label
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if folder is None:
            # one training row as the query: scored alone, so a large store never builds an
            # n x n matrix
            key = ("self-q", store_id, _store_stamp(store), q, mode)
            top = self._cached(key, lambda: self._score_rows(store, q, q + 1, mode))
            return top, 0, qid, top.meta, "computed here"
        log = load_queries(folder)
        # the whole set in one pass over the store, cached for every later query
        top = self._cached(
            ("set", store_id, set_name, _store_stamp(store), _stamp(*folder.iterdir()), mode),
            lambda: compute_influence_all(log, store, mode=mode, top_k=MAX_K, progress=False),
        )
        return top, q, qid, top.meta, "computed here"

    def influence(
        self,
        store_id: str,
        set_name: str,
        q: int,
        k: int = 10,
        mode: str = "dot",
        scores: str = "",
    ) -> dict[str, Any]:
        """Top-``k`` helpful and harmful training examples for query number ``q`` of a set.

        ``mode``: ``dot`` or ``relatif``, computed here with the store's preconditioner;
        ``scores``: the name of scores saved beside the store (`save_scores`) instead.
        Returns ``{"query", "helpful": [{"score", **example}], "harmful": [...], "method",
        "compare", "preconditioner", "seconds"}``; helpful best first (largest score), harmful
        most harmful first. ``method``: how the lists were made (mode, preconditioner, damping,
        refine, and ``line``, one sentence of it). ``compare``: the other sources scoring this
        query (every saved set when computed here; computed here with ``dot`` when saved), with
        their top-`MAX_K` ids and ``why`` their lists can differ.
        """
        if not 1 <= k <= MAX_K:
            raise ValueError(f"k must be 1-{MAX_K}, got {k}")
        store_dir = self._store_dir(store_id)
        t0 = time.perf_counter()
        top, row, qid, meta, label = self._lists(store_id, set_name, q, mode, scores)
        folder = self._set_dir(store_dir, set_name)
        shown_q = self._shown(store_dir if folder is None else folder)
        shown = self._shown(store_dir)
        pick = min(k, top.k)

        def side(values: torch.Tensor, ids: list) -> list[dict[str, Any]]:
            return [
                {"score": float(s), **shown(i)}
                for s, i in zip(values[row, :pick].tolist(), ids[row][:pick], strict=True)
            ]

        others: list[tuple[str, str]] = []
        if scores:
            others.append(("", "dot"))
        else:
            for f in score_sets(store_dir):
                others.append((f.name, mode))
        compare = []
        for name, other_mode in others:
            try:
                o_top, o_row, _, o_meta, o_label = self._lists(
                    store_id, set_name, q, other_mode, name
                )
            except (ValueError, KeyError):  # for another query set, or not this query
                continue
            compare.append(
                {
                    "source": name or "here",
                    "label": o_label,
                    "line": method_line(o_meta),
                    "why": method_difference(meta, o_meta),
                    "helpful_ids": o_top.helpful_ids[o_row],
                    "harmful_ids": o_top.harmful_ids[o_row],
                }
            )
        return {
            "query": shown_q(qid),
            "index": q,
            "helpful": side(top.helpful_scores, top.helpful_ids),
            "harmful": side(top.harmful_scores, top.harmful_ids),
            "method": {
                "source": scores or "here",
                "label": label,
                "line": method_line(meta),
                **json_plain(
                    {key: meta.get(key) for key in ("mode", "preconditioner", "damping")}
                    | {key: meta.get(key) for key in ("module_damping", "refine")},
                    "meta",
                ),
            },
            "compare": compare,
            "preconditioner": meta.get("preconditioner"),
            "seconds": time.perf_counter() - t0,
        }

    @staticmethod
    def _score_rows(store: GradientStore, start: int, stop: int, mode: str = "dot") -> Any:
        """Top-`MAX_K` of training rows ``start:stop`` used as queries against their store."""
        rows = store.rows(start, stop)
        if not all_finite(rows):
            # as a query the rows would be refused as "gradient rows": name their shard instead
            src = as_source(store)
            raise nonfinite_error(src, src.shard_at(start, rows), store.ids[start:stop], rows)
        log = GradientLog(store.ids[start:stop], rows, store.meta)
        return compute_influence_all(log, store, mode=mode, top_k=MAX_K, progress=False)

    def _prefill_self(self, store_id: str, n: int, mode: str = "dot") -> None:
        """Score the first ``n`` training rows as queries in one pass over the store (the
        export's), cached as if each had been asked for alone."""
        store = GradientStore(self._store_dir(store_id))
        n = min(n, len(store))
        stamp = _store_stamp(store)
        if n == 0 or all(("self-q", store_id, stamp, q, mode) in self._cache for q in range(n)):
            return
        top = self._score_rows(store, 0, n, mode)
        with self._lock:
            for q in range(n):
                self._cache[("self-q", store_id, stamp, q, mode)] = TopKInfluence(
                    [top.test_ids[q]],
                    top.helpful_scores[q : q + 1],
                    [top.helpful_ids[q]],
                    top.harmful_scores[q : q + 1],
                    [top.harmful_ids[q]],
                    top.meta,
                )

    def self_influence(self, store_id: str, k: int = 10) -> dict[str, Any]:
        """The ``k`` training examples of highest and of lowest self-influence
        (``g_iᵀ (H + λI)⁻¹ g_i``: high = unusual or mislabeled, the model bent most for it)."""
        if not 1 <= k <= MAX_K:
            raise ValueError(f"k must be 1-{MAX_K}, got {k}")
        store_dir = self._store_dir(store_id)
        res = self._cached(
            ("self", store_id, _store_stamp(GradientStore(store_dir))),
            lambda: compute_self_influence(GradientStore(store_dir), progress=False),
        )
        order = torch.argsort(res.scores, descending=True).tolist()
        shown = self._shown(store_dir)

        def item(j: int) -> dict[str, Any]:
            return {"score": float(res.scores[j]), "index": j, **shown(res.ids[j])}

        return {
            "highest": [item(j) for j in order[:k]],
            "lowest": [item(j) for j in order[::-1][:k]],
            "method": {"line": "self-influence g_iᵀ(H+λI)⁻¹g_i · " + method_line(res.meta)},
        }

    def export(self, store_id: str, sets: list[dict[str, Any]], k: int = 20) -> dict[str, Any]:
        """What an ``--export`` file carries for a store: the first `EXPORT_QUERIES` queries of
        each set scored, the self-influence ranking and the query pickers."""
        out: dict[str, Any] = {"self": self.self_influence(store_id, k), "sets": {}}
        for mode in MODES:
            self._prefill_self(store_id, EXPORT_QUERIES, mode)
        saved = [f.name for f in score_sets(self._store_dir(store_id))]
        for s in sets:
            name = s["name"]
            n = min(s["n"], EXPORT_QUERIES)
            queries = self.queries(store_id, name)
            queries["items"] = queries["items"][:n]  # only these are scored in the file
            # "scored": computed here with mode dot; "sources": the other sources by their key in
            # the page's source picker ("here:relatif", "saved:<name>")
            sources: dict[str, dict[str, Any]] = {"here:relatif": {}}
            for q in range(n):
                sources["here:relatif"][str(q)] = self.influence(store_id, name, q, k, "relatif")
                for other in saved:
                    try:
                        res = self.influence(store_id, name, q, k, scores=other)
                    except (ValueError, KeyError):  # another query set's, or not this query
                        continue
                    sources.setdefault(f"saved:{other}", {})[str(q)] = res
            out["sets"][name] = {
                "queries": queries,
                "scored": {str(q): self.influence(store_id, name, q, k) for q in range(n)},
                "sources": sources,
            }
        # a training example appears under many queries: its image is carried once, under
        # "images", and the examples name it by "image_ref"
        images: dict[str, str] = {}

        def share(node: Any) -> None:
            if isinstance(node, dict):
                if isinstance(node.get("image"), str):
                    ref = images.setdefault(node["image"], str(len(images)))
                    node["image_ref"] = ref
                    del node["image"]
                for v in node.values():
                    share(v)
            elif isinstance(node, list):
                for v in node:
                    share(v)

        share(out)
        out["images"] = {ref: url for url, ref in images.items()}
        return out
