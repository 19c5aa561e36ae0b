"""The shard commit logs (shards/rank{r}.log): a store knows its shards and refuses one that lost
a file; a kill at each step of a commit recovers; stores written before the logs still open."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nnstat


def read_log(path):
    """``({stem: rows}, torn)`` of a commit log; ``torn``: its last line was cut short (a crash
    mid-append: that shard is not logged). A damaged line is a ``ValueError`` naming the file."""
    from nnstat.store.commits import parse_log

    entries = parse_log(path)
    return entries.rows, entries.torn


SCRIPT = r"""
import os, sys, torch
from torch import nn
import nnstat
import nnstat.store.writer as writer

root, project, crash = sys.argv[1], sys.argv[2], sys.argv[3]
commits = {"n": 0}
real_replace, real_append = os.replace, writer.append_commit


def replace(src, dst, *a, **k):  # the .npy rename of the third shard
    last = str(dst).endswith(".npy") and commits["n"] == 2
    if last and crash == "before-npy-rename":
        os._exit(9)
    real_replace(src, dst, *a, **k)
    if last and crash == "after-npy-rename":
        os._exit(9)


def append(shard_dir, rank, stem, rows):
    if commits["n"] == 2 and crash == "torn-log-line":
        with open(os.path.join(shard_dir, f"rank{rank}.log"), "ab") as f:
            f.write(f"{stem} {rows}"[:7].encode())
        os._exit(9)
    real_append(shard_dir, rank, stem, rows)
    commits["n"] += 1
    if commits["n"] == 3 and crash == "after-log-append":
        os._exit(9)


os.replace, writer.append_commit = replace, append
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
g = torch.Generator().manual_seed(1)
x, y = torch.randn(60, 6, generator=g), torch.randint(0, 3, (60,), generator=g)
run = nnstat.init(project=project, root_dir=root)
nnstat.setup({"statistic": "none", "shard_rows": 10})
nnstat.watch(model)
nnstat.add_projection(rank=4, seed=3)
for lo in range(0, 60, 10):
    with run(data_id=[f"id{i}" for i in range(lo, lo + 10)]):
        nn.functional.cross_entropy(model(x[lo:lo+10]), y[lo:lo+10], reduction="sum").backward()
