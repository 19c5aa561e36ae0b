"""One logging pass into a store: meta.json checks, resume, duplicate ids, NaN/Inf policy.

:class:`StoreLogger` sits between the Run and the background :class:`StoreWriter`. It owns the
decisions that must be made in the training process (so errors surface where the user is):

* one writer per rank: the rank's lock (:class:`~nnstat.store.lock.WriterLock`) is taken
  before the store is read, so a second process is refused before it touches anything;
* a store that already exists is resumed only if its meta agrees on everything that shapes the
  rows (configuration, layout, projection hash, dtype) and on the weights they were computed
  with (``params_sha256``, :func:`check_same_params`); otherwise the error lists what differs;
* ids already stored are skipped (``on_stored_id="skip"``) or refused (``"error"``);
* an id seen twice in one pass is an error;
* rows with NaN/Inf follow ``nonfinite`` (``"error"``, ``"skip"`` counted in meta.json, ``"keep"``).

Example:
    >>> import tempfile, torch
    >>> d = Path(tempfile.mkdtemp())
    >>> meta = {"format_version": 1, "row_width": 2, "dtype": "float32", "modules": []}
    >>> opts = StoreSettings("float32", "error", None, 16, "skip", 2**33, None)
    >>> log = StoreLogger(d, meta, opts)
    >>> log.add([0, 1], torch.ones(2, 2)); log.close()
    2
"""

from __future__ import annotations

import functools
import math
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nnstat.store import files, outer
from nnstat.store.errors import ModelChangedError, StoreWriteError, add_note
from nnstat.store.ids import DataId
from nnstat.store.integrity import diff_dicts
from nnstat.store.lock import WriterLock
from nnstat.store.shards import STORE_DTYPES, overflow_threshold
from nnstat.store.writer import StoreWriter, stored_ids

NONFINITE_POLICIES = ("error", "skip", "keep")
ON_STORED_ID = ("skip", "error")
# meta.json keys that must agree for a store to be resumed (the rest is bookkeeping)
RESUME_KEYS = (
    "format_version",
    "config",
    "dtype",
    "row_width",
    "modules",
    "projection",
    "projection_sha256",
    "nonfinite",
)


@dataclass(frozen=True)
class StoreSettings:
    """What a store pass is told by the run's configuration (``setup`` keys of the same names).

    Built by :attr:`nnstat.run.RunConfig.store`, which validates every value and holds the
    defaults: this record only carries them (no second set of defaults or checks).

    Attributes:
        dtype: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (stored as uint16 bits).
        nonfinite: rows with NaN/Inf: ``"error"``, ``"skip"`` (counted) or ``"keep"``.
        shard_rows: rows per shard file (``None``: about 64 MiB per shard).
        queue_size: blocks the background writer may hold before training waits.
        on_stored_id: ids already in the store when resuming: ``"skip"`` or ``"error"``.
        size_budget_bytes: warn when the projected store size exceeds this.
        num_samples: number of samples in the pass, for the up-front size check (or ``None``).
    """

    dtype: str
    nonfinite: str
    shard_rows: int | None
    queue_size: int
    on_stored_id: str
    size_budget_bytes: int
    num_samples: int | None


