"""Reading a gradient store: :class:`GradientStore`, :class:`GradientLog` and the log loader.

Shards are memory-mapped (``numpy.load(mmap_mode="r")``) and blocks of rows are sliced from them,
so scoring reads one contiguous block per batch instead of one item per row.

Example:
    >>> import tempfile, torch
    >>> from nnstat.store.files import atomic_write_json
    >>> from nnstat.store.writer import StoreWriter
    >>> d = Path(tempfile.mkdtemp())
    >>> atomic_write_json(d / "meta.json", {"format_version": 1, "row_width": 2,
    ...     "dtype": "float32", "modules": [{"name": "fc", "offset": 0, "width": 2,
    ...     "r_out": 1, "r_in": 2}]})
    >>> w = StoreWriter(d / "shards", row_width=2); w.put(["a", "b"], torch.eye(2)); _ = w.close()
    >>> store = GradientStore(d)
    >>> store.ids, len(store)
    (['a', 'b'], 2)
"""

from __future__ import annotations

import bisect
import mmap
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from nnstat.store.commits import Shard, check_content, check_ids, committed_shards, log_path
from nnstat.store.factored import unfactor
from nnstat.store.files import (
    META_FILE,
    PROJECTIONS_FILE,
    SHARD_DIR,
    STATISTICS_FILE,
    load_safetensors,
    read_npy_header,
)
from nnstat.store.ids import DataId, read_ids
from nnstat.store.integrity import tensors_hash
from nnstat.store.meta import format_revision, read_meta
from nnstat.store.shards import STORE_DTYPES, decode_rows


def _module_entry(meta: dict[str, Any], name: str) -> dict[str, Any]:
    for m in meta["modules"]:
        if m["name"] == name:
            return m
    raise KeyError(
        f"no module {name!r} in the store; modules: {[m['name'] for m in meta['modules']]}"
    )


def module_view(meta: dict[str, Any], rows: torch.Tensor, name: str) -> torch.Tensor:
    """A module's slice of ``rows`` ``[b, row_width]`` reshaped to ``[b, r_out, r_in]``.

    Kinds without a Kronecker structure (layernorm) come back as ``[b, 1, r]``; a module
    stored as factors comes back dense (:func:`~nnstat.store.factored.unfactor`).

    Example:
        >>> meta = {"modules": [{"name": "fc", "offset": 1, "width": 6, "r_out": 2, "r_in": 3}]}
        >>> module_view(meta, torch.arange(14.0).reshape(2, 7), "fc")[1].tolist()  # 2nd row
        [[8.0, 9.0, 10.0], [11.0, 12.0, 13.0]]
    """
    m = _module_entry(meta, name)
    block = rows[:, m["offset"] : m["offset"] + m["width"]]
    if m.get("factors"):  # stored as factors: the dense matrix Uᵀ V
        block = unfactor(block, int(m["factors"]), int(m["r_out"]), int(m["r_in"]))
    return block.reshape(rows.shape[0], m.get("r_out") or 1, m["r_in"])


