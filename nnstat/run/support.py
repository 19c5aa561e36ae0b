"""Pieces of :class:`nnstat.run.Run` that are plain functions: meta, I/O, DDP.

The run's configuration is :class:`nnstat.run.config.RunConfig`.

Example:
    >>> duplicate_ids([3, 4, 3])
    [3]
"""

from __future__ import annotations

import hashlib
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from nnstat import __version__
from nnstat.run.config import RunConfig
from nnstat.store import format as fmt
from nnstat.store.projection import ModuleProjection, ModuleSpec, layout, projection_tensors
from nnstat.store.writer import WriterLock


def save_statistics(collector: Any, path: Path, rank: int) -> dict[str, torch.Tensor]:
    """End ``collector``'s pass (all-reduced under DDP), save it (rank 0), return its state."""
    collector.finalize()
    if rank == 0:
        Path(path).mkdir(parents=True, exist_ok=True)
        collector.save(path)
    return collector.state_dict()


def finalized_statistics(state: Mapping[str, torch.Tensor], path: Path) -> dict[str, torch.Tensor]:
    """This run's finalized statistics, else ``statistics.safetensors`` of the store, else ``{}``."""
    if state:
        return dict(state)
    return load_tensors(Path(path) / fmt.STATISTICS_FILE)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """safetensors file as a dict, ``{}`` when absent (a damaged file names itself)."""
    return fmt.load_safetensors(Path(path))


def statistics_hash(path: Path) -> str | None:
    """``format.tensors_hash`` of the store's ``statistics.safetensors``, ``None`` without one."""
    target = Path(path) / fmt.STATISTICS_FILE
    return fmt.tensors_hash(fmt.load_safetensors(target)) if target.exists() else None


def record_statistics_hash(
    path: Path, rank: int, saved: Mapping[str, torch.Tensor] | None = None
) -> None:
    """Rank 0: put the hash of the statistics just saved into meta.json (when the store has
    one), so meta.json always names the statistics that go with its rows. ``saved``: the
    tensors just written, hashed as they are in memory (the same names, dtypes, shapes and
    bytes as the file) instead of reading the whole file back (1.3 GB for GPT-2 small)."""
    meta_path = Path(path) / fmt.META_FILE
    if rank != 0 or not meta_path.exists():
        return
    meta = fmt.read_json(meta_path)
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path}: expected a JSON object, got {type(meta).__name__}")
    meta["statistics_sha256"] = statistics_hash(path) if saved is None else fmt.tensors_hash(saved)
    fmt.atomic_write_json(meta_path, meta)


def watched_parameters(engine: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``("{module}.{param}", full tensor)`` of every watched module's own parameters, in watch
    order (registration order within a module). A DTensor (FSDP2) is gathered with
    ``full_tensor()``, a collective: every rank hashes the same whole weights. FSDP1 flat
    parameters are hashed as each rank holds them (outside forward: its shard);
    :func:`params_fingerprint` combines the ranks' hashes."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        DTensor = ()  # noqa: N806
    for name, module in engine.watched.items():
        for pname, p in module.named_parameters(recurse=False):
            t = p.detach()
            yield f"{name}.{pname}", t.full_tensor() if isinstance(t, DTensor) else t


def params_fingerprint(engine: Any) -> str:
    """``meta["params_sha256"]``: :func:`nnstat.store.format.params_hash` of
    :func:`watched_parameters` (the weights the rows of a pass are computed with).

    Under ``torch.distributed`` every rank returns the same value (a collective: call it on
    every rank): the ranks' hashes are exchanged, and when they differ (FSDP1, where each rank
    holds its shard) the fingerprint is the hash of all of them in rank order. Without this the
    ranks would write one shared ``meta.json`` with whichever rank's shard came first and
    refuse each other's passes."""
    with torch.no_grad():
        local = fmt.params_hash(watched_parameters(engine))
    return combine_rank_digests(local)


def combine_rank_digests(local: str) -> str:
    """One digest for all ranks: ``local`` when every rank has it (replicated weights: DDP,
    FSDP2's gathered tensors, one process), else sha256 of the ranks' digests in rank order."""
    from nnstat.distributed import rank_world

    _, world = rank_world()
    if world == 1:
        return local
    import torch.distributed as dist

    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, local)
    if all(d == local for d in digests):
        return local
    return hashlib.sha256(("sharded:" + ",".join(map(str, digests))).encode()).hexdigest()


_LOCK_RE = re.compile(r"^rank(\d+)\.lock$")
_SHARD_FILE_RE = re.compile(r"^rank\d+-\d{5,}\.")


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
        shard_dir = path / fmt.SHARD_DIR
        locks: list[WriterLock] = []
        try:
            if shard_dir.is_dir():
                for f in sorted(shard_dir.iterdir()):
                    if m := _LOCK_RE.match(f.name):
                        locks.append(WriterLock(shard_dir, int(m.group(1))))
                for f in shard_dir.iterdir():
                    if _SHARD_FILE_RE.match(f.name):
                        f.unlink()
            for name in (TENSORS_FILE, JSON_FILE, fmt.PROJECTIONS_FILE, fmt.META_FILE):
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