def _one_of(key: str, value: Any, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{key}={value!r} is not valid; valid values: {list(valid)}")


Rows = torch.Tensor | list[torch.Tensor]


def filter_nonfinite(
    ids: list[DataId], rows: Rows, policy: str, dtype: str = "float32"
) -> tuple[list[DataId], Rows, int]:
    """Apply the NaN/Inf ``policy``; return kept ids, kept rows, number skipped.

    ``rows`` is ``[n, w]`` or a list of column blocks ``[n, w_k]`` (one per module) that make up
    the rows; the same form comes back. With a 16-bit store ``dtype``, a value that storage
    would round to infinity (``|x| >= format.overflow_threshold(dtype)``) counts as Inf: the
    policy sees what would be stored, not only what was computed.

    Example:
        >>> filter_nonfinite([1, 2], torch.tensor([[0.0], [float("nan")]]), "skip")[0]
        [1]
        >>> filter_nonfinite([1, 2], torch.tensor([[7e4], [1.0]]), "skip", "float16")[0]
        [2]
    """
    _one_of("nonfinite", policy, NONFINITE_POLICIES)
    if policy == "keep" or not len(ids):
        return ids, rows, 0
    blocks = rows if isinstance(rows, list) else [rows]
    limit = overflow_threshold(dtype)
    # one scalar reduction per block instead of an elementwise mask: a NaN/Inf entry makes the
    # sum NaN/Inf (an overflowing sum of finite entries only sends us to the exact check below)
    if all(math.isfinite(float(b.sum())) and _below(b, limit) for b in blocks):
        return ids, rows, 0
    finite = torch.stack([row_flags(b, dtype) for b in blocks]).all(dim=0)
    if bool(finite.all()):
        return ids, rows, 0
    bad = [ids[j] for j in (~finite).nonzero().flatten().tolist()]
    if policy == "error":
        raise nonfinite_error(bad, dtype)
    kept = [i for i, f in zip(ids, finite.tolist(), strict=True) if f]
    out = [b[finite] for b in blocks]
    return kept, out if isinstance(rows, list) else out[0], len(bad)


def _chosen(take: list[int], words: torch.Tensor) -> list[int]:
    """The rows ``take`` of a staged block (no flags to read: ``words`` is unused)."""
    return take


def nonfinite_error(bad: list[DataId], dtype: str) -> ValueError:
    """The error of ``nonfinite="error"`` for the rows of ids ``bad`` in a ``dtype`` store."""
    limit = overflow_threshold(dtype)
    beyond = f" or values {dtype} stores as Inf (|x| >= {limit:g})" if limit < math.inf else ""
    return ValueError(
        f"per-sample gradients of ids {bad[:5]} contain NaN/Inf{beyond} "
        "(setup({'nonfinite': 'skip'}) drops such rows, 'keep' stores them)"
    )


def row_flags(rows: torch.Tensor, dtype: str = "float32") -> torch.Tensor:
    """``[N]`` bool, on ``rows``' device and not read: which rows ``[N, W]`` a ``dtype`` store
    holds as finite (every ``|x|`` below its overflow threshold; NaN fails): the per-row test of
    :func:`filter_nonfinite`, in two row reductions that never leave the device.

    Example:
        >>> row_flags(torch.tensor([[1.0, 7e4], [float("nan"), 0.0], [1.0, 2.0]]), "float16")
        tensor([False, False,  True])
    """
    limit = overflow_threshold(dtype)
    if not rows.shape[1]:
        return torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
    lo, hi = torch.aminmax(rows, dim=1)  # NaN propagates into both and compares False
    return (hi < limit) & (lo > -limit)


def _below(block: torch.Tensor, limit: float) -> bool:
    if limit == math.inf or not block.numel():
        return True
    lo, hi = torch.stack(torch.aminmax(block)).tolist()
    return max(-lo, hi) < limit  # NaN compares False


def check_resumable(old: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    """Raise ``ValueError`` listing every difference on :data:`RESUME_KEYS`."""
    diffs: list[str] = []
    for key in RESUME_KEYS:
        diffs += diff_dicts(old.get(key), new.get(key), key)
    if diffs:
        shown = "; ".join(diffs[:12]) + (
            f"; ... ({len(diffs) - 12} more)" if len(diffs) > 12 else ""
        )
        raise ValueError(
            f"cannot resume the gradient store {path}: it was written with a different "
            f"configuration or projection ({shown}). Use another project name or delete the "
            "directory to start over."
        )


def check_same_params(old: dict[str, Any], new: dict[str, Any], path: Path) -> None:
    """Raise :class:`~nnstat.store.errors.ModelChangedError` when ``old`` (the store's meta) and
    ``new`` both record ``model_sha256`` (every parameter and buffer of the model) or
    ``params_sha256`` (the watched parameters) and they differ: the model is not the one the
    stored rows were computed with. A meta without them (older stores) is not checked."""
    before, now = old.get("params_sha256"), new.get("params_sha256")
    if before is not None and now is not None and before != now:
        raise ModelChangedError(
            f"cannot add to the gradient store {path}: its rows were computed with other "
            f"weights of the watched parameters (meta.json params_sha256 {before[:12]}..., the "
            f"model now {now[:12]}...); the model changed since (a training step, another "
            "checkpoint), and one store mixing two models describes neither. Log into a new "
            "store (another project name) or replace this one: nnstat.init(project=..., "
            "overwrite=True) / Run(..., overwrite=True)."
        )
    before, now = old.get("model_sha256"), new.get("model_sha256")
    if before is not None and now is not None and before != now:
        raise ModelChangedError(
            f"cannot add to the gradient store {path}: its rows were computed with another "
            f"model (meta.json model_sha256 {before[:12]}..., the model now {now[:12]}...: its "
            "parameters or buffers changed, maybe outside the watched modules, e.g. a layer "
            "that is not watched was re-trained or BatchNorm statistics were reloaded). Log "
            "into a new store (another project name) or replace this one: "
            "nnstat.init(project=..., overwrite=True)."
        )


class StoreLogger:
    """Writes one pass of rows into the store at ``path`` (see module docstring).

    Args:
        path: the project directory (``<root_dir>/<project>``).
        meta: the meta.json this pass would write (layout, configuration, projection hash, ...).
        options: :class:`StoreSettings` (``RunConfig.store``, validated there).
        rank: process rank (``torch.distributed``); rank 0 writes meta.json.
        world_size: number of processes.
        prepare: completes ``meta`` in place and writes what must exist with it (the Run: the
            projection hash and ``projections.safetensors``). For a new store it runs in the
            writer's thread, then meta.json is written there, before any shard: the first
            batch does not wait on hashing and fsyncs. Resuming, it runs here, before the
            comparison with the stored meta.json.
    """

    def __init__(
        self,
        path: Path,
        meta: dict[str, Any],
        options: StoreSettings,
        rank: int = 0,
        world_size: int = 1,
        prepare: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.path, self.options, self.rank = Path(path), options, rank
        shard_dir = self.path / files.SHARD_DIR
        shard_dir.mkdir(parents=True, exist_ok=True)
        # before anything is read: what this pass decides (fresh or resumed, which ids are
        # stored) holds only while no other writer of this rank changes the store
        lock = WriterLock(shard_dir, rank)
        try:
            self._open(meta, options, world_size, prepare)
            self.writer = StoreWriter(
                shard_dir,
                row_width=int(self.meta["row_width"]),
                shard_rows=options.shard_rows,
                dtype=options.dtype,
                rank=rank,
                queue_size=options.queue_size,
                lock=lock,
                require_log=self._require_log,
            )
        except BaseException:
            lock.release()
            raise
        if self._fresh:
            # the writer's first job, ahead of every shard: a store on disk always has its
            # meta.json (and what `prepare` writes) before its first shard
            self.writer.submit(functools.partial(self._start, prepare))
        self._warned_budget = False

    def _open(
        self,
        meta: dict[str, Any],
        options: StoreSettings,
        world_size: int,
        prepare: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        meta_path = self.path / files.META_FILE
        self.meta = dict(meta, nonfinite=options.nonfinite, dtype=options.dtype)
        self.meta.setdefault("skipped_rows", 0)
        self._fresh = fresh = not meta_path.exists()
        # meta.json is rewritten at close only over a complete start (see _start)
        self._started = not fresh
        # a new store keeps commit logs (shards/rank{r}.log); a store that predates them is
        # logged from now on, but its meta.json cannot vouch for ranks other writers left
        self._require_log = False
        self.meta["shard_logs"] = True
        # a store with commit logs always holds this key (null: no statistics with its rows)
        self.meta.setdefault("statistics_sha256", None)
        if not fresh:
            old = files.read_json(meta_path)
            if not isinstance(old, dict):
                raise ValueError(f"{meta_path}: expected a JSON object, got {type(old).__name__}")
            check_same_params(old, self.meta, self.path)  # the most actionable difference first
            if prepare is not None:
                prepare(self.meta)  # a resumed store is compared with the complete meta
            check_resumable(old, self.meta, self.path)
            self.meta["skipped_rows"] = int(old.get("skipped_rows", 0))
            self._require_log = old.get("shard_logs") is True
            if not self._require_log:
                self.meta.pop("shard_logs")
            # unchanged by this pass until statistics are saved (the Run records their hash)
            self.meta["statistics_sha256"] = old.get("statistics_sha256")
            for key in ("params_sha256", "model_sha256"):
                if key not in old:
                    # an older store: its rows' weights are unknown, so this pass cannot
                    # vouch for them either
                    self.meta.pop(key, None)
                elif old[key] is None:
                    self.meta[key] = None  # recorded as unknown: the key stays (revision 3)
            # the store keeps its identity and the revision it was created in: this pass
            # cannot vouch for what an older writer left (content hashes of its shards); the
            # factors' captured energy of earlier passes stays (this pass's is merged in)
            for key in ("store_id", "format_revision", "factor_energy"):
                if key in old:
                    self.meta[key] = old[key]
                else:
                    self.meta.pop(key, None)
        self.stored: set[DataId] = stored_ids(self.path / files.SHARD_DIR, self._require_log)
        self.seen: set[DataId] = set()
        self.skipped_nonfinite = 0
        self.skipped_stored = 0
        self.world_size = world_size
        self._check_size()

    def _start(self, prepare: Callable[[dict[str, Any]], None] | None) -> None:
        if prepare is not None:
            prepare(self.meta)
        if self.rank == 0:
            files.atomic_write_json(self.path / files.META_FILE, self.meta)
        self._started = True

    @functools.cached_property
    def bytes_per_row(self) -> int:
        """Bytes of one stored row (asked once per batch by the budget check: cached)."""
        import numpy as np

        return int(self.meta["row_width"]) * np.dtype(STORE_DTYPES[self.options.dtype][0]).itemsize

    def _check_size(self) -> None:
        n = self.options.num_samples
        if n is None:
            return
        total = n * self.bytes_per_row
        free = shutil.disk_usage(self.path).free
        if total > free:
            raise OSError(
                f"the gradient store needs about {total} bytes ({n} rows x {self.bytes_per_row} "
                f"bytes) but {self.path} has {free} bytes free; add a projection (add_projection("
                "rank=...)) or free disk space"
            )
        if total > self.options.size_budget_bytes:
            warnings.warn(
                f"the gradient store will take about {total} bytes ({n} rows x "
                f"{self.bytes_per_row} bytes), over size_budget_bytes="
                f"{self.options.size_budget_bytes}",
                stacklevel=3,
            )

    def admit(self, ids: list[DataId]) -> list[bool]:
        """Check ``ids`` before a batch runs; return which rows to keep (False = already stored).

        Raises on duplicates within the pass and, with ``on_stored_id="error"``, on stored ids.
        The ids count as seen only once :meth:`add` has them (a failed batch can be retried).
        """
        self.writer.check()
        batch_seen: set[DataId] = set()
        dup: list[DataId] = []
        for i in ids:
            if i in self.seen or i in batch_seen:
                dup.append(i)
            batch_seen.add(i)
        if dup:
            raise ValueError(f"duplicate data ids in this pass: {dup[:5]} (ids must be unique)")
        keep = [i not in self.stored for i in ids]
        if not all(keep) and self.options.on_stored_id == "error":
            already = [i for i, k in zip(ids, keep, strict=True) if not k]
            raise ValueError(
                f"data ids already in the store {self.path}: {already[:5]} "
                "(on_stored_id='error'; use 'skip' to resume)"
            )
        return keep

    def add(
        self,
        ids: list[DataId],
        rows: Rows,
        keep: list[bool] | None = None,
        recycle: torch.Tensor | None = None,
        factors: list[outer.OuterFactors] | None = None,
    ) -> None:
        """Queue rows (already admitted; a tensor or per-module column blocks); NaN/Inf policy.

        ``recycle``: the writer's :meth:`~StoreWriter.row_buffer` holding ``rows``, handed back
        to the writer with them. ``factors``: the rows are those outer products, not yet formed
        (``rows`` is the row buffer): the writer forms them when the factors certify the block
        finite and every row is kept; otherwise they are formed here and checked as rows.
        """
        self.writer.check()
        self.seen.update(ids)
        if factors:
            limit = overflow_threshold(self.options.dtype)
            check = (keep is not None and not all(keep)) or (
                self.options.nonfinite != "keep" and not outer.certified(factors, limit)
            )
            # on the writer's thread only when it has a core to itself: otherwise it would take
            # one from torch's threads mid-GEMM (measured slower at 2 threads on 2 cores)
            in_writer = not check and outer.idle_core()
            if not in_writer:
                assert isinstance(rows, torch.Tensor)
                outer.fill(rows, factors)
            if not check:
                self.writer.put(ids, rows, recycle=recycle, factors=factors if in_writer else None)
                self._budget_warning()
                return
        if keep is not None and not all(keep):
            idx = [j for j, k in enumerate(keep) if k]
            self.skipped_stored += len(ids) - len(idx)
            ids = [ids[j] for j in idx]
            rows = [b[idx] for b in rows] if isinstance(rows, list) else rows[idx]
        ids, rows, skipped = filter_nonfinite(ids, rows, self.options.nonfinite, self.options.dtype)
        self.skipped_nonfinite += skipped
        self.writer.put(ids, rows, recycle=recycle)
        self._budget_warning()

    def add_staged(
        self,
        ids: list[DataId],
        rows: torch.Tensor,
        keep: list[bool] | None = None,
        flat: torch.Tensor | None = None,
        same: torch.Tensor | None = None,
        confirm: Callable[[list[bool]], None] | None = None,
    ) -> None:
        """Queue rows ``[N, W]`` that are still on a device (already admitted): the writer
        copies them to the host in one non-blocking transfer and writes them once it is done.
        Nothing is read back here: the rows' NaN/Inf flags (:func:`row_flags`, not under
        ``"keep"``) and ``same`` go to the words after the rows in ``flat`` (the flat staging
        buffer ``rows`` begins, with ``N + same.numel()`` words after them), travel in the
        same copy, and the writer's thread applies the policy to them once it has landed.

        ``same``: the weights guard's device flag (one per group), checked there by
        ``confirm`` (which raises :class:`~nnstat.store.errors.ModelChangedError`). A refusal
        in the thread (NaN/Inf under ``"error"``, a changed model) is raised, with the same
        message, by the next :meth:`admit`, :meth:`add`, :meth:`add_staged` or :meth:`close`;
        the rows queued before the refused ones are stored, none after them.

        Raises:
            ValueError: an earlier block's rows were refused (see above).
            StoreWriteError: the writer failed.
        """
        self.writer.check()
        self.seen.update(ids)
        n = len(ids)
        take = list(range(n)) if keep is None else [j for j, k in enumerate(keep) if k]
        self.skipped_stored += n - len(take)
        finite = self.options.nonfinite != "keep" and n > 0
        if flat is None or not (finite or same is not None):
            flat, decide = None, None  # nothing to check: the rows alone
            if len(take) < n:
                decide = functools.partial(_chosen, take)
        else:
            words = flat[rows.numel() :]
            if finite:
                words[:n].copy_(row_flags(rows, self.options.dtype))
            if same is not None:
                words[n : n + same.numel()].copy_(same.reshape(-1))
            decide = functools.partial(
                self._decide, ids, take, finite, same.numel() if same is not None else 0, confirm
            )
        self.writer.put_staged(ids, rows, flat, decide)
        self._budget_warning()

    def _decide(
        self,
        ids: list[DataId],
        take: list[int],
        finite: bool,
        groups: int,
        confirm: Callable[[list[bool]], None] | None,
        words: torch.Tensor,
    ) -> list[int] | None:
        """In the writer's thread, from the host copy of a staged block's flag ``words``: the
        rows to write (``None``: all), or the refusal (raised)."""
        n = len(ids)
        flags = (words[: n + groups] != 0).tolist()  # a host copy: reads no device
        try:
            if groups and confirm is not None:
                confirm(flags[n : n + groups])
            if finite and not all(flags[j] for j in take):
                if self.options.nonfinite == "error":
                    bad = [ids[j] for j in take if not flags[j]]
                    raise nonfinite_error(bad, self.options.dtype)
                good = [j for j in take if flags[j]]
                self.skipped_nonfinite += len(take) - len(good)  # read at close, after the thread
                take = good
        except ValueError as error:
            add_note(
                error,
                "found when the rows had left the device: the rows of this block and of the "
                "blocks logged after it are not stored (those before it are); log them again "
                "in a pass that resumes the store",
            )
            raise
        return None if len(take) == n else take

    def _budget_warning(self) -> None:
        queued = (len(self.seen) - self.skipped_stored) * self.bytes_per_row
        if not self._warned_budget and queued > self.options.size_budget_bytes:
            self._warned_budget = True
            warnings.warn(
                f"the gradient store has passed size_budget_bytes={self.options.size_budget_bytes} "
                f"({self.bytes_per_row} bytes per row)",
                stacklevel=4,
            )

    def close(self, progress: bool = True, collective: bool = True) -> int:
        """Flush and stop the writer, record skipped rows in meta.json; returns rows written.

        A writer failure is raised as :class:`~nnstat.store.writer.StoreWriteError` even when
        the meta.json rewrite fails after it (that error is added to it as a note: the first
        failure is the cause, a full disk fails both). ``collective=False`` (at interpreter
        exit, where other ranks may be gone) skips the all-reduce of skipped rows: this rank's
        count only.
        """
        try:
            written = self.writer.close(progress=progress)
        except ValueError as e:  # the refusal of staged rows, seen first here
            if e is not self.writer.refused:
                raise
            self._rewrite_meta(collective)
            raise
        except StoreWriteError as e:
            try:
                self._rewrite_meta(collective)
            except Exception as also:  # noqa: BLE001 - reported on the error being raised
                add_note(e, f"meta.json was not rewritten either: {also!r}")
            raise
        self._rewrite_meta(collective)
        return written

    def _rewrite_meta(self, collective: bool) -> None:
        skipped = self.skipped_nonfinite
        if self.world_size > 1 and collective:
            import torch.distributed as dist

            t = torch.tensor([skipped], dtype=torch.long)
            dist.all_reduce(t)  # every rank, also after its own writer failed: no rank hangs
            skipped = int(t.item())
        self.meta["skipped_rows"] = int(self.meta.get("skipped_rows", 0)) + skipped
        if self.rank == 0 and self._started:
            files.atomic_write_json(self.path / files.META_FILE, self.meta)
