"""What the influence explorer shows for an id: examples and query sets saved beside a store.

A gradient store holds ids and gradient rows, not the data. So that ``nnstat view`` can show a
training digit instead of ``id 42``, :func:`save_examples` writes the examples (images, labels,
texts) beside the store's files; :func:`save_queries` writes a query log (the in-memory
`GradientLog` of ``nnstat.get_log()``) beside the store it will be scored against::

    <store>/viewer/examples.json            {"format": "nnstat-examples", "version": 2, "ids": [...],
                                            "labels": [...] | null, "texts": [...] | null,
                                            "images": {"shape": [n, H, W(, C)]} | null,
                                            "ids_sha256": <digest of the store's ids>,
                                            "store_id": <meta.json's store_id> | null,
                                            "digests": [<digest of id, label, text, image>, ...]}
    <store>/viewer/examples.safetensors     "images" float32 [n, H, W] or [n, H, W, C] (C = 1, 3, 4)
    <store>/viewer/queries/<name>/query.json         {"format": "nnstat-queries", "version": 1,
                                                      "ids": [...], "meta": <the log's meta>}
    <store>/viewer/queries/<name>/rows.safetensors   "rows" float32 [n, row_width]
    <store>/viewer/queries/<name>/examples.json (+ .safetensors)   save_examples(<that folder>, ...)

Everything is JSON or safetensors (no pickle), written to a temporary name and renamed.
:func:`load_examples` refuses a file whose ``ids_sha256`` is not the digest of the folder's ids
now (the store was logged again, the file copied from another), whose ``store_id`` is not the
store's (copied from another store with the same ids; stores written before stores had an id
are not checked), or whose ``digests`` do not match
each example's id, label, text and image (ids reordered or edited), and files of version 1 (no
digests, so such a mix-up could not be seen): no examples rather than wrong ones. The
explorer scores each query set of a store against that store, and the store against itself
(every training example as a query) whether or not a query set exists.

Example:
    >>> import tempfile, numpy as np
    >>> from nnstat.viewer.examples import save_examples, load_examples
    >>> store = tiny_store(tempfile.mkdtemp(), ["a", "b"])
    >>> _ = save_examples(store, ["a", "b"], images=np.zeros((2, 8, 8)), labels=[3, 5])
    >>> ex = load_examples(store)
    >>> ex.ids, ex.labels, tuple(ex.images.shape)
    (['a', 'b'], [3, 5], (2, 8, 8))
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from nnstat.influence.row_layout import check_compatible
from nnstat.influence.sources import all_finite
from nnstat.store import GradientLog, GradientStore
from nnstat.store.factored import dense_layout
from nnstat.store.files import atomic_write_bytes, read_json
from nnstat.store.ids import ids_digest

__all__ = [
    "Examples",
    "VIEWER_DIR",
    "ids_digest",
    "ids_match",
    "load_examples",
    "load_queries",
    "query_sets",
    "save_examples",
    "save_queries",
]

VIEWER_DIR = "viewer"
QUERIES_DIR = "queries"
EXAMPLES_JSON = "examples.json"
EXAMPLES_TENSORS = "examples.safetensors"
QUERY_JSON = "query.json"
QUERY_ROWS = "rows.safetensors"


@dataclass
class Examples:
    """Examples saved for a store or query set: ``ids`` and, aligned with them, optional
    ``images`` (float32 ``[n, H, W]`` or ``[n, H, W, C]``), ``labels`` and ``texts``.

    Example:
        >>> import tempfile
        >>> store = tiny_store(tempfile.mkdtemp(), [4, 9])
        >>> _ = save_examples(store, [4, 9], texts=["four", "nine"])
        >>> load_examples(store)
        Examples(ids=[4, 9], images=None, labels=None, texts=['four', 'nine'])
    """

    ids: list
    images: torch.Tensor | None = None
    labels: list | None = None
    texts: list[str] | None = None


def ids_match(recorded: Any, ids: Sequence[Any]) -> bool:
    """Whether ``recorded`` is the digest of ``ids`` in order.

    The digest is the store's (:func:`~nnstat.store.ids.ids_digest`, whose JSON escapes non-ASCII
    characters); the unescaped UTF-8 form of the same JSON is accepted too, so a viewer file that
    recorded that form for non-ASCII string ids still verifies.

    Args:
        recorded: the digest a viewer file records (anything: a missing field never matches).
        ids: the ids it should be the digest of.

    Returns:
        ``True`` when ``recorded`` is either form of the digest of ``ids``.

    Example:
        >>> ids_match(ids_digest([0, "é"]), [0, "é"]), ids_match(ids_digest([0, 1]), [1, 0])
        (True, False)
    """
    if recorded == ids_digest(ids):
        return True
    text = json.dumps(list(ids), separators=(",", ":"), ensure_ascii=False)
    return recorded == hashlib.sha256(text.encode("utf-8")).hexdigest()


def _example_digests(
    ids: list, labels: list | None, texts: list | None, images: torch.Tensor | None
) -> list[str]:
    """One digest per example over its id, label, text and image (float32 bytes): an id moved
    to another example's position no longer matches its digest."""
    out = []
    for n, i in enumerate(ids):
        fields = [i, None if labels is None else labels[n], None if texts is None else texts[n]]
        h = hashlib.sha256(
            json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
        )
        if images is not None:
            h.update(images[n].contiguous().numpy().tobytes())
        out.append(h.hexdigest()[:32])
    return out