def dist_info() -> tuple[int, int]:
    """``(rank, world_size)`` under an initialised ``torch.distributed``, else ``(0, 1)``."""
    from nnstat.distributed import rank_world

    return rank_world()


def build_meta(
    project: str,
    settings: RunConfig,
    projection_args: Mapping[str, Any],
    projections: Mapping[str, ModuleProjection],
    hashed: bool = True,
    params_sha256: str | None = None,
    statistics_sha256: str | None = None,
) -> dict[str, Any]:
    """meta.json for rows made with ``projections`` (see docs/architecture.md).

    ``hashed=False``: ``projection_sha256`` is ``None``, for :func:`prepare_store` to fill in.
    ``params_sha256``: :func:`params_fingerprint` of the weights the rows are computed with;
    ``statistics_sha256``: :func:`statistics_hash` of the statistics that go with them.
    """
    mods = layout(projections)
    return {
        "format_version": fmt.FORMAT_VERSION,
        "nnstat_version": __version__,
        "project": project,
        "config": settings.content(),
        "dtype": settings.store.dtype,
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
        "projection_sha256": (
            fmt.tensors_hash(projection_tensors(projections)) if hashed else None
        ),
        "nonfinite": settings.store.nonfinite,
        "skipped_rows": 0,
        "params_sha256": params_sha256,
        "statistics_sha256": statistics_sha256,
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
        meta["projection_sha256"] = fmt.tensors_hash(projection_tensors(projections))
    if (Path(path) / fmt.META_FILE).exists():
        return
    if meta.get("statistics_sha256") is None:
        meta["statistics_sha256"] = statistics_hash(path)
    write_projections(path, projections, rank)


def write_projections(path: Path, projections: Mapping[str, ModuleProjection], rank: int) -> None:
    """Save ``projections.safetensors`` (rank 0), replacing any file of that name."""
    target = Path(path) / fmt.PROJECTIONS_FILE
    if rank != 0:
        return
    from safetensors.torch import save

    Path(path).mkdir(parents=True, exist_ok=True)
    tensors = projection_tensors(projections)
    fmt.atomic_write_bytes(target, save(tensors) if tensors else save({}))


def projection_tensors_of(
    projections: Mapping[str, ModuleProjection] | None,
) -> dict[str, torch.Tensor]:
    return projection_tensors(projections) if projections else {}


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
        spec = ModuleSpec(m["name"], m["kind"], int(m["d_in"]), m["d_out"])
        out[m["name"]] = ModuleProjection(
            spec,
            int(m["r_in"]),
            m["r_out"],
            tensors.get(f"{m['name']}/p_in"),
            tensors.get(f"{m['name']}/p_out"),
        )
    if fmt.tensors_hash(tensors) != store.meta.get("projection_sha256"):
        raise ValueError(f"{path}: projections.safetensors does not match meta.json's sha256")
    p = store.meta.get("projection", {})
    args = {"rank": p.get("rank"), "init": p.get("init") or "random", "seed": p.get("seed", 0)}
    return out, args


def module_blocks(
    batch: Mapping[str, torch.Tensor],
    projections: Mapping[str, ModuleProjection],
    warned: set[str],
) -> list[torch.Tensor]:
    """One ``[N, width]`` block per module in layout order; zeros for modules without gradient.

    A watched module that took no part in the loss has a zero gradient: stored as zeros, with a
    one-time warning naming it. Nothing captured at all is an error (no backward in the block).
    """
    if not batch:
        raise RuntimeError(
            "nothing was captured inside run(...): call loss.backward() inside the block "
            "(and make sure the loss depends on a watched module)"
        )
    n = next(iter(batch.values())).shape[0]
    new = [m for m in projections if m not in batch and m not in warned]
    if new:
        warned.update(new)
        warnings.warn(
            f"watched modules {new} received no gradient in a batch; their per-sample "
            "gradients are stored as zeros (they did not take part in the loss)",
            stacklevel=4,
        )
    return [batch[m] if m in batch else torch.zeros(n, p.width) for m, p in projections.items()]


def duplicate_ids(ids: list) -> list:
    """The entries of ``ids`` that repeat an earlier entry, in order."""
    seen: set = set()
    out = []
    for i in ids:
        if i in seen:
            out.append(i)
        seen.add(i)
    return out


def freeze_params(engine: Any) -> Callable[[], None]:
    """Turn off ``requires_grad`` of watched modules' parameters; return the restore function."""
    saved: list[tuple[torch.nn.Parameter, bool]] = []
    seen: set[int] = set()
    for module in engine.watched.values():
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                saved.append((p, p.requires_grad))
    for p, _ in saved:
        p.requires_grad_(False)

    def restore() -> None:
        for p, flag in saved:
            p.requires_grad_(flag)

    return restore
