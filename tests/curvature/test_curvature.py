"""Statistics vs explicit sums, EK-FAC vs its definition, save/load and spectral summaries."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from nnstat.capture import CaptureEngine
from nnstat.curvature import EKFAC, KFAC, Covariance, Mean, StatisticsCollector


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))


BATCHES_SIZES = (5, 3)  # unequal batches catch averaging of averages


def make_batches(seq=4):
    g = torch.Generator().manual_seed(1)
    out = []
    for n in BATCHES_SIZES:
        x = torch.randn(n, seq, 3, generator=g)
        y = torch.randint(0, 2, (n, seq), generator=g)
        m = torch.rand(n, seq, generator=g) > 0.3
        out.append((x, y, m))
    return out


def masked_loss(out, y, m):
    per = F.cross_entropy(out.reshape(-1, 2), y.reshape(-1), reduction="none")
    return (per * m.reshape(-1).float()).sum()


def run_pass(model, engine, batches):
    for x, y, m in batches:
        with engine.batch(mask=m):
            masked_loss(model(x), y, m).backward()
        model.zero_grad()


def explicit_factors(model, batches):
    """A and S from raw inputs / retained output grads (no hooks involved)."""
    sums = {
        n: [torch.zeros(d + 1, d + 1), torch.zeros(o, o), 0, 0]
        for n, d, o in (("0", 3, 4), ("2", 4, 2))
    }
    for x, y, m in batches:
        h0 = x
        o0 = model[0](h0)
        o0.retain_grad()
        h2 = model[1](o0)
        o2 = model[2](h2)
        o2.retain_grad()
        masked_loss(o2, y, m).backward()
        model.zero_grad()
        for name, inp, out in (("0", h0, o0), ("2", h2, o2)):
            keep = m.reshape(-1)
            a = torch.cat([inp.reshape(-1, inp.shape[-1]), torch.ones(inp[..., :1].numel(), 1)], 1)[
                keep
            ]
            b = out.grad.reshape(-1, out.shape[-1])[keep]
            sums[name][0] += a.T.detach() @ a.detach()
            sums[name][1] += b.T @ b
            sums[name][2] += int(keep.sum())
            sums[name][3] += x.shape[0]
    return {n: (s[0] / s[2], s[1] / s[3]) for n, s in sums.items()}


def per_sample_grads(model, batches):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def one(p, x, y, m):
        out = functional_call(model, p, (x.unsqueeze(0),))
        return masked_loss(out, y, m)

    rows = []
    for x, y, m in batches:
        g = vmap(grad(one), in_dims=(None, 0, 0, 0))(params, x, y, m)
        rows.append(g)
    # matrix form [N, d_out, d_in + 1] (bias = last column)
    return {
        n: torch.cat(
            [torch.cat([r[f"{n}.weight"], r[f"{n}.bias"].unsqueeze(-1)], -1) for r in rows]
        )
        for n in ("0", "2")
    }


def test_kfac_factors_equal_explicit_sums():
    model, batches = make_model(), make_batches()
    engine = CaptureEngine()
    engine.watch(model)
    col = StatisticsCollector("kfac")
    engine.add_consumer(col)
    run_pass(model, engine, batches)
    col.finalize()
    state = col.state_dict()
    for name, (a, s) in explicit_factors(model, batches).items():
        torch.testing.assert_close(state[f"{name}/forward/covariance"], a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(state[f"{name}/backward/covariance"], s, rtol=1e-5, atol=1e-6)


def test_raw_covariance_and_mean_of_grads_vs_vmap():
    model, batches = make_model(), make_batches()
    engine = CaptureEngine()
    engine.watch(model)
    col = StatisticsCollector({"grad": [Mean, Covariance], "forward": [Mean]})
    engine.add_consumer(col)
    run_pass(model, engine, batches)
    col.finalize()
    state = col.state_dict()
    ref = per_sample_grads(model, batches)
    for name, g in ref.items():
        flat = g.reshape(len(g), -1)
        torch.testing.assert_close(state[f"{name}/grad/mean"], g.mean(0), rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(
            state[f"{name}/grad/covariance"], flat.T @ flat / len(g), rtol=1e-4, atol=1e-6
        )
    xs = torch.cat([x[m] for x, _, m in batches])
    torch.testing.assert_close(state["0/forward/mean"][:3], xs.mean(0))
    assert state["0/forward/mean"][3] == 1.0


def test_kfac_identity_for_single_position():
    # with one sample and one position, g = vec(b aᵀ) so g gᵀ = b bᵀ ⊗ a aᵀ exactly: pins the
    # normalisation convention A ⊗ S ≈ (1/N) Σ g gᵀ (no extra factors of N or T)
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(1, 3)
    engine = CaptureEngine()
    engine.watch(model)
    col = StatisticsCollector(
        {"forward": [Covariance], "backward": [Covariance], "grad": [Covariance]}
    )
    engine.add_consumer(col)
    with engine.batch():
        model(x).pow(2).sum().backward()
    col.finalize()
    st = col.state_dict()
    kron = torch.kron(st["model/backward/covariance"], st["model/forward/covariance"])
    torch.testing.assert_close(kron, st["model/grad/covariance"], rtol=1e-5, atol=1e-6)


def test_embedding_with_padding_kfac_and_ekfac_equal_explicit_one_hot_sums():
    """Embedding(padding_idx): the forward factor is the one-hot Gram with padded rows zero (the
    padding row gets no gradient) over all positions, the backward factor sums every position's
    output gradient (padded ones included: they are not masked) over N, and the EK-FAC
    eigenvalues are (1/N) sum_i (Q_S^T G_i Q_A)^2 with G_i from torch.func."""
    torch.manual_seed(0)
    vocab, pad = 9, 4
    model = nn.Sequential(nn.Embedding(vocab, 3, padding_idx=pad), nn.Linear(3, 2))
    gen = torch.Generator().manual_seed(2)
    batches = []
    for n in BATCHES_SIZES:
        x = torch.randint(0, vocab, (n, 4), generator=gen)
        x[:, -1] = pad  # every sample ends padded, and index 0 is an ordinary token
        batches.append((x, torch.randint(0, 2, (n, 4), generator=gen)))

    def loss(out, y):
        return F.cross_entropy(out.reshape(-1, 2), y.reshape(-1), reduction="sum")

    engine = CaptureEngine()
    engine.watch(model, name_filter="0")
    col = StatisticsCollector({"log": "grad", "save": "grad", "statistic": "ekfac"})
    engine.add_consumer(col)
    for _ in col.passes:
        for x, y in batches:
            with engine.batch():
                loss(model(x), y).backward()
            model.zero_grad()
        col.finalize()
    st = col.state_dict()

    a_sum, s_sum, positions, n_total, grads = 0, 0, 0, 0, []
    params = {k: v.detach() for k, v in model.named_parameters()}
    for x, y in batches:
        onehot = F.one_hot(x, vocab).double() * (x != pad).unsqueeze(-1)
        emb = model[0](x)
        emb.retain_grad()
        loss(model[1](emb), y).backward()
        model.zero_grad()
        b = emb.grad.double().reshape(-1, 3)
        a_sum = a_sum + onehot.reshape(-1, vocab).T @ onehot.reshape(-1, vocab)
        s_sum = s_sum + b.T @ b
        positions, n_total = positions + x.numel(), n_total + len(x)
        g = vmap(
            grad(lambda p, xi, yi: loss(functional_call(model, p, (xi[None],)), yi[None])),
            in_dims=(None, 0, 0),
        )(params, x, y)
        grads.append(g["0.weight"].transpose(1, 2).double())  # [N, D, V] matrix form
    a_ref, s_ref = a_sum / positions, s_sum / n_total
    assert a_ref[pad, pad] == 0 and a_ref[0, 0] > 0
    # one-hot inputs: the forward factor is diagonal and saved as its diagonal [vocab]
    assert st["0/forward/covariance"].shape == (vocab,)
    a_dense = torch.diag(st["0/forward/covariance"].double())
    torch.testing.assert_close(a_dense, a_ref, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(st["0/backward/covariance"].double(), s_ref, rtol=1e-4, atol=1e-6)
    assert "0/forward/eigenvectors" not in st  # the identity
    qa = torch.eye(vocab, dtype=torch.float64)
    qs = st["0/backward/eigenvectors"].double()
    g = torch.cat(grads)
    want = ((qs.T @ g @ qa) ** 2).mean(0)
    torch.testing.assert_close(st["0/ekfac/eigenvalues"].double(), want, rtol=1e-4, atol=1e-7)


def ekfac_two_passes(model, batches):
    engine = CaptureEngine()
    engine.watch(model)
    col = StatisticsCollector({"log": "grad", "save": "grad", "statistic": "ekfac"})
    engine.add_consumer(col)
    assert [p.name for p in col.passes] == ["factors", "eigenvalues"]
    run_pass(model, engine, batches)
    col.finalize()
    assert col.current_pass.name == "eigenvalues"  # the second pass is never skipped
    run_pass(model, engine, batches)
    col.finalize()
    assert col.done
    return col


def test_ekfac_eigenvalues_match_definition_no_double_division():
    model, batches = make_model(), make_batches()
    col = ekfac_two_passes(model, batches)
    state = col.state_dict()
    ref = per_sample_grads(model, batches)
    factors = explicit_factors(model, batches)
    for name, g in ref.items():
        qa = state[f"{name}/forward/eigenvectors"].double()
        qs = state[f"{name}/backward/eigenvectors"].double()
        # the eigenbases diagonalise the explicit factors
        a, s = (f.double() for f in factors[name])
        off = qa.T @ a @ qa
        assert (off - torch.diag(off.diagonal())).abs().max() < 1e-5
        want = ((qs.T @ g.double() @ qa) ** 2).mean(0)
        got = state[f"{name}/ekfac/eigenvalues"].double()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
        assert col.counts[f"{name}/ekfac/eigenvalues"] == sum(BATCHES_SIZES)


def test_precondition_never_damps_in_place_and_matches_explicit_inverse():
    model, batches = make_model(), make_batches()
    col = ekfac_two_passes(model, batches)
    st = col.state_dict()
    lam = st["2/ekfac/eigenvalues"]
    lam_before = lam.clone()
    qa, qs = st["2/forward/eigenvectors"], st["2/backward/eigenvectors"]
    g = torch.randn(3, 2, 5)
    r1 = EKFAC.precondition(g, qa, qs, lam, damping=0.1)
    r2 = EKFAC.precondition(g, qa, qs, lam, damping=0.1)
    torch.testing.assert_close(r1, r2, rtol=0, atol=0)
    assert torch.equal(lam, lam_before) and torch.equal(
        col.state_dict()["2/ekfac/eigenvalues"], lam_before
    )
    # explicit: F = (Q_S ⊗ Q_A) diag(vec Λ) (Q_S ⊗ Q_A)ᵀ on row-major vec(G)
    q = torch.kron(qs.double(), qa.double())
    fisher = q @ torch.diag(lam.double().reshape(-1)) @ q.T
    want = torch.linalg.solve(
        fisher + 0.1 * torch.eye(10, dtype=torch.float64), g.double().reshape(3, 10).T
    ).T
    torch.testing.assert_close(r1.double().reshape(3, 10), want, rtol=1e-4, atol=1e-6)
    a, s = st["2/forward/covariance"], st["2/backward/covariance"]
    a0 = a.clone()
    k = KFAC.precondition(g, a, s, damping=0.1)
    want = torch.linalg.solve(
        torch.kron(s.double(), a.double()) + 0.1 * torch.eye(10, dtype=torch.float64),
        g.double().reshape(3, 10).T,
    ).T
    torch.testing.assert_close(k.double().reshape(3, 10), want, rtol=1e-4, atol=1e-6)
    assert torch.equal(a, a0)
    with pytest.raises(ValueError, match="damping"):
        EKFAC.precondition(g, qa, qs, lam, damping=-1.0)


def test_ekfac_without_factors_is_an_error():
    model, batches = make_model(), make_batches()
    engine = CaptureEngine()
    engine.watch(model)
    col = StatisticsCollector({"grad": [EKFAC]})
    col._pass = 1  # jump straight to the eigenvalue pass
    engine.add_consumer(col)
    with pytest.raises(RuntimeError, match="EKFAC needs the K-FAC eigenbases"):
        run_pass(model, engine, batches)


def test_layernorm_gets_full_grad_covariance_under_kfac():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(3), nn.Linear(3, 2))
    x, y = torch.randn(6, 3), torch.randint(0, 2, (6,))
    engine = CaptureEngine()
    engine.watch(model)
    col = StatisticsCollector("ekfac")
    engine.add_consumer(col)
    for _ in col.passes:
        with engine.batch():
            F.cross_entropy(model(x), y, reduction="sum").backward()
        col.finalize()
    st = col.state_dict()
    assert "0/forward/covariance" not in st and "0/ekfac/eigenvalues" not in st
    params = {k: v.detach() for k, v in model.named_parameters()}
    g = vmap(
        grad(
            lambda p, a, b: F.cross_entropy(
                functional_call(model, p, (a[None],)), b[None], reduction="sum"
            )
        ),
        in_dims=(None, 0, 0),
    )(params, x, y)
    flat = torch.cat([g["0.weight"], g["0.bias"]], 1)
    torch.testing.assert_close(st["0/grad/covariance"], flat.T @ flat / 6, rtol=1e-4, atol=1e-6)
    assert "1/ekfac/eigenvalues" in st


def saved_kfac(path):
    """A K-FAC collector after one pass over :func:`make_batches`, saved into ``path``."""
    model, batches = make_model(), make_batches()
    engine = CaptureEngine()
    engine.watch(model)
    col = StatisticsCollector("kfac")
    engine.add_consumer(col)
    run_pass(model, engine, batches)
    col.finalize()
    col.save(path)
    return col


def test_statistics_json_of_older_nnstat_loads(tmp_path):
    """statistics.json written before RunConfig moved to nnstat.run recorded the run's capture
    and store keys in its "config" too: they load (and are not needed)."""
    col = saved_kfac(tmp_path)
    path = tmp_path / "statistics.json"
    saved = json.loads(path.read_text())
    assert sorted(saved["config"]) == ["log", "max_factor_dim", "save", "statistic"]
    old = {"loss_reduction": "sum", "param_grads": True, "nonfinite": "error", "dtype": "float32"}
    saved["config"].update(old, rank=None)
    path.write_text(json.dumps(saved, indent=2, sort_keys=True))
    back = StatisticsCollector.load(tmp_path)
    assert back.done and back.preset == "kfac" and back.passes == col.passes


def test_save_load_roundtrip_and_spectral_summary(tmp_path):
    col = saved_kfac(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "statistics.json",
        "statistics.safetensors",
    ]
    back = StatisticsCollector.load(tmp_path)
    assert back.done and back.preset == "kfac" and back.counts == col.counts
    for k, v in col.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)
    summary = back.spectral_summary()
    a = col.state_dict()["0/forward/covariance"].double().numpy()
    ev = np.linalg.eigvalsh(a)
    p = ev / ev.sum()
    assert summary["kfac/0/forward/trace"] == pytest.approx(np.trace(a), rel=1e-6)
    assert summary["kfac/0/forward/max_eig"] == pytest.approx(ev[-1], rel=1e-6)
    assert summary["kfac/0/forward/condition_number"] == pytest.approx(ev[-1] / ev[0], rel=1e-4)
    assert summary["kfac/0/forward/effective_rank"] == pytest.approx(
        np.exp(-(p * np.log(p)).sum()), rel=1e-6
    )
    assert set(summary) == {
        f"kfac/{m}/{f}/{s}"
        for m in ("0", "2")
        for f in ("forward", "backward")
        for s in ("trace", "max_eig", "condition_number", "effective_rank")
    }


def test_nonfinite_contribution_is_an_error():
    # nothing is read back per batch (a device would wait for it): the NaN batch leaves its
    # sums non-finite, and finalize() refuses the pass naming the statistics
    model = nn.Linear(2, 2)
    engine = CaptureEngine()
    engine.watch(model)
    col = StatisticsCollector("kfac")
    engine.add_consumer(col)
    for x in ([[1.0, 2.0]], [[float("nan"), 1.0]], [[3.0, 4.0]]):
        with engine.batch():
            model(torch.tensor(x)).sum().backward()
    with pytest.raises(FloatingPointError, match=r"\['model/forward/covariance'\]: non-finite"):
        col.finalize()
    assert not col.state_dict()


def test_oversized_factors_fall_back_to_the_diagonal_and_raw_is_refused(monkeypatch):
    import nnstat.curvature.operations as st

    monkeypatch.setattr(st, "MAX_FACTOR_DIM", 6)
    monkeypatch.setattr(st, "MAX_RAW_DIM", 10)
    # the embedding's forward factor (7 > 6) is diagonal by construction, kept as [7] silently;
    # the Linear's backward factor (8 > 6) is kept as its diagonal with a warning
    model = nn.Sequential(nn.Embedding(7, 3), nn.Linear(3, 8))
    engine = CaptureEngine()
    engine.watch(model)
    col = StatisticsCollector("raw")
    engine.add_consumer(col)
    with pytest.raises(ValueError, match=r"the raw gradient covariance would be (21x21|32x32)"):
        with engine.batch():
            model(torch.tensor([[1, 2]])).sum().backward()
    engine.remove_consumer(col)
    col = StatisticsCollector("kfac")
    engine.add_consumer(col)
    with pytest.warns(UserWarning, match=r"1 \(Linear\): its backward K-FAC factor would be 8x8"):
        with engine.batch():
            model(torch.tensor([[1, 2]])).sum().backward()
    col.finalize()
    st_ = col.state_dict()
    assert st_["0/forward/covariance"].tolist() == [0, 0.5, 0.5, 0, 0, 0, 0]
    assert st_["1/backward/covariance"].shape == (8,)
    assert {k: f.form for k, f in col.factor_forms.items()} == {
        "0/forward": "diagonal",
        "0/backward": "dense",
        "1/forward": "dense",
        "1/backward": "diagonal",
    }


def test_finalize_without_any_capture_is_an_error_not_an_empty_result():
    col = StatisticsCollector("kfac")
    with pytest.raises(RuntimeError, match="nothing was captured in pass 'statistics'"):
        col.finalize()
    none = StatisticsCollector("none")
    none.finalize()  # a logging-only pass has nothing to compute
    assert none.done and none.state_dict() == {}


def test_spectral_summary_is_a_tracker_provider():
    from nnstat.tracker import Tracker

    model, batches = make_model(), make_batches()
    engine = CaptureEngine()
    engine.watch(model)
    col = StatisticsCollector("kfac")
    engine.add_consumer(col)
    run_pass(model, engine, batches)
    col.finalize()
    logged = []
    tracker = Tracker(model, stats=["l2"], groups=["weight"], sinks=[lambda m, s: logged.append(m)])
    tracker.add_provider(col.spectral_summary)
    tracker.step()
    assert logged[0]["kfac/2/backward/max_eig"] == col.spectral_summary()["kfac/2/backward/max_eig"]
    assert "weight/0.weight/l2" in logged[0]
