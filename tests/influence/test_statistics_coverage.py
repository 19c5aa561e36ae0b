"""The saved K-FAC statistics must cover every row of a store: rows added by a later pass on new
data (whose statistics replace the earlier ones) make kfac/ekfac scoring refuse, while a pass
re-run over all the data (ids already stored skipped) or a store recording no coverage scores
against explicitly built K-FAC factors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist import spawn
from _influence_ref import layer_grads
from torch import nn

import nnstat
from nnstat.influence import compute_influence_all
from nnstat.store import files

N, BATCH, LAM = 40, 10, 1e-2


def _data():
    """The model, N training samples and 4 queries (the same in every process)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(N + 4, 6), torch.randint(0, 3, (N + 4,))
    return model, (x[:N], y[:N]), (x[N:], y[N:])


@pytest.fixture(scope="module")
def data():
    return _data()


def _loss(model, x, y):
    return nn.functional.cross_entropy(model(x), y, reduction="sum")


def _log(root, project, model, train, lo, hi, statistic="kfac"):
    """One logging run (every pass of ``statistic``) over the training ids ``lo..hi``."""
    run = nnstat.init(project=project, root_dir=root)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": statistic})
    nnstat.watch(model)
    x, y = train
    for _ in run.schedule():
        for s in range(lo, hi, BATCH):
            with run(data_id=list(range(s, s + BATCH))):
                _loss(model, x[s : s + BATCH], y[s : s + BATCH]).backward()
            model.zero_grad()
    nnstat.unwatch()
    return root / project


def _query_log(root, model, query):
    run = nnstat.init(project="queries", root_dir=root)
    nnstat.setup({"log": "grad"})
    nnstat.watch(model)
    nnstat.eval()
    with run(data_id=["q0", "q1", "q2", "q3"]):
        _loss(model, *query).backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return log


def _kfac_reference(model, train, query, rows):
    """Scores of every training row with K-FAC factors built from ``train[rows]`` (float64)."""
    gt = {k: v.double() for k, v in layer_grads(model, *train).items()}
    gq = {k: v.double() for k, v in layer_grads(model, *query).items()}
    x, y = train[0][rows], train[1][rows]
    z0 = model[0](x).detach().requires_grad_(True)
    h = torch.relu(z0)
    z2 = model[2](h)
    # row i of each output gradient is sample i's (the summed loss)
    b0, b2 = torch.autograd.grad(nn.functional.cross_entropy(z2, y, reduction="sum"), [z0, z2])
    ones = torch.ones(len(x), 1)
    total = torch.zeros(len(query[0]), len(train[0]), dtype=torch.float64)
    for name, a, b in (("0", torch.cat([x, ones], 1), b0), ("2", torch.cat([h, ones], 1), b2)):
        a, b = a.detach().double(), b.double()
        kron = torch.kron(b.T @ b / len(x), a.T @ a / len(x))
        damped = kron + LAM * torch.eye(len(kron), dtype=kron.dtype)
        total += gq[name].flatten(1) @ torch.linalg.solve(damped, gt[name].flatten(1).T)
    return total


def _check(scores, expected):
    torch.testing.assert_close(
        scores.double(), expected, rtol=2e-3, atol=1e-3 * expected.abs().max().item()
    )


