"""The shard commit log of a gradient store: ``shards/rank{r}.log``, one ``"{stem} {rows}"`` line
per committed shard of rank ``r``, so that a store knows its own shards and refuses one that
lost a file instead of opening with fewer rows.

A shard is committed in five steps (:func:`append_begin`,
:meth:`~nnstat.store.shards.ShardFile.commit`, then :func:`append_commit`): a
``"begin {stem} {rows} {ids_sha256}"`` line appended and fsynced (the digest of the shard's ids
in order, :func:`~nnstat.store.ids.ids_digest`); ``.npy.tmp`` sealed and fsynced; the ids file
renamed into place; the ``.npy`` renamed into place (the shard is now complete); its line
appended to the log and fsynced. A crash between the last two leaves one complete shard past
the log's last line: it is *pending*, and both readers and the next writer of that rank adopt
it (the writer appends its line), so readers and writers always agree on the rows. In a log
with ``begin`` lines, only a shard whose commit began there is pending: one copied in from
another store is refused. Every shard with a ``begin`` line has its ids checked against the
digest when read (:func:`check_ids`): a reordered or swapped ids file is refused. A torn last line (a crash mid-append)
is no line: the writer rewrites the log without it. Anything else that disagrees with the log
(a logged shard with a missing file, a row count that differs, an unlogged shard before the
last logged one) is a ``ValueError`` naming the file and the fix.

Stores written before the log existed (no ``rank{r}.log``, and meta.json without
``"shard_logs": true``) are read as before: every complete shard counts.

Example:
    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> append_commit(d, 0, "rank0-00000", 3); parse_log(log_path(d, 0)).rows
    {'rank0-00000': 3}
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import NamedTuple

from nnstat.store import files
from nnstat.store.shards import file_rows_digest, list_shards

_LOG_RE = re.compile(r"^rank(\d+)\.log$")
# "begin {stem} {rows} {ids_sha256}[ {rows_sha256}]" or "{stem} {rows}"; logs written before
# shard content hashes have begin lines without the last field
_HEX = r"(?: ([0-9a-f]{64}))?"
_LINE_RE = re.compile(rf"^(begin )?(rank(\d+)-\d{{5,}}) (\d+){_HEX}{_HEX}$")
_FILE_RE = re.compile(r"^rank(\d+)-\d{5,}\.")
_FIX = (
    "restore the missing file from a copy of this store, or log the store again "
    "(nnstat.init(project, overwrite=True)); to drop the shard's rows on purpose, delete both "
    "of its files and its line in {log}"
)


class Shard(NamedTuple):
    """One shard that counts: ``rank``, ``index``, its two files, and the row count its log
    line records (``None`` in a store without a log, or for a pending shard)."""

    rank: int
    index: int
    npy: Path
    ids: Path
    rows: int | None
    digest: str | None = None  # ids_digest of its ids, from its begin line (None: not logged)
    content: str | None = None  # rows_hasher digest of its rows, from its begin line


class LogEntries(NamedTuple):
    """A parsed commit log: ``rows`` of each committed shard, ``begun``: ``(rows, digest)`` of
    each shard whose commit began (the last such line), ``lines``: the complete lines."""

    rows: dict[str, int]
    begun: dict[str, tuple[int, str, str | None]]
    torn: bool
    lines: list[str]


def log_path(shard_dir: Path, rank: int) -> Path:
    """The commit log of ``rank`` in ``shard_dir``."""
    return Path(shard_dir) / f"rank{rank}.log"


def parse_log(path: Path, rank: int | None = None) -> LogEntries:
    """Every entry of a commit log (:class:`LogEntries`). A damaged line, or (given ``rank``)
    one naming another rank's shard, is a ``ValueError`` naming the file, the line and the fix.
    """
    path = Path(path)
    data = path.read_bytes()
    raw_lines = data.split(b"\n")
    torn = raw_lines[-1] != b""  # a complete log ends with a newline
    entries: dict[str, int] = {}
    begun: dict[str, tuple[int, str, str | None]] = {}
    lines: list[str] = []
    for n, raw in enumerate(raw_lines[:-1], start=1):
        line = raw.decode("utf-8", errors="replace")
        m = _LINE_RE.match(line)
        begin = m is not None and m.group(1) is not None
        if m is None or begin != (m.group(5) is not None) or (not begin and m.group(2) in entries):
            raise ValueError(
                f"{path}: line {n} {raw[:80]!r} is not a new '{{shard}} {{rows}}' or 'begin "
                "{shard} {rows} {ids_sha256} {rows_sha256}' entry; the commit log is damaged: "
                "restore it from a copy of this store or log the store again"
            )
        if rank is not None and int(m.group(3)) != rank:
            raise ValueError(
                f"{path}: line {n} names shard {m.group(2)} of rank {m.group(3)}, but this is "
                f"the commit log of rank {rank} (a log copied or renamed from another rank?): "
                f"restore rank{rank}.log from a copy of this store, or log the store again"
            )
        if begin:
            begun[m.group(2)] = (int(m.group(4)), m.group(5), m.group(6))
        else:
            entries[m.group(2)] = int(m.group(4))
        lines.append(line)
    return LogEntries(entries, begun, torn, lines)


def check_ids(shard: Shard, ids: list, digest: bool = True) -> None:
    """Refuse ids that are not the ones committed with ``shard`` (its log's digest).

    Args:
        shard: a shard from :func:`committed_shards`.
        ids: its ids file's content.
        digest: also compare the digest (``False``: the count only).

    Raises:
        ValueError: naming the ids file, when the count or the digest differs from the log's.
    """
    from nnstat.store.ids import ids_digest

    log = log_path(shard.ids.parent, shard.rank)
    if shard.rows is not None and shard.rows != len(ids):
        raise ValueError(
            f"{shard.ids}: {len(ids)} ids, but {log} records {shard.rows} rows for this shard: "
            "the ids file was replaced or edited; restore it from a copy of this store or log "
            "the store again"
        )
    if digest and shard.digest is not None and ids_digest(ids) != shard.digest:
        raise ValueError(
            f"{shard.ids}: these are not the ids committed with {shard.npy.name} (their digest "
            f"differs from the one {log} records): the ids file was reordered, edited or "
            "swapped with another shard's, so its rows would be read under the wrong ids. "
            "Restore it from a copy of this store, or log the store again"
        )


def check_content(shard: Shard) -> None:
    """Refuse a shard whose rows are not the ones committed with it: their
    :func:`~nnstat.store.shards.rows_hasher` digest (the whole file after its header is read)
    against the one its log's ``begin`` line records. A shard logged before content hashes
    existed (no digest) is not checked.

    Args:
        shard: a shard from :func:`committed_shards`.

    Raises:
        ValueError: naming the shard, when its rows' digest differs from the log's.
    """
    if shard.content is None:
        return
    header = files.read_npy_header(shard.npy)
    nbytes = math.prod(header.shape) * header.dtype.itemsize
    if file_rows_digest(shard.npy, header.offset, nbytes) != shard.content:
        log = log_path(shard.npy.parent, shard.rank)
        raise ValueError(
            f"{shard.npy}: its rows are not the ones committed with this shard (their SHA-256 "
            f"differs from the one {log} records): the file was modified, damaged or replaced "
            "by another store's shard of the same size. Restore it from a copy of this store, "
            "or log the store again"
        )


def append_begin(
    shard_dir: Path, rank: int, stem: str, rows: int, digest: str, content: str | None = None
) -> None:
    """Append ``"begin {stem} {rows} {digest} {content}"`` to ``rank``'s commit log and fsync
    it (the first step of a shard's commit: the shard may count as pending only after it).
    ``digest``: :func:`~nnstat.store.ids.ids_digest` of its ids; ``content``:
    :func:`~nnstat.store.shards.rows_hasher`'s digest of its rows (the writer always gives it).
    """
    tail = f" {content}" if content is not None else ""
    _append(log_path(shard_dir, rank), f"begin {stem} {rows} {digest}{tail}\n")


def append_commit(shard_dir: Path, rank: int, stem: str, rows: int) -> None:
    """Append ``"{stem} {rows}"`` to ``rank``'s commit log and fsync it (the last step of a
    shard's commit; only the holder of that rank's writer lock calls it)."""
    _append(log_path(shard_dir, rank), f"{stem} {rows}\n")


def _append(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        _write_all(fd, line.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def committed_shards(shard_dir: Path, required: bool = False) -> list[Shard]:
    """The shards that count, in ``(rank, index)`` order, checked against the commit logs.

    ``required``: the store's meta.json says its writers keep commit logs (``shard_logs``), so
    a rank with shards but no log lost it. Raises ``ValueError`` naming the file when a logged
    shard lost a file or an unlogged shard sits among logged ones.
    """
    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        return []
    names = [p.name for p in shard_dir.iterdir()]
    complete = list_shards(shard_dir)
    ranks = {r for r, *_ in complete}
    ranks |= {int(m.group(1)) for n in names if (m := _LOG_RE.match(n) or _FILE_RE.match(n))}
    out: list[Shard] = []
    for rank in sorted(ranks):
        mine = [s for s in complete if s[0] == rank]
        path = log_path(shard_dir, rank)
        if not path.exists():
            if required and mine:
                raise ValueError(
                    f"{path} is missing, but meta.json says this store's writers log every "
                    f"committed shard (shard_logs): the shards of rank {rank} cannot be "
                    "checked. Restore the log from a copy of this store, or log the store again"
                )
            out += [Shard(*s, None) for s in mine]
            continue
        out += _check_rank(shard_dir, path, parse_log(path, rank), mine)
    return out


def _check_rank(
    shard_dir: Path, path: Path, log: LogEntries, mine: list[tuple[int, int, Path, Path]]
) -> list[Shard]:
    present = {npy.name[: -len(".npy")]: (r, i, npy, ids) for r, i, npy, ids in mine}
    fix = _FIX.format(log=path)
    logged = log.rows
    for stem, rows in logged.items():
        if stem not in present:
            lost = [f"{stem}{ext}" for ext in (".npy", ".ids.json")]
            lost = [n for n in lost if not (shard_dir / n).exists()] or lost
            raise ValueError(
                f"{shard_dir / lost[0]} is missing, but {path} records shard {stem} ({rows} "
                f"rows) as committed: the store lost {' and '.join(lost)}. {fix}"
            )
    last = max((present[s][1] for s in logged), default=-1)
    out = []
    for stem, (r, i, npy, ids) in sorted(present.items(), key=lambda kv: kv[1][1]):
        digest, content = log.begun[stem][1:] if stem in log.begun else (None, None)
        if stem in logged:
            out.append(Shard(r, i, npy, ids, logged[stem], digest, content))
        elif i > last and i == mine[-1][1] and (digest is not None or not log.begun):
            # pending: renamed, not yet logged
            out.append(Shard(r, i, npy, ids, None, digest, content))
        elif i > last and i == mine[-1][1]:
            raise ValueError(
                f"{npy}: shard {stem} is past the last one {path} records, but no commit of it "
                "began in this store (its log has no 'begin' line for it): a shard copied in "
                "from another store is not adopted. Remove its .npy and .ids.json, or log the "
                "store again"
            )
        else:
            raise ValueError(
                f"{npy}: shard {stem} is not in {path}, which lists every shard this store's "
                f"writer of rank {r} committed (a shard copied in from elsewhere?): remove its "
                ".npy and .ids.json, or log the store again"
            )
    return out


def recover_log(shard_dir: Path, rank: int, required: bool = False) -> list[str]:
    """The writer of ``rank``, holding its lock, before it writes: check the rank's shards
    against its log (:func:`committed_shards`), drop a torn last line, and log what counts but
    is not logged (a pending shard; every shard of a store written before the log). Returns the
    stems it adopted."""
    from nnstat.store.ids import read_ids

    shard_dir = Path(shard_dir)
    path = log_path(shard_dir, rank)
    mine = [s for s in committed_shards(shard_dir, required) if s.rank == rank]
    stems = [s.npy.name[: -len(".npy")] for s in mine]
    if not path.exists():  # a new rank, or a store written before the log: one atomic write
        lines = [f"{stem} {len(read_ids(s.ids))}\n" for stem, s in zip(stems, mine, strict=True)]
        files.atomic_write_bytes(path, "".join(lines).encode())
        return stems
    log = parse_log(path, rank)
    logged = log.rows
    if log.torn:  # the complete lines, begin lines included
        files.atomic_write_bytes(path, "".join(f"{line}\n" for line in log.lines).encode())
    adopted = [(stem, s) for stem, s in zip(stems, mine, strict=True) if stem not in logged]
    for stem, s in adopted:  # at most one: the pending shard
        ids = read_ids(s.ids)
        check_ids(s, ids)
        check_content(s)  # one read of the one shard a crash left unlogged
        append_commit(shard_dir, rank, stem, len(ids))
    return [stem for stem, _ in adopted]