def _folder_identity(folder: Path) -> tuple[list, str | None]:
    """The ids of a store or query set, and the ``store_id`` of the store (``None`` for a
    query set, or a store written before stores had an id)."""
    if (folder / QUERY_JSON).is_file():
        return list(_read_query_json(folder)["ids"]), None
    store = GradientStore(folder)  # raises "... is not a gradient store" on other folders
    return store.ids, store.meta.get("store_id")


def _examples_dir(folder: Path) -> Path:
    # a query set's examples sit in its own folder; a store's in its viewer/ sub-folder
    return folder if (folder / QUERY_JSON).is_file() else folder / VIEWER_DIR


def _as_images(images: Any, n: int) -> torch.Tensor:
    t = torch.as_tensor(np.asarray(images) if not isinstance(images, torch.Tensor) else images)
    t = t.detach().cpu()
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"images must be real numbers, got dtype {t.dtype}")
    if t.ndim == 2:
        raise ValueError(
            f"images must be [n, H, W], [n, H, W, C] or [n, C, H, W]; got shape {tuple(t.shape)} "
            "(flat rows? reshape them to [n, H, W] first)"
        )
    if t.ndim == 4 and t.shape[1] in (1, 3) and t.shape[3] not in (1, 3, 4):
        t = t.permute(0, 2, 3, 1)  # [n, C, H, W] (torchvision) -> [n, H, W, C]
    if t.ndim not in (3, 4) or (t.ndim == 4 and t.shape[3] not in (1, 3, 4)):
        raise ValueError(
            f"images must be [n, H, W], [n, H, W, C] or [n, C, H, W] with C in 1, 3, 4; "
            f"got shape {tuple(t.shape)}"
        )
    if t.shape[0] != n:
        raise ValueError(f"images has {t.shape[0]} examples but ids has {n}")
    t = t.to(torch.float32).contiguous()
    if not torch.isfinite(t).all():
        raise ValueError("images hold NaN or infinite values")
    return t


def _plain_list(values: Any, n: int, what: str, kinds: tuple[type, ...]) -> list:
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{what} must be a sequence of {n} values, not one string")
    if isinstance(values, (torch.Tensor, np.ndarray)):
        values = values.tolist()
    out = list(values)
    if len(out) != n:
        raise ValueError(f"{what} has {len(out)} values but ids has {n}")
    for i, v in enumerate(out):
        if isinstance(v, np.generic):
            v = v.item()
            out[i] = v
        if isinstance(v, bool) or not isinstance(v, kinds):
            names = " or ".join(k.__name__ for k in kinds)
            raise TypeError(f"{what}[{i}] must be {names}, got {type(v).__name__}")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{what}[{i}] is {v}")
    return out


