"""Refinement (preconditioned CG on exact curvature) against explicit Hessian / Gauss-Newton
matrices of a tiny model, on real stores (projected and not) written by a run."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

import nnstat
from nnstat.influence import (
    Refinement,
    block_cg,
    compute_influence_all,
    compute_self_influence,
    preconditioned_cg,
)
from nnstat.influence.logged_space import LoggedSpace as _Flat
from nnstat.influence.refine import fit_fisher_statistics, refine_queries
from nnstat.influence.sources import as_source

N_TRAIN, N_QUERY, BATCH = 36, 4, 12
LOSS = nn.functional.cross_entropy


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    x = torch.randn(N_TRAIN + N_QUERY, 4)
    y = torch.randint(0, 3, (N_TRAIN + N_QUERY,))
    return model, (x[:N_TRAIN], y[:N_TRAIN]), (x[N_TRAIN:], y[N_TRAIN:])


def _log(tmp_path, project, model, train, query, rank=None, statistic="ekfac"):
    run = nnstat.init(project=project, root_dir=tmp_path)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": statistic})
    nnstat.watch(model)
    if rank is not None:
        nnstat.add_projection(rank=rank, seed=3)
    x, y = train
    for _ in run.schedule():
        for s in range(0, N_TRAIN, BATCH):
            with run(data_id=list(range(s, s + BATCH))):
                LOSS(model(x[s : s + BATCH]), y[s : s + BATCH], reduction="sum").backward()
            model.zero_grad()
    nnstat.eval()
    with run(data_id=[f"q{i}" for i in range(N_QUERY)]):
        LOSS(model(query[0]), query[1], reduction="sum").backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return nnstat.GradientStore(tmp_path / project), log


def _flat_params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).double()


def _loss_at(model, flat, x, y):
    shapes = [(n, p.shape) for n, p in model.named_parameters()]
    parts = torch.split(flat, [s.numel() for _, s in shapes])
    params = {n: t.view(s) for (n, s), t in zip(shapes, parts, strict=True)}
    return LOSS(functional_call(model.double(), params, (x.double(),)), y)


def _explicit_hessian(model, train):
    x, y = train
    h = torch.autograd.functional.hessian(lambda f: _loss_at(model, f, x, y), _flat_params(model))
    model.float()
    return h


def _explicit_ggn(model, train):
    """(1/n) Σ_i J_iᵀ H_i J_i with H_i = diag(p_i) - p_i p_iᵀ (softmax cross-entropy)."""
    x, y = train
    flat = _flat_params(model)
    shapes = [(n, p.shape) for n, p in model.named_parameters()]

    def outputs(f):
        parts = torch.split(f, [s.numel() for _, s in shapes])
        params = {n: t.view(s) for (n, s), t in zip(shapes, parts, strict=True)}
        return functional_call(model.double(), params, (x.double(),))

    jac = torch.autograd.functional.jacobian(outputs, flat)  # [n, C, P]
    p = torch.softmax(outputs(flat), -1).detach()
    hl = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]
    model.float()
    return torch.einsum("icp,icd,idq->pq", jac, hl, jac) / len(x)


def _example_grads(model, data):
    x, y = data
    flat = _flat_params(model)
    rows = []
    for i in range(len(x)):
        f = flat.clone().requires_grad_(True)
        (g,) = torch.autograd.grad(_loss_at(model, f, x[i : i + 1], y[i : i + 1]), f)
        rows.append(g)
    model.float()
    return torch.stack(rows)


def _reference(model, store, log, train, query, curvature_matrix, lam):
    """Scores yᵀ row_i with y = (P C Pᵀ + λI)⁻¹ row_q solved explicitly in float64, P the
    store's projection as an explicit matrix (identity when unprojected)."""
    flat = _Flat(model, as_source(store), torch.float64)
    p_mat = flat.project(torch.eye(flat.size, dtype=torch.float64))  # [n_params, width] = Pᵀ
    c = p_mat.T @ curvature_matrix @ p_mat
    q_rows = torch.as_tensor(log.rows).double()
    y = torch.linalg.solve(c + lam * torch.eye(len(c), dtype=torch.float64), q_rows.T).T
    rows = torch.cat([r for _, r in store.iter_blocks(1000)]).double()
    return y @ rows.T


