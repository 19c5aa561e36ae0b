"""K-FAC factors over ``max_factor_dim``: diagonal without a projection, logged space with one.

References are independent of nnstat's capture: per-sample layer inputs, output gradients and
parameter gradients come from ``torch.func``; the dense covariances, their diagonals, the
K-FAC/EK-FAC curvature and the influence scores are built by numpy (``np.kron`` of the
factors, a dense damped inverse). A tiny two-layer network with a lowered limit makes one
factor of each side fall back; a GPT-2 of width 32 runs the README's logging workflow with
its ``lm_head`` over the limit.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import nnstat
from nnstat.curvature import StatisticsCollector
from nnstat.curvature import operations as ops
from nnstat.influence import TensorSource, as_source, compute_influence_all
from nnstat.store.files import load_safetensors
from nnstat.store.integrity import tensors_hash

N, T, D_IN, HID, C = 12, 3, 5, 7, 3
LIMIT = 6  # "0"/backward (7) and "2"/forward (8 with the bias) are over it, the others not
DAMPING = 0.05


def _problem(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D_IN, HID), nn.Tanh(), nn.Linear(HID, C))
    x, y = torch.randn(N + 3, T, D_IN), torch.randint(0, C, (N + 3, T))
    return model, (x[:N], y[:N]), (x[N:], y[N:])


def _loss(out, y):  # each sample's own loss, summed over its positions and the batch
    return F.cross_entropy(out.reshape(-1, C), y.reshape(-1), reduction="sum")


def _reference(model, x, y):
    """torch.func per-sample quantities (float64 numpy): inputs ``a`` with the ones column,
    output gradients ``b`` and gradients ``G = Σ_t b aᵀ`` of both layers."""
    w0, b0 = model[0].weight.detach(), model[0].bias.detach()
    w2, b2 = model[2].weight.detach(), model[2].bias.detach()

    def head(z0, yi):  # z0 [T, HID] -> the sample's loss
        return _loss(torch.tanh(z0) @ w2.T + b2, yi)

    z0 = x @ w0.T + b0
    h = torch.tanh(z0)
    g0 = vmap(grad(head))(z0, y)  # [N, T, HID]
    g2 = vmap(grad(lambda z2, yi: _loss(z2, yi)))(h @ w2.T + b2, y)  # [N, T, C]
    params = {k: v.detach() for k, v in model.named_parameters()}
    pg = vmap(
        grad(lambda p, xi, yi: _loss(functional_call(model, p, (xi[None],)), yi[None])),
        in_dims=(None, 0, 0),
    )(params, x, y)
    ones = torch.ones(len(x), T, 1)
    out = {}
    for name, a, b in (("0", torch.cat([x, ones], -1), g0), ("2", torch.cat([h, ones], -1), g2)):
        g = torch.cat([pg[f"{name}.weight"], pg[f"{name}.bias"][..., None]], -1)
        out[name] = {"a": a.double().numpy(), "b": b.double().numpy(), "g": g.double().numpy()}
    return out


def _dense_factors(ref):
    """``A = Σ a aᵀ / #positions``, ``S = Σ_i Σ_t b bᵀ / N`` per layer, by numpy."""
    out = {}
    for name, r in ref.items():
        a, b = r["a"].reshape(-1, r["a"].shape[-1]), r["b"].reshape(-1, r["b"].shape[-1])
        out[name] = (a.T @ a / len(a), b.T @ b / len(r["b"]))
    return out


