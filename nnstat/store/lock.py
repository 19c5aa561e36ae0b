"""The writer lock of a gradient store's rank: one writer per rank, refused with the holder named.

Example:
    >>> import tempfile; d = Path(tempfile.mkdtemp())
    >>> lock = WriterLock(d, 0); lock.held, lock_path(d, 0).name
    (True, 'rank0.lock')
    >>> lock.release()
"""

from __future__ import annotations

import errno
import os
import warnings
import weakref
from pathlib import Path

from nnstat.store.errors import StoreLockedError

# errno values of a filesystem that cannot lock at all (as opposed to a lock that is held)
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def lock_path(shard_dir: Path, rank: int) -> Path:
    """The lock file of ``rank``'s writer in ``shard_dir`` (``rank{r}.lock``; never a shard)."""
    return Path(shard_dir) / f"rank{rank}.lock"


def lock_dir(shard_dir: Path, rank: int) -> Path:
    """The lock directory of ``rank``'s writer (``rank{r}.lock.d``, holding the holder's pid)."""
    return Path(shard_dir) / f"rank{rank}.lock.d"


class WriterLock:
    """An exclusive ``fcntl.flock`` held for a writer's life on ``shards/rank{r}.lock.d``, a
    directory (never empty: it holds the holder's ``pid``), and on ``shards/rank{r}.lock``.

    Two writers of one rank would interleave shard indices and delete each other's temporary
    files (each cleans its rank's leftovers on open), so the second is refused. The kernel
    drops the lock when the holder's process dies (SIGKILL included): a crash never leaves a
    stale lock, and the next writer takes it. A lock on a file is lost when the file is
    deleted (the next writer locks a new file of that name), so the lock that counts is the
    directory's: a non-empty directory cannot be removed by ``rm``, ``unlink`` or ``rmdir``.
    After locking, the locked directory is checked to still be the one at that path (else it
    was replaced meanwhile: locked again); :meth:`check` tells the holder whether it still is.
    The file lock keeps out writers of nnstat versions that lock only the file. Platforms
    without ``fcntl`` (Windows) do not lock.

    Args:
        shard_dir: directory of the shards (must exist).
        rank: the rank whose shards the holder writes.
    """

    def __init__(self, shard_dir: Path, rank: int) -> None:
        self.path = lock_path(shard_dir, rank)
        self.dir = lock_dir(shard_dir, rank)
        self._fd: int | None = None
        self._file_fd: int | None = None
        self._where = (rank, Path(shard_dir).parent)
        try:
            import fcntl  # noqa: F401
        except ImportError:  # not POSIX: no advisory locks to take
            return
        for _ in range(100):  # the directory replaced between open and flock: lock the new one
            self.dir.mkdir(exist_ok=True)
            os.close(os.open(self.dir / "pid", os.O_WRONLY | os.O_CREAT, 0o644))  # never empty
            fd = self._lock(os.open(self.dir, os.O_RDONLY), self.dir / "pid")
            if fd is None:
                return  # no locks on this filesystem (warned)
            if self._same(fd):
                break
            os.close(fd)
        else:
            raise StoreLockedError(f"{self.dir}: replaced again and again while being locked")
        try:
            self._file_fd = self._lock(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), self.path)
            with open(self.dir / "pid", "w") as f:
                f.write(f"{os.getpid()}\n")
            if self._file_fd is not None:
                os.ftruncate(self._file_fd, 0)
                os.pwrite(self._file_fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def _same(self, fd: int) -> bool:
        try:
            st = os.stat(self.dir)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev)

    def _lock(self, fd: int, pid_file: Path) -> int | None:
        """``fd`` locked (exclusive, non-blocking); ``None`` where the filesystem cannot lock."""
        import fcntl

        rank, store = self._where
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            try:
                holder = pid_file.read_text(errors="replace").strip() or "unknown"
            except OSError:
                holder = "unknown"
            same = holder == str(os.getpid())
            who = (
                "an earlier logging pass of this process that was not finalize()d"
                if same
                else f"another process (pid {holder})"
            )
            if not same and not _alive(holder):
                who = (
                    f"a process started by pid {holder} (no longer running) that still holds "
                    "its lock (a child forked without Python's fork hooks; find it with "
                    f"`fuser {self.path}` and end it)"
                )
            raise StoreLockedError(
                f"{self.path}: {who} is writing rank {rank} of the gradient store "
                f"{store}; two writers of one rank would corrupt its shards. "
                + (
                    "Call finalize() on that run first."
                    if same
                    else "Wait until it has finished, or log into another project."
                )
            ) from None
        except OSError as e:
            os.close(fd)
            if e.errno not in _NO_LOCKS:
                raise
            # a filesystem without flock (some FUSE/network mounts): writing stays possible,
            # and the user learns that a second writer would not be refused there
            warnings.warn(
                f"{self.path}: this filesystem does not support file locks ({e.strerror}); a "
                "second writer of the same rank would not be refused",
                stacklevel=4,
            )
            return None
        except BaseException:
            os.close(fd)
            raise
        if _second_lock_succeeds(pid_file.parent if pid_file.name == "pid" else pid_file):
            os.close(fd)
            warnings.warn(
                f"{self.path}: this filesystem accepts file locks but does not enforce them (a "
                "second lock from another descriptor succeeded): a second writer of the same "
                "rank would not be refused, and two would delete each other's files. Write "
                "the store on a local filesystem, or make sure only one process logs each rank",
                stacklevel=4,
            )
            return None
        _LIVE.add(self)
        return fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def check(self) -> None:
        """Raise :class:`StoreLockedError` when the locked directory is no longer the one at its
        path (someone removed it with ``rm -r``): another writer could be in, so this one must
        not create or remove files."""
        if self._fd is not None and not self._same(self._fd):
            raise StoreLockedError(
                f"{self.dir} was removed while this writer held it: another writer of rank "
                f"{self._where[0]} may be writing {self._where[1]}; this writer stopped. Never "
                "remove a lock directory of a running writer"
            )

    def release(self) -> None:
        """Unlock (closing the descriptors drops the flocks); idempotent."""
        fd, self._fd = self._fd, None
        file_fd, self._file_fd = self._file_fd, None
        for d in (file_fd, fd):
            if d is not None:
                os.close(d)


def _alive(pid: str) -> bool:
    """Whether process ``pid`` (a pid file's text) runs; ``True`` when it cannot be told."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, OverflowError):
        return True
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it runs, as another user
        return True
    return True


def _second_lock_succeeds(path: Path) -> bool:
    """A lock held on one descriptor must refuse another's: where it does not, flock is a no-op
    (some FUSE and network filesystems accept it and lock nothing)."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


# the locks this process holds: a forked child closes its copies of their descriptors, so the
# lock goes when its holder ends (a flock lasts while any descriptor of it is open: a DataLoader
# worker forked mid-pass would otherwise keep the store locked after the writer's death)
_LIVE: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    for lock in list(_LIVE):
        for fd in (lock._fd, lock._file_fd):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        lock._fd = lock._file_fd = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)
