"""One writer per store: the lock that counts is a flock on a non-empty directory, so deleting
the lock file while writer A holds it does not let writer B in (B would remove A's temporary
shard)."""

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from nnstat.store import GradientStore, StoreLockedError, StoreWriteError
from nnstat.store.files import atomic_write_json
from nnstat.store.writer import StoreWriter

SECOND = r"""
import sys
from nnstat.store import StoreLockedError
from nnstat.store.writer import StoreWriter
try:
    StoreWriter(sys.argv[1], 3).close()
    print("second writer got in")
except StoreLockedError as e:
    print("refused:", e)
"""


def _meta(path):
    atomic_write_json(
        path / "meta.json",
        {
            "format_version": 1,
            "row_width": 3,
            "dtype": "float32",
            "modules": [{"name": "fc", "offset": 0, "width": 3, "r_out": 1, "r_in": 3}],
        },
    )


def _wait_for_tmp(shards):
    deadline = time.time() + 30
    while not list(shards.glob("*.npy.tmp")):
        assert time.time() < deadline
        time.sleep(0.01)


def test_deleting_the_lock_file_does_not_let_a_second_writer_in(tmp_path):
    _meta(tmp_path)
    shards = tmp_path / "shards"
    a = StoreWriter(shards, 3, shard_rows=100)
    a.put(list(range(10)), torch.ones(10, 3))
    _wait_for_tmp(shards)
    os.remove(shards / "rank0.lock")  # a clean-up of *.lock files, an rm by hand
    for remove in (os.remove, os.rmdir):  # the directory lock cannot go by accident
        with pytest.raises(OSError):
            remove(shards / "rank0.lock.d")
    script = tmp_path / "second.py"
    script.write_text(SECOND)
    done = subprocess.run(
        [sys.executable, str(script), str(shards)], capture_output=True, text=True, timeout=120
    )
    assert (
        f"refused: {shards / 'rank0.lock'}: another process (pid {os.getpid()})" in done.stdout
    ), (done.stdout + done.stderr)
    assert list(shards.glob("*.npy.tmp"))  # A's temporary shard was left alone
    a.put(list(range(10, 20)), torch.ones(10, 3))
    assert a.close() == 20  # before: FileNotFoundError, B had removed A's file
    assert sorted(GradientStore(tmp_path).ids) == list(range(20))


def test_a_writer_whose_lock_directory_was_removed_stops(tmp_path):
    _meta(tmp_path)
    shards = tmp_path / "shards"
    a = StoreWriter(shards, 3, shard_rows=5)
    a.put(list(range(5)), torch.ones(5, 3))  # one whole shard
    deadline = time.time() + 30
    while not list(shards.glob("*.npy")):
        assert time.time() < deadline
        time.sleep(0.01)
    shutil.rmtree(shards / "rank0.lock.d")  # on purpose: rm -r
    a.put(list(range(5, 10)), torch.ones(5, 3))
    with pytest.raises(StoreWriteError) as info:
        a.close()
    assert isinstance(info.value.__cause__, StoreLockedError)
    assert "rank0.lock.d was removed while this writer held it" in str(info.value.__cause__)


def test_a_filesystem_whose_flock_locks_nothing_is_detected(tmp_path, monkeypatch):
    import fcntl

    from nnstat.store.lock import WriterLock

    monkeypatch.setattr(fcntl, "flock", lambda fd, op: None)  # accepted, enforced nowhere
    with pytest.warns(UserWarning, match="accepts file locks but does not enforce them"):
        lock = WriterLock(tmp_path, 0)  # before: "held", and a second writer got in as well
    assert not lock.held
    lock.release()


FORKED = r"""
import os, sys, time
from nnstat.store.lock import WriterLock
lock = WriterLock(__import__("pathlib").Path(sys.argv[1]), 0)
assert lock.held
if os.fork() == 0:  # a worker forked while the writer holds the lock, outliving it
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 1), os.dup2(null, 2)  # the test does not wait for its output
    time.sleep(10)
    os._exit(0)
print("parent done", flush=True)
os._exit(0)
"""


def test_a_forked_child_does_not_keep_a_dead_writers_lock(tmp_path):
    from nnstat.store.lock import WriterLock

    script = tmp_path / "fork.py"
    script.write_text(FORKED)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert "parent done" in done.stdout, done.stderr
    lock = WriterLock(tmp_path, 0)  # before: refused, naming the dead parent's pid
    assert lock.held
    lock.release()
