"""One view over every kind of gradient log the influence code accepts.

`as_source` turns a `GradientLog` (in memory), a `GradientStore`, a store path, a log
dataloader (``loader.dataset.store``) or a `TensorSource` into a `RowSource`: ids, meta, layout,
streamed row blocks, statistics and projection matrices.

Example:
    >>> import torch
    >>> src = TensorSource(torch.ones(3, 4), ids=[7, 8, 9], layout=[ModuleSpec("fc", 0, 2, 2)])
    >>> [ids for ids, _ in src.iter_blocks(2)]
    [[7, 8], [9]]
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import os
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from nnstat.store.factored import densify, is_factored
from nnstat.store.files import PROJECTIONS_FILE, STATISTICS_FILE, load_safetensors
from nnstat.store.ids import duplicate_ids
from nnstat.store.lazy import LazyStatistics
from nnstat.store.meta import statistics_coverage
from nnstat.store.shards import STORE_DTYPES

from .row_layout import ModuleSpec, layout_from_meta, row_width, validate_layout


@runtime_checkable
class RowSource(Protocol):
    """What the scorer needs from a log: see `TensorSource` for the reference implementation."""

    ids: list
    meta: dict
    layout: list[ModuleSpec]
    fingerprint: str
    finite: bool  # rows are known to hold no NaN/Inf (no per-block check needed)

    def __len__(self) -> int: ...

    def iter_blocks(self, batch_size: int) -> Iterator[tuple[list, torch.Tensor]]: ...

    def iter_shards(self) -> list[Any]: ...

    def iter_shard_blocks(
        self, shard: Any, batch_size: int
    ) -> Iterator[tuple[list, torch.Tensor]]: ...

    def statistics(self) -> Mapping[str, torch.Tensor]: ...

    def projections(self) -> dict[str, torch.Tensor]: ...


def all_finite(values: torch.Tensor) -> bool:
    """True when ``values`` hold no NaN/Inf.

    NaN and Inf reach the sum, so a finite sum proves every value finite in one fast reduction
    (torch.isfinite(...).all() reads several times slower on the CPU); only a non-finite sum,
    which finite values can give by overflowing, needs the element-wise check.

    Example:
        >>> all_finite(torch.tensor([3e38, 3e38])), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
    """
    return bool(torch.isfinite(values.sum())) or bool(torch.isfinite(values).all())


def _check_finite(rows: torch.Tensor, what: str) -> None:
    if not all_finite(rows):
        bad = (~torch.isfinite(rows)).any(dim=1).nonzero().flatten()[:5].tolist()
        raise ValueError(f"{what} contains NaN/Inf values (first bad rows: {bad})")


class TensorSource:
    """Rows already in memory, with their ids and per-module layout.

    ``statistics`` uses the store's keys (``"{module}/forward/covariance"`` …) and
    ``projections`` the keys ``"{module}/p_in"``, ``"{module}/p_out"``.

    Raises:
        ValueError: ``rows`` not 2-D, NaN/Inf in them, ``ids`` of another length than the rows
            or holding a repeated id (named in the message), or a layout that does not fit.

    Example:
        >>> import torch
        >>> len(TensorSource(torch.zeros(5, 6), layout=[ModuleSpec("fc", 0, 2, 3)]))
        5
    """

    def __init__(
        self,
        rows: torch.Tensor,
        ids: Sequence | None = None,
        layout: Sequence[ModuleSpec] | None = None,
        meta: Mapping[str, Any] | None = None,
        statistics: Mapping[str, torch.Tensor] | None = None,
        projections: Mapping[str, torch.Tensor] | None = None,
        shard_rows: int | None = None,
    ) -> None:
        if rows.dim() != 2:
            raise ValueError(f"rows must be a 2-D tensor [n, row_width], got {tuple(rows.shape)}")
        self.rows = rows.detach().to(torch.float32)
        _check_finite(self.rows, "gradient rows")
        self.ids = list(range(len(rows))) if ids is None else list(ids)
        if len(self.ids) != len(rows):
            raise ValueError(f"{len(self.ids)} ids for {len(rows)} rows")
        # refused as the store refuses them: results name rows by id, a repeat is ambiguous
        if dup := duplicate_ids(self.ids):
            raise ValueError(
                f"duplicate ids in TensorSource: {list(dict.fromkeys(dup))[:5]} ({len(dup)} "
                "repeats); ids name the rows of influence results and must be unique: pass unique "
                "ids, e.g. the rows' positions (ids=None)"
            )
        self.meta = dict(meta or {})
        if layout is None:
            layout = (
                layout_from_meta(self.meta)
                if self.meta.get("modules")
                else [ModuleSpec("all", 0, 1, rows.shape[1], "flat", flat_width=rows.shape[1])]
            )
        self.layout = list(layout)
        validate_layout(self.layout, rows.shape[1])
        self._statistics: Mapping[str, torch.Tensor] = dict(statistics or {})
        self._projections = dict(projections or {})
        self._shard_rows = shard_rows or max(len(rows), 1)
        self.finite = True  # checked above
        # a fresh key per instance: in-memory rows can change, so fits are never shared across them
        self.fingerprint = f"tensor:{uuid.uuid4().hex}"

    def __len__(self) -> int:
        return len(self.rows)

    def iter_blocks(self, batch_size: int) -> Iterator[tuple[list, torch.Tensor]]:
        for start in range(0, len(self.rows), batch_size):
            yield self.ids[start : start + batch_size], self.rows[start : start + batch_size]

    def iter_shards(self) -> list[Any]:
        return list(range(0, len(self.rows), self._shard_rows))

    def iter_shard_blocks(self, shard: Any, batch_size: int) -> Iterator[tuple[list, torch.Tensor]]:
        stop = min(shard + self._shard_rows, len(self.rows))
        for start in range(shard, stop, batch_size):
            end = min(start + batch_size, stop)
            yield self.ids[start:end], self.rows[start:end]

    def statistics(self) -> Mapping[str, torch.Tensor]:
        return self._statistics

    def projections(self) -> dict[str, torch.Tensor]:
        return self._projections


def check_statistics_coverage(
    meta: Mapping[str, Any], ids: Sequence[Any], root: Path | str, saved: bool = True
) -> None:
    """Refuse a store whose saved statistics (K-FAC/EK-FAC factors) did not see all of its rows
    (:func:`~nnstat.store.meta.statistics_coverage`): a preconditioner built from them would
    use the curvature of part of the data only; and a store whose configuration collects K-FAC
    factors but that saved none (``saved=False``: its pass was killed or never finalized), which
    the default preconditioner would otherwise score as ``raw``. Stores that record no
    coverage pass; so do query logs (``get_log()`` records none).

    Args:
        meta: the store's meta.json (or a `GradientLog`'s meta, a copy of it).
        ids: the store's ids (the log's).
        root: the store's directory, or what the rows are (named in the error).
        saved: whether any statistics were saved.

    Raises:
        ValueError: the statistics cover fewer rows than the store holds, or were not saved.

    Example:
        >>> check_statistics_coverage({}, [0, 1], Path("store"))  # no coverage recorded
    """
    if not saved:
        run = (meta.get("config") or {}).get("run") or {}
        asked = run.get("statistic") if isinstance(run, Mapping) else None
        if isinstance(asked, Mapping) and ids and "Covariance" in (asked.get("forward") or []):
            raise ValueError(
                f"{root}: its configuration collects K-FAC statistics, but none were saved "
                "(no statistics.safetensors: the statistics pass was killed, or never reached "
                "finalize()); its rows are whole. Run the pass again with the same configuration "
                "over the whole dataset (ids already stored are skipped, the statistics see every "
                'batch), or score with preconditioner="raw" or "identity" explicitly'
            )
        return
    cov = statistics_coverage(meta, ids)
    if cov is not None and cov[0] < cov[1]:
        raise ValueError(
            f"{root}: the saved statistics (statistics.safetensors) cover {cov[0]} of the "
            f"store's {cov[1]} rows (rows were added by a later pass whose statistics replaced "
            "them); a kfac/ekfac preconditioner would use the curvature of part of the data. "
            "Log the statistics again over all the data (a pass with the same configuration "
            "over the whole dataset: ids already stored are skipped, the statistics see every "
            'batch), or score with preconditioner="raw" or "identity"'
        )


class StoreSource:
    """Adapter over a `nnstat.store.GradientStore` (streamed shard by shard from disk)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.meta = dict(store.meta)
        self.ids = list(store.ids)
        self.root = Path(_store_root(store))
        # factored rows (meta's modules with "factors") are densified a block at a time, on the
        # host unless a view from `stored_rows` hands them out as stored (for a device to score)
        self._factored = self.meta["modules"] if is_factored(self.meta) else None
        self._host_dense = True
        # 16-bit rows are widened to float32 on the host unless a `stored_rows` view hands them
        # out as stored (the device widens them after the copy: half the bytes cross)
        self._host_float32 = True
        try:
            self.layout = layout_from_meta(self.meta)
            width = int(getattr(store, "row_width", row_width(self.layout)))
            validate_layout(self.layout, row_width(self.layout) if self._factored else width)
        except ValueError as e:
            raise ValueError(f"{self.root / 'meta.json'}: {e}") from e
        # the writer refused ("error") or dropped ("skip") non-finite rows; "keep" stored them
        self.finite = self.meta.get("nonfinite", "error") in ("error", "skip")
        self._statistics: dict[str, torch.Tensor] | None = None
        self._projections: dict[str, torch.Tensor] | None = None
        # meta.json and the safetensors files too: a fit cached before one of them was replaced
        # would otherwise be reused without the replaced file ever being read (and checked)
        # (statistics.json too: the factor forms the statistics are read with)
        files = [
            self.root / n
            for n in ("meta.json", PROJECTIONS_FILE, STATISTICS_FILE, "statistics.json")
        ]
        stamp = ";".join(
            f"{p.name}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"
            for p in [*sorted(self.root.glob("shards/*.npy")), *(f for f in files if f.exists())]
            for st in [p.stat()]
        )
        key = f"{self.root.resolve()}|{len(self.ids)}|{stamp}"
        self.fingerprint = "store:" + hashlib.sha256(key.encode()).hexdigest()

    def __len__(self) -> int:
        return len(self.ids)

    def iter_blocks(self, batch_size: int) -> Iterator[tuple[list, torch.Tensor]]:
        start = 0
        for ids, rows in self.store.iter_blocks(batch_size):
            rows = torch.as_tensor(rows, dtype=torch.float32)
            # the passes over iter_blocks (preconditioner fit, self-influence, queries) copy each
            # block and do more work per row than one sum, so they check the rows meta.json
            # calls finite (the streaming score loop checks its scores instead)
            if self.finite and not all_finite(rows):
                raise self.nonfinite_error(self.shard_at(start, rows), list(ids), rows)
            # the store's reader decodes to float32; a `stored_rows` view narrows them back
            # (exact: they were stored in that dtype). Only a store without shard files, or
            # more ranks than shards, reads this way on the device branch.
            yield list(ids), self._handed_out(rows)
            start += len(ids)

    def _handed_out(self, rows: torch.Tensor) -> torch.Tensor:
        """A block of stored rows as this source hands them out (see `stored_rows`)."""
        rows = rows.to(torch.float32 if self._host_float32 else self.stored_dtype)
        return rows if not self._host_dense else self.dense(rows)

    @property
    def stored_dtype(self) -> torch.dtype:
        """The torch dtype of the rows as the shards hold them (``meta.json``'s ``dtype``).

        Example:
            >>> # StoreSource(GradientStore(path_of_a_float16_store)).stored_dtype
            >>> # torch.float16
        """
        name = getattr(self.store, "dtype", None) or self.meta.get("dtype", "float32")
        return STORE_DTYPES[name][1] if name in STORE_DTYPES else torch.float32

    @property
    def factored(self) -> bool:
        """Whether the stored rows hold factored modules (``factors=c``)."""
        return self._factored is not None

    def dense(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows as dense rows (factored modules multiplied out), on ``rows``' device.

        Args:
            rows: ``[N, stored row width]`` rows as the shards hold them, on any device.

        Returns:
            float32 ``[N, row_width(layout)]`` on ``rows``' device (``rows`` as they are where
            nothing is factored).

        Example:
            >>> # StoreSource(store).dense(rows_on_gpu): densified by the GPU
        """
        return rows if self._factored is None else densify(rows, self._factored)

    def stored_rows(self, widen: bool = False) -> StoreSource:
        """A view of this source whose blocks (`iter_blocks`, `iter_shard_blocks`) are the rows
        as stored: factored modules are not multiplied out and 16-bit rows (``dtype`` float16
        or bfloat16) keep their dtype, so the device branch of scoring copies the stored bytes
        (4-8x fewer than the dense ones for factored rows, half of float32 for 16-bit ones),
        widens them to float32 on the device (`pipeline.read_ahead`) and scores them there as
        stored (`FactoredScores`; `dense` multiplies a chunk out where norms need it).

        Args:
            widen: 16-bit rows widened to float32 on the host all the same (the CPU branch
                scores factored rows as stored, in float32).

        Returns:
            A shallow copy sharing the store, ids and fingerprint; its blocks are read-only
            views of the shards' memory maps where the store has them.

        Example:
            >>> # blocks = units(src.stored_rows(), 512); dense = src.dense(rows.to("cuda"))
        """
        view = copy.copy(self)
        view._host_dense = False
        view._host_float32 = widen
        return view

    def shard_at(self, start: int, rows: torch.Tensor) -> Any:
        """The shard (index) holding the first non-finite row of the block at row ``start``."""
        starts = getattr(self.store, "_starts", None)
        if not starts:
            return None
        row = start + int((~torch.isfinite(rows)).any(1).nonzero()[0, 0])
        return bisect.bisect_right(starts, row) - 1

    def shard_path(self, shard: Any) -> Path:
        """The file of ``shard`` (an entry of `iter_shards`), else the store's directory."""
        shards = getattr(self.store, "shards", None)
        if isinstance(shard, int) and shards is not None and 0 <= shard < len(shards):
            return Path(shards[shard])
        return self.root

    def nonfinite_error(self, shard: Any, ids: list, rows: torch.Tensor) -> ValueError:
        """The error for NaN/Inf in ``rows`` (a block of ``shard``), naming the file."""
        bad = [ids[i] for i in (~torch.isfinite(rows)).any(1).nonzero().flatten()[:5].tolist()]
        policy = self.meta.get("nonfinite", "error")
        if self.finite:
            return ValueError(
                f"{self.shard_path(shard)}: rows of ids {bad} hold NaN/Inf, but "
                f"{self.root / 'meta.json'} says nonfinite={policy!r} (the writer stores finite "
                "rows only): the shard was modified or damaged; restore it or log the store again"
            )
        return ValueError(
            f"{self.shard_path(shard)}: rows of ids {bad} hold NaN/Inf (the store was logged "
            "with nonfinite='keep'), which cannot be scored: log with nonfinite='skip', or leave "
            "those examples out"
        )

    def iter_shards(self) -> list[Any]:
        shards = getattr(self.store, "shards", None)
        if shards is not None and hasattr(self.store, "iter_shard_blocks"):
            return list(range(len(shards)))
        return [None]

    def iter_shard_blocks(self, shard: Any, batch_size: int) -> Iterator[tuple[list, torch.Tensor]]:
        if shard is None:
            yield from self.iter_blocks(batch_size)
            return
        mapped = self._mapped(shard)
        if mapped is not None:
            ids = self.store.ids
            start = self.store._starts[shard] if hasattr(self.store, "_starts") else None
            if start is not None:
                for lo in range(0, len(mapped), batch_size):
                    hi = min(lo + batch_size, len(mapped))
                    yield ids[start + lo : start + hi], self._handed_out(mapped[lo:hi])
                return
        for ids, rows in self.store.iter_shard_blocks(shard, batch_size):
            yield list(ids), self._handed_out(torch.as_tensor(rows, dtype=torch.float32))

    def prefetch(self, shard: Any) -> None:
        """Ask the OS to read ``shard`` (an entry of `iter_shards`) ahead, if the store can."""
        hint = getattr(self.store, "prefetch", None)
        if hint is not None and isinstance(shard, int):
            hint(shard)

    def _mapped(self, shard: Any) -> torch.Tensor | None:
        """A shard as a read-only tensor of its stored dtype over its memory map: scoring only
        reads it, so the copy the generic reader makes (to hand out writable float32 rows) is
        skipped (16-bit rows are widened block by block, or not at all by a `stored_rows`
        view)."""
        dtype = getattr(self.store, "dtype", None)
        if dtype not in STORE_DTYPES or not isinstance(shard, int):
            return None
        getter = getattr(self.store, "shard_array", None)
        if getter is None:
            return None
        array = getter(shard)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array": never written
            if dtype == "bfloat16":  # numpy holds the raw 16-bit patterns (uint16)
                return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
            return torch.from_numpy(array)

    def statistics(self) -> Mapping[str, torch.Tensor]:
        if self._statistics is None:
            from nnstat.curvature.collector import check_saved_forms

            lazy = LazyStatistics.open(
                self.root / STATISTICS_FILE, self.meta.get("statistics_sha256")
            )
            loaded: Mapping[str, torch.Tensor]
            if lazy is not None:
                loaded = lazy
            else:  # no recorded hash, no file, or a mismatch: the store's own reader decides
                stats = getattr(self.store, "statistics", None)
                loaded = dict(stats() if callable(stats) else {})
            # the forms statistics.json records (dense, diagonal, projected) must be the tensors'
            check_saved_forms(loaded, self.root)
            check_statistics_coverage(self.meta, self.ids, self.root, saved=len(loaded) > 0)
            self._statistics = loaded
        return self._statistics

    def projections(self) -> dict[str, torch.Tensor]:
        if self._projections is None:
            getter = getattr(self.store, "projections", None)
            if callable(getter):
                self._projections = dict(getter())
            else:
                self._projections = load_safetensors(self.root / PROJECTIONS_FILE)
        return self._projections