def _log(tmp_path, model, train, query, statistic="kfac", rank=None, limit=LIMIT, project="p"):
    run = nnstat.init(project=project, root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": statistic, "max_factor_dim": limit})
    nnstat.watch(model)
    nnstat.add_projection(rank=rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in run.schedule():
            for lo in range(0, N, 4):
                with run(data_id=list(range(lo, lo + 4))):
                    _loss(model(train[0][lo : lo + 4]), train[1][lo : lo + 4]).backward()
                model.zero_grad()
    nnstat.eval()
    with run(data_id=["q0", "q1", "q2"]):
        _loss(model(query[0]), query[1]).backward()
    model.zero_grad()
    log = nnstat.get_log()
    loader = nnstat.build_log_dataloader(batch_size=5)
    nnstat.unwatch()
    fallback = [w for w in caught if "max_factor_dim" in str(w.message)]
    return log, loader, tmp_path / project, fallback


def _scores(curv, q_rows, t_rows):
    """``Q (H + λI)⁻¹ Tᵀ`` with ``H`` block diagonal over the layers (numpy, float64)."""
    blocks = [np.linalg.inv(h + DAMPING * np.eye(len(h))) for h in curv]
    m = np.zeros((sum(len(b) for b in blocks),) * 2)
    off = 0
    for b in blocks:
        m[off : off + len(b), off : off + len(b)] = b
        off += len(b)
    return q_rows @ m @ t_rows.T


def _rows(ref):
    return np.concatenate([ref[k]["g"].reshape(len(ref[k]["g"]), -1) for k in ("0", "2")], 1)


def _close(got, want, rtol=2e-4):
    got = np.asarray(got, dtype=np.float64)
    assert np.abs(got - want).max() <= rtol * np.abs(want).max(), np.abs(got - want).max()


def test_fallback_factor_is_the_diagonal_of_the_dense_covariance_with_one_warning(tmp_path):
    model, train, query = _problem()
    _, _, root, fallback = _log(tmp_path, model, train, query)
    # one warning per factor over the limit (not per batch), naming module, side and size
    assert len(fallback) == 2
    msgs = sorted(str(w.message) for w in fallback)
    assert "0 (Linear): its backward K-FAC factor would be 7x7" in msgs[0]
    assert "2 (Linear): its forward K-FAC factor would be 8x8" in msgs[1]
    assert all("setup({'max_factor_dim':" in m and "add_projection" in m for m in msgs)

    stats = StatisticsCollector.load(root).state_dict()
    (a0, s0), (a2, s2) = _dense_factors(_reference(model, *train)).values()
    assert stats["0/backward/covariance"].shape == (HID,)
    assert stats["2/forward/covariance"].shape == (HID + 1,)
    _close(stats["0/backward/covariance"], np.diag(s0), 1e-5)
    _close(stats["2/forward/covariance"], np.diag(a2), 1e-5)
    _close(stats["0/forward/covariance"], a0, 1e-5)  # within the limit: dense as before
    _close(stats["2/backward/covariance"], s2, 1e-5)
    factors = json.loads((root / "statistics.json").read_text())["factors"]
    assert factors["0/backward"] == {"form": "diagonal", "size": 7, "reason": "over max_factor_dim"}
    # meta.json's hash of the statistics (taken from memory at finalize) is the file's
    saved = load_safetensors(root / "statistics.safetensors")
    assert json.loads((root / "meta.json").read_text())["statistics_sha256"] == tensors_hash(saved)
    assert factors["0/forward"] == {"form": "dense", "size": 6}


def test_kfac_scores_with_diagonal_sides_equal_the_numpy_kronecker_formula(tmp_path):
    model, train, query = _problem(1)
    log, loader, _, _ = _log(tmp_path, model, train, query)
    ref, qref = _reference(model, *train), _reference(model, *query)
    (a0, s0), (a2, s2) = _dense_factors(ref).values()
    curv = [np.kron(np.diag(np.diag(s0)), a0), np.kron(s2, np.diag(np.diag(a2)))]
    want = _scores(curv, _rows(qref), _rows(ref))
    got = compute_influence_all(log, loader, preconditioner="kfac", damping=DAMPING, progress=False)
    _close(got.scores, want)


def test_ekfac_eigenvalues_are_exact_in_the_identity_basis_of_a_diagonal_side(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(ops, "EKFAC_CHUNK", 10)  # one sample at a time: the chunked path
    model, train, query = _problem(2)
    log, loader, root, fallback = _log(tmp_path, model, train, query, statistic="ekfac")
    assert len(fallback) == 2  # the eigenvalues pass decides nothing again
    stats = StatisticsCollector.load(root).state_dict()
    ref, qref = _reference(model, *train), _reference(model, *query)
    (a0, s0), (a2, s2) = _dense_factors(ref).values()
    bases = {  # (Q_S, Q_A): the identity on the diagonal sides
        "0": (np.eye(HID), np.linalg.eigh(a0)[1]),
        "2": (np.linalg.eigh(s2)[1], np.eye(HID + 1)),
    }
    curv = []
    for name, (qs, qa) in bases.items():
        lam = np.mean((qs.T @ ref[name]["g"] @ qa) ** 2, axis=0)  # (1/N) Σ_i (Q_Sᵀ G_i Q_A)²
        _close(stats[f"{name}/ekfac/eigenvalues"], lam, 1e-4)
        q = np.kron(qs, qa)
        curv.append(q @ np.diag(lam.reshape(-1)) @ q.T)
    assert "0/backward/eigenvectors" not in stats and "2/forward/eigenvectors" not in stats
    want = _scores(curv, _rows(qref), _rows(ref))
    got = compute_influence_all(
        log, loader, preconditioner="ekfac", damping=DAMPING, progress=False
    )
    _close(got.scores, want)


def test_statistics_read_with_another_form_than_written_are_refused(tmp_path):
    model, train, query = _problem(3)
    log, loader, root, _ = _log(tmp_path, model, train, query)
    path = root / "statistics.json"
    meta = json.loads(path.read_text())
    meta["factors"]["0/backward"] = {"form": "dense", "size": HID}  # expects the 7x7 matrix
    path.write_text(json.dumps(meta))
    match = r"records the backward factor of '0' as dense, shape \(7, 7\), but .* \(7,\)"
    with pytest.raises(ValueError, match=match):
        StatisticsCollector.load(root)
    with pytest.raises(ValueError, match=match):
        compute_influence_all(root, root, preconditioner="kfac", damping=DAMPING, progress=False)
    del meta["factors"]["0/backward"]  # a factor whose form is not recorded at all
    path.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="'0/backward/covariance', which statistics.json does not"):
        compute_influence_all(root, root, preconditioner="kfac", damping=DAMPING, progress=False)


def test_projected_side_keeps_the_exact_factor_of_the_logged_space(tmp_path):
    model, train, query = _problem(4)
    log, loader, root, fallback = _log(tmp_path, model, train, query, rank=3)
    assert fallback == []  # both sides over the limit are projected: nothing approximated
    stats = StatisticsCollector.load(root).state_dict()
    projections = dict(log.projections)
    p_out0, p_in0 = projections["0/p_out"].double().numpy(), projections["0/p_in"].double().numpy()
    p_in2 = projections["2/p_in"].double().numpy()
    assert "2/p_out" not in projections  # 3 classes: rank 3 is the identity on that side
    ref, qref = _reference(model, *train), _reference(model, *query)
    (a0, s0), (a2, s2) = _dense_factors(ref).values()
    assert stats["0/backward/projected_covariance"].shape == (3, 3)
    assert "0/backward/covariance" not in stats and "2/forward/covariance" not in stats
    _close(stats["0/backward/projected_covariance"], p_out0 @ s0 @ p_out0.T, 1e-5)
    _close(stats["2/forward/projected_covariance"], p_in2 @ a2 @ p_in2.T, 1e-5)
    torch.testing.assert_close(stats["0/backward/projection"], projections["0/p_out"])

    def rows(r):
        g0 = p_out0 @ r["0"]["g"] @ p_in0.T
        g2 = r["2"]["g"] @ p_in2.T
        return np.concatenate([g0.reshape(len(g0), -1), g2.reshape(len(g2), -1)], 1)

    curv = [
        np.kron(p_out0 @ s0 @ p_out0.T, p_in0 @ a0 @ p_in0.T),
        np.kron(s2, p_in2 @ a2 @ p_in2.T),
    ]
    want = _scores(curv, rows(qref), rows(ref))
    got = compute_influence_all(log, loader, preconditioner="kfac", damping=DAMPING, progress=False)
    _close(got.scores, want)
    # the same statistics with rows of another projection: refused, never silently mixed
    other = {**projections, "0/p_out": torch.randn(3, HID)}
    src = TensorSource(
        torch.as_tensor(rows(ref)).float(),
        layout=list(as_source(log).layout),
        statistics=stats,
        projections=other,
    )
    with pytest.raises(ValueError, match="'0'.*rank-3 projection.*projected with another"):
        compute_influence_all(src, src, preconditioner="kfac", damping=DAMPING, progress=False)


def test_gpt2_readme_kfac_workflow_runs_with_lm_head_over_the_limit(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    vocab = 300
    config = transformers.GPT2Config(
        n_layer=1,
        n_embd=32,
        n_head=2,
        vocab_size=vocab,
        n_positions=32,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
    )
    model = transformers.GPT2LMHeadModel(config)
    data = torch.randint(0, vocab, (8, 16))

    def loss_fn(logits, ids):  # each sample's own next-token loss, summed
        return F.cross_entropy(
            logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1), reduction="sum"
        )

    results = {}
    for rank in (64, None):  # README: rank-64 projection; and unprojected (diagonal fallback)
        run = nnstat.init(project=f"gpt2-{rank}", root_dir=tmp_path)
        nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac", "max_factor_dim": 256})
        watched = nnstat.watch(model)  # every module, nothing left out by hand
        # wte.weight is lm_head.weight: one parameter, captured once under lm_head (tied.py)
        assert "lm_head" in watched and "transformer.wte" not in watched
        nnstat.add_projection(rank=rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for lo in range(0, 8, 4):
                ids = list(range(lo, lo + 4))
                with run(data_id=ids):  # no expanded position_ids
                    loss_fn(model(data[ids]).logits, data[ids]).backward()
                model.zero_grad()
            nnstat.finalize()
        fallback = [str(w.message) for w in caught if "max_factor_dim" in str(w.message)]
        nnstat.eval()
        loader = nnstat.build_log_dataloader(batch_size=128)
        queries = torch.randint(0, vocab, (3, 16))
        with run(data_id=["t0", "t1", "t2"]):
            loss_fn(model(queries).logits, queries).backward()
        model.zero_grad()
        result = compute_influence_all(nnstat.get_log(), loader, progress=False)
        nnstat.unwatch()
        assert result.scores.shape == (3, 8) and torch.isfinite(result.scores).all()
        factors = json.loads((tmp_path / f"gpt2-{rank}" / "statistics.json").read_text())
        results[rank] = (factors["factors"], fallback)
    forms, fallback = results[64]
    assert (
        forms["lm_head/backward"]["form"] == "projected" and forms["lm_head/backward"]["rank"] == 64
    )
    assert forms["transformer.wpe/forward"]["form"] == "diagonal" and fallback == []
    forms, fallback = results[None]
    assert forms["lm_head/backward"] == {
        "form": "diagonal",
        "size": vocab,
        "reason": "over max_factor_dim",
    }
    assert (
        len(fallback) == 1
        and "lm_head (Linear): its backward K-FAC factor would be 300x300" in fallback[0]
    )
