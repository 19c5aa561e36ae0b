"""The saved K-FAC statistics must cover every row of a store: rows added by a later pass on new
data (whose statistics replace the earlier ones) make kfac/ekfac scoring refuse, while a pass
re-run over all the data (ids already stored skipped) or a store recording no coverage scores
against explicitly built K-FAC factors."""

from __future__ import annotations

import pytest
import torch
from _influence_ref import layer_grads
from torch import nn

import nnstat
from nnstat.influence import compute_influence_all
from nnstat.store import files

N, BATCH, LAM = 40, 10, 1e-2


@pytest.fixture(scope="module")
def data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(N + 4, 6), torch.randint(0, 3, (N + 4,))
    return model, (x[:N], y[:N]), (x[N:], y[N:])


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