def _store_root(store: Any) -> str:
    for attr in ("path", "root", "root_dir", "directory"):
        value = getattr(store, attr, None)
        if value is not None:
            return os.fspath(value)
    raise TypeError(f"cannot find the directory of {type(store).__name__}")


class LogSource(TensorSource):
    """Adapter over an in-memory `nnstat.store.GradientLog` (the query side)."""

    def __init__(self, log: Any) -> None:
        meta = dict(log.meta)
        rows = torch.as_tensor(log.rows, dtype=torch.float32)
        if is_factored(meta):  # queries are scored dense (preconditioned as dense rows)
            rows = densify(rows, meta["modules"])
        stats = getattr(log, "statistics", None)
        projections = getattr(log, "projections", None)
        super().__init__(
            rows,
            ids=list(log.ids),
            layout=layout_from_meta(meta),
            meta=meta,
            projections=(projections() if callable(projections) else projections) or None,
        )
        # kept as given: a query log's statistics are read one tensor at a time (get_log()'s
        # LazyStatistics), a copy into a dict would load them all
        stats = stats() if callable(stats) else stats
        self._statistics = stats if isinstance(stats, Mapping) else dict(stats or {})
        self.log = log
        self._coverage_checked = False

    def statistics(self) -> Mapping[str, torch.Tensor]:
        # a store's rows loaded in memory (GradientStore.load()) carry its meta.json: the same
        # refusal as the store's own, read from disk
        if not self._coverage_checked and len(self._statistics):
            check_statistics_coverage(
                self.meta, self.ids, "this GradientLog (GradientStore.load() of a store)"
            )
            self._coverage_checked = True
        return self._statistics


