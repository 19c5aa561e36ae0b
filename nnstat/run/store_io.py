"""The Run's reads and writes of its store that need more than the store itself: the
statistics collector's files (saving a pass, reading them back, ``overwrite=True`` clearing
them), the capture engine's watched modules (logging queries in a store's projection space),
the streams a pass may save, and stopping the store's logger after its writer failed.

Example:
    >>> import tempfile
    >>> finalized_statistics({}, Path(tempfile.mkdtemp()))  # no pass, no statistics.safetensors
    {}
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from nnstat.distributed import rank_world
from nnstat.store.errors import StoreWriteError, add_note
from nnstat.store.files import (
    META_FILE,
    PROJECTIONS_FILE,
    SHARD_DIR,
    STATISTICS_FILE,
    load_safetensors,
)
from nnstat.store.integrity import tensors_hash
from nnstat.store.lazy import LazyStatistics
from nnstat.store.lock import WriterLock
from nnstat.store.logger import StoreLogger
from nnstat.store.meta import record_statistics_hash, statistics_coverage_record
from nnstat.store.projection import ModuleProjection, ModuleShape
from nnstat.store.writer import stored_ids


def save_statistics(collector: Any, path: Path, rank: int) -> dict[str, torch.Tensor]:
    """End ``collector``'s pass (all-reduced under DDP), save it (rank 0), return its state."""
    collector.finalize()
    if rank == 0:
        Path(path).mkdir(parents=True, exist_ok=True)
        collector.save(path)
    return collector.state_dict()


def saved_statistics(path: Path) -> dict[str, torch.Tensor]:
    """The store's ``statistics.safetensors`` (``{}`` without one), checked against the factor
    forms its ``statistics.json`` records."""
    from nnstat.curvature.collector import check_saved_forms

    stats = load_safetensors(Path(path) / STATISTICS_FILE)
    check_saved_forms(stats, path)
    return stats


def lazy_statistics(path: Path) -> tuple[Mapping[str, torch.Tensor], str | None]:
    """``(statistics, their tensors_hash)`` of the store at ``path``: ``statistics.safetensors``
    read one tensor at a time when accessed (hashed one tensor at a time now), else loaded whole
    by `saved_statistics` (``({}, None)`` without a file). A query log holds this, not the
    tensors (1.5 GB of K-FAC factors at GPT-2 small)."""
    from nnstat.curvature.collector import check_saved_forms

    lazy, digest = LazyStatistics.scan(Path(path) / STATISTICS_FILE)
    if lazy is None:
        stats = saved_statistics(path)
        return stats, tensors_hash(stats) if stats else None
    check_saved_forms(lazy, path)
    return lazy, digest


