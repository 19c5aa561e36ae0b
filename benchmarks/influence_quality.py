"""Attribution quality: LDS of nnstat's presets vs LogIX and Kronfluence on the same model.

Task: scikit-learn digits (bundled, no download), a 64-h-10 tanh MLP trained full-batch with Adam.
Every method scores the same trained model; the LDS uses the same retraining protocol
(`nnstat.influence.run_lds_protocol`: m random 50% subsets, models retrained from scratch, query
losses recorded). Also checks `nnstat.influence.exact` against the influence computed from the
explicitly built Hessian (Spearman over all pairs). Prints markdown tables.

    .venv/bin/python benchmarks/influence_quality.py            # peers: pip install -r benchmarks/requirements.txt
    .venv/bin/python benchmarks/influence_quality.py --no-peers
"""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr
from sklearn.datasets import load_digits
from torch import nn

import nnstat
from nnstat.influence import compute_influence_all, exact, lds_per_query, run_lds_protocol


def load_data(n_train: int, n_query: int):
    x, y = load_digits(return_X_y=True)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = torch.tensor(x[perm], dtype=torch.float32), torch.tensor(y[perm])
    return (x[:n_train], y[:n_train]), (
        x[n_train : n_train + n_query],
        y[n_train : n_train + n_query],
    )


def make_model(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))


def trainer(train, hidden: int, steps: int, lr: float, wd: float):
    x, y = train

    def train_fn(indices: torch.Tensor) -> nn.Module:
        model = make_model(hidden)
        opt = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=wd)
        xs, ys = x[indices], y[indices]
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(xs), ys).backward()
            opt.step()
        return model.eval()

    return train_fn


# ------------------------------------------------------------------------------ nnstat
def nnstat_logs(model, train, query, root: Path, project: str, projection=None):
    """Log the training set (statistics + per-sample rows) and the queries; return (log, loader)."""
    run = nnstat.init(project=project, root_dir=root)
    nnstat.watch(model)
    x, y = train
    batches = [(list(range(i, min(i + 100, len(x)))),) for i in range(0, len(x), 100)]

    def one_pass():
        for (ids,) in batches:
            with run(data_id=ids):
                nn.functional.cross_entropy(model(x[ids]), y[ids], reduction="sum").backward()
            model.zero_grad()
        nnstat.finalize()

    if projection is not None and projection[0] == "pca":
        # PCA bases come from the K-FAC factors of the unprojected run's statistics pass
        (root / project).mkdir(parents=True, exist_ok=True)
        shutil.copy(root / "full" / "statistics.safetensors", root / project)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "kfac"})
    if projection is not None:
        nnstat.add_projection(rank=projection[1], init=projection[0], seed=0)
    one_pass()
    nnstat.eval()
    loader = nnstat.build_log_dataloader(batch_size=4096)
    with run(data_id=[f"q{i}" for i in range(len(query[0]))]):
        nn.functional.cross_entropy(model(query[0]), query[1], reduction="sum").backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return log, loader


# ------------------------------------------------------------------------------ peers
def logix_scores(model, train, query, root: Path) -> torch.Tensor:
    """LogIX defaults: K-FAC statistics, `compute_influence_all` with default damping."""
    import logix

    cwd = os.getcwd()
    os.chdir(root)
    try:
        Path("config.yaml").write_text("logging:\n  flush_threshold: 1000000000\n")
        run = logix.init(project="logix_bench", config="config.yaml")
        # logix-ai 0.1.1's setup format; the README's {"log": "grad", ...} is silently ignored
        logix.setup({"grad": ["log"], "forward": ["covariance"], "backward": ["covariance"]})
        logix.watch(model)
        run.save(True)
        x, y = train
        for i in range(0, len(x), 100):
            ids = [str(j) for j in range(i, min(i + 100, len(x)))]
            with run(data_id=ids):
                model.zero_grad()
                nn.functional.cross_entropy(
                    model(x[i : i + 100]), y[i : i + 100], reduction="sum"
                ).backward()
        logix.finalize()
        logix.eval()
        loader = logix.build_log_dataloader()
        with run(data_id=[f"q{i}" for i in range(len(query[0]))]):
            model.zero_grad()
            nn.functional.cross_entropy(model(query[0]), query[1], reduction="sum").backward()
        res = run.influence.compute_influence_all(logix.get_log(), loader)
        order = [res["tgt_ids"].index(str(i)) for i in range(len(x))]
        return res["influence"][:, order].float()
    finally:
        os.chdir(cwd)