nnstat.finalize()
"""


def _log(tmp_path, project, crash="none"):
    script = tmp_path / "log.py"
    script.write_text(SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path), project, crash],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _store(tmp_path, project, n=200, shard_rows=64):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    x = torch.randn(n, 5)
    run = nnstat.init(project=project, root_dir=tmp_path)
    nnstat.setup({"statistic": "none", "rank": 2, "shard_rows": shard_rows})
    nnstat.watch(model)
    try:
        for lo in range(0, n, 50):
            with run(data_id=list(range(lo, min(n, lo + 50)))):
                model(x[lo : lo + 50]).logsumexp(1).sum().backward()
        nnstat.finalize()
    finally:
        nnstat.unwatch()
    return tmp_path / project


@pytest.mark.parametrize("lost", [".ids.json", ".npy"])
def test_a_shard_that_lost_a_file_is_refused_not_dropped(tmp_path, lost):
    path = _store(tmp_path, "p")
    assert len(nnstat.GradientStore(path)) == 200
    (path / "shards" / f"rank0-00001{lost}").rename(tmp_path / "aside")
    with pytest.raises(ValueError, match=f"rank0-00001{lost} is missing"):
        nnstat.GradientStore(path)  # before: opened with 64 rows fewer, without a word
    (tmp_path / "aside").rename(path / "shards" / f"rank0-00001{lost}")
    assert read_log(path / "shards" / "rank0.log") == (
        {"rank0-00000": 64, "rank0-00001": 64, "rank0-00002": 64, "rank0-00003": 8},
        False,
    )
    (path / "shards" / f"rank0-00001{lost}").unlink()
    match = rf"rank0-00001{lost} is missing, but .*rank0.log records shard rank0-00001 \(64 rows"
    with pytest.raises(ValueError, match=match):
        nnstat.GradientStore(path)
    with pytest.raises(ValueError, match=match):  # influence opens it the same way
        nnstat.influence.compute_influence_all(path, path, progress=False)
    with pytest.raises(ValueError, match=match):  # and so does a writer resuming it
        _store(tmp_path, "p")


def test_a_lost_commit_log_and_an_unlogged_shard_are_refused(tmp_path):
    path = _store(tmp_path, "p")
    shards = path / "shards"
    for ext in (".npy", ".ids.json"):  # a shard copied in among the logged ones
        (shards / f"rank0-00009{ext}").write_bytes((shards / f"rank0-00003{ext}").read_bytes())
    (shards / "rank0-00002.npy").rename(shards / "rank0-00010.npy")
    (shards / "rank0-00002.ids.json").rename(shards / "rank0-00010.ids.json")
    with pytest.raises(ValueError, match="rank0-00002.npy is missing"):
        nnstat.GradientStore(path)
    (shards / "rank0-00010.npy").rename(shards / "rank0-00002.npy")
    (shards / "rank0-00010.ids.json").rename(shards / "rank0-00002.ids.json")
    # rank0-00009 is past the last logged shard, but no commit of it began in this store: a
    # copy from elsewhere, not a commit killed before its log line, so it is not adopted
    with pytest.raises(ValueError, match=r"rank0-00009.npy: .* no commit of it began"):
        nnstat.GradientStore(path)
    with pytest.raises(ValueError, match=r"rank0-00009.npy: .* no commit of it began"):
        _store(tmp_path, "p")  # nor by a writer resuming the store
    (shards / "rank0-00012.npy").write_bytes((shards / "rank0-00003.npy").read_bytes())
    (shards / "rank0-00012.ids.json").write_text("[1000, 1001, 1002, 1003, 1004, 1005, 6, 7]")
    with pytest.raises(ValueError, match=r"rank0-00009.npy: shard rank0-00009 is not in .*rank0"):
        nnstat.GradientStore(path)
    for ext in (".npy", ".ids.json"):
        (shards / f"rank0-00009{ext}").unlink()
        (shards / f"rank0-00012{ext}").unlink()
    (shards / "rank0.log").unlink()
    with pytest.raises(ValueError, match=r"rank0.log is missing, but meta.json says .*shard_logs"):
        nnstat.GradientStore(path)


def test_a_store_written_before_the_logs_opens_and_is_logged_when_resumed(tmp_path):
    path = _store(tmp_path, "old", n=100)
    (path / "shards" / "rank0.log").unlink()  # as nnstat wrote it before the commit logs
    meta = nnstat.store.files.read_json(path / "meta.json")
    for key in ("shard_logs", "format_revision", "store_id"):  # keys of later revisions
        del meta[key]
    nnstat.store.files.atomic_write_json(path / "meta.json", meta)
    assert len(nnstat.GradientStore(path)) == 100
    _store(tmp_path, "old", n=150)  # resumed: ids 100..149 added, the old shards adopted
    store = nnstat.GradientStore(path)
    assert sorted(store.ids) == list(range(150))
    logged, _ = read_log(path / "shards" / "rank0.log")
    assert sorted(logged) == [p.name[:-4] for p in store.shards]
    assert "shard_logs" not in store.meta  # another rank's old shards could not be vouched for


@pytest.mark.parametrize(
    "crash, kept",
    [
        ("before-npy-rename", 20),  # ids renamed, .npy not: an orphan ids file, not counted
        ("after-npy-rename", 30),  # complete, not logged yet: pending, adopted
        ("torn-log-line", 30),  # killed mid-append: the torn line is no line; adopted
        ("after-log-append", 30),
    ],
)
def test_a_kill_at_each_step_of_a_commit_recovers(tmp_path, crash, kept):
    done = _log(tmp_path, "crash", crash)
    assert done.returncode == 9, done.stderr
    store = nnstat.GradientStore(tmp_path / "crash")
    assert sorted(store.ids) == sorted(f"id{i}" for i in range(kept))
    assert [store.rows(0, len(store)).shape[0]] == [kept]  # every counted shard maps whole

    done = _log(tmp_path, "crash")  # the same pass again: resumes, recovering the log first
    assert done.returncode == 0, done.stderr
    store = nnstat.GradientStore(tmp_path / "crash")
    assert sorted(store.ids) == sorted(f"id{i}" for i in range(60))  # every id exactly once
    logged, torn = read_log(tmp_path / "crash" / "shards" / "rank0.log")
    assert not torn and list(logged) == [p.name[:-4] for p in store.shards]
    assert sum(logged.values()) == 60
    assert not [p for p in os.listdir(store.path / "shards") if p.endswith(".tmp")]

    assert _log(tmp_path, "reference").returncode == 0  # the same rows as an unbroken pass
    ref = nnstat.GradientStore(tmp_path / "reference")
    ref_rows = dict(zip(ref.ids, ref.rows(0, len(ref)), strict=True))
    for rid, row in zip(store.ids, store.rows(0, len(store)), strict=True):
        torch.testing.assert_close(row, ref_rows[rid])
    assert Path(store.path / "meta.json").exists()


def test_a_reordered_or_swapped_ids_file_is_refused_with_its_name(tmp_path):
    path = _store(tmp_path, "p")
    shards = path / "shards"
    first = shards / "rank0-00001.ids.json"
    original = first.read_text()
    ids = nnstat.store.files.read_json(first)
    nnstat.store.files.atomic_write_json(first, ids[::-1])  # same ids, other rows
    match = r"rank0-00001.ids.json: these are not the ids committed with rank0-00001.npy"
    with pytest.raises(ValueError, match=match):
        nnstat.GradientStore(path)  # before: opened, every row under another id
    with pytest.raises(ValueError, match=match):
        _store(tmp_path, "p")  # a writer resuming it reads them the same way
    first.write_text(original)
    second = shards / "rank0-00002.ids.json"
    swapped = second.read_text()
    second.write_text(original)
    first.write_text(swapped)  # two shards of 64 rows: the counts agree
    with pytest.raises(ValueError, match=r"rank0-00001.ids.json: these are not the ids"):
        nnstat.GradientStore(path)
    first.write_text(original)
    second.write_text(swapped)
    assert sorted(nnstat.GradientStore(path).ids) == list(range(200))


def test_a_shard_copied_from_another_store_is_not_adopted(tmp_path):
    path = _store(tmp_path, "p", n=100)
    other = _store(tmp_path, "other", n=300)
    for ext in (".npy", ".ids.json"):  # the next index after this store's last shard
        (path / "shards" / f"rank0-00002{ext}").write_bytes(
            (other / "shards" / f"rank0-00004{ext}").read_bytes()
        )
    with pytest.raises(ValueError, match=r"rank0-00002.npy: .* no commit of it began"):
        nnstat.GradientStore(path)  # before: adopted as a crash leftover, 100 + 44 rows


def test_a_log_line_naming_another_ranks_shard_is_a_clear_error(tmp_path):
    path = _store(tmp_path, "p", n=100)
    shards = path / "shards"
    for ext in (".npy", ".ids.json"):
        (shards / f"rank1-00000{ext}").write_bytes((shards / f"rank0-00000{ext}").read_bytes())
    with open(shards / "rank0.log", "a") as f:
        f.write("rank1-00000 64\n")
    with pytest.raises(ValueError, match=r"rank0.log: line \d+ names shard rank1-00000 of rank 1"):
        nnstat.GradientStore(path)  # before: a bare IndexError


def test_a_log_without_begin_lines_still_adopts_its_pending_shard(tmp_path):
    path = _store(tmp_path, "p", n=100)
    log = path / "shards" / "rank0.log"
    lines = [ln for ln in log.read_text().splitlines() if not ln.startswith("begin ")]
    assert lines == ["rank0-00000 64", "rank0-00001 36"]
    log.write_text(lines[0] + "\n")  # as written before begin lines, killed before the last
    meta = nnstat.store.files.read_json(path / "meta.json")
    for key in ("format_revision", "store_id"):  # a store of that time (revision 2)
        del meta[key]
    nnstat.store.files.atomic_write_json(path / "meta.json", meta)
    assert sorted(nnstat.GradientStore(path).ids) == list(range(100))
