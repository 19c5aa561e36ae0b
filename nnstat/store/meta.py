"""A gradient store's ``meta.json``: building it, checking it when read, and keeping the hashes
it records in step with the files they name (``projections.safetensors``,
``statistics.safetensors``).

Example:
    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> statistics_hash(d) is None  # no statistics.safetensors
    True
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence, Set
from pathlib import Path
from typing import Any

import torch

from nnstat import __version__
from nnstat.store import files
from nnstat.store.factored import factored_width, merge_energy
from nnstat.store.ids import DataId, ids_set_digest
from nnstat.store.integrity import tensors_hash
from nnstat.store.projection import ModuleProjection, layout, projection_tensors
from nnstat.store.shards import STORE_DTYPES

FORMAT_VERSION = 1
#: the revision of format 1 a new store is written in (``meta.json``'s ``format_revision``):
#: 2 (no ``format_revision``, ``"shard_logs": true``) added the commit logs; 3 a ``store_id``
#: and each shard's content hash in its log; 4 factored modules (``"factors": c`` in a module's
#: entry, :mod:`nnstat.store.factored`) and ``factor_energy``. An older revision still opens,
#: with the checks its files allow.
FORMAT_REVISION = 4
#: the revision from which meta.json always holds each key (its value may be ``null``): a
#: store of that revision or later without it was edited, and is refused (:func:`read_meta`)
#: rather than read unchecked as an older store
REQUIRED_SINCE = {
    "statistics_sha256": 2,
    "projection_sha256": 3,
    "params_sha256": 3,
    "model_sha256": 3,
    "store_id": 3,
    "factor_energy": 4,
}
#: what each key of :data:`REQUIRED_SINCE` vouches for (named in the error when it is missing)
VOUCHES_FOR = {
    "statistics_sha256": f"{files.STATISTICS_FILE}",
    "projection_sha256": f"{files.PROJECTIONS_FILE}",
    "params_sha256": "the weights of the watched modules",
    "model_sha256": "the weights of the whole model",
    "store_id": "the files saved for this store (viewer/examples.json)",
    "factor_energy": "the energy the factored rows kept",
}


def format_revision(meta: Mapping[str, Any]) -> int:
    """The revision of format 1 a store's ``meta`` was written in (see :data:`FORMAT_REVISION`).

    Example:
        >>> format_revision({"format_revision": 3}), format_revision({"shard_logs": True})
        (3, 2)
    """
    rev = meta.get("format_revision")
    if isinstance(rev, int) and not isinstance(rev, bool):
        return rev
    return 2 if meta.get("shard_logs") is True else 1


def missing_keys(meta: Mapping[str, Any]) -> list[str]:
    """The keys of :data:`REQUIRED_SINCE` that ``meta``'s revision always holds but it lacks.

    Example:
        >>> missing_keys({"shard_logs": True}), missing_keys({})
        (['statistics_sha256'], [])
    """
    rev = format_revision(meta)
    return [k for k, since in REQUIRED_SINCE.items() if since <= rev and k not in meta]


def read_meta(path: Path) -> dict[str, Any]:
    """A store's ``meta.json`` (:func:`~nnstat.store.files.read_json`) with the fields every reader relies on
    checked: ``format_version`` (this version), ``row_width`` (a positive int), ``dtype`` (one of
    :data:`STORE_DTYPES`, default float32) and ``modules`` (a list of ``{name, offset, width,
    r_in}`` that tile the row, with safe names, known kinds and ranks consistent with their
    widths and dimensions: :func:`_module_problems`), ``format_revision`` (one this nnstat
    reads) and every key that revision always holds (:func:`missing_keys`). Anything else is a ``ValueError`` naming
    the file and the field.

    Example:
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "meta.json"
        >>> files.atomic_write_json(p, {"format_version": 1, "modules": []})
        >>> read_meta(p)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: .../meta.json: missing 'row_width' ...
    """
    meta = files.read_json(path)
    if not isinstance(meta, dict):
        raise ValueError(
            f"{path}: expected a JSON object (a store's meta), got {type(meta).__name__}"
        )
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"{path}: format version {version!r}, this nnstat reads {FORMAT_VERSION}")
    problems: list[str] = []
    width = meta.get("row_width")
    if "row_width" not in meta:
        problems.append("missing 'row_width' (columns per row)")
    elif isinstance(width, bool) or not isinstance(width, int) or width < 1:
        problems.append(f"'row_width' must be a positive int, got {width!r}")
        width = None
    if meta.get("dtype", "float32") not in STORE_DTYPES:
        problems.append(f"'dtype' {meta.get('dtype')!r} is not one of {sorted(STORE_DTYPES)}")
    rev = meta.get("format_revision", 2)
    if isinstance(rev, bool) or not isinstance(rev, int) or not 2 <= rev <= FORMAT_REVISION:
        problems.append(
            f"'format_revision' {rev!r} is not one this nnstat reads (2 to {FORMAT_REVISION})"
        )
    else:
        problems += [
            f"{VOUCHES_FOR[key]}: would go unchecked, meta.json records no {key}, which every "
            f"store of format revision {format_revision(meta)} records (the key was deleted)"
            for key in missing_keys(meta)
        ]
    modules = meta.get("modules")
    if not isinstance(modules, list):
        problems.append(f"'modules' must be a list, got {modules!r}")
        modules = []
    problems += _module_problems(modules, width, meta.get("projection"))
    if problems:
        raise ValueError(
            f"{path}: " + "; ".join(problems) + " (the file is damaged or not a "
            "gradient store's meta.json)"
        )
    return meta


_UNSAFE_NAME = re.compile(r"[/\\\x00-\x1f\x7f]")


def _int(v: Any, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _module_problems(modules: list, width: int | None, projection: Any) -> list[str]:
    """What is wrong with meta.json's ``modules``: each an object with a safe, unique ``name``
    (a module path: no ``/``, ``\\`` or control characters, no empty ``.`` part), a known
    ``kind`` (a registered :class:`~nnstat.capture.kinds.Kind`), ``r_in``/``r_out`` the ranks its projection
    gives (``min(rank, d)``, or ``d`` without one; ``r_out`` null for layernorm), ``width =
    r_in * (r_out or 1)`` and ``offset`` right after the previous module; ``row_width`` their
    sum."""
    from nnstat.capture.kinds import REGISTRY

    problems: list[str] = []
    rank = projection.get("rank", ...) if isinstance(projection, dict) else ...
    names: set[str] = set()
    end = 0
    for i, m in enumerate(modules):
        if not isinstance(m, dict):
            problems.append(f"modules[{i}] must be an object, got {m!r}")
            continue
        missing = [k for k in ("name", "offset", "width", "r_in") if k not in m]
        if missing:
            problems.append(f"modules[{i}] ({m.get('name')!r}) misses {missing}")
            continue
        name, at = m["name"], f"modules[{i}]"
        if (
            not isinstance(name, str)
            or not name
            or _UNSAFE_NAME.search(name)
            or "" in (name.split("."))
        ):
            problems.append(f"{at}.name {name!r} is not a module path (a.b.c)")
        elif name in names:
            problems.append(f"{at}.name {name!r} appears twice")
        names.add(name if isinstance(name, str) else "")
        at = f"{at} ({name!r})"
        kind = m.get("kind", "linear")
        known = isinstance(kind, str) and kind in REGISTRY
        if not known:
            problems.append(f"{at}: kind {kind!r} is not one of {list(REGISTRY)}")
        if not (_int(m["offset"], 0) and _int(m["width"], 0)):
            problems.append(f"{at}: offset/width must be ints >= 0")
            continue
        if m["offset"] != end:
            problems.append(f"{at}: offset {m['offset']}, but the previous modules end at {end}")
        end = m["offset"] + m["width"]
        r_in, r_out = m["r_in"], m.get("r_out")
        flat = known and not REGISTRY[kind].outer  # a flat gradient (layernorm)
        factors = m.get("factors")
        if factors is not None and (not _int(factors, 1) or flat or not _int(r_out, 1)):
            problems.append(f"{at}: factors {factors!r} must be a positive int of a Kronecker kind")
            continue
        if not _int(r_in, 1) or (r_out is not None or not flat) and not _int(r_out, 1):
            problems.append(
                f"{at}: r_in {r_in!r} / r_out {r_out!r} must be positive ints"
                + (" (r_out null)" if flat else "")
            )
            continue
        if factors is not None:
            if m["width"] != factored_width(factors, r_out, r_in):
                problems.append(
                    f"{at}: width {m['width']} != factors * (r_out + r_in) = "
                    f"{factored_width(factors, r_out, r_in)}"
                )
        elif m["width"] != r_in * (r_out or 1):
            problems.append(f"{at}: width {m['width']} != r_out * r_in = {(r_out or 1) * r_in}")
        for side, r in (("in", r_in), ("out", r_out)):
            d = m.get(f"d_{side}")
            if r is None or not _int(d, 1) or rank is ...:
                continue
            want = d if rank is None else min(rank, d) if _int(rank, 1) else r
            if r != want:
                problems.append(
                    f"{at}: r_{side} {r}, but projection rank {rank} and d_{side} {d} give {want}"
                )
    if width is not None and modules and end != width:
        problems.append(f"'row_width' {width} != {end}, the sum of the modules' widths")
    return problems


def build_meta(
    project: str,
    config: dict[str, Any],
    dtype: str,
    nonfinite: str,
    projection_args: Mapping[str, Any],
    projections: Mapping[str, ModuleProjection],
    hashed: bool = True,
    params_sha256: str | None = None,
    statistics_sha256: str | None = None,
) -> dict[str, Any]:
    """meta.json for rows made with ``projections`` (see docs/architecture.md).

    ``config``: the run's configuration as recorded (``RunConfig.content()``); ``dtype`` and
    ``nonfinite``: the store options of those names.
    ``hashed=False``: ``projection_sha256`` is ``None``, for :func:`prepare_store` to fill in.
    ``params_sha256``: ``nnstat.run.params.params_fingerprint`` of the weights the rows are
    computed with;
    ``statistics_sha256``: :func:`statistics_hash` of the statistics that go with them.
    """
    mods = layout(projections)
    return {
        "format_version": FORMAT_VERSION,
        "format_revision": FORMAT_REVISION,
        # this store's identity: files saved for it (examples) carry it, so files copied from
        # another store with the same ids are refused; a new one with every new store
        "store_id": uuid.uuid4().hex,
        "nnstat_version": __version__,
        "project": project,
        "config": config,
        "dtype": dtype,
        "row_width": sum(m["width"] for m in mods),
        "modules": mods,
        "projection": {
            "rank": projection_args["rank"],
            "init": projection_args["init"] if projection_args["rank"] is not None else None,
            "seed": projection_args["seed"],
            "seed_rule": "torch.Generator().manual_seed(seed * 1000003 + crc32(name)); "
            "p_in then p_out, N(0, 1/r); identity where r >= dim",
        },
        "projection_seed": projection_args["seed"],
        "projection_sha256": (tensors_hash(projection_tensors(projections)) if hashed else None),
        "nonfinite": nonfinite,
        "skipped_rows": 0,
        "params_sha256": params_sha256,
        "statistics_sha256": statistics_sha256,
        # per factored module {rows, mean, min} of the energy kept (record_factor_energy)
        "factor_energy": {},
    }


def prepare_store(
    path: Path, projections: Mapping[str, ModuleProjection], rank: int, meta: dict[str, Any]
) -> None:
    """Complete ``meta`` with the projection hash; for a new store (no meta.json yet) also with
    the hash of the statistics already there, and save the projections (rank 0).

    A resumed store keeps its files (its meta.json, compared by hash, names them). A new one
    always writes its projections, also over a file left by a run that died before its first
    meta.json: that file belongs to no store, and keeping it would pair another projection
    with this meta.json's hash.
    """
    if meta.get("projection_sha256") is None:
        meta["projection_sha256"] = tensors_hash(projection_tensors(projections))
    if (Path(path) / files.META_FILE).exists():
        return
    if meta.get("statistics_sha256") is None:
        meta["statistics_sha256"] = statistics_hash(path)
    write_projections(path, projections, rank)


def write_projections(path: Path, projections: Mapping[str, ModuleProjection], rank: int) -> None:
    """Save ``projections.safetensors`` (rank 0), replacing any file of that name."""
    target = Path(path) / files.PROJECTIONS_FILE
    if rank != 0:
        return
    from safetensors.torch import save

    Path(path).mkdir(parents=True, exist_ok=True)
    tensors = projection_tensors(projections)
    files.atomic_write_bytes(target, save(tensors) if tensors else save({}))


def statistics_hash(path: Path) -> str | None:
    """:func:`~nnstat.store.integrity.tensors_hash` of the store's ``statistics.safetensors``,
    ``None`` without one."""
    target = Path(path) / files.STATISTICS_FILE
    return tensors_hash(files.load_safetensors(target)) if target.exists() else None


def record_statistics_hash(
    path: Path,
    rank: int,
    saved: Mapping[str, torch.Tensor] | None = None,
    coverage: dict[str, Any] | None | bool = False,
) -> None:
    """Rank 0: put the hash of the statistics just saved into meta.json (when the store has
    one), so meta.json always names the statistics that go with its rows. ``saved``: the
    tensors just written, hashed as they are in memory (the same names, dtypes, shapes and
    bytes as the file) instead of reading the whole file back (1.3 GB for GPT-2 small).
    ``coverage``: the rows these statistics cover (:func:`statistics_coverage_record`;
    ``None``: unknown), recorded as ``statistics_coverage``; ``False`` leaves it as it is."""
    meta_path = Path(path) / files.META_FILE
    if rank != 0 or not meta_path.exists():
        return
    meta = files.read_json(meta_path)
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
    meta["statistics_sha256"] = statistics_hash(path) if saved is None else tensors_hash(saved)
    if coverage is not False:
        meta["statistics_coverage"] = coverage
    files.atomic_write_json(meta_path, meta)


def statistics_coverage_record(seen: Set[DataId], store_ids: Set[DataId]) -> dict[str, Any]:
    """What meta.json's ``statistics_coverage`` records of the ids a statistics pass saw
    (``seen``, stored or skipped as already stored) against the store's rows once the pass is
    flushed (``store_ids``): how many of those rows the statistics cover, and digests to tell
    later whether the store still holds just those rows (:func:`statistics_coverage`).

    Example:
        >>> statistics_coverage_record({2, 3}, {0, 1, 2, 3})["rows"]
        2
    """
    return {
        "rows": len(store_ids & seen),
        "of": len(store_ids),
        "store_ids_sha256": ids_set_digest(store_ids),
        "ids_sha256": ids_set_digest(seen),
    }


def statistics_coverage(meta: Mapping[str, Any], ids: Sequence[DataId]) -> tuple[int, int] | None:
    """``(rows the saved statistics cover, rows of the store)`` for a store with ``ids`` and
    ``meta``; ``None`` when meta.json records no coverage (a store written before it was
    recorded).

    Rows are only ever added to a store: rows added after the statistics were saved count as
    not covered, unless the statistics pass saw exactly the ids the store now holds.

    Args:
        meta: the store's meta.json.
        ids: the store's ids now.

    Returns:
        ``(covered, total)``, or ``None`` when unknown.

    Example:
        >>> rec = statistics_coverage_record({2, 3}, {0, 1, 2, 3})
        >>> statistics_coverage({"statistics_coverage": rec}, [0, 1, 2, 3])
        (2, 4)
    """
    cov = meta.get("statistics_coverage")
    if not isinstance(cov, Mapping):
        return None
    digest = ids_set_digest(ids)
    if digest == cov.get("ids_sha256"):
        return len(ids), len(ids)
    return min(int(cov.get("rows", 0)), len(ids)), len(ids)


def record_factor_energy(path: Path, rank: int, energy: Mapping[str, Mapping[str, float]]) -> None:
    """Rank 0: merge a pass's captured energy of factored rows
    (:meth:`~nnstat.store.factored.EnergyTally.summary`: module → ``{rows, mean, min}``) into
    meta.json's ``factor_energy`` (rank 0's rows: the other ranks' are not gathered).

    Args:
        path: the store's directory.
        rank: this process's rank (only rank 0 writes).
        energy: the pass's record.

    Example:
        >>> import tempfile; d = Path(tempfile.mkdtemp())
        >>> files.atomic_write_json(d / "meta.json", {"factor_energy": {}})
        >>> record_factor_energy(d, 0, {"fc": {"rows": 2, "mean": 0.9, "min": 0.8}})
        >>> files.read_json(d / "meta.json")["factor_energy"]["fc"]["min"]
        0.8
    """
    meta_path = Path(path) / files.META_FILE
    if rank != 0 or not energy or not meta_path.exists():
        return
    meta = files.read_json(meta_path)
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
    meta["factor_energy"] = merge_energy(meta.get("factor_energy"), energy)
    files.atomic_write_json(meta_path, meta)