def as_source(obj: Any) -> RowSource:
    """Turn any accepted log object into a `RowSource`.

    Accepts a `TensorSource`/`RowSource`, a `GradientLog` (has ``.rows``), a `GradientStore`
    (has ``.iter_blocks``), a path to a store directory, or a log dataloader
    (``loader.dataset.store``).

    Example:
        >>> import torch
        >>> as_source(TensorSource(torch.zeros(2, 3))).layout[0].width
        3
    """
    if isinstance(obj, (TensorSource, StoreSource)):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        from nnstat.store import GradientStore

        path = Path(obj)
        if not path.exists():
            raise FileNotFoundError(f"no gradient store at {path}")
        return StoreSource(GradientStore(path))
    dataset = getattr(obj, "dataset", None)
    if dataset is not None and getattr(dataset, "store", None) is not None:
        return StoreSource(dataset.store)
    if hasattr(obj, "iter_blocks") and hasattr(obj, "meta"):
        return StoreSource(obj)
    if hasattr(obj, "rows") and hasattr(obj, "ids") and hasattr(obj, "meta"):
        return LogSource(obj)
    if isinstance(obj, RowSource):
        return obj
    raise TypeError(
        f"cannot read gradients from {type(obj).__name__}: pass a GradientLog, a GradientStore, "
        "a store path, a log dataloader (loader.dataset.store) or a TensorSource"
    )