def kronfluence_scores(model, train, query, root: Path, heuristic_damping=False) -> torch.Tensor:
    """Kronfluence defaults: EK-FAC factors (true Fisher), default ScoreArguments (damping 1e-8);
    ``heuristic_damping`` switches to its ``damping_factor=None`` (0.1 x mean eigenvalue)."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import ScoreArguments
    from kronfluence.task import Task

    class ClassificationTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            inputs, targets = batch
            logits = model(inputs)
            if sample:
                with torch.no_grad():
                    targets = torch.multinomial(torch.softmax(logits.detach(), -1), 1).flatten()
            return nn.functional.cross_entropy(logits, targets, reduction="sum")

        def compute_measurement(self, batch, model):
            inputs, targets = batch
            return nn.functional.cross_entropy(model(inputs), targets, reduction="sum")

    task = ClassificationTask()
    model = prepare_model(copy.deepcopy(model), task)
    name = "bench_heuristic" if heuristic_damping else "bench"
    analyzer = Analyzer(name, model, task, cpu=True, disable_tqdm=True, output_dir=str(root))
    train_ds = torch.utils.data.TensorDataset(*train)
    query_ds = torch.utils.data.TensorDataset(*query)
    analyzer.fit_all_factors("factors", train_ds, per_device_batch_size=100)
    analyzer.compute_pairwise_scores(
        "scores",
        "factors",
        query_ds,
        train_ds,
        per_device_query_batch_size=len(query[0]),
        per_device_train_batch_size=100,
        score_args=ScoreArguments(damping_factor=None) if heuristic_damping else None,
    )
    return analyzer.load_pairwise_scores("scores")["all_modules"].float()


# ------------------------------------------------------------------------------ exact
def flat_loss_fn(model, x, y):
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for _, p in model.named_parameters()]
    sizes = [p.numel() for _, p in model.named_parameters()]

    def f(flat):
        parts = torch.split(flat, sizes)
        p = {n: t.view(s) for n, t, s in zip(names, parts, shapes, strict=True)}
        return nn.functional.cross_entropy(torch.func.functional_call(model, p, (x,)), y)

    theta = torch.cat([p.detach().reshape(-1) for _, p in model.named_parameters()])
    return f, theta


def explicit_influence(model, train, query, damping: float) -> torch.Tensor:
    m64 = copy.deepcopy(model).double()
    f, theta = flat_loss_fn(m64, train[0].double(), train[1])
    h = torch.autograd.functional.hessian(f, theta, vectorize=True)

    def grads(x, y):
        rows = []
        for i in range(len(x)):
            fi, _ = flat_loss_fn(m64, x[i : i + 1].double(), y[i : i + 1])
            rows.append(torch.func.grad(fi)(theta))
        return torch.stack(rows)

    g_t, g_q = grads(*train), grads(*query)
    return g_q @ torch.linalg.solve(h + damping * torch.eye(len(h), dtype=h.dtype), g_t.T), h


# ------------------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n-train", type=int, default=300)
    ap.add_argument("--n-query", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=24)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--wd", type=float, default=1e-3)
    ap.add_argument("--m", type=int, default=50, help="LDS subsets")
    ap.add_argument("--rank", type=int, default=8, help="projection rank per side")
    ap.add_argument("--no-peers", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    train, query = load_data(args.n_train, args.n_query)
    train_fn = trainer(train, args.hidden, args.steps, args.lr, args.wd)
    torch.manual_seed(0)
    base = train_fn(torch.arange(args.n_train))
    n_params = sum(p.numel() for p in base.parameters())

    def query_losses(model):
        return nn.functional.cross_entropy(model(query[0]), query[1], reduction="none")

    t0 = time.perf_counter()
    proto = run_lds_protocol(train_fn, args.n_train, query_losses, alpha=0.5, m=args.m, seed=1)
    t_proto = time.perf_counter() - t0

    rows: list[tuple[str, float, float, float]] = []

    def record(name: str, fn) -> torch.Tensor | None:
        t = time.perf_counter()
        try:
            scores = fn()
        except Exception:  # a peer that fails is reported, not hidden
            print(f"{name} failed:\n{traceback.format_exc()}")
            rows.append((name, float("nan"), float("nan"), time.perf_counter() - t))
            return None
        per_q = lds_per_query(scores, proto.subset_masks, proto.subset_losses)
        per_q = per_q[~np.isnan(per_q)]
        sem = per_q.std(ddof=1) / np.sqrt(len(per_q))
        rows.append((name, float(per_q.mean()), float(sem), time.perf_counter() - t))
        return scores

    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        logs = {}
        t = time.perf_counter()
        logs["full"] = nnstat_logs(base, train, query, root, "full")
        t_log = time.perf_counter() - t
        for kind in ("ekfac", "kfac", "raw", "identity"):
            label = f"nnstat {kind}" + (" (default)" if kind == "ekfac" else "")
            record(
                label,
                lambda kind=kind: compute_influence_all(
                    *logs["full"], preconditioner=kind, progress=False
                ).scores,
            )
        for init in ("random", "pca"):
            log, loader = nnstat_logs(base, train, query, root, f"proj_{init}", (init, args.rank))
            for kind in ("ekfac", "raw"):
                record(
                    f"nnstat {kind}, projected rank {args.rank} ({init})",
                    lambda kind=kind, log=log, loader=loader: compute_influence_all(
                        log, loader, preconditioner=kind, progress=False
                    ).scores,
                )
        # exact: damping on the mean-loss scale, large enough for H + λI to be positive definite
        f, theta = flat_loss_fn(copy.deepcopy(base).double(), train[0].double(), train[1])
        eig = torch.linalg.eigvalsh(torch.autograd.functional.hessian(f, theta, vectorize=True))
        lam = max(0.1 * eig.clamp_min(0).mean().item(), -1.5 * eig.min().item(), 1e-4)
        ex = record(
            f"nnstat exact (CG, λ={lam:.2g})",
            lambda: exact(base, nn.functional.cross_entropy, train, query, damping=lam).scores,
        )
        explicit, _ = explicit_influence(base, train, query, lam)
        record("explicit Hessian (reference)", lambda: explicit.float())
        rho = (
            spearmanr(ex.flatten().numpy(), explicit.flatten().numpy()).statistic
            if ex is not None
            else float("nan")
        )
        if not args.no_peers:
            record(
                "LogIX 0.1.1 default (K-FAC)",
                lambda: logix_scores(copy.deepcopy(base), train, query, root),
            )
            record(
                "Kronfluence 1.0.1 default (EK-FAC)",
                lambda: kronfluence_scores(base, train, query, root),
            )
            record(
                "Kronfluence 1.0.1 EK-FAC, damping_factor=None (its heuristic)",
                lambda: kronfluence_scores(base, train, query, root, heuristic_damping=True),
            )

    print(
        f"\ndigits, MLP 64-{args.hidden}-10 ({n_params} parameters), {args.n_train} train / "
        f"{args.n_query} queries, LDS over m={args.m} subsets (alpha=0.5, retrained "
        f"{args.steps} Adam steps; protocol {t_proto:.0f} s), torch threads "
        f"{torch.get_num_threads()}; nnstat logging pass {t_log:.1f} s\n"
    )
    print("| method | LDS (mean ± s.e. over queries) | time (s) |")
    print("| --- | ---: | ---: |")
    for name, value, sem, secs in rows:
        print(f"| {name} | {value:.3f} ± {sem:.3f} | {secs:.1f} |")
    print(
        f"\n`exact` vs explicit-Hessian influence: Spearman {rho:.4f} over all "
        f"{explicit.numel()} pairs (λ = {lam:.3g})"
    )


if __name__ == "__main__":
    main()
