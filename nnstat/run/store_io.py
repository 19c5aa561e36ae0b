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
from collections.abc import Mapping
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


def pass_coverage(logger: StoreLogger | None, path: Path) -> dict[str, Any] | None:
    """The rows of the store at ``path`` (flushed) that a statistics pass saw: the ids its
    ``logger`` was given, stored or skipped as already stored
    (:func:`~nnstat.store.meta.statistics_coverage_record`). ``None`` (unknown) for a pass
    that logged no rows, or under ``torch.distributed`` (rank 0 sees its own ids only)."""
    if logger is None or rank_world()[1] > 1:
        return None
    return statistics_coverage_record(logger.seen, stored_ids(Path(path) / SHARD_DIR))


def close_pass(
    logger: StoreLogger | None,
    collector: Any,
    path: Path,
    rank: int,
    error: BaseException | None = None,
) -> dict[str, torch.Tensor] | None:
    """End a logging pass: flush the store, then save the statistics (and record their hash).

    Args:
        logger: the pass's open logger (``None``: no rows logged, or flushed already).
        collector: the pass's statistics collector (``None``: no statistics this pass).
        path: the project directory.
        rank: this process's rank.
        error: a writer failure seen earlier in the pass, raised at the end.

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
            saved = save_statistics(collector, path, rank)
            record_statistics_hash(path, rank, saved=saved, coverage=pass_coverage(logger, path))
        except BaseException as e:
            if error is None:
                raise
            add_note(error, f"the statistics were not saved either: {e!r}")
    if error is not None:
        raise error
    return saved