def nonfinite_error(
    source: RowSource, shard: Any, ids: list, rows: torch.Tensor
) -> ValueError | None:
    """The error for a block of ``source`` whose ``rows`` hold NaN/Inf, naming the file they
    come from (``shard``: an entry of ``source.iter_shards()``); ``None`` when they are finite.

    Example:
        >>> nonfinite_error(TensorSource(torch.ones(2, 2)), 0, [0, 1], torch.ones(2, 2)) is None
        True
    """
    if all_finite(rows):
        return None
    if isinstance(source, StoreSource):
        return source.nonfinite_error(shard, ids, rows)
    bad = [ids[i] for i in (~torch.isfinite(rows)).any(1).nonzero().flatten()[:5].tolist()]
    return ValueError(f"training rows {bad} contain NaN/Inf values")


def describe(source: RowSource) -> str:
    """How errors name ``source``: a store's directory, else what it is.

    Example:
        >>> describe(TensorSource(torch.ones(1, 2)))
        'the in-memory rows (TensorSource)'
    """
    if isinstance(source, StoreSource):
        return f"the store {source.root}"
    if isinstance(source, LogSource):
        return f"the query log ({type(source.log).__name__})"
    return f"the in-memory rows ({type(source).__name__})"


def all_rows(source: RowSource, batch_size: int) -> tuple[list, torch.Tensor]:
    """Every id and row of ``source`` in memory (float32): the query side of scoring.

    Example:
        >>> all_rows(TensorSource(torch.ones(3, 2)), 2)[1].shape
        torch.Size([3, 2])
    """
    ids, blocks = [], []
    for b_ids, rows in source.iter_blocks(batch_size):
        ids.extend(b_ids)
        blocks.append(rows.to(torch.float32))
    if not blocks:
        raise ValueError("the query log is empty")
    return ids, blocks[0] if len(blocks) == 1 else torch.cat(blocks)