def finalized_statistics(state: Mapping[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """This run's finalized statistics, else ``statistics.safetensors`` of the store, else ``{}``."""
    if state:
        return dict(state)
    return load_safetensors(Path(path) / STATISTICS_FILE)


_LOCK_RE = re.compile(r"^rank(\d+)\.lock(\.d)?$")
_SHARD_FILE_RE = re.compile(r"^rank\d+-\d{5,}\.")
_COMMIT_LOG_RE = re.compile(r"^rank\d+\.log$")


def clear_store(path: Path, rank: int, world_size: int) -> None:
    """``overwrite=True``: delete the store's rows, projections, statistics and meta.json.

    Rank 0 deletes while holding every rank's writer lock (a store another process is still
    writing is refused with :class:`~nnstat.store.writer.StoreLockedError`); meta.json goes
    last, so a crash half-way still leaves the old weights' fingerprint refusing a mismatched
    pass. Other files in the directory are left alone. Under ``torch.distributed`` every rank
    waits for rank 0 before it writes.
    """
    from nnstat.curvature.collector import JSON_FILE, TENSORS_FILE

    path = Path(path)
    error: BaseException | None = None
    if rank == 0 and path.is_dir():
        shard_dir = path / SHARD_DIR
        locks: list[WriterLock] = []
        try:
            if shard_dir.is_dir():
                ranks = {
                    int(m.group(1)) for f in shard_dir.iterdir() if (m := _LOCK_RE.match(f.name))
                }
                for r in sorted(ranks):
                    locks.append(WriterLock(shard_dir, r))
                for f in shard_dir.iterdir():
                    if _SHARD_FILE_RE.match(f.name):
                        f.unlink()
                for f in shard_dir.iterdir():  # the commit logs after the shards they list
                    if _COMMIT_LOG_RE.match(f.name):
                        f.unlink()
            for name in (TENSORS_FILE, JSON_FILE, PROJECTIONS_FILE, META_FILE):
                (path / name).unlink(missing_ok=True)
        except Exception as e:  # raised below, after the other ranks learnt of it
            error = e
        finally:
            for lock in locks:
                lock.release()
    if world_size > 1:
        import torch.distributed as dist

        # every rank must learn whether rank 0 cleared the store: a failed rank 0 would
        # otherwise leave the others waiting forever (or writing into the old store)
        status = [None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(status, src=0)
        if error is None and status[0] is not None:
            raise RuntimeError(f"overwrite=True: rank 0 could not clear {path}: {status[0]}")
    if error is not None:
        raise error


def projections_from_store(
    path: Path, engine: Any
) -> tuple[dict[str, ModuleProjection], dict[str, Any]]:
    """The projections (and their arguments) of a store, so queries are logged in its space."""
    from nnstat.store.reader import GradientStore

    store = GradientStore(path)
    tensors = store.projections()
    watched = list(engine.watched)
    stored = [m["name"] for m in store.modules]
    if watched != stored:
        raise ValueError(
            f"the watched modules {watched} differ from the store's {stored} ({path}); watch the "
            "same modules of the same model to log queries against this store"
        )
    out: dict[str, ModuleProjection] = {}
    for m in store.modules:
        spec = ModuleShape(m["name"], m["kind"], int(m["d_in"]), m["d_out"])
        out[m["name"]] = ModuleProjection(
            spec,
            int(m["r_in"]),
            m["r_out"],
            tensors.get(f"{m['name']}/p_in"),
            tensors.get(f"{m['name']}/p_out"),
            m.get("factors"),
        )
    if tensors_hash(tensors) != store.meta.get("projection_sha256"):
        raise ValueError(f"{path}: projections.safetensors does not match meta.json's sha256")
    p = store.meta.get("projection", {})
    args = {"rank": p.get("rank"), "init": p.get("init") or "random", "seed": p.get("seed", 0)}
    return out, args


def refuse_other_streams(save: Mapping[str, Any]) -> None:
    """The gradient store holds the ``grad`` stream only: any other stream a pass's ``save``
    asks for is an error pointing to the recorder."""
    extra = [s for s, on in save.items() if on and s != "grad"]
    if extra:
        raise ValueError(
            f"the gradient store saves the 'grad' stream only; save={extra} is not "
            "supported (log those streams with the recorder instead)"
        )


def close_after_failure(logger: StoreLogger, error: BaseException) -> None:
    """Stop ``logger`` after its writer failed with ``error`` (its lock released, so another run
    may write the store); a further failure of the close becomes a note on ``error``."""
    try:
        logger.close(progress=False)
    except StoreWriteError:
        pass  # the failure being raised, seen again by close()
    except Exception as also:  # noqa: BLE001 - reported on the error being raised
        add_note(error, f"closing the store failed too: {also!r}")


class PassIds:
    """The data ids the statistics of a schedule round saw, for the coverage its passes record.

    A pass that stores rows has its logger's ids (stored, or skipped as already stored); a
    statistics pass that stores none (EK-FAC's ``factors`` pass, ``save=None``) notes each
    block's ids here (`note`), a block without ``data_id`` numbered 0, 1, ... like the rows a
    pass stores without ids. The statistics saved at a pass's end hold every pass of the round
    so far (the EK-FAC factors and their eigenvalues), so they cover the ids all of them saw.

    Example:
        >>> ids = PassIds()
        >>> ids.note([3, 4]); ids.samples = 2; ids.note(None)
        >>> sorted(ids.end_pass(None, first=True))
        [0, 1, 3, 4]
        >>> sorted(ids.end_pass({1, 3}, first=False))  # the round's second pass saw 1 and 3
        [1, 3]
    """

    def __init__(self) -> None:
        self.pass_ids: set[Any] = set()
        self.samples = 0  # the batch size of the last captured block (set by the Run's hook)
        self._next_auto = 0
        self._round: set[Any] = set()

    def note(self, ids: list | None) -> None:
        """A block of a statistics pass that stores no rows saw ``ids`` (``None``: the next
        `samples` automatic ids)."""
        if ids is None:
            ids = list(range(self._next_auto, self._next_auto + self.samples))
            self._next_auto += self.samples
        self.pass_ids.update(ids)

    def end_pass(self, logger_seen: set | None, first: bool) -> set[Any]:
        """The ids the round's statistics cover once this pass ends (``logger_seen``: the ids of
        a pass that stored rows; ``first``: the pass begins a round); starts the next pass."""
        seen = self.pass_ids if logger_seen is None else set(logger_seen)
        self._round = seen if first else self._round & seen
        self.discard()
        return self._round

    def discard(self) -> None:
        """Forget the ids of a pass that saved no statistics (nothing they could cover)."""
        self.pass_ids, self._next_auto = set(), 0


def pass_coverage(seen: set | None, path: Path) -> dict[str, Any] | None:
    """The rows of the store at ``path`` (flushed) that the saved statistics cover: ``seen``
    (`PassIds.end_pass`), gathered from every rank under ``torch.distributed`` (a collective:
    every rank calls it) against the store's ids
    (:func:`~nnstat.store.meta.statistics_coverage_record`); ``None`` (unknown) without ids."""
    if seen is None:
        return None
    world = rank_world()[1]
    if world > 1:
        import torch.distributed as dist

        # each rank saw its own part of the data; ids are ints and strings
        parts: list[Any] = [None] * world
        dist.all_gather_object(parts, list(seen))
        seen = set().union(*parts)
    return statistics_coverage_record(seen, stored_ids(Path(path) / SHARD_DIR))


def close_pass(
    logger: StoreLogger | None,
    collector: Any,
    path: Path,
    rank: int,
    error: BaseException | None = None,
    seen: Callable[[set | None], set | None] = lambda logged: logged,
) -> dict[str, torch.Tensor] | None:
    """End a logging pass: flush the store, then save the statistics (and record their hash
    and the store rows they cover).

    Args:
        logger: the pass's open logger (``None``: no rows logged, or flushed already).
        collector: the pass's statistics collector (``None``: no statistics this pass).
        path: the project directory.
        rank: this process's rank.
        error: a writer failure seen earlier in the pass, raised at the end.
        seen: the ids the saved statistics cover, given the logger's ids (``None`` without a
            logger): `PassIds.end_pass`.

    Returns:
        The saved statistics' state (``None`` without a collector).

    Raises:
        StoreWriteError: the writer failed (the statistics are saved first; a failure to save
            them too is added to it as a note: the writer's failure is often the cause).
    """
    saved = None
    try:
        if logger is not None:
            logger.close(progress=True)
    except BaseException as e:  # raised below, after the statistics were saved
        error = e
    if collector is not None:
        try:
            # gathered before rank 0 saves, next to the statistics' own all-reduce
            covered = pass_coverage(seen(None if logger is None else logger.seen), path)
            saved = save_statistics(collector, path, rank)
            record_statistics_hash(path, rank, saved=saved, coverage=covered)
        except BaseException as e:
            if error is None:
                raise
            add_note(error, f"the statistics were not saved either: {e!r}")
    if error is not None:
        raise error
    return saved