@pytest.mark.parametrize("rank", [None, 2])
@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
@pytest.mark.parametrize("solver", ["block", "cg"])
def test_refinement_converges_to_the_explicit_solution(tmp_path, rank, curvature, solver):
    model, train, query = _setup()
    store, log = _log(tmp_path, "p", model, train, query, rank=rank)
    if curvature == "hessian":
        c = _explicit_hessian(model, train)
    else:
        c = _explicit_ggn(model, train)
    lam = 0.05 + max(0.0, -float(torch.linalg.eigvalsh(c).min()))
    ref = _reference(model, store, log, train, query, c, lam)
    n_params = sum(p.numel() for p in model.parameters())
    query_data = query if rank is None else None  # optional: a check, the rows are the rhs
    refine = Refinement(
        model, LOSS, train, query_data=query_data, steps=n_params + 5, curvature=curvature,
        damping=lam, dtype=torch.float64, batch_size=10, solver=solver,
    )  # fmt: skip
    res = compute_influence_all(log, store, refine=refine)
    assert res.scores.shape == (N_QUERY, N_TRAIN)
    err = (res.scores.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err
    info = res.meta["refine"]
    assert info["curvature"] == curvature and info["passes"] <= n_params + 5
    assert info["solver"] == solver
    assert info["max_residual"] < 1e-6
    assert info["damping"] == lam and set(res.meta["module_damping"].values()) == {lam}


def test_default_damping_is_the_mean_curvature_and_costs_no_pass_under_the_block_solver(tmp_path):
    """damping=None: λ = Hutchinson's tr(H)/n_params on 8 seeded probes. The block solver gets it
    from probes riding along its first product (passes = steps per block); per-query CG spends a
    pass on it. Both reach the explicit solution at that λ, and agree on λ."""
    model, train, query = _setup()
    store, log = _log(tmp_path, "p", model, train, query)
    c = _explicit_ggn(model, train)
    n_params = len(c)
    p_mat = _Flat(model, as_source(store), torch.float64).project(torch.eye(n_params).double())
    c_logged = p_mat.T @ c @ p_mat  # the store's column order
    z = torch.randint(0, 2, (8, n_params), generator=torch.Generator().manual_seed(0)).double()
    z = z * 2 - 1
    hutchinson = float(((z @ c_logged) * z).sum(1).mean()) / n_params  # the same probes
    infos = {}
    for solver in ("block", "cg"):
        refine = Refinement(model, LOSS, train, steps=n_params + 5, curvature="ggn",
                            dtype=torch.float64, solver=solver)  # fmt: skip
        res = compute_influence_all(log, store, refine=refine)
        infos[solver] = info = res.meta["refine"]
        assert info["damping"] == pytest.approx(hutchinson, rel=1e-9)
        assert 0.3 < info["damping"] / float(torch.diagonal(c).mean()) < 3  # a trace estimate
        if solver == "block":  # one block of 4 queries: its space fills in ~n_params / 4 passes
            assert info["passes"] == info["passes_per_block"] <= n_params // 4 + 2
        else:
            assert info["passes"] == info["passes_per_block"] + 1
        ref = _reference(model, store, log, train, query, c, info["damping"])
        err = (res.scores.double() - ref).abs().max() / ref.abs().max()
        assert err < 1e-5, (solver, err)
    assert "first pass" in infos["block"]["damping_rule"]


def test_zero_steps_gives_the_unrefined_scores_exactly(tmp_path):
    model, train, query = _setup()
    store, log = _log(tmp_path, "p", model, train, query, rank=2)
    plain = compute_influence_all(log, store)
    zero = compute_influence_all(log, store, refine=Refinement(model, LOSS, train, steps=0))
    assert torch.equal(plain.scores, zero.scores)
    assert zero.meta["refine"]["passes"] == 0
    s_plain = compute_self_influence(store)
    s_zero = compute_self_influence(store, refine=Refinement(model, LOSS, train, steps=0))
    assert torch.equal(s_plain.scores, s_zero.scores)


@pytest.mark.parametrize("solver", ["block", "cg"])
def test_each_step_does_not_increase_the_energy_error(tmp_path, solver):
    """On the real curvature: x_k from k = 0..K steps, error in the (H + λI)-norm."""
    model, train, query = _setup()
    store, log = _log(tmp_path, "p", model, train, query)  # unprojected: rows are x itself
    h = _explicit_hessian(model, train)
    lam = 0.05 + max(0.0, -float(torch.linalg.eigvalsh(h).min()))
    a = h + lam * torch.eye(len(h))
    g_q = _example_grads(model, query)
    exact = torch.linalg.solve(a, g_q.T).T
    flat = _Flat(model, as_source(store), torch.float64)
    errors = []
    for k in range(0, 8):
        refine = Refinement(
            model, LOSS, train, query_data=query, steps=k, damping=lam, dtype=torch.float64,
            solver=solver,
        )  # fmt: skip
        if k == 0:
            x = torch.zeros_like(exact)
        else:
            _, _, solved, _ = refine_queries(
                refine, as_source(log), as_source(store), None, None, 64, query
            )
            x = flat.lift(solved.double())  # unprojected: the rows are x itself
        e = x - exact
        errors.append(((e @ a) * e).sum(1))
    errors = torch.stack(errors)  # [steps, queries]
    assert (errors[1:] <= errors[:-1] * (1 + 1e-6) + 1e-12).all(), errors
    assert (errors[-1] < 0.5 * errors[0]).all()


def test_preconditioned_cg_energy_error_is_monotone_on_a_random_spd_system():
    gen = torch.Generator().manual_seed(1)
    q, _ = torch.linalg.qr(torch.randn(30, 30, generator=gen, dtype=torch.float64))
    a = q @ torch.diag(torch.logspace(-2, 2, 30, dtype=torch.float64)) @ q.T
    b = torch.randn(3, 30, generator=gen, dtype=torch.float64)
    m = torch.diag(1 / torch.diagonal(a))
    exact = torch.linalg.solve(a, b.T).T
    seen = []
    x, info = preconditioned_cg(lambda v: v @ a, lambda r: r @ m, b, 200, on_step=seen.append)
    energy = torch.stack([(((s - exact) @ a) * (s - exact)).sum(1) for s in seen])
    assert (energy[1:] <= energy[:-1] * (1 + 1e-9) + 1e-20).all()
    assert torch.allclose(x, exact, rtol=1e-6, atol=1e-8)
    assert info["products"] <= 3 * 200 and info["residual"].max() < 1e-9


def _spd_system(n=30, k=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    a = q @ torch.diag(torch.logspace(-2, 2, n, dtype=torch.float64)) @ q.T
    b = torch.randn(k, n, generator=gen, dtype=torch.float64)
    m = torch.diag(1 / torch.diagonal(a))
    return a, b, m, torch.linalg.solve(a, b.T).T


def _energy(x, exact, a):
    return (((x - exact) @ a) * (x - exact)).sum(1)


def test_block_cg_of_one_row_is_preconditioned_cg():
    a, b, m, _ = _spd_system(k=1)
    for steps in (1, 4, 9):
        x1, i1 = preconditioned_cg(lambda v: v @ a, lambda r: r @ m, b, steps)
        x2, i2 = block_cg(lambda v: v @ a, lambda r: r @ m, b, steps)
        assert torch.allclose(x1, x2, rtol=1e-9, atol=1e-12)
        assert i1["passes"] == i2["passes"] == steps and i1["products"] == i2["products"]


def test_block_cg_beats_per_row_cg_and_is_monotone_and_exact_when_the_space_is_full():
    """The block space holds every row's own CG space: per row, never a larger (A)-norm error
    than PCG at equal steps; monotone per step; exact once k·steps ≥ n (dependent directions
    dropped, so the last steps apply fewer products)."""
    a, b, m, exact = _spd_system(n=30, k=6)
    seen = []
    x, info = block_cg(lambda v: v @ a, lambda r: r @ m, b, 5, on_step=seen.append)
    energy = torch.stack([_energy(s, exact, a) for s in seen])
    assert (energy[1:] <= energy[:-1] * (1 + 1e-9) + 1e-20).all()
    assert torch.allclose(x, exact, rtol=1e-7, atol=1e-9)
    assert info["passes"] == 5 and info["products"] == 30
    for steps in (1, 2, 3, 4):
        xb, _ = block_cg(lambda v: v @ a, lambda r: r @ m, b, steps)
        xc, _ = preconditioned_cg(lambda v: v @ a, lambda r: r @ m, b, steps)
        assert (_energy(xb, exact, a) <= _energy(xc, exact, a) * (1 + 1e-9)).all()


def test_block_cg_from_other_start_directions_adds_the_preconditioned_rhs_at_step_two():
    """``start`` (the first pass's directions, taken before the preconditioner is final): the
    second step adds ``precondition(rhs)``, so two steps are never further (A-norm, per row) from
    the solution than one step of plain block CG, nor than ``start``'s own Galerkin solution;
    the error never increases, and the solution is exact once the space is full."""
    a, b, m, exact = _spd_system(n=30, k=6)
    start = torch.randn(6, 30, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    seen = []
    xs, info = block_cg(lambda v: v @ a, lambda r: r @ m, b, 6, on_step=seen.append, start=start)
    energy = torch.stack([_energy(x, exact, a) for x in seen])
    assert (energy[1:] <= energy[:-1] * (1 + 1e-9) + 1e-20).all()
    assert torch.allclose(xs, exact, rtol=1e-7, atol=1e-9)
    assert info["passes"] == 4  # 6 + 12 + 6 + 6 directions fill the 30
    one, _ = block_cg(lambda v: v @ a, lambda r: r @ m, b, 1)
    two, info2 = block_cg(lambda v: v @ a, lambda r: r @ m, b, 2, start=start)
    assert (_energy(two, exact, a) <= _energy(one, exact, a) * (1 + 1e-9)).all()
    assert info2["products"] == 6 + 12


def test_block_cg_shift_moves_the_system_in_place_without_repeating_products():
    """``shift``: A indefinite (its smallest eigenvalue pushed below 0); each step the callback
    sees the smallest Ritz value and may add δI. The solution is that of A + (Σδ)I (explicit
    solve), with one product per direction, as without shift."""
    a, b, m, _ = _spd_system(n=30, k=6)
    e_min = float(torch.linalg.eigvalsh(a).min())
    a = a - 2 * e_min * torch.eye(30, dtype=a.dtype)  # λ_min(A) = -e_min < 0
    total = 0.0
    seen = []

    def shift(mu):
        nonlocal total
        seen.append(mu)
        delta = max(0.0, 1.5 * -mu) if mu < 0.5 * e_min else 0.0
        total += delta
        return delta

    def matvec(v):  # follows the shifts, as the refinement's λ does
        return v @ a + total * v

    x, info = block_cg(matvec, lambda r: r @ m, b, 6, shift=shift)
    assert total > e_min and info["products"] == 30
    exact = torch.linalg.solve(a + total * torch.eye(30, dtype=a.dtype), b.T).T
    assert torch.allclose(x, exact, rtol=1e-7, atol=1e-9)
    assert min(seen) < 0  # the negative curvature was seen before it was shifted away


def test_block_cg_drops_dependent_rows_and_refuses_an_indefinite_space():
    a, b, m, exact = _spd_system(n=20, k=2)
    twice = torch.cat([b, b, 2 * b[:1]])  # rows 2-4 add no direction
    x, info = block_cg(lambda v: v @ a, lambda r: r @ m, twice, 3)
    assert info["products"] == 6  # 2 new directions per step, not 5
    assert torch.allclose(x[:2], x[2:4]) and torch.allclose(x[4], 2 * x[0])
    with pytest.raises(ValueError, match="NaN/Inf"):
        block_cg(lambda v: v @ a, lambda r: r * float("nan"), b, 2)
    d = torch.diag(torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="not positive definite") as e:
        block_cg(lambda v: v @ d, lambda r: r, torch.ones(2, 3, dtype=torch.float64), 3)
    assert e.value.rows == [0, 1] and min(e.value.curvature) < 0


def test_indefinite_hessian_is_reported_not_scored(tmp_path):
    model, train, query = _setup()
    store, log = _log(tmp_path, "p", model, train, query)
    lam = 1e-4  # under |λ_min| of this untrained tanh MLP's Hessian
    assert float(torch.linalg.eigvalsh(_explicit_hessian(model, train)).min()) < -lam
    # asked for explicitly, the Hessian's indefinite direction is an error naming the fix
    strict = Refinement(model, LOSS, train, steps=3, damping=lam, curvature="hessian")
    with pytest.raises(ValueError, match="not positive definite.*curvature='ggn'"):
        compute_influence_all(log, store, refine=strict)
    # the default refines every query with the Gauss-Newton matrix instead, and says so
    auto = Refinement(model, LOSS, train, steps=3, damping=lam, dtype=torch.float64)
    with pytest.warns(UserWarning, match="indefinite.*curvature='ggn'"):
        res = compute_influence_all(log, store, refine=auto)
    ggn = compute_influence_all(
        log, store, refine=Refinement(**{**auto.__dict__, "curvature": "ggn"})
    )
    torch.testing.assert_close(res.scores, ggn.scores)
    info = res.meta["refine"]
    assert info["curvature"] == "ggn (the Hessian was indefinite)"
    assert info["passes"] > ggn.meta["refine"]["passes"]  # the Hessian's passes are counted

    def concave(out, target):  # negative curvature everywhere, in the outputs too
        return -(out**2).mean()

    # unprojected store: the queries come from the log; the curvature is that of `concave`
    refine = Refinement(model, concave, train, steps=3, damping=1e-6)
    with pytest.raises(ValueError, match="not positive definite.*so is the Gauss-Newton"):
        compute_influence_all(log, store, refine=refine)


def test_query_data_that_is_not_the_log_is_refused(tmp_path):
    model, train, query = _setup()
    store, log = _log(tmp_path, "p", model, train, query, rank=2)
    shuffled = (query[0].flip(0), query[1].flip(0))
    with pytest.raises(ValueError, match="do not match the logged rows"):
        compute_influence_all(
            log, store, refine=Refinement(model, LOSS, train, query_data=shuffled)
        )
    with pytest.raises(ValueError, match="has 3 examples but the log has 4"):
        short = (query[0][:3], query[1][:3])
        compute_influence_all(log, store, refine=Refinement(model, LOSS, train, query_data=short))
    with torch.no_grad():
        model[0].bias += 0.01  # other weights than the store's
    with pytest.raises(ValueError, match="not those the store"):
        compute_influence_all(log, store, refine=Refinement(model, LOSS, train))
    with pytest.raises(ValueError, match="mode='dot'"):
        compute_influence_all(
            log, store, mode="cosine", refine=Refinement(model, LOSS, train, query_data=query)
        )


@pytest.mark.parametrize("solver", ["block", "cg"])
def test_refined_self_influence_is_the_diagonal_of_all_pairs(tmp_path, solver):
    model, train, query = _setup()
    store, _ = _log(tmp_path, "p", model, train, query, rank=2)
    refine = Refinement(
        model, LOSS, train, steps=4, curvature="ggn", dtype=torch.float64, solver=solver
    )
    selfs = compute_self_influence(store, refine=refine)
    pairs = compute_influence_all(
        store, store, refine=Refinement(**{**refine.__dict__, "query_data": train})
    )
    assert selfs.ids == list(range(N_TRAIN))
    assert torch.allclose(selfs.scores, torch.diagonal(pairs.scores), rtol=1e-5, atol=1e-7)
    # two blocks of query_batch=32 rows; per-query CG spends one more pass estimating the
    # default damping (the block solver's probes ride along its first pass), and the block
    # solver stops early once its space is the whole (rank-2, 12-wide) logged space
    info = selfs.meta["refine"]
    if solver == "cg":
        assert info["passes"] == 4 * 2 + 1 and info["passes_per_block"] == 4
    else:
        assert info["passes"] <= 2 * info["passes_per_block"] and info["passes_per_block"] < 4
        assert info["max_residual"] < 1e-9


def test_refinement_validates_its_arguments():
    model, train, _ = _setup()
    for bad in ({"steps": -1}, {"curvature": "fisher"}, {"preconditioner": "nope"}):
        with pytest.raises(ValueError):
            Refinement(model, LOSS, train, **bad)
    with pytest.raises(TypeError):
        Refinement("model", LOSS, train)


@pytest.mark.parametrize("fisher", ["true", "empirical", "sampled"])
def test_refit_fisher_factors_match_their_closed_form(fisher):
    """Softmax regression: the output gradient is p − e_c, so S has a closed form."""
    torch.manual_seed(1)
    model = nn.Linear(5, 4)
    x, y = torch.randn(64, 5), torch.randint(0, 4, (64,))
    p = torch.softmax(model(x).detach(), -1).double()
    samples = 400 if fisher == "sampled" else 1
    refine = Refinement(model, LOSS, (x, y), fisher=fisher, fisher_samples=samples, batch_size=16)
    stats = fit_fisher_statistics(refine, ["model"], "kfac")
    if fisher == "empirical":
        e = p - nn.functional.one_hot(y, 4).double()
        s_ref = e.T @ e / len(x)
    else:
        s_ref = (torch.diag_embed(p) - p[:, :, None] * p[:, None, :]).mean(0)
    a = torch.cat([x, torch.ones(len(x), 1)], 1).double()
    a_ref = a.T @ a / len(x)  # float32 sums over up to 400 draws x 64 rows
    assert torch.allclose(stats["model/forward/covariance"].double(), a_ref, rtol=1e-4, atol=1e-5)
    tol = 0.1 * s_ref.abs().max() if fisher == "sampled" else 1e-6
    assert (stats["model/backward/covariance"].double() - s_ref).abs().max() < tol
    assert all(p.grad is None for p in model.parameters())  # .grad left as it was


def test_true_fisher_preconditioner_changes_the_path_not_the_solution(tmp_path):
    model, train, query = _setup()
    store, log = _log(tmp_path, "p", model, train, query, statistic="none")
    c = _explicit_ggn(model, train)
    ref = _reference(model, store, log, train, query, c, 0.05)
    n_params = sum(p.numel() for p in model.parameters())
    refine = Refinement(
        model, LOSS, train, steps=n_params + 5, curvature="ggn", damping=0.05, fisher="true",
        dtype=torch.float64,
    )  # fmt: skip
    res = compute_influence_all(log, store, refine=refine)
    assert (res.scores.double() - ref).abs().max() / ref.abs().max() < 1e-5
    assert res.meta["refine"]["preconditioner"] == "ekfac"
    assert res.meta["refine"]["fisher"] == "true"
    assert res.meta["refine"]["passes"] <= n_params + 5 + 2  # CG stops at convergence; + 2 refit


@pytest.mark.parametrize("curvature", ["hessian", "ggn"])
def test_batch_loss_refinement_on_framework_batches(tmp_path, curvature):
    """Dict batches and a batch_loss (as HF/Lightning give them): autograd Hessian products and
    engine-captured query gradients reach the explicit solution too."""
    model, train, query = _setup()
    store, log = _log(tmp_path, "p", model, train, query, rank=2)
    h = _explicit_hessian(model, train) if curvature == "hessian" else _explicit_ggn(model, train)
    lam = 0.05 + max(0.0, -float(torch.linalg.eigvalsh(h).min()))
    ref = _reference(model, store, log, train, query, h, lam)

    def dicts(data, size):
        return [
            {"x": data[0][i : i + size], "y": data[1][i : i + size]}
            for i in range(0, len(data[0]), size)
        ]

    def batch_loss(b):
        return LOSS(model(b["x"]), b["y"], reduction="sum")

    n_params = sum(p.numel() for p in model.parameters())
    refine = Refinement(
        model, None, dicts(train, 10), query_data=dicts(query, 3), batch_loss=batch_loss,
        loss_reduction="sum", steps=n_params + 5, damping=lam, dtype=torch.float64,
        curvature=curvature,
    )  # fmt: skip
    res = compute_influence_all(log, store, refine=refine)
    assert (res.scores.double() - ref).abs().max() / ref.abs().max() < 1e-4
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(TypeError, match="exactly one"):
        Refinement(model, LOSS, [], batch_loss=batch_loss)


def test_ggn_through_batch_loss_refuses_a_loss_that_bypasses_the_output(tmp_path):
    model, train, query = _setup()
    store, log = _log(tmp_path, "p", model, train, query)

    def regularised(b):  # the L2 term reaches the weights without passing through the logits
        return LOSS(model(b[0]), b[1], reduction="sum") + model[0].weight.square().sum()

    refine = Refinement(model, None, [train], batch_loss=regularised, loss_reduction="sum",
                        curvature="ggn", steps=2)  # fmt: skip
    with pytest.raises(ValueError, match="other than through"):
        compute_influence_all(log, store, refine=refine)


@pytest.mark.parametrize("solver", ["block", "cg"])
def test_default_damping_is_raised_past_negative_hessian_curvature(tmp_path, solver):
    """curvature=None with the default damping: where H + λI is indefinite, λ is raised to 1.5 x
    the most negative curvature found and every query solved again with the Hessian (not the
    GGN), with a warning; the scores are then the explicit Hessian solution at the final λ."""
    model, train, query = _setup()  # untrained: λ_min(H) = -0.16, mean eigenvalue 0.05
    store, log = _log(tmp_path, "p", model, train, query)
    h = _explicit_hessian(model, train)
    lam_min = float(torch.linalg.eigvalsh(h).min())
    n_params = len(h)
    refine = Refinement(model, LOSS, train, steps=n_params + 5, dtype=torch.float64, solver=solver)
    with pytest.warns(UserWarning, match="default damping: it was raised from"):
        res = compute_influence_all(log, store, refine=refine)
    info = res.meta["refine"]
    assert info["curvature"] == "hessian" and "raised from" in info["damping_rule"]
    assert info["damping"] > -lam_min  # the whole space was explored: H + λI is definite
    if solver == "block":  # raised in place to 1.5 x the most negative Ritz value: λ_min itself
        assert info["damping"] == pytest.approx(-1.5 * lam_min, rel=1e-6)
    ref = _reference(model, store, log, train, query, h, info["damping"])
    err = (res.scores.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err


class _FrozenAndUnused(nn.Sequential):
    """A frozen layer between trainable ones and a watched Linear the forward never calls."""

    def __init__(self):
        super().__init__(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 5), nn.Tanh(), nn.Linear(5, 3))
        self[2].requires_grad_(False)
        self.unused = nn.Linear(3, 3)

    def forward(self, x):
        return self[4](self[3](self[2](self[1](self[0](x)))))


def test_refinement_with_frozen_and_unused_modules_is_the_trainable_parameters_solution(tmp_path):
    """Frozen parameters are outside the refined space (no curvature in their directions) and
    an unused module's parameters have none: the explicit curvature restricted to the
    trainable parameters gives the same scores."""
    torch.manual_seed(0)
    model = _FrozenAndUnused()
    _, train, query = _setup()
    with pytest.warns(UserWarning, match="received no gradient"):
        store, log = _log(tmp_path, "p", model, train, query)
    c = _explicit_hessian(model, train)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    starts = dict(
        zip(sizes, torch.tensor([0, *sizes.values()]).cumsum(0).tolist()[:-1], strict=True)
    )
    space = _Flat(model, as_source(store), torch.float64)
    assert "2.weight" not in space.names and "unused.weight" in space.names
    idx = torch.cat([torch.arange(starts[n], starts[n] + sizes[n]) for n in space.names])
    c = c[idx][:, idx]
    lam = 0.05 + max(0.0, -float(torch.linalg.eigvalsh(c).min()))
    ref = _reference(model, store, log, train, query, c, lam)
    refine = Refinement(
        model, LOSS, train, steps=len(idx) + 5, curvature="hessian", damping=lam,
        dtype=torch.float64, batch_size=12,
    )  # fmt: skip
    with pytest.warns(RuntimeWarning, match="no K-FAC statistics"):
        res = compute_influence_all(log, store, refine=refine)
    assert (res.scores.double() - ref).abs().max() / ref.abs().max() < 1e-5
