"""End to end: a real run writes a store, influence reads it (loader, store, path, CLI), checked
against torch.func per-sample gradients and explicitly built K-FAC factors."""

from __future__ import annotations

from contextlib import nullcontext

import pandas as pd
import pytest
import torch
from _influence_ref import layer_grads
from torch import nn

import nnstat
from nnstat.influence import as_source, compute_influence_all, compute_self_influence
from nnstat.influence.cache import fitted
from nnstat.influence.cli import main as cli_main
from nnstat.store import GradientStore

N_TRAIN, BATCH = 40, 10


def _model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    x, y = torch.randn(N_TRAIN + 4, 6), torch.randint(0, 3, (N_TRAIN + 4,))
    return model, (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


def _log_run(tmp_path, project, model, train, query, rank=None, seed=0):
    run = nnstat.init(project=project, root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac"})
    nnstat.watch(model)
    if rank is not None:
        nnstat.add_projection(rank=rank, init="random", seed=seed)
    x, y = train
    for start in range(0, N_TRAIN, BATCH):
        with run(data_id=list(range(start, start + BATCH))):
            loss = nn.functional.cross_entropy(
                model(x[start : start + BATCH]), y[start : start + BATCH], reduction="sum"
            )
            loss.backward()
        model.zero_grad()
    nnstat.finalize()
    nnstat.eval()
    loader = nnstat.build_log_dataloader(batch_size=16)
    with run(data_id=["q0", "q1", "q2", "q3"]):
        nn.functional.cross_entropy(model(query[0]), query[1], reduction="sum").backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return loader, log, tmp_path / project


def _grads(model, data):
    """{layer: [n, d_out, d_in + 1]} float64 per-sample gradients (torch.func reference)."""
    return {k: v.double() for k, v in layer_grads(model, *data).items()}


def _kfac_factors(model, x, y):
    """{layer: (S, A)} for the mean loss, built from layer inputs and output gradients."""
    z0 = model[0](x).detach().requires_grad_(True)
    h = torch.relu(z0)
    z2 = model[2](h)
    loss = nn.functional.cross_entropy(z2, y, reduction="sum")  # row i = grad of sample i's loss
    b0, b2 = torch.autograd.grad(loss, [z0, z2])
    ones = torch.ones(len(x), 1)
    out = {}
    for name, a, b in (("0", torch.cat([x, ones], 1), b0), ("2", torch.cat([h, ones], 1), b2)):
        a, b = a.detach().double(), b.double()
        out[name] = (b.T @ b / len(x), a.T @ a / len(x))
    return out


def _project(g, projections, name):
    p_out = projections.get(f"{name}/p_out")
    p_in = projections.get(f"{name}/p_in")
    if p_out is not None:
        g = p_out.double() @ g
    if p_in is not None:
        g = g @ p_in.double().T
    return g


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    model, train, query = _model_and_data()
    tmp = tmp_path_factory.mktemp("influence_store")
    loader, log, path = _log_run(tmp, "plain", model, train, query)
    return model, train, query, loader, log, path


def _explicit(model, train, query, projections, lam, kind):
    gt, gq = _grads(model, train), _grads(model, query)
    factors = _kfac_factors(model, *train)
    total = torch.zeros(len(query[0]), len(train[0]), dtype=torch.float64)
    for name in ("0", "2"):
        t = _project(gt[name], projections, name).flatten(1)
        q = _project(gq[name], projections, name).flatten(1)
        if kind == "raw":
            h = t.T @ t / len(t)
        else:
            s, a = factors[name]
            p_out = projections.get(f"{name}/p_out")
            p_in = projections.get(f"{name}/p_in")
            s = s if p_out is None else p_out.double() @ s @ p_out.double().T
            a = a if p_in is None else p_in.double() @ a @ p_in.double().T
            h = torch.kron(s, a)
        total += q @ torch.linalg.solve(h + lam * torch.eye(len(h), dtype=h.dtype), t.T)
    return total


def test_store_raw_scores_match_torch_func_fisher(logged):
    model, train, query, loader, log, path = logged
    res = compute_influence_all(log, loader, preconditioner="raw", damping=1e-2, progress=False)
    expected = _explicit(model, train, query, {}, 1e-2, "raw")
    torch.testing.assert_close(
        res.scores.double(), expected, rtol=2e-3, atol=1e-3 * expected.abs().max().item()
    )
    assert res.test_ids == ["q0", "q1", "q2", "q3"] and res.train_ids == list(range(N_TRAIN))
    # a GradientStore and a path give the same scores
    for train_side in (GradientStore(path), path, str(path)):
        other = compute_influence_all(
            log, train_side, preconditioner="raw", damping=1e-2, progress=False
        )
        torch.testing.assert_close(other.scores, res.scores)


def test_store_kfac_matches_explicit_factors(logged):
    model, train, query, loader, log, _ = logged
    res = compute_influence_all(log, loader, preconditioner="kfac", damping=1e-2, progress=False)
    expected = _explicit(model, train, query, {}, 1e-2, "kfac")
    torch.testing.assert_close(
        res.scores.double(), expected, rtol=2e-3, atol=1e-3 * expected.abs().max().item()
    )


def test_projected_store_kfac_and_raw_in_projected_space(tmp_path):
    model, train, query = _model_and_data()
    loader, log, path = _log_run(tmp_path, "proj", model, train, query, rank=4)
    projections = GradientStore(path).projections()
    assert projections, "the projected run should save its projection matrices"
    for kind in ("raw", "kfac"):
        res = compute_influence_all(log, loader, preconditioner=kind, damping=1e-2, progress=False)
        expected = _explicit(model, train, query, projections, 1e-2, kind)
        torch.testing.assert_close(
            res.scores.double(), expected, rtol=2e-3, atol=1e-3 * expected.abs().max().item()
        )
    # a query made with another projection seed is refused with what differs
    other_loader, other_log, _ = _log_run(tmp_path, "proj_seed1", model, train, query, 4, seed=1)
    with pytest.raises(ValueError, match="projection"):
        compute_influence_all(other_log, loader, progress=False)


def test_self_influence_of_query_log_and_of_training_store(logged):
    _, _, _, loader, log, _ = logged
    pairs = compute_influence_all(log, loader, preconditioner="kfac", damping=0.1, progress=False)
    assert pairs.meta["preconditioner"] == "kfac"
    self_q = compute_self_influence(log, damping=0.1, progress=False)
    # a query log carries the training statistics: its default curvature is K-FAC from them
    assert self_q.meta["preconditioner"] == "kfac" and self_q.ids == log.ids
    explicit = compute_influence_all(log, log, preconditioner="kfac", damping=0.1, progress=False)
    torch.testing.assert_close(self_q.scores, torch.diagonal(explicit.scores), rtol=1e-4, atol=1e-6)
    self_t = compute_self_influence(loader, preconditioner="raw", damping=0.1, progress=False)
    full = compute_influence_all(loader, loader, preconditioner="raw", damping=0.1, progress=False)
    torch.testing.assert_close(self_t.scores, torch.diagonal(full.scores), rtol=1e-4, atol=1e-6)


def test_cli_writes_top_k_and_full_tables(logged, tmp_path, capsys):
    _, _, _, loader, _, path = logged
    out = tmp_path / "scores.parquet"
    code = cli_main(
        [
            str(path),
            "--query",
            str(path),
            "--top-k",
            "3",
            "--out",
            str(out),
            "--preconditioner",
            "raw",
            "--damping",
            "0.1",
        ]
    )
    assert code == 0
    frame = pd.read_parquet(out)
    api = compute_influence_all(
        path, path, preconditioner="raw", damping=0.1, top_k=3, progress=False
    )
    assert len(frame) == N_TRAIN * 3 * 2
    helpful = frame[(frame["kind"] == "helpful") & (frame["test_id"] == 5)].sort_values("rank")
    assert helpful["train_id"].tolist() == api.helpful_ids[5]
    out_csv = tmp_path / "all.csv"
    assert cli_main([str(path), "--query", str(path), "--out", str(out_csv)]) == 0
    assert len(pd.read_csv(out_csv)) == N_TRAIN * N_TRAIN
    assert cli_main([str(path), "--self", "--out", str(tmp_path / "self.csv")]) == 0
    assert cli_main([str(tmp_path / "missing"), "--query", str(path)]) == 2
    assert "no gradient store" in capsys.readouterr().err


class _WithUnused(nn.Sequential):
    """The Sequential plus a watched Linear that never takes part in the forward."""

    def __init__(self, model):
        super().__init__(*model)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self[2](self[1](self[0](x)))


@pytest.mark.parametrize("unused", [False, True], ids=["all_used", "unused_module"])
def test_stored_ekfac_statistics_are_used_and_match_explicit(tmp_path, unused):
    """A watched module that got no gradient (its rows are zeros, no statistics) is fitted
    from its rows with a warning; the other modules keep their EK-FAC factors."""
    model, train, query = _model_and_data()
    if unused:
        model = _WithUnused(model)
    run = nnstat.init(project="ekfac", root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "ekfac"})
    nnstat.watch(model)
    x, y = train
    for _ in run.schedule():  # factors, then eigenvalues + rows
        for start in range(0, N_TRAIN, BATCH):
            with run(data_id=list(range(start, start + BATCH))):
                sl = slice(start, start + BATCH)
                nn.functional.cross_entropy(model(x[sl]), y[sl], reduction="sum").backward()
            model.zero_grad()
    nnstat.eval()
    loader = nnstat.build_log_dataloader(batch_size=16)
    with run(data_id=["q0", "q1", "q2", "q3"]):
        nn.functional.cross_entropy(model(query[0]), query[1], reduction="sum").backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    origin = {"0": "statistics", "2": "statistics"} | ({"unused": "rows"} if unused else {})
    with (
        pytest.warns(RuntimeWarning, match=r"\['unused'\] have no K-FAC")
        if unused
        else nullcontext()
    ):
        res = compute_influence_all(log, loader, damping=1e-2, progress=False)  # default: ekfac
    assert res.meta["preconditioner"] == "ekfac"
    assert fitted(as_source(loader), "ekfac").origin == origin
    gt, gq = _grads(model, train), _grads(model, query)
    factors = _kfac_factors(model, *train)
    expected = torch.zeros(4, N_TRAIN, dtype=torch.float64)
    for name in ("0", "2"):
        s, a = factors[name]
        basis = torch.kron(torch.linalg.eigh(s)[1], torch.linalg.eigh(a)[1])
        t, q = gt[name].flatten(1), gq[name].flatten(1)
        corrected = torch.diagonal(basis.T @ (t.T @ t / len(t)) @ basis)
        h = basis @ torch.diag(corrected) @ basis.T
        expected += q @ torch.linalg.solve(h + 1e-2 * torch.eye(len(h), dtype=h.dtype), t.T)
    torch.testing.assert_close(
        res.scores.double(), expected, rtol=2e-3, atol=1e-3 * expected.abs().max().item()
    )


def test_cli_reports_a_damaged_store_in_one_error_line(logged, tmp_path, capsys):
    import shutil

    path = logged[-1]
    damaged = tmp_path / "damaged"
    shutil.copytree(path, damaged)
    (damaged / "meta.json").write_text("{cut short")
    capsys.readouterr()
    assert cli_main([str(damaged), "--self"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nnstat influence: error: ")
    assert f"{damaged / 'meta.json'}: not valid JSON" in err[0] and "restore it" in err[0]
    assert cli_main([str(path), "--query", str(damaged)]) == 1
    assert "meta.json: not valid JSON" in capsys.readouterr().err