@pytest.mark.parametrize("statistic", ["kfac", "ekfac"])
def test_rows_added_on_new_data_refuse_kfac_scoring(tmp_path, data, statistic):
    model, train, query = data
    _log(tmp_path, "store", model, train, 0, N // 2, statistic)
    path = _log(tmp_path, "store", model, train, N // 2, N, statistic)
    log = _query_log(tmp_path, model, query)
    with pytest.raises(ValueError, match=r"cover 20 of the store's 40 rows") as err:
        compute_influence_all(log, path, preconditioner=statistic, damping=LAM, progress=False)
    assert str(path) in str(err.value) and 'preconditioner="raw"' in str(err.value)
    # raw fits on the rows themselves: unaffected
    raw = compute_influence_all(log, path, preconditioner="raw", damping=LAM, progress=False)
    assert raw.train_ids == list(range(N))


def test_pass_rerun_over_all_data_scores_with_full_statistics(tmp_path, data):
    model, train, query = data
    _log(tmp_path, "store", model, train, 0, N // 2)  # e.g. the part of a pass that was stored
    path = _log(tmp_path, "store", model, train, 0, N)  # ids 0..19 skipped, statistics see all
    log = _query_log(tmp_path, model, query)
    res = compute_influence_all(log, path, preconditioner="kfac", damping=LAM, progress=False)
    assert res.train_ids == list(range(N))
    _check(res.scores, _kfac_reference(model, train, query, slice(0, N)))


def test_store_recording_no_coverage_scores_as_before(tmp_path, data):
    model, train, query = data
    _log(tmp_path, "store", model, train, 0, N // 2)
    path = _log(tmp_path, "store", model, train, N // 2, N)
    meta = files.read_json(path / "meta.json")
    del meta["statistics_coverage"]  # a store written before coverage was recorded
    files.atomic_write_json(path / "meta.json", meta)
    log = _query_log(tmp_path, model, query)
    res = compute_influence_all(log, path, preconditioner="kfac", damping=LAM, progress=False)
    # the statistics of the last pass only, as such a store always held
    _check(res.scores, _kfac_reference(model, train, query, slice(N // 2, N)))


def _statistics_pass(root, model, train, lo, hi, ids=True, statistic="kfac"):
    """A statistics pass that stores no rows (``save=None``) over the samples ``lo..hi``,
    given their ids, or none (``ids=False``: numbered 0, 1, ... as rows stored without ids)."""
    run = nnstat.init(project="store", root_dir=root)
    nnstat.setup({"log": "grad", "save": None, "statistic": statistic})
    nnstat.watch(model)
    x, y = train
    for _ in run.schedule():
        for s in range(lo, hi, BATCH):
            with run(data_id=list(range(s, s + BATCH)) if ids else None):
                _loss(model, x[s : s + BATCH], y[s : s + BATCH]).backward()
            model.zero_grad()
    nnstat.unwatch()


@pytest.mark.parametrize("ids", [True, False], ids=["data_id", "no data_id"])
def test_a_statistics_pass_storing_no_rows_records_what_it_covers(tmp_path, data, ids):
    model, train, query = data
    path = _log(tmp_path, "store", model, train, 0, N)
    log = _query_log(tmp_path, model, query)
    _statistics_pass(tmp_path, model, train, 0, N // 2, ids)  # its statistics replace the store's
    with pytest.raises(ValueError, match=r"cover 20 of the store's 40 rows"):
        compute_influence_all(log, path, preconditioner="kfac", damping=LAM, progress=False)
    _statistics_pass(tmp_path, model, train, 0, N, ids)  # again over every row
    res = compute_influence_all(log, path, preconditioner="kfac", damping=LAM, progress=False)
    _check(res.scores, _kfac_reference(model, train, query, slice(0, N)))


def test_ekfac_statistics_cover_the_ids_both_passes_saw(tmp_path, data):
    # the eigenvalues pass sees every row, the factors pass (its eigenbases) only half of them
    model, train, query = data
    run = nnstat.init(project="store", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "ekfac"})
    nnstat.watch(model)
    x, y = train
    for spec in run.schedule():
        for s in range(0, N // 2 if spec.name == "factors" else N, BATCH):
            with run(data_id=list(range(s, s + BATCH))):
                _loss(model, x[s : s + BATCH], y[s : s + BATCH]).backward()
            model.zero_grad()
    nnstat.unwatch()
    log = _query_log(tmp_path, model, query)
    for kind in ("kfac", "ekfac"):
        with pytest.raises(ValueError, match=r"cover 20 of the store's 40 rows"):
            compute_influence_all(log, run.path, preconditioner=kind, damping=LAM, progress=False)


def _ranks_log(rank, root, lo, hi):
    """Rank ``rank`` of two logs its half of the ids ``lo..hi`` (K-FAC all-reduced)."""
    model, train, _ = _data()
    half = (hi - lo) // 2
    _log(Path(root), "store", model, train, lo + rank * half, lo + (rank + 1) * half)


def test_coverage_under_torch_distributed_counts_every_ranks_rows(tmp_path, data):
    model, train, query = data
    spawn(_ranks_log, str(tmp_path), 0, N // 2)
    path = tmp_path / "store"
    meta = files.read_json(path / "meta.json")
    assert {k: meta["statistics_coverage"][k] for k in ("rows", "of")} == {"rows": 20, "of": 20}
    log = _query_log(tmp_path, model, query)
    res = compute_influence_all(log, path, preconditioner="kfac", damping=LAM, progress=False)
    half = (train[0][: N // 2], train[1][: N // 2])
    _check(res.scores, _kfac_reference(model, half, query, slice(0, N // 2)))
    spawn(_ranks_log, str(tmp_path), N // 2, N)  # new rows, whose statistics replace the first
    with pytest.raises(ValueError, match=r"cover 20 of the store's 40 rows"):
        compute_influence_all(log, path, preconditioner="kfac", damping=LAM, progress=False)


def test_a_store_loaded_in_memory_is_refused_as_the_store_is(tmp_path, data):
    model, train, query = data
    _log(tmp_path, "store", model, train, 0, N // 2)
    path = _log(tmp_path, "store", model, train, N // 2, N)
    log = _query_log(tmp_path, model, query)
    loaded = nnstat.GradientStore(path).load()
    for kind in ("kfac", "ekfac", None):  # None: the default, ekfac here
        with pytest.raises(ValueError, match=r"GradientLog.*cover 20 of the store's 40 rows"):
            compute_influence_all(log, loaded, preconditioner=kind, damping=LAM, progress=False)
    raw = compute_influence_all(log, loaded, preconditioner="raw", damping=LAM, progress=False)
    assert raw.train_ids == list(range(N))


UNFINALIZED = r"""
import sys, torch, nnstat
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
x, y = torch.randn(44, 6), torch.randint(0, 3, (44,))
run = nnstat.init(project="store", root_dir=sys.argv[1])
nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac"})
nnstat.watch(model)
for s in range(0, 40, 10):
    with run(data_id=list(range(s, s + 10))):
        nn.functional.cross_entropy(model(x[s : s + 10]), y[s : s + 10], reduction="sum").backward()
    model.zero_grad()
# the script ends (an exception, SIGTERM, Ctrl-C) before finalize(): rows flushed, no statistics
"""


def test_a_store_whose_statistics_pass_never_finished_refuses_kfac_and_the_default(tmp_path, data):
    model, train, query = data
    script = tmp_path / "log.py"
    script.write_text(UNFINALIZED)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True)
    assert proc.returncode == 0, proc.stderr.decode()
    path = tmp_path / "store"
    assert len(nnstat.GradientStore(path)) == N and not (path / files.STATISTICS_FILE).exists()
    log = _query_log(tmp_path, model, query)
    for preconditioner in (None, "kfac", "ekfac"):  # None: the default, which was raw
        with pytest.raises(ValueError, match="none were saved") as err:
            compute_influence_all(log, path, preconditioner=preconditioner, progress=False)
        assert str(path) in str(err.value) and "Run the pass again" in str(err.value)
    raw = compute_influence_all(log, path, preconditioner="raw", damping=LAM, progress=False)
    assert raw.meta["preconditioner"] == "raw"
    path = _log(tmp_path, "store", model, train, 0, N)  # the fix: ids skipped, statistics saved
    res = compute_influence_all(log, path, damping=LAM, preconditioner="kfac", progress=False)
    _check(res.scores, _kfac_reference(model, train, query, slice(0, N)))
