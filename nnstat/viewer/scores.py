"""Influence scores saved beside a store, so ``nnstat view`` shows the lists a report used.

A gradient store holds the rows the explorer scores with the store's own preconditioner. Scores
made otherwise (refined with ``nnstat.influence.Refinement``, which needs the model and the data,
or another ``mode``) cannot be recomputed from the store: :func:`save_scores` writes them beside
it, with the ``meta`` that says how they were made, and the explorer offers them as a source::

    <store>/viewer/scores/<name>/scores.json          {"format": "nnstat-scores", "version": 1,
        "name", "label", "queries": <query set name, "" = training rows of the store>,
        "kind": "full" | "top_k", "test_ids": [...], "meta": <the result's meta>,
        "store_ids_sha256", "query_ids_sha256", "tensors_sha256"}
    <store>/viewer/scores/<name>/scores.safetensors   "full": "scores" [n_query, n_train] (columns
        in the store's id order); "top_k": "helpful_scores", "harmful_scores" [n_query, k] and
        "helpful_index", "harmful_index" int64 positions in the store's ids

JSON and safetensors only (no pickle), each written to a temporary name and renamed, the JSON
last. :func:`load_scores` refuses a file whose store or query-set ids digest is not that of the
ids now (the store or query set was written again, the file was copied from another store) or
whose tensors are not the ones the JSON names, with a message naming the file and the fix.

Example:
    >>> import tempfile, torch
    >>> from nnstat.influence import InfluenceResult
    >>> from nnstat.viewer.examples import tiny_store
    >>> store = tiny_store(tempfile.mkdtemp(), [0, 1, 2])
    >>> r = InfluenceResult(torch.tensor([[1.0, -2.0, 3.0]]), [1], [0, 1, 2], {"mode": "dot"})
    >>> _ = save_scores(store, "mine", r, label="by hand")
    >>> load_scores(store, "mine").result.scores.tolist()
    [[1.0, -2.0, 3.0]]
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from nnstat.influence.result import InfluenceResult, TopKInfluence
from nnstat.store import GradientStore
from nnstat.store.files import atomic_write_bytes, read_json
from nnstat.store.ids import ids_digest
from nnstat.viewer.examples import (
    VIEWER_DIR,
    check_set_name,
    ids_match,
    query_sets,
    read_query_ids,
    saved_sets,
)

__all__ = [
    "SavedScores",
    "save_scores",
    "load_scores",
    "score_sets",
    "method_line",
    "method_difference",
]

SCORES_DIR = "scores"
SCORES_JSON = "scores.json"
SCORES_TENSORS = "scores.safetensors"
_FIX = "save the scores again with nnstat.viewer.save_scores"


@dataclass
class SavedScores:
    """Scores saved by :func:`save_scores`: ``result`` (an `InfluenceResult` or a
    `TopKInfluence`, train ids = the store's), its ``meta``, and what they are for.

    Example:
        >>> import tempfile, torch
        >>> from nnstat.influence import InfluenceResult
        >>> from nnstat.viewer.examples import tiny_store
        >>> store = tiny_store(tempfile.mkdtemp(), [0, 1])
        >>> r = InfluenceResult(torch.tensor([[2.0, 1.0]]), [1], [0, 1], {"mode": "dot"})
        >>> _ = save_scores(store, "by_hand", r, label="dot, by hand")
        >>> saved = load_scores(store, "by_hand")
        >>> saved.name, saved.label, saved.queries, saved.test_ids, saved.meta["mode"]
        ('by_hand', 'dot, by hand', '', [1], 'dot')
    """

    name: str
    label: str
    queries: str  # a query set beside the store, or "" for the store's own training rows
    result: InfluenceResult | TopKInfluence
    path: Path

    @property
    def meta(self) -> dict:
        return self.result.meta

    @property
    def test_ids(self) -> list:
        return self.result.test_ids


def json_plain(value: Any, where: str) -> Any:
    """``value`` as JSON (numbers, strings, lists, objects); non-finite floats as strings."""
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    if isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): json_plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_plain(v, where) for v in value]
    raise TypeError(f"save_scores: {where} holds a {type(value).__name__}, not JSON")


def _query_folder(store_dir: Path, queries: str) -> Path:
    for q in query_sets(store_dir):
        if q.name == queries:
            return q
    have = [q.name for q in query_sets(store_dir)]
    raise KeyError(
        f"no query set {queries!r} beside the store {store_dir} (saved: {have}); save it first "
        "with nnstat.viewer.save_queries, or pass queries=None for training rows as queries"
    )


def save_scores(
    store_dir: str | Path,
    name: str,
    result: InfluenceResult | TopKInfluence,
    queries: str | None = None,
    label: str = "",
) -> Path:
    """Save influence scores beside the store they were computed against.

    Args:
        store_dir: the gradient store whose rows are the training side (``result.train_ids``
            must be its ids, any order; a `TopKInfluence` names ids of it).
        name: folder name under ``<store>/viewer/scores/`` (letters, digits, ``-_.``).
        result: what ``compute_influence_all`` returned (full scores, or ``top_k=``), with its
            ``meta`` (mode, preconditioner, damping, refinement), which is saved with it.
        queries: the query set (`save_queries` name) whose ids are ``result.test_ids`` in order;
            ``None``: the queries are training rows of the store itself.
        label: a short description for the page (e.g. ``"the report's grid"``).

    Returns the ``scores.json`` path. Saving again under ``name`` replaces the scores.

    Example:
        >>> save_scores("runs/digits", "refined", res, queries="misclassified")  # doctest: +SKIP
    """
    check_set_name(name)
    folder = Path(store_dir)
    store = GradientStore(folder)
    test_ids = [i.item() if isinstance(i, np.generic) else i for i in result.test_ids]
    if len(set(test_ids)) != len(test_ids):
        raise ValueError("save_scores: the result's query ids repeat")
    if queries is None:
        known = set(store.ids)
        missing = [i for i in test_ids if i not in known]
        if missing:
            raise KeyError(
                f"save_scores: queries=None means training rows of {folder} as queries, but "
                f"ids {missing[:5]} are not in the store; pass the query set's name"
            )
        q_digest = None
    else:
        q_ids = read_query_ids(_query_folder(folder, queries))
        if q_ids != test_ids:
            raise ValueError(
                f"save_scores: the result's query ids {test_ids[:5]}... are not the ids of query "
                f"set {queries!r} in order ({q_ids[:5]}...); score that query set"
            )
        q_digest = ids_digest(q_ids)
    position = {i: n for n, i in enumerate(store.ids)}
    if isinstance(result, InfluenceResult):
        kind = "full"
        train = list(result.train_ids)
        if (
            len(train) != len(store.ids)
            or len(set(train)) != len(train)
            or not all(i in position for i in train)
        ):
            raise ValueError(
                f"save_scores: the result's training ids are not the ids of {folder} "
                f"({len(result.train_ids)} against {len(store.ids)}): not scored on this store"
            )
        cols = torch.as_tensor([position[i] for i in result.train_ids])
        scores = result.scores.detach().cpu()
        out = torch.empty_like(scores)
        out[:, cols] = scores
        tensors = {"scores": _float(out)}
    elif isinstance(result, TopKInfluence):
        kind = "top_k"
        tensors = {}
        for side in ("helpful", "harmful"):
            ids = getattr(result, f"{side}_ids")
            try:
                index = [[position[i] for i in row] for row in ids]
            except KeyError as exc:
                raise ValueError(
                    f"save_scores: {side} id {exc.args[0]!r} not in {folder}"
                ) from None
            tensors[f"{side}_index"] = torch.as_tensor(index, dtype=torch.int64).reshape(
                len(ids), -1
            )
            tensors[f"{side}_scores"] = _float(getattr(result, f"{side}_scores").detach().cpu())
    else:
        raise TypeError(
            f"save_scores takes an InfluenceResult or TopKInfluence, got {type(result)}"
        )
    for key, t in tensors.items():
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(f"save_scores: {key} hold NaN/Inf values")
    blob = st_save({k: v.contiguous() for k, v in tensors.items()})
    rec = {
        "format": "nnstat-scores",
        "version": 1,
        "name": name,
        "label": str(label),
        "queries": "" if queries is None else queries,
        "kind": kind,
        "test_ids": json_plain(test_ids, "test_ids"),
        "meta": json_plain(dict(result.meta), "meta"),
        "store_ids_sha256": ids_digest(store.ids),
        "query_ids_sha256": q_digest,
        "tensors_sha256": hashlib.sha256(blob).hexdigest(),
    }
    out_dir = folder / VIEWER_DIR / SCORES_DIR / name
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out_dir / SCORES_TENSORS, blob)
    path = out_dir / SCORES_JSON
    atomic_write_bytes(path, json.dumps(rec, allow_nan=False).encode("utf-8"))
    return path


def _float(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.to(torch.float32)


def score_sets(store_dir: str | Path) -> list[Path]:
    """Score set folders saved beside a store, sorted by name.

    Example:
        >>> import tempfile
        >>> score_sets(tempfile.mkdtemp())
        []
    """
    return saved_sets(store_dir, SCORES_DIR, SCORES_JSON)


def load_scores(store_dir: str | Path, name: str) -> SavedScores:
    """The scores saved under ``name`` beside a store (:func:`save_scores`).

    Args:
        store_dir: the gradient store's directory.
        name: the name the scores were saved under.

    Returns:
        A :class:`SavedScores`: the result, its label, its query set and its file.

    Raises:
        ValueError: the file is damaged, or bound to other ids than the store (or its query
            set) holds now; the message names the file and the fix.
        FileNotFoundError: no scores were saved under ``name``.

    Example:
        >>> import tempfile, torch
        >>> from nnstat.influence import InfluenceResult
        >>> from nnstat.viewer.examples import tiny_store
        >>> store = tiny_store(tempfile.mkdtemp(), ["a", "b"])
        >>> r = InfluenceResult(torch.tensor([[0.5, -1.0]]), ["b"], ["a", "b"], {"mode": "dot"})
        >>> _ = save_scores(store, "mine", r)
        >>> load_scores(store, "mine").result.top_k(1).helpful_ids
        [['a']]
        >>> load_scores(store, "other")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        FileNotFoundError: no scores 'other' saved beside ...
    """
    check_set_name(name)
    folder = Path(store_dir)
    path = folder / VIEWER_DIR / SCORES_DIR / name / SCORES_JSON
    if not path.is_file():
        raise FileNotFoundError(f"no scores {name!r} saved beside {folder} ({path})")
    rec = read_json(path)
    if not isinstance(rec, dict) or rec.get("format") != "nnstat-scores":
        raise ValueError(f"{path}: not an nnstat scores file")
    if rec.get("version") != 1 or rec.get("kind") not in ("full", "top_k"):
        raise ValueError(f"{path}: version {rec.get('version')}, kind {rec.get('kind')!r} unknown")
    test_ids, meta = rec.get("test_ids"), rec.get("meta")
    if not isinstance(test_ids, list) or not isinstance(meta, dict):
        raise ValueError(f"{path}: test_ids must be a list and meta an object; {_FIX}")
    store = GradientStore(folder)
    if not ids_match(rec.get("store_ids_sha256"), store.ids):
        raise ValueError(
            f"{path}: saved for other ids than {folder} holds now (store_ids_sha256 differs: the "
            f"store was written again, or the file comes from another store); {_FIX}"
        )
    queries = rec.get("queries") or ""
    if queries:
        q_folder = _query_folder(folder, queries)
        if not ids_match(rec.get("query_ids_sha256"), read_query_ids(q_folder)):
            raise ValueError(
                f"{path}: saved for other query ids than {q_folder} holds now (query_ids_sha256 "
                f"differs: the query set was saved again); {_FIX}"
            )
        if not ids_match(rec["query_ids_sha256"], test_ids):
            raise ValueError(f"{path}: test_ids are not the query set's ids; {_FIX}")
    tpath = path.with_name(SCORES_TENSORS)
    try:
        blob = tpath.read_bytes()
    except OSError as exc:
        raise ValueError(f"{tpath}: cannot read the scores ({exc}); {_FIX}") from exc
    if hashlib.sha256(blob).hexdigest() != rec.get("tensors_sha256"):
        raise ValueError(
            f"{tpath}: not the tensors {path} was saved with (tensors_sha256 differs); {_FIX}"
        )
    t = st_load(blob)
    n_q, n_t = len(test_ids), len(store.ids)
    if rec["kind"] == "full":
        scores = t.get("scores")
        if scores is None or tuple(scores.shape) != (n_q, n_t):
            raise ValueError(f"{tpath}: scores must be [{n_q}, {n_t}]; {_FIX}")
        result: InfluenceResult | TopKInfluence = InfluenceResult(
            scores, list(test_ids), list(store.ids), meta
        )
    else:
        sides = {}
        for side in ("helpful", "harmful"):
            s, i = t.get(f"{side}_scores"), t.get(f"{side}_index")
            if s is None or i is None or s.shape != i.shape or s.shape[0] != n_q:
                raise ValueError(f"{tpath}: {side} scores and index must be [{n_q}, k]; {_FIX}")
            if i.numel() and (int(i.min()) < 0 or int(i.max()) >= n_t):
                raise ValueError(f"{tpath}: {side}_index outside the store's {n_t} rows; {_FIX}")
            sides[side] = (s, [[store.ids[j] for j in row] for row in i.tolist()])
        result = TopKInfluence(list(test_ids), *sides["helpful"], *sides["harmful"], meta)
    return SavedScores(name, str(rec.get("label", "")), queries, result, path)


_CURVATURE = {"ggn": "Gauss-Newton", "hessian": "Hessian"}
_MODES = {
    "dot": "dot g_qᵀ(H+λI)⁻¹g_i",
    "relatif": "relatif (RelatIF: the training side divided by ‖g_i‖ in the same metric)",
    "cosine": "cosine",
    "l2": "l2",
}


def _lam(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)


def _damping(meta: dict) -> str:
    per = meta.get("module_damping") or {}
    values = [v for v in per.values() if isinstance(v, (int, float))]
    if meta.get("damping") is not None:
        return f"damping λ = {_lam(meta['damping'])}"
    if not values:
        return "damping: default"
    lo, hi = min(values), max(values)
    span = _lam(lo) if lo == hi else f"{_lam(lo)}–{_lam(hi)}"
    return f"damping default: 0.1 × mean eigenvalue per module (λ {span})"


def _refinement(meta: dict) -> str:
    r = meta.get("refine") or {}
    if meta.get("preconditioner") != "refined" or not r.get("steps"):
        return "not refined"
    curv = str(r.get("curvature", "?"))
    for key, word in _CURVATURE.items():
        curv = curv.replace(key, word, 1) if curv.startswith(key) else curv
    return (
        f"refined: {r['steps']} conjugate-gradient steps on the exact {curv} curvature, "
        f"preconditioned by {r.get('preconditioner', '?')}"
    )


def _any_damping(meta: dict) -> str:
    if meta.get("preconditioner") != "refined":
        return _damping(meta)
    r = meta.get("refine") or {}
    rule = r.get("damping_rule")
    return f"damping λ = {_lam(r.get('damping', meta.get('damping')))}" + (
        f" ({rule})" if rule else ""
    )


def method_line(meta: dict) -> str:
    """How scores were made, in one line, from a result's ``meta`` (mode, preconditioner,
    damping, refinement): what the explorer prints above its lists and the report beside its.

    Example:
        >>> method_line({"mode": "dot", "preconditioner": "ekfac", "damping": None,
        ...              "module_damping": {"fc": 0.002, "out": 0.01}})
        'mode dot g_qᵀ(H+λI)⁻¹g_i · preconditioner ekfac · damping default: 0.1 × mean eigenvalue per module (λ 0.002–0.01) · not refined'
    """
    mode = meta.get("mode")
    parts = [] if mode is None else [f"mode {_MODES.get(mode, mode)}"]
    refined = meta.get("preconditioner") == "refined"
    if refined:
        parts.append(_refinement(meta))
        parts.append(_any_damping(meta))
    else:
        parts.append(f"preconditioner {meta.get('preconditioner', '?')}")
        parts.append(_damping(meta))
        parts.append("not refined")
    return " · ".join(parts)


def method_difference(ours: dict, theirs: dict) -> str:
    """Why two score sets can rank differently: the parts of their methods that differ, as
    "<theirs> there, <ours> here".

    Example:
        >>> method_difference({"mode": "dot", "preconditioner": "ekfac"},
        ...                   {"mode": "relatif", "preconditioner": "ekfac"})
        'mode relatif there, dot here'
    """
    out = []
    if ours.get("mode") != theirs.get("mode"):
        out.append(f"mode {theirs.get('mode')} there, {ours.get('mode')} here")
    a, b = _refinement(ours), _refinement(theirs)
    if a != b:
        out.append(f"{b} there, {a} here")
    pa, pb = ours.get("preconditioner"), theirs.get("preconditioner")
    if pa != pb and "refined" not in (pa, pb):
        out.append(f"preconditioner {pb} there, {pa} here")
    if _any_damping(ours) != _any_damping(theirs):
        out.append(f"{_any_damping(theirs)} there, {_any_damping(ours)} here")
    return "; ".join(out) or "the same method (the lists differ by ties or rounding)"