def save_examples(
    store_dir: str | Path,
    ids: Sequence[Any],
    images: Any | None = None,
    labels: Sequence[Any] | None = None,
    texts: Sequence[str] | None = None,
) -> Path:
    """Save what the influence explorer shows for ``ids`` beside a store (or a query set).

    Args:
        store_dir: a gradient store folder, or a query set folder written by `save_queries`.
        ids: ids of that folder's rows (ints/strings as logged; tensors and arrays are turned
            into lists); each at most once. Ids not given are shown as ids only.
        images: ``[n, H, W]``, ``[n, H, W, C]`` or ``[n, C, H, W]`` (C = 1, 3 or 4) numbers,
            row ``i`` for ``ids[i]``; shown scaled from the smallest to the largest value of
            the whole set.
        labels: one int or string per id (e.g. the class).
        texts: one string per id (e.g. the sentence).

    Returns the ``examples.json`` path. Saving again replaces the previous examples.

    Raises:
        FileNotFoundError: ``store_dir`` is neither a store nor a query set.
        KeyError: an id is not in the store (the first few missing are named).
        ValueError / TypeError: lengths or shapes disagree, duplicates, non-finite values.

    Example:
        >>> import tempfile
        >>> store = tiny_store(tempfile.mkdtemp(), [0, 1, 2])
        >>> save_examples(store, [0, 2], texts=["a cat", "a dog"]).name
        'examples.json'
        >>> save_examples(store, [7])
        Traceback (most recent call last):
        KeyError: 'ids not in the store ...: [7] (1 of 1 missing)'
    """
    folder = Path(store_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"save_examples: {folder} is not a folder")
    known, store_id = _folder_identity(folder)
    if isinstance(ids, (torch.Tensor, np.ndarray)):
        ids = ids.tolist()
    ids = [i.item() if isinstance(i, np.generic) else i for i in ids]
    if not ids:
        raise ValueError("save_examples: ids is empty")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, str)):
            raise TypeError(f"ids must be ints or strings (as logged), got {i!r}")
    if len(set(ids)) != len(ids):
        seen: set = set()
        dup = [i for i in ids if i in seen or seen.add(i)]
        raise ValueError(f"save_examples: ids repeat: {dup[:5]}")
    known_set = set(known)
    missing = [i for i in ids if i not in known_set]
    if missing:
        raise KeyError(
            f"ids not in the store {folder}: {missing[:5]} ({len(missing)} of {len(ids)} missing)"
        )
    n = len(ids)
    record: dict[str, Any] = {
        "format": "nnstat-examples",
        "version": 2,
        "ids": ids,
        "labels": None if labels is None else _plain_list(labels, n, "labels", (int, str)),
        "texts": None if texts is None else _plain_list(texts, n, "texts", (str,)),
        "images": None,
        # binds the file to the folder's ids now, and each example's id to its content
        "ids_sha256": ids_digest(known),
        # ... and to the store itself: another store with the same ids has another id
        "store_id": store_id,
    }
    t = None if images is None else _as_images(images, n)
    record["digests"] = _example_digests(ids, record["labels"], record["texts"], t)
    out_dir = _examples_dir(folder)
    out_dir.mkdir(exist_ok=True)
    if t is not None:
        record["images"] = {"shape": list(t.shape)}
        atomic_write_bytes(out_dir / EXAMPLES_TENSORS, st_save({"images": t}))
    else:
        (out_dir / EXAMPLES_TENSORS).unlink(missing_ok=True)
    # the JSON last: it names what the safetensors file must hold, so a reader never pairs new
    # JSON with old images
    path = out_dir / EXAMPLES_JSON
    atomic_write_bytes(path, json.dumps(record, allow_nan=False).encode("utf-8"))
    return path


def load_examples(store_dir: str | Path) -> Examples | None:
    """The examples saved for a store or query set, or ``None`` when none were saved.

    Raises ``ValueError`` naming the file when it is damaged or disagrees with itself.

    Example:
        >>> import tempfile
        >>> load_examples(tiny_store(tempfile.mkdtemp(), [0])) is None
        True
    """
    out_dir = _examples_dir(Path(store_dir))
    path = out_dir / EXAMPLES_JSON
    if not path.is_file():
        return None
    rec = read_json(path)
    if not isinstance(rec, dict) or rec.get("format") != "nnstat-examples":
        raise ValueError(f"{path}: not an nnstat examples file")
    ids = rec.get("ids")
    if not isinstance(ids, list) or not all(
        isinstance(i, (int, str)) and not isinstance(i, bool) for i in ids
    ):
        raise ValueError(f"{path}: ids must be a list of ints and strings")
    n = len(ids)
    try:
        labels = (
            None
            if rec.get("labels") is None
            else _plain_list(rec["labels"], n, "labels", (int, str))
        )
        texts = None if rec.get("texts") is None else _plain_list(rec["texts"], n, "texts", (str,))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    images = None
    if rec.get("images") is not None:
        tpath = out_dir / EXAMPLES_TENSORS
        try:
            images = st_load(tpath.read_bytes())["images"]
        except Exception as exc:  # OSError, KeyError or safetensors' own error type
            raise ValueError(f"{tpath}: cannot read the images ({exc})") from exc
        if list(images.shape) != rec["images"].get("shape") or images.shape[0] != n:
            raise ValueError(
                f"{tpath}: images of shape {list(images.shape)}, {path} says "
                f"{rec['images'].get('shape')} for {n} ids; save the examples again"
            )
    _check_bound(Path(store_dir), path, rec, Examples(ids, images, labels, texts))
    return Examples(ids=ids, images=images, labels=labels, texts=texts)