@dataclass
class GradientLog:
    """Rows captured in memory (the query side of influence), same layout as a store.

    Args:
        ids: one data id per row.
        rows: ``[n, row_width]`` float rows.
        meta: the store-style metadata (``row_width``, ``modules``, hashes).
        statistics: statistics tensors of the run (``"{module}/{stream}/{statistic}"``).
        projections: the projection matrices (``"{module}/p_in"``, ``"{module}/p_out"``).

    Example:
        >>> log = GradientLog(ids=[0], rows=torch.zeros(1, 2), meta={"row_width": 2, "modules": []})
        >>> len(log)
        1
    """

    ids: list[DataId]
    rows: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)
    statistics: dict[str, torch.Tensor] = field(default_factory=dict)
    projections: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def row_width(self) -> int:
        return int(self.rows.shape[1])

    @property
    def modules(self) -> list[dict[str, Any]]:
        return list(self.meta.get("modules", []))

    def module_view(self, name: str, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, r_out, r_in]`` view of module ``name`` (of ``rows``, default all rows)."""
        return module_view(self.meta, self.rows if rows is None else rows, name)


def missing_meta_message(path: Path) -> str:
    """Why ``path`` (without ``meta.json``) is not a store, with the fix when it holds the
    statistics of a pass that stored no rows (EK-FAC's first pass, ``factors``).

    Example:
        >>> missing_meta_message(Path("nowhere"))
        'nowhere is not a gradient store: no meta.json'
    """
    message = f"{path} is not a gradient store: no {META_FILE}"
    if (path / STATISTICS_FILE).exists():
        message += (
            f" (it holds {STATISTICS_FILE} only: a statistics pass stored no rows, such as "
            "EK-FAC's first pass, 'factors'. Run the logging loop again for the next pass, "
            "which stores the rows, or loop over run.schedule(), which runs every pass)"
        )
    return message


class GradientStore:
    """Read-only view of a store directory (all ranks' complete shards).

    Attributes: ``path``, ``meta`` (meta.json), ``modules``, ``row_width``, ``dtype``, ``ids``
    (in row order), ``shards`` (``.npy`` paths).

    Args:
        path: the store directory (``root_dir/project`` of the run that wrote it).

    Raises:
        FileNotFoundError: ``path`` has no ``meta.json``.
        ValueError: files that do not belong together or are damaged (a shard, its ids, its
            commit log, duplicate ids), named in the message.

    Example:
        >>> store = GradientStore("./nnstat_logs/my_project")  # doctest: +SKIP
        >>> for ids, block in store.iter_blocks(256): ...  # doctest: +SKIP
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        meta_path = self.path / META_FILE
        if not meta_path.exists():
            raise FileNotFoundError(missing_meta_message(self.path))
        self.meta: dict[str, Any] = _read_meta(meta_path)
        self.dtype: str = self.meta.get("dtype", "float32")
        self.row_width: int = self.meta["row_width"]
        self.shards: list[Path] = []
        self.ids: list[DataId] = []
        self._starts: list[int] = []
        self._lengths: list[int] = []
        np_dtype = np.dtype(STORE_DTYPES[self.dtype][0])
        # cheap metadata only (ids files, shard headers and sizes): rows are checked where
        # scoring reads them anyway, so opening a store never costs a pass over its rows
        # the shards the commit logs (shards/rank{r}.log) name: a lost file is an error, not
        # a store with fewer rows (stores written before the logs: every complete shard)
        required = format_revision(self.meta) >= 2  # written with commit logs (shard_logs)
        logged = committed_shards(self.path / SHARD_DIR, required)
        hashed = format_revision(self.meta) >= 3  # every shard's log records its content hash
        for shard in logged:
            npy, ids_path = shard.npy, shard.ids
            ids = _read_ids(ids_path)
            check_ids(shard, ids, digest=False)  # the count its log records
            if hashed and shard.content is None:
                raise _unhashed_error(shard)
            _check_shard_header(npy, np_dtype, self.dtype, self.row_width, len(ids))
            self._starts.append(len(self.ids))
            self._lengths.append(len(ids))
            self.shards.append(npy)
            self.ids.extend(ids)
        if len(set(self.ids)) != len(self.ids):
            raise _duplicate_ids_error(self.path, self.shards, self._starts, self.ids)
        # then (new stores) the digest its log records: reordered or swapped ids files
        for shard, start, n in zip(logged, self._starts, self._lengths, strict=True):
            check_ids(shard, self.ids[start : start + n])
        self._logged = logged
        self._maps: dict[int, np.ndarray] = {}
        self._tensors: dict[str, dict[str, torch.Tensor]] = {}  # verified safetensors, by name

    # memmaps are per process: workers of a DataLoader reopen them instead of copying them
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_maps"] = {}
        return state

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"GradientStore({str(self.path)!r}, rows={len(self)}, row_width={self.row_width})"

    @property
    def modules(self) -> list[dict[str, Any]]:
        return list(self.meta["modules"])

    def shard_array(self, i: int) -> np.ndarray:
        """Memory-mapped array of shard ``i`` (validated against its ids and the row width)."""
        if i not in self._maps:
            try:
                a = np.load(self.shards[i], mmap_mode="r", allow_pickle=False)
            except FileNotFoundError as e:  # removed since the store was opened
                raise FileNotFoundError(
                    f"{self.shards[i]} is missing: it was removed or renamed after the store "
                    f"was opened ({len(self)} rows); restore it from a copy of this store, or "
                    "log the store again"
                ) from e
            if a.ndim != 2 or a.shape != (self._lengths[i], self.row_width):
                raise ValueError(
                    f"{self.shards[i]}: shape {a.shape}, expected ({self._lengths[i]}, "
                    f"{self.row_width}) from its ids file and meta.json"
                )
            self._maps[i] = a
        return self._maps[i]

    def prefetch(self, i: int) -> None:
        """Ask the OS to read shard ``i`` into the page cache in the background
        (``madvise(MADV_WILLNEED)`` on its memory map): the scorer hints the next shard while it
        scores this one, so a cold store's disk reads overlap the scoring. A no-op where the
        platform has no such hint."""
        handle = getattr(self.shard_array(i), "_mmap", None)
        if handle is not None and hasattr(handle, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            handle.madvise(mmap.MADV_WILLNEED)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``[start, stop)`` as one float32 tensor (slices across shard boundaries).

        Args:
            start: first row.
            stop: one past the last row (clipped to the store's length).

        Returns:
            ``[stop - start, row_width]`` float32 rows.
        """
        start, stop = max(0, start), min(len(self), stop)
        if stop <= start:
            return torch.empty(0, self.row_width)
        parts = []
        s = bisect.bisect_right(self._starts, start) - 1
        while start < stop:
            lo = start - self._starts[s]
            hi = min(self._lengths[s], stop - self._starts[s])
            parts.append(self.shard_array(s)[lo:hi])
            start += hi - lo
            s += 1
        array = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return decode_rows(array, self.dtype)

    def iter_blocks(self, batch_size: int = 1024) -> Iterator[tuple[list[DataId], torch.Tensor]]:
        """Yield ``(ids, rows)`` blocks of up to ``batch_size`` rows in store order.

        Args:
            batch_size: rows per block.

        Returns:
            An iterator of ``(ids, rows)``.
        """
        for start in range(0, len(self), batch_size):
            stop = min(start + batch_size, len(self))
            yield self.ids[start:stop], self.rows(start, stop)

    def iter_shards(self) -> Iterator[tuple[list[DataId], torch.Tensor]]:
        """Yield ``(ids, rows)`` per shard."""
        for i, (start, n) in enumerate(zip(self._starts, self._lengths, strict=True)):
            yield self.ids[start : start + n], decode_rows(self.shard_array(i), self.dtype)

    def iter_shard_blocks(
        self, shard: Path | int, batch_size: int = 1024
    ) -> Iterator[tuple[list[DataId], torch.Tensor]]:
        """Yield ``(ids, rows)`` blocks of one shard (an entry of ``.shards`` or its index)."""
        i = shard if isinstance(shard, int) else self.shards.index(Path(shard))
        start, n = self._starts[i], self._lengths[i]
        array = self.shard_array(i)
        for lo in range(0, n, batch_size):
            hi = min(lo + batch_size, n)
            yield self.ids[start + lo : start + hi], decode_rows(array[lo:hi], self.dtype)

    def module_view(self, rows: torch.Tensor, name: str) -> torch.Tensor:
        """Module ``name``'s slice of ``rows`` as ``[b, r_out, r_in]``."""
        return module_view(self.meta, rows, name)

    def load(self) -> GradientLog:
        """Every row in memory as a :class:`GradientLog` (small stores only).

        Returns:
            The store's rows, ids, metadata, statistics and projections.

        Raises:
            ValueError: statistics or projections that do not match meta.json's hashes.
        """
        return GradientLog(
            list(self.ids),
            self.rows(0, len(self)),
            dict(self.meta),
            self.statistics(),
            self.projections(),
        )

    def verify(self) -> int:
        """The full check of the store's files, reading every byte once: each shard's rows
        against the content hash its commit log records (a shard whose bytes changed while its
        size did not: a bit flip, an edit, another store's shard of the same shape), and the
        projections and statistics against meta.json (:meth:`projections`,
        :meth:`statistics`). Opening checks only what is cheap (sizes, headers, ids); run this
        after copying a store, or before results that matter.

        Returns:
            The number of shards whose content was checked (shards logged before content
            hashes existed are not).

        Raises:
            ValueError: naming the first file that is not this store's own, and the fix.

        Example:
            >>> GradientStore("./nnstat_logs/my_project").verify()  # doctest: +SKIP
            1
        """
        checked = 0
        for shard in self._logged:
            check_content(shard)
            checked += shard.content is not None
        self.projections()
        self.statistics()
        return checked

    def projections(self) -> dict[str, torch.Tensor]:
        """The projection matrices (``"{module}/p_in"``, ``"{module}/p_out"``), empty if none.

        Checked once against meta.json's ``projection_sha256`` (a ``ValueError`` naming the file
        when they differ: rows projected one way must never be read with another projection).
        """
        return self._verified(PROJECTIONS_FILE, "projection_sha256", required=True)

    def statistics(self) -> dict[str, torch.Tensor]:
        """Statistics saved by the run (``"{module}/{stream}/{statistic}"``), empty if none.

        Checked once against meta.json's ``statistics_sha256``: a file beside a recorded
        ``null`` is refused like a mismatch, and so is one beside a meta.json without the key
        that has commit logs (``shard_logs``: written after the key existed); only a store
        written before nnstat recorded it reads the file unchecked.
        """
        return self._verified(STATISTICS_FILE, "statistics_sha256", required=False)

    def _verified(self, name: str, key: str, required: bool) -> dict[str, torch.Tensor]:
        """The tensors of ``name``, hashed once per store against ``meta[key]`` (a fresh dict)."""
        if name not in self._tensors:
            self._tensors[name] = _load_verified(self.path, name, key, self.meta, required)
        return dict(self._tensors[name])


# --------------------------------------------------------------------------- integrity checks
# Every error names the file and says what differs and what to do: a store whose files do not
# belong together would otherwise be scored without a word.

_DAMAGED = "restore it from a copy or log the store again"


def _read_meta(meta_path: Path) -> dict[str, Any]:
    try:  # JSON, format_version, row_width, dtype and modules, each error naming the file
        meta = read_meta(meta_path)
    except ValueError as e:
        raise ValueError(f"{e}: {_DAMAGED}") from e
    nonfinite = meta.get("nonfinite", "error")
    if nonfinite not in ("error", "skip", "keep"):  # it decides whether rows may hold NaN/Inf
        raise ValueError(
            f"{meta_path}: nonfinite {nonfinite!r}, expected 'error', 'skip' or 'keep': {_DAMAGED}"
        )
    return meta


def _read_ids(ids_path: Path) -> list[DataId]:
    try:  # a JSON list of ints and strings (no floats, booleans, null, lists or objects)
        return read_ids(ids_path)
    except ValueError as e:
        raise ValueError(f"{e}: {_DAMAGED}") from e


def _unhashed_error(shard: Shard) -> ValueError:
    return ValueError(
        f"{shard.npy}: {log_path(shard.npy.parent, shard.rank)} records no content hash for "
        "this shard, but meta.json's format_revision says its writer recorded one for every "
        "shard: the log was edited or the shard comes from another store. Restore the log "
        f"from a copy of this store, or log the store again"
    )


def _check_shard_header(npy: Path, np_dtype: np.dtype, dtype: str, width: int, rows: int) -> None:
    """A shard's ``.npy`` header against meta.json and its ids file (a few hundred bytes read,
    and one stat)."""
    try:  # a damaged header, or a file shorter than its header says
        header = read_npy_header(npy)
    except ValueError as e:
        raise ValueError(f"{e}: {_DAMAGED}") from e
    if header.dtype != np_dtype:
        raise ValueError(
            f"{npy}: rows stored as {header.dtype}, but meta.json says dtype {dtype!r} (stored "
            f"as {np_dtype}); the shard comes from another store or was rewritten: {_DAMAGED}"
        )
    if len(header.shape) != 2 or header.shape[1] != width or header.fortran_order:
        order = ", Fortran order" if header.fortran_order else ""
        raise ValueError(
            f"{npy}: shape {header.shape}{order}, but meta.json says C-order rows of width "
            f"{width}; the shard comes from another store or was rewritten: {_DAMAGED}"
        )
    if header.shape[0] != rows:
        raise ValueError(
            f"{npy}: {header.shape[0]} rows, but its ids file (and commit log) say {rows}; the "
            f"shard comes from another store or was rewritten: {_DAMAGED}"
        )


def _duplicate_ids_error(
    root: Path, shards: list[Path], starts: list[int], ids: list[DataId]
) -> ValueError:
    seen: dict[DataId, int] = {}
    for row, i in enumerate(ids):
        if i in seen:
            first = shards[bisect.bisect_right(starts, seen[i]) - 1]
            second = shards[bisect.bisect_right(starts, row) - 1]
            where = f"twice in {first}" if first == second else f"in {first} and in {second}"
            count = len(ids) - len(set(ids))
            return ValueError(
                f"{root}: id {i!r} is stored {where} ({count} duplicate ids in all); a store "
                "holds each id once (a copied or re-labelled shard, or two ranks that logged the "
                "same example): remove the extra shard (its .npy with its .ids.json) or log the "
                "store again"
            )
        seen[i] = row
    raise AssertionError("no duplicate id found")  # only called when there is one


def _load_verified(
    root: Path, name: str, key: str, meta: dict[str, Any], required: bool
) -> dict[str, torch.Tensor]:
    path, meta_path = root / name, root / META_FILE
    expected = meta.get(key)
    if not path.exists():
        # the writer always saves projections (an empty file for identity ones): a missing file
        # whose hash says it held tensors would silently turn them into identities
        if expected is not None and expected != tensors_hash({}):
            raise ValueError(
                f"{path} is missing, but {meta_path} records its {key} {str(expected)[:16]}...: "
                "restore the file from a copy of this store"
            )
        return {}
    tensors = _load_tensors(path)
    if expected is None:
        if key in meta and not required:  # recorded as null: no file of this store's own
            raise ValueError(
                f"{path}: {meta_path} records {key} null (no {name} went with these rows), "
                f"yet the file exists: it comes from another store or run (or a pass died "
                f"between saving it and recording its hash), so it cannot be checked against "
                f"the rows. Delete it, or run the statistics pass for this store again (its "
                f"finalize() records the hash)"
            )
        if required or meta.get("shard_logs") is True:
            # a store with commit logs was written after nnstat recorded every hash key: a
            # key deleted from its meta.json is no older store, the file would go unchecked
            raise ValueError(
                f"{path}: {meta_path} records no {key}, so the file cannot be checked against "
                "the rows (nnstat always records it): the meta.json was edited or belongs to "
                "another store; log the store again"
            )
        return tensors  # a store written before the hash was recorded
    actual = tensors_hash(tensors)
    if actual != expected:
        raise ValueError(
            f"{path} does not belong to this store: its sha256 {actual[:16]}... differs from "
            f"{key} {str(expected)[:16]}... in {meta_path} (replaced by another run's file, or "
            f"modified); restore this store's own {name} or log the store again"
        )
    return tensors


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:  # {} when absent; a damaged file names itself
        return load_safetensors(path)
    except ValueError as e:
        raise ValueError(f"{e}: {_DAMAGED}") from e


class LogBlockDataset(Dataset):
    """Map-style dataset whose item ``i`` is the ``i``-th block ``(ids, rows)`` of a store.

    Example:
        >>> import tempfile
        >>> from nnstat.store.files import atomic_write_json
        >>> from nnstat.store.writer import StoreWriter
        >>> d = Path(tempfile.mkdtemp())
        >>> atomic_write_json(d / "meta.json", {"format_version": 1, "row_width": 1,
        ...     "dtype": "float32", "modules": [{"name": "b", "offset": 0, "width": 1,
        ...     "r_out": 1, "r_in": 1}]})
        >>> w = StoreWriter(d / "shards", row_width=1); w.put([5, 6, 7], torch.ones(3, 1))
        >>> _ = w.close()
        >>> blocks = LogBlockDataset(GradientStore(d), batch_size=2)
        >>> len(blocks), blocks[1][0], tuple(blocks[0][1].shape)  # the last block is short
        (2, [7], (2, 1))
    """

    def __init__(self, store: GradientStore, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.store, self.batch_size = store, batch_size

    def __len__(self) -> int:
        return -(-len(self.store) // self.batch_size)

    def __getitem__(self, i: int) -> tuple[list[DataId], torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        start = i * self.batch_size
        stop = min(start + self.batch_size, len(self.store))
        return self.store.ids[start:stop], self.store.rows(start, stop)


def _keep(item: Any) -> Any:
    return item


def make_log_dataloader(
    store: GradientStore | str | Path, batch_size: int = 1024, num_workers: int = 0
) -> DataLoader:
    """DataLoader of ``(ids, rows)`` blocks, one block per batch; ``.dataset.store`` is the store.

    Example:
        >>> loader = make_log_dataloader("./nnstat_logs/my_project", 256)  # doctest: +SKIP
    """
    if not isinstance(store, GradientStore):
        store = GradientStore(store)
    dataset = LogBlockDataset(store, batch_size)
    # batch_size=None: each dataset item already is a batch (a slice of a memory-mapped shard)
    return DataLoader(
        dataset, batch_size=None, shuffle=False, num_workers=num_workers, collate_fn=_keep
    )