_FIX = "no examples are shown; save them again with nnstat.viewer.save_examples"


def _check_bound(folder: Path, path: Path, rec: dict, ex: Examples) -> None:
    """Refuse examples not bound to ``folder``'s ids and to their own content (see above)."""
    if "digests" not in rec or rec.get("version") == 1:
        raise ValueError(
            f"{path}: written by an nnstat that did not bind each example to its id (version "
            f"{rec.get('version')}), so an example shown against the wrong id could not be "
            f"detected; {_FIX}"
        )
    ids, store_id = _folder_identity(folder)
    if store_id is not None and rec.get("store_id") != store_id:
        raise ValueError(
            f"{path}: saved for another store (store_id {rec.get('store_id')!r}, {folder} is "
            f"{store_id!r}): copied from a store with the same ids, its examples are not this "
            f"store's; {_FIX}"
        )
    if not ids_match(rec.get("ids_sha256"), ids):
        raise ValueError(
            f"{path}: saved for other ids than {folder} holds now (ids_sha256 differs: the store "
            f"or query set was written again, or the file comes from another); {_FIX}"
        )
    digests = rec["digests"]
    if not isinstance(digests, list) or len(digests) != len(ex.ids):
        raise ValueError(f"{path}: digests must be a list of {len(ex.ids)} strings; {_FIX}")
    actual = _example_digests(ex.ids, ex.labels, ex.texts, ex.images)
    bad = [i for i, a, d in zip(ex.ids, actual, digests, strict=True) if a != d]
    if bad:
        raise ValueError(
            f"{path}: ids {bad[:5]} ({len(bad)} of {len(ex.ids)}) do not match the label, text "
            f"or image saved with them (ids reordered or edited); {_FIX}"
        )


def _read_query_json(folder: Path) -> dict[str, Any]:
    path = folder / QUERY_JSON
    rec = read_json(path)
    if not isinstance(rec, dict) or rec.get("format") != "nnstat-queries":
        raise ValueError(f"{path}: not an nnstat query set")
    if not isinstance(rec.get("ids"), list) or not isinstance(rec.get("meta"), dict):
        raise ValueError(f"{path}: a query set needs ids (list) and meta (object)")
    return rec


def read_query_ids(folder: str | Path) -> list:
    """The ids of a query set written by `save_queries` (its rows are not read)."""
    return list(_read_query_json(Path(folder))["ids"])


def check_set_name(name: str) -> None:
    """Refuse a saved set's ``name`` (a folder name) that is not letters, digits, ``-_.``.

    Example:
        >>> check_set_name("../up")
        Traceback (most recent call last):
        ValueError: name must be letters, digits, '-', '_' or '.', got '../up'
    """
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name in (".", ".."):
        raise ValueError(f"name must be letters, digits, '-', '_' or '.', got {name!r}")


def save_queries(log: GradientLog, store_dir: str | Path, name: str = "queries") -> Path:
    """Write a query log beside the store it is scored against; returns the query set folder.

    ``nnstat view <store>`` then offers its queries in the influence explorer (scored with the
    store's default preconditioner, as ``compute_influence_all(log, store)`` would).

    Args:
        log: the `GradientLog` of ``nnstat.get_log()`` (analysis mode).
        store_dir: the training store (same projection and weights: checked now).
        name: folder name under ``<store>/viewer/queries/`` (letters, digits, ``-_.``).

    Example:
        >>> import tempfile, torch
        >>> from nnstat.store import GradientLog
        >>> store = tiny_store(tempfile.mkdtemp(), [0, 1])
        >>> meta = GradientStore(store).meta
        >>> q = save_queries(GradientLog(["q0"], torch.ones(1, 2), meta), store)
        >>> load_queries(q).ids
        ['q0']
    """
    if not isinstance(log, GradientLog):
        raise TypeError(f"save_queries takes a GradientLog (nnstat.get_log()), got {type(log)}")
    check_set_name(name)
    store = GradientStore(store_dir)
    rows = log.rows.detach().to("cpu", torch.float32).contiguous()
    if rows.ndim != 2 or rows.shape[0] != len(log.ids):
        raise ValueError(f"log.rows {tuple(rows.shape)} does not match {len(log.ids)} ids")
    width = dense_layout(store.meta)["row_width"]  # a factored store's queries are dense
    if rows.shape[1] != width:
        raise ValueError(
            f"log rows are {rows.shape[1]} wide, the store's {width}: not the same run"
        )
    check_compatible(log.meta, store.meta)  # raises naming what differs (projection, modules)
    ids = [i.item() if isinstance(i, np.generic) else i for i in log.ids]
    if not all_finite(rows):
        raise ValueError(f"save_queries: {_nonfinite(rows, ids)}")
    if len(set(ids)) != len(ids):
        raise ValueError("save_queries: the log's ids repeat")
    folder = Path(store_dir) / VIEWER_DIR / QUERIES_DIR / name
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(folder / QUERY_ROWS, st_save({"rows": rows}))
    rec = {"format": "nnstat-queries", "version": 1, "ids": ids, "meta": log.meta}
    atomic_write_bytes(folder / QUERY_JSON, json.dumps(rec, allow_nan=False).encode("utf-8"))
    return folder


def _nonfinite(rows: torch.Tensor, ids: list) -> str:
    bad = (~torch.isfinite(rows)).any(1).nonzero().flatten().tolist()
    return (
        f"query rows of ids {[ids[i] for i in bad[:5]]} hold NaN/Inf values ({len(bad)} of "
        f"{len(ids)} rows), which cannot be scored"
    )


def load_queries(folder: str | Path) -> GradientLog:
    """The `GradientLog` saved by :func:`save_queries` in ``folder``.

    Args:
        folder: the query set's folder (what :func:`save_queries` returned).

    Returns:
        The query log: its ids, rows (float32) and meta.

    Raises:
        ValueError: a file of the query set is missing or damaged (the message names it).

    Example:
        >>> import tempfile, torch
        >>> from nnstat.store import GradientLog
        >>> store = tiny_store(tempfile.mkdtemp(), [0, 1])
        >>> log = GradientLog(["q0", "q1"], torch.eye(2), GradientStore(store).meta)
        >>> q = save_queries(log, store, name="two")
        >>> back = load_queries(q)
        >>> back.ids, back.rows.tolist()
        (['q0', 'q1'], [[1.0, 0.0], [0.0, 1.0]])
        >>> (q / "rows.safetensors").unlink()
        >>> load_queries(q)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../rows.safetensors: cannot read the query rows (...)
    """
    folder = Path(folder)
    rec = _read_query_json(folder)
    path = folder / QUERY_ROWS
    try:
        rows = st_load(path.read_bytes())["rows"]
    except Exception as exc:  # OSError, KeyError or safetensors' own error
        raise ValueError(f"{path}: cannot read the query rows ({exc})") from exc
    if rows.ndim != 2 or rows.shape[0] != len(rec["ids"]) or rows.dtype != torch.float32:
        raise ValueError(
            f"{path}: rows {tuple(rows.shape)} {rows.dtype} do not match {len(rec['ids'])} ids"
        )
    if not all_finite(rows):  # else the scorer's message would not say which file
        raise ValueError(f"{path}: {_nonfinite(rows, rec['ids'])}; save the query set again")
    return GradientLog(ids=list(rec["ids"]), rows=rows, meta=rec["meta"])


def query_sets(store_dir: str | Path) -> list[Path]:
    """Query set folders saved beside a store, sorted by name.

    Example:
        >>> import tempfile
        >>> query_sets(tempfile.mkdtemp())
        []
    """
    return saved_sets(store_dir, QUERIES_DIR, QUERY_JSON)


def saved_sets(store_dir: str | Path, kind: str, marker: str) -> list[Path]:
    """Folders ``<store>/viewer/<kind>/*`` holding a ``marker`` file (complete sets), by name."""
    root = Path(store_dir) / VIEWER_DIR / kind
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if (p / marker).is_file())


def tiny_store(root: str | Path, ids: list, rows: torch.Tensor | None = None) -> Path:
    """A 2-wide store with ``ids`` and ``rows`` (default ``0, 1, 2, ...`` row-major), for the
    examples above and the tests."""
    from nnstat.store.files import atomic_write_json
    from nnstat.store.writer import StoreWriter

    d = Path(root)
    atomic_write_json(
        d / "meta.json",
        {
            "format_version": 1,
            "row_width": 2,
            "dtype": "float32",
            "modules": [{"name": "fc", "offset": 0, "width": 2, "r_out": 1, "r_in": 2}],
        },
    )
    w = StoreWriter(d / "shards", row_width=2)
    w.put(list(ids), torch.arange(2.0 * len(ids)).reshape(len(ids), 2) if rows is None else rows)
    w.close()
    return d
