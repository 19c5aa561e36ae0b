"""Attribution quality: LDS of nnstat (unrefined, refined, exact) vs LogIX and Kronfluence.

Tasks on scikit-learn data (bundled, no download): a 64-h-10 tanh MLP on digits, multinomial
logistic regression on digits (one ``nn.Linear(64, 10)``), a small CNN on the 8x8 digit images,
optionally logistic regression on breast cancer; ``lm``: a one-layer causal character
transformer on the source text of a standard-library module (`_lm_task.py`). Each is trained with full-batch L-BFGS to
convergence on ``mean CE + wd/2 ||θ||²`` and/or with full-batch Adam (``weight_decay=wd``, the
same objective, a fixed number of steps). Every method scores the same trained model; the LDS
uses the same retraining protocol (`nnstat.influence.run_lds_protocol`: ``m`` random 50% subsets,
each retrained from scratch with the same procedure as the scored model, query losses recorded).

Methods, side by side: nnstat ``identity`` / ``raw`` / ``kfac`` / ``ekfac`` (a damping sweep for
``raw`` and ``ekfac``), `Refinement` with k = 1, 2, 5, 10 steps on the Hessian and on the
Gauss-Newton matrix (solved in the store's logged space; default damping = the mean eigenvalue
of that curvature, plus λ = wd and a damping sweep, other preconditioners at k = 5 and the Fisher
source of its preconditioner when nnstat has the ``fisher`` field), `exact` influence (CG on
Hessian-vector products) next to the influence from the explicitly built Hessian and GGN; LogIX
K-FAC and EK-FAC and Kronfluence EK-FAC at their defaults and at nnstat's damping values; LogIX's
LoGra (``--peers logra``: its LoRA projection at ``--logra-rank``, its own initialisation) with
its raw, K-FAC and EK-FAC. Reported per task x training x store projection: LDS (mean ± s.e.
over queries), Spearman against exact influence over all query x train pairs, cost, bytes per
stored row (nnstat stores, dense or factored by ``--factors``, and LoGra's). Markdown tables on
stdout, all numbers in the ``--out`` JSON.

``--quick`` keeps: nnstat identity / raw / kfac / ekfac at their default damping; refine
k = 1, 2, 5, 10 at the default damping (Hessian and GGN), k = 5 and 10 at λ = wd (Hessian),
k = 5 with ``fisher="true"`` (GGN); exact; LogIX K-FAC / EK-FAC at their default and a small
damping sweep; Kronfluence EK-FAC at its heuristic and its default.

    .venv/bin/python benchmarks/influence_quality.py --out /tmp/iq.json  # peers: requirements.txt
    .venv/bin/python benchmarks/influence_quality.py --no-peers --tasks logreg --train lbfgs
    .venv/bin/python benchmarks/influence_quality.py --quick --ranks none,8 --out /tmp/iq.json
    .venv/bin/python benchmarks/influence_quality.py --tasks lm --out /tmp/iq_lm.json
    .venv/bin/python benchmarks/influence_quality.py --tasks lm --lm-d 128 --lm-mlp 256 \
        --no-exact --quick --peers logra --ranks 64 --factors 64:4,64:8,256:11

``--tasks lm`` has its own defaults (`TASK_DEFAULTS`: Adam then L-BFGS in float64, wd = 1e-2,
150 training windows, only the rows of its table, ``--lean``); flags given override them. Its
exact reference is the explicitly built Hessian (``nnstat.influence.exact`` is not run): at
λ = wd through a pseudo-inverse where ``H + wd·I`` is singular only along the flat directions of
the model's continuous symmetries (rotations of the residual stream and of each head's q/k and
v/out spaces, which leave loss and L2 unchanged and to which every gradient is orthogonal).
``--no-exact`` skips that reference (a model whose Hessian does not fit in memory): no exact row
and no Spearman column, τ from the per-example gradients, the LDS and every method unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _exact_reference import FLAT_TOL, Explicit, module_mask, reference_system
from scipy.stats import spearmanr
from sklearn.datasets import load_breast_cancer, load_digits
from torch import nn

import nnstat
from nnstat.influence import (
    Refinement,
    as_source,
    compute_influence_all,
    exact,
    lds_per_query,
    run_lds_protocol,
)
from nnstat.store.shards import STORE_DTYPES

CE = nn.functional.cross_entropy
HAS_FISHER = "fisher" in {f.name for f in dataclasses.fields(Refinement)}


# ------------------------------------------------------------------------------ tasks
@dataclasses.dataclass
class Task:
    name: str
    describe: str
    make_model: Callable[[], nn.Module]
    train: tuple[torch.Tensor, torch.Tensor]
    query: tuple[torch.Tensor, torch.Tensor]
    #: ``loss(outputs, targets, reduction=...)``: the per-example loss and its batch reductions
    loss: Callable[..., torch.Tensor] = CE
    #: the dtype of training (the trained model is returned in float32 either way)
    train_dtype: torch.dtype = torch.float32
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


def _split(x: np.ndarray, y: np.ndarray, n_train: int, n_query: int, image: bool = False):
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    perm = np.random.default_rng(0).permutation(len(x))
    x, y = torch.tensor(x[perm], dtype=torch.float32), torch.tensor(y[perm])
    if image:
        x = x.reshape(-1, 1, 8, 8)
    return (x[:n_train], y[:n_train]), (
        x[n_train : n_train + n_query],
        y[n_train : n_train + n_query],
    )


#: per-task defaults of the flags left unset on the command line (``None`` there)
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "*": {
        "train": "both",
        "n_train": 300,
        "steps": 300,
        "lr": 0.01,
        "lbfgs_iter": 1000,
        "wd": 1e-3,
        "ranks": "none,8",
        "counterfactual": 15,
        "lean": False,
    },
    # float64: float32 L-BFGS stalls at ‖∇‖ ≈ 1e-4 on this objective (its loss's resolution)
    "lm": {
        "train": "adam+lbfgs",
        "n_train": 120,
        "steps": 300,
        "lr": 0.03,
        "lbfgs_iter": 400,
        "wd": 1e-2,
        "ranks": "none",
        "counterfactual": 0,
        "lean": True,
    },
}


def task_args(args, name: str):
    """``args`` with the task's defaults in place of the flags left unset."""
    out = copy.copy(args)
    for key, value in {**TASK_DEFAULTS["*"], **TASK_DEFAULTS.get(name, {})}.items():
        if getattr(out, key) is None:
            setattr(out, key, value)
    out.ranks = [None if r.strip().lower() == "none" else int(r) for r in out.ranks.split(",")]
    return out


def make_task(name: str, args) -> Task:
    if name == "lm":
        from _lm_task import lm_loss, make_lm

        describe, make_model, train, query, info = make_lm(args)
        return Task(name, describe, make_model, train, query, lm_loss, torch.float64, info)
    # logistic regressions sit in an nn.Sequential: Kronfluence 1.0.1's prepare_model recurses
    # without end on a bare root nn.Linear (RecursionError); the model is the same
    if name == "cancer":
        x, y = load_breast_cancer(return_X_y=True)
        train, query = _split(x, y, args.n_train, args.n_query)
        return Task(
            name,
            "breast cancer, logistic regression 30-2",
            lambda: nn.Sequential(nn.Linear(30, 2)),
            train,
            query,
        )
    x, y = load_digits(return_X_y=True)
    train, query = _split(x, y, args.n_train, args.n_query, image=name == "cnn")
    if name == "mlp":
        h = args.hidden
        return Task(
            name,
            f"digits, MLP 64-{h}-10 (tanh)",
            lambda: nn.Sequential(nn.Linear(64, h), nn.Tanh(), nn.Linear(h, 10)),
            train,
            query,
        )
    if name == "logreg":
        return Task(
            name,
            "digits, logistic regression 64-10",
            lambda: nn.Sequential(nn.Linear(64, 10)),
            train,
            query,
        )
    if name == "cnn":
        return Task(
            name,
            "digits 8x8, CNN conv3x3(1→8)-ReLU-conv3x3(8→8)-ReLU-linear(128→10)",
            lambda: nn.Sequential(
                nn.Conv2d(1, 8, 3),
                nn.ReLU(),
                nn.Conv2d(8, 8, 3),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(128, 10),
            ),
            train,
            query,
        )
    raise ValueError(f"unknown task {name!r}")


def l2(model: nn.Module) -> torch.Tensor:
    return sum(p.square().sum() for p in model.parameters())


def trainer(task: Task, method: str, args) -> Callable[[torch.Tensor], nn.Module]:
    """``train_fn(indices) -> model``: the scored model and every LDS retraining use it."""
    x, y = task.train

    dtype, loss_fn = task.train_dtype, task.loss

    def train_fn(indices: torch.Tensor) -> nn.Module:
        model = task.make_model().to(dtype)
        xs, ys = x[indices], y[indices]
        xs = xs.to(dtype) if xs.is_floating_point() else xs
        if method in ("adam", "adam+lbfgs"):
            opt = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.wd)
            for _ in range(args.steps):
                opt.zero_grad()
                loss_fn(model(xs), ys).backward()
                opt.step()
        if method in ("lbfgs", "adam+lbfgs"):
            # full batch L-BFGS on mean loss + wd/2 ||θ||² (the same objective as Adam's)
            opt = torch.optim.LBFGS(
                model.parameters(),
                lr=1.0,
                max_iter=args.lbfgs_iter,
                max_eval=2 * args.lbfgs_iter,
                history_size=50,
                tolerance_grad=1e-7,
                tolerance_change=1e-12,
                line_search_fn="strong_wolfe",
            )

            def closure():
                opt.zero_grad()
                loss = loss_fn(model(xs), ys) + 0.5 * args.wd * l2(model)
                loss.backward()
                return loss

            opt.step(closure)
        return model.float().eval()

    return train_fn


def objective_grad_norm(model: nn.Module, task: Task, wd: float, indices=None) -> float:
    """‖∇(mean loss + wd/2 ‖θ‖²)‖ over the training set (or ``indices`` of it) at the model's
    (float32) weights, evaluated in float64."""
    m64 = copy.deepcopy(model).double()
    x, y = task.train if indices is None else (task.train[0][indices], task.train[1][indices])
    x = x.double() if x.is_floating_point() else x
    (task.loss(m64(x), y) + 0.5 * wd * l2(m64)).backward()
    return torch.sqrt(sum(p.grad.square().sum() for p in m64.parameters())).item()


# ------------------------------------------------------------------------------ nnstat
def nnstat_logs(
    model,
    train,
    query,
    root: Path,
    project: str,
    rank=None,
    init="random",
    loss=CE,
    types=None,
    factors=None,
):
    """Log the training set (EK-FAC statistics + per-sample rows) and the queries (of the
    modules of classes ``types`` only, when given); ``factors``: factored rows (``rank``
    needed)."""
    run = nnstat.init(project=project, root_dir=root)
    x, y = train
    batches = [list(range(i, min(i + 100, len(x)))) for i in range(0, len(x), 100)]
    if rank is not None and init == "pca":
        # PCA bases come from the K-FAC factors of the unprojected run's statistics
        full = project.rsplit("_rank", 1)[0] + "_full"
        (root / project).mkdir(parents=True, exist_ok=True)
        shutil.copy(root / full / "statistics.safetensors", root / project)
    setup = {"log": "grad", "save": "grad", "statistic": "ekfac"}
    if factors is not None:
        setup.update(rank=rank, factors=factors)
    nnstat.setup(setup)
    nnstat.watch(model, type_filter=types)
    if rank is not None:
        nnstat.add_projection(rank=rank, init=init, seed=0)
    for _ in run.schedule():
        for ids in batches:
            with run(data_id=ids):
                loss(model(x[ids]), y[ids], reduction="sum").backward()
            model.zero_grad()
    nnstat.eval()
    loader = nnstat.build_log_dataloader(batch_size=4096)
    with run(data_id=[f"q{i}" for i in range(len(query[0]))]):
        loss(model(query[0]), query[1], reduction="sum").backward()
    model.zero_grad()
    log = nnstat.get_log()
    nnstat.unwatch()
    return log, loader


def in_train_order(res) -> torch.Tensor:
    """Scores with columns in training-index order (store ids are the positions)."""
    order = np.argsort(np.asarray([int(i) for i in res.train_ids]))
    return res.scores[:, torch.as_tensor(order)].float()


def mean_eigenvalue(loader) -> float:
    """Trace / width of the block-diagonal curvature (E‖g‖² / columns of the store rows)."""
    total, n, width = 0.0, 0, 0
    # the source's blocks: dense rows also of a factored store (its stored columns are factors)
    for _, rows in as_source(loader).iter_blocks(4096):
        total += float(rows.double().square().sum())
        n, width = n + len(rows), rows.shape[1]
    return total / n / width


# ------------------------------------------------------------------------------ peers
def logix_scores(
    model,
    train,
    query,
    root: Path,
    project: str,
    hessian: str,
    dampings,
    loss=CE,
    lora_rank: int | None = None,
    relative_dampings: tuple[float, ...] = (),
) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """LogIX 0.1.1 raw, K-FAC or EK-FAC (its scheduler's passes); one score matrix per damping,
    and ``{"bytes_per_row", "columns"}`` of the rows it logs. LogIX watches ``nn.Linear`` /
    ``nn.Conv2d`` only (and skips their bias).

    ``lora_rank``: LoGra, LogIX's gradient projection (``LogIXScheduler(lora="random")``: its
    ``add_lora`` inserts ``C·B·A`` next to every watched module, ``A`` and ``C`` Kaiming-uniform
    at rank ``min(lora_rank, in, out)``, ``B`` zero, and logs ``B``'s gradient, the projected
    ``rank × rank`` one). ``relative_dampings``: more dampings, as multiples of the mean
    eigenvalue of the logged rows' covariance (the store's scale, which a projection changes).
    The projection is drawn from torch's generator seeded with 0 (LogIX's own init takes the
    global generator, which data loaders also draw from): the same draw in every run.
    """
    from logix import LogIX, LogIXScheduler
    from logix.config import LoRAConfig

    cwd = os.getcwd()
    os.chdir(root)
    stack = contextlib.ExitStack()
    try:
        stack.enter_context(torch.random.fork_rng())
        torch.manual_seed(0)
        Path("config.yaml").write_text("logging:\n  flush_threshold: 1000000000\n")
        run = LogIX(project=project, config="config.yaml")
        if lora_rank is not None:
            run.set_lora_config(LoRAConfig(rank=lora_rank))
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                # LogIX's patch extraction transposes its input in place, which breaks autograd
                # when that input is a ReLU output: hand it a clone (same values and gradients)
                m.register_forward_pre_hook(lambda mod, a: (a[0].clone(), *a[1:]))
        run.watch(model)
        x, y = train
        lora = "none" if lora_rank is None else "random"
        for _ in LogIXScheduler(run, lora=lora, hessian=hessian, save="grad"):
            for i in range(0, len(x), 100):
                ids = [str(j) for j in range(i, min(i + 100, len(x)))]
                with run(data_id=ids):
                    model.zero_grad()
                    loss(model(x[i : i + 100]), y[i : i + 100], reduction="sum").backward()
            run.finalize()
        run.eval()
        # LogIX keeps updating its statistics in eval mode: log the queries without them
        run.setup({"grad": ["log"]})
        loader = run.build_log_dataloader()
        with run(data_id=[f"q{i}" for i in range(len(query[0]))]):
            model.zero_grad()
            loss(model(query[0]), query[1], reduction="sum").backward()
        qlog = run.get_log()
        model.zero_grad()
        grads = [g["grad"] for g in qlog[1].values()]
        info = {
            "bytes_per_row": sum(g[0].numel() * g.element_size() for g in grads),
            "columns": sum(g[0].numel() for g in grads),
        }
        if relative_dampings:  # the mean eigenvalue of the logged rows' covariance
            total, n = 0.0, 0
            for _, log in loader:
                total += sum(float(m["grad"].double().square().sum()) for m in log.values())
                n += len(next(iter(log.values()))["grad"])
            info["tau_store"] = total / n / info["columns"]
            dampings = [*dampings, *(r * info["tau_store"] for r in relative_dampings)]
        info["dampings"] = list(dampings)
        # precondition_kfac adds the damping to the EK-FAC eigenvalues in place: restore them
        saved = {k: v.clone() for k, v in getattr(run.state, "ekfac_eigval_state", {}).items()}
        out = []
        for damping in dampings:
            for k, v in saved.items():
                run.state.ekfac_eigval_state[k] = v.clone()
            if hessian == "raw":  # LogIX inverts at the first damping and keeps that inverse
                run.state.covariance_inverse(damping=damping)
            res = run.influence.compute_influence_all(qlog, loader, damping=damping)
            order = [res["tgt_ids"].index(str(i)) for i in range(len(x))]
            out.append(res["influence"][:, order].float())
        return out, info
    finally:
        stack.close()
        os.chdir(cwd)


def kronfluence_scores(model, train, query, root: Path, name: str, dampings, loss=CE):
    """Kronfluence 1.0.1 EK-FAC (true Fisher, its default); one score matrix per damping_factor
    (``None`` = its heuristic, 0.1 x mean eigenvalue per module). Kronfluence tracks
    ``nn.Linear`` / ``nn.Conv2d`` only."""
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import ScoreArguments
    from kronfluence.task import Task as KTask

    class ClassificationTask(KTask):
        def compute_train_loss(self, batch, model, sample=False):
            inputs, targets = batch
            logits = model(inputs)
            if sample:  # one class per prediction (per position for a sequence model)
                with torch.no_grad():
                    probs = torch.softmax(logits.detach(), -1)
                    flat = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1)
                    targets = flat.view(probs.shape[:-1])
            return loss(logits, targets, reduction="sum")

        def compute_measurement(self, batch, model):
            inputs, targets = batch
            return loss(model(inputs), targets, reduction="sum")

    task = ClassificationTask()
    model = prepare_model(copy.deepcopy(model), task)
    analyzer = Analyzer(name, model, task, cpu=True, disable_tqdm=True, output_dir=str(root))
    train_ds = torch.utils.data.TensorDataset(*train)
    query_ds = torch.utils.data.TensorDataset(*query)
    analyzer.fit_all_factors("factors", train_ds, per_device_batch_size=100)
    out = []
    for i, damping in enumerate(dampings):
        analyzer.compute_pairwise_scores(
            f"scores{i}",
            "factors",
            query_ds,
            train_ds,
            per_device_query_batch_size=len(query[0]),
            per_device_train_batch_size=100,
            score_args=ScoreArguments(damping_factor=damping),
        )
        out.append(analyzer.load_pairwise_scores(f"scores{i}")["all_modules"].float())
    return out


# ------------------------------------------------------------------------------ scoring
def lds_summary(scores: torch.Tensor, proto) -> tuple[float, float, int]:
    """LDS mean over the queries whose correlation is defined, its standard error, their count."""
    per_q = lds_per_query(scores, proto.subset_masks, proto.subset_losses)
    per_q = per_q[~np.isnan(per_q)]
    return float(per_q.mean()), float(per_q.std(ddof=1) / np.sqrt(len(per_q))), len(per_q)


class Board:
    """Rows of one task x training x projection: LDS, Spearman vs exact, cost."""

    def __init__(self, proto, reference: torch.Tensor | None) -> None:
        self.proto = proto
        self.reference = reference
        self.rows: list[dict[str, Any]] = []

    def add(self, method: str, scores: torch.Tensor | None, **info) -> dict[str, Any]:
        row: dict[str, Any] = {"method": method, "lds": None, "sem": None, "spearman": None}
        if scores is not None:
            row["lds"], row["sem"], row["n_queries_scored"] = lds_summary(scores, self.proto)
            if self.reference is not None:
                row["spearman"] = float(
                    spearmanr(scores.flatten().numpy(), self.reference.flatten().numpy()).statistic
                )
        row.update(info)
        self.rows.append(row)
        print(f"  {fmt_row(row)}", flush=True)
        return row

    def run(self, method: str, fn: Callable[[], Any], **info) -> dict[str, Any]:
        """``fn() -> scores`` or ``(scores, info)``; errors become a status, never a crash."""
        t = time.perf_counter()
        try:
            out = fn()
        except Exception as e:  # reported, not hidden
            secs = time.perf_counter() - t
            msg = str(e)
            if "not positive definite" in msg:
                status = "indefinite"
            else:
                status = f"failed: {type(e).__name__}: {msg.splitlines()[0][:120] if msg else ''}"
                if not isinstance(e, ValueError):
                    traceback.print_exc()
            return self.add(method, None, seconds=secs, status=status, error=msg[:500], **info)
        secs = time.perf_counter() - t
        scores, extra = out if isinstance(out, tuple) else (out, {})
        return self.add(method, scores, seconds=secs, status="ok", **{**info, **extra})


def fmt_damping(row: dict[str, Any]) -> str:
    d = row.get("module_damping")
    if isinstance(d, dict) and d:
        lo, hi = min(d.values()), max(d.values())
        return f"{lo:.2g}" if np.isclose(lo, hi) else f"{lo:.2g}–{hi:.2g}"
    d = row.get("damping")
    return "" if d is None else (d if isinstance(d, str) else f"{d:.3g}")


def fmt_row(row: dict[str, Any]) -> str:
    if row["lds"] is None:
        lds = row.get("status", "")
    else:
        lds = f"{row['lds']:.3f} ± {row['sem']:.3f}"
    rho = "" if row["spearman"] is None else f"{row['spearman']:.3f}"
    secs = f"{row['seconds']:.1f}" if row.get("seconds") is not None else ""
    prod = "" if row.get("products") is None else str(row["products"])
    passes = "" if row.get("passes") is None else str(row["passes"])
    if row.get("passes_per_block") is not None:
        passes += f" ({row['passes_per_block']}/block)"
    return (
        f"| {row['method']} | {lds} | {rho} | {secs} | {prod} | {passes} | "
        f"{fmt_damping(row)} | {row.get('note', '')} |"
    )


def refined(log, loader, refine: Refinement):
    res = compute_influence_all(log, loader, refine=refine, progress=False)
    info = res.meta["refine"]
    extra = {
        "products": info["products"],
        "passes": info["passes"],
        "passes_per_block": info.get("passes_per_block"),
        "refine_seconds": info["seconds"],
        "damping": info["damping"],
        "damping_rule": info.get("damping_rule"),
        "curvature_used": info["curvature"],
        "unrefined_module_damping": res.meta.get("module_damping"),
        "preconditioner_origin": info["preconditioner"],
        "max_residual": info.get("max_residual"),
        "note": str(info["preconditioner"]),
    }
    rule = info.get("damping_rule", "given")
    if rule != "given":  # the block solver's trace probes ride along its first pass
        extra["note"] += " (λ: mean eigenvalue, " + (
            "+1 pass)" if "one pass" in rule else "probes in pass 1)"
        )
    if info.get("fisher", "store") != "store":
        extra["note"] += f" refit ({info['fisher']} Fisher: +2 statistics passes, counted)"
    return in_train_order(res), extra


def unrefined(log, loader, kind: str, damping: float | None, mode: str = "dot"):
    res = compute_influence_all(
        log, loader, preconditioner=kind, damping=damping, mode=mode, progress=False
    )
    extra = {"module_damping": res.meta.get("module_damping") if kind != "identity" else None}
    return in_train_order(res), extra


# ------------------------------------------------------------------------------ one setting
def damping_sweep(tau: float, gamma: float | None, wd: float | None) -> dict[str, float]:
    """Relative to τ (mean eigenvalue of the empirical Fisher, what damping=None scales),
    0.1 × γ (mean eigenvalue of the GGN = true Fisher) and the L2 coefficient."""
    out = {"0.01τ": 0.01 * tau, "0.1τ": 0.1 * tau, "τ": tau, "10τ": 10 * tau}
    if gamma is not None:
        out["0.1γ"] = 0.1 * gamma
    if wd is not None:
        out["wd"] = wd
    return out


def bench_store(board: Board, ctx: dict[str, Any], log, loader, args, projected: bool) -> None:
    """Every nnstat method on one store (unprojected or projected)."""
    model, train, query = ctx["model"], ctx["train"], ctx["query"]
    tau = mean_eigenvalue(loader)
    tau_full, gamma, wd, lam_ref = ctx["tau_full"], ctx["gamma"], args.wd, ctx["lam_ref"]
    # in a projected store the curvature lives on another scale: only relative values there
    sweep = damping_sweep(tau, None if projected else gamma, None if projected else wd)
    sweep_full = damping_sweep(tau_full, gamma, wd)
    board.rows.append({"method": "_meta", "tau_store": tau, "tau_full": tau_full, "gamma": gamma})
    print(
        f"  (store mean eigenvalue τ = {tau:.3g}; full space: τ = {tau_full:.3g}, "
        f"GGN mean eigenvalue γ = {'not estimated' if gamma is None else f'{gamma:.3g}'}, "
        f"wd = {wd:g})"
    )
    for kind in ("identity", "raw", "kfac", "ekfac"):
        board.run(
            f"nnstat {kind}" + (" (default damping)" if kind != "identity" else ""),
            lambda kind=kind: unrefined(log, loader, kind, None),
            group="unrefined",
            preconditioner=kind,
        )
    # RelatIF (mode="relatif"): the same scores with each training row divided by the square
    # root of its self-influence; LDS is per query, so only the training side can matter
    for kind in () if args.lean else ("raw", "ekfac"):
        board.run(
            f"nnstat {kind} relatif (default damping)",
            lambda kind=kind: unrefined(log, loader, kind, None, mode="relatif"),
            group="unrefined",
            preconditioner=kind,
        )
    for kind in () if args.quick or args.lean else ("raw", "ekfac"):
        for label, lam in sweep.items():
            board.run(
                f"nnstat {kind}, λ = {label}",
                lambda kind=kind, lam=lam: unrefined(log, loader, kind, lam),
                group="unrefined sweep",
                preconditioner=kind,
                damping=lam,
            )

    def refine(steps, curvature, **kw) -> Refinement:
        return Refinement(
            model,
            ctx["loss"],
            train,
            query_data=query,
            steps=steps,
            curvature=curvature,
            progress=False,
            **kw,
        )

    def go(name: str, group: str, steps: int, curvature: str | None, **kw) -> None:
        board.run(
            name,
            lambda: refined(log, loader, refine(steps, curvature, **kw)),
            group=group,
            steps=steps,
            curvature=curvature,
            **kw,
        )

    # the library's defaults (curvature=None: the Hessian, damping raised or the GGN where that
    # is indefinite), the refine columns of the tables
    for k in (1, 2, 5, 10):
        go(f"refine k={k}, default", "refine", k, None, damping=None)
    if args.lean:
        return
    curvatures = ("hessian", "ggn")
    if args.quick:
        for c in curvatures:
            for k in (1, 2, 5, 10):
                go(f"refine k={k}, {c}, λ = default", "refine", k, c, damping=None)
        for k in (5, 10):
            go(f"refine k={k}, hessian, λ = wd", "refine", k, "hessian", damping=wd)
            go(
                f"refine k={k}, hessian, λ = default, solver=cg",
                "refine cg",
                k,
                "hessian",
                damping=None,
                solver="cg",
            )
        if HAS_FISHER:
            go(
                "refine k=5, ggn, fisher=true, λ = default",
                "refine fisher",
                5,
                "ggn",
                damping=None,
                fisher="true",
            )
        return
    # k curves at the default damping (mean eigenvalue of the logged-space curvature) and two
    # fixed ones
    for label, lam in (("default", None), ("0.1γ", 0.1 * gamma), ("wd", wd)):
        for c in curvatures:
            for k in (1, 2, 5, 10):
                go(f"refine k={k}, {c}, λ = {label}", "refine", k, c, damping=lam)
                go(
                    f"refine k={k}, {c}, λ = {label}, solver=cg",
                    "refine cg",
                    k,
                    c,
                    damping=lam,
                    solver="cg",
                )
    for c in curvatures:
        for label, lam in sweep_full.items():
            go(f"refine k=5, {c}, λ = {label}", "refine sweep", 5, c, damping=lam)
        go(f"refine k=10, {c}, λ = λ_exact", "refine sweep", 10, c, damping=lam_ref)
    for label, lam in (("0.1τ", 0.1 * tau_full), ("0.1γ", 0.1 * gamma)):
        for c in curvatures:
            for pre in ("ekfac", "kfac", "raw", "identity"):
                go(
                    f"refine k=5, {c}, preconditioner={pre}, λ = {label}",
                    "refine preconditioner",
                    5,
                    c,
                    damping=lam,
                    preconditioner=pre,
                )
    if HAS_FISHER:
        for label, lam in (("default", None), ("0.1γ", 0.1 * gamma)):
            for c in curvatures:
                for fisher in ("store", "empirical", "true", "sampled"):
                    go(
                        f"refine k=5, {c}, fisher={fisher}, λ = {label}",
                        "refine fisher",
                        5,
                        c,
                        damping=lam,
                        fisher=fisher,
                    )


def peer_versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in ("logix-ai", "kronfluence"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def accuracy(model: nn.Module, data) -> float:
    """Share of correct argmax predictions (per position for a sequence model)."""
    with torch.no_grad():
        return (model(data[0]).argmax(-1) == data[1]).float().mean().item()


def reference_rows(ex: Explicit, proto, system, explicit_ref, base, task: Task, args) -> Board:
    """The exact rows of the full runs: nnstat's CG exact influence (the reference), the
    explicit Hessian and GGN at its λ and at the sweep's."""
    lam_ref, lam_heur = system["lambda"], system["lambda_heuristic"]
    lam_min = float(ex.evals.min())
    tau_full = float(ex.g_train.square().sum(1).mean()) / ex.g_train.shape[1]
    gamma = ex.ggn_mean_eigenvalue()
    t = time.perf_counter()
    if system["kind"] == "pinv":  # CG on a singular system: not run, the explicit one stands in
        ref, ref_status = explicit_ref, "not run: H + wd·I singular (pseudo-inverse reference)"
    else:
        try:
            ref = exact(base, task.loss, task.train, task.query, damping=lam_ref).scores
            ref_status = "ok"
        except Exception as e:  # reported
            ref, ref_status = explicit_ref, f"failed: {e}"
    t_exact = time.perf_counter() - t
    common = Board(proto, ref)
    common.add(
        f"nnstat exact (CG, λ = {lam_ref:.3g})",
        ref if ref_status == "ok" else None,
        seconds=t_exact,
        status=ref_status,
        group="exact",
        damping=lam_ref,
    )
    common.rows[0]["_explicit_spearman"] = float(
        spearmanr(ref.flatten().numpy(), explicit_ref.flatten().numpy()).statistic
    )
    common.add("explicit Hessian (same λ)", explicit_ref, group="exact", damping=lam_ref)
    common.add("explicit GGN (same λ)", ex.scores(ex.ggn, lam_ref), group="exact", damping=lam_ref)
    variants = (
        ("λ_heur", lam_heur),
        ("wd", args.wd),
        ("0.1τ", 0.1 * tau_full),
        ("0.1γ", 0.1 * gamma),
    )
    for label, lam in () if args.quick else variants:
        if lam == lam_ref:
            continue
        if lam_min + lam > 0:
            common.add(
                f"explicit Hessian, λ = {label}",
                ex.scores(ex.hessian, lam),
                group="exact",
                damping=lam,
            )
        else:
            common.add(
                f"explicit Hessian, λ = {label}",
                None,
                status="indefinite",
                group="exact",
                damping=lam,
            )
        common.add(f"explicit GGN, λ = {label}", ex.scores(ex.ggn, lam), group="exact", damping=lam)
    return common


def lean_reference_rows(ex: Explicit, proto, system, explicit_ref, wd: float, secs: float, linear):
    """The exact rows of a lean run: the explicit Hessian's influence is the reference (first
    row); where it is at λ = wd through a pseudo-inverse, also at the heuristic λ; where the
    system is indefinite, also the GGN at λ = wd; the exact influence on the ``linear``
    parameters alone (what LogIX, Kronfluence and the nn.Linear-only store see). Plus random
    scores, the floor."""
    lam_ref, lam_heur = system["lambda"], system["lambda_heuristic"]
    common = Board(proto, explicit_ref)
    how = ", pseudo-inverse over the flat directions" if system["kind"] == "pinv" else ""
    common.add(
        f"exact: explicit Hessian, λ = {lam_ref:.3g}{how}",
        explicit_ref,
        seconds=secs,
        group="exact",
        damping=lam_ref,
    )
    if system["kind"] == "pinv":
        common.add(
            f"explicit Hessian, λ = λ_heur = {lam_heur:.3g}",
            ex.scores(ex.hessian, lam_heur),
            group="exact",
            damping=lam_heur,
        )
    elif lam_ref != wd:  # indefinite: the Gauss-Newton matrix at the objective's own λ
        common.add(
            f"explicit GGN, λ = wd = {wd:.3g}", ex.scores(ex.ggn, wd), group="exact", damping=wd
        )
    tol = system.get("tol", FLAT_TOL * float(ex.evals.max()))
    common.add(
        f"exact on the nn.Linear parameters only ({int(linear.sum())}), λ = {lam_ref:.3g}",
        ex.restricted_scores(linear, lam_ref, tol),
        group="exact restricted",
        damping=lam_ref,
    )
    gen = torch.Generator().manual_seed(0)
    common.add("random scores", torch.randn(explicit_ref.shape, generator=gen), group="baseline")
    return common


def full_mean_eigenvalue(model: nn.Module, task: Task) -> float:
    """τ of the unprojected parameters without building a Hessian: ``E‖g_i‖² / P`` over the
    training examples, each ``g_i`` the float64 gradient of its own loss (as `Explicit`'s)."""
    m64 = copy.deepcopy(model).double()
    x, y = task.train
    total = 0.0
    for i in range(len(x)):
        m64.zero_grad()
        xi = x[i : i + 1].double() if x.is_floating_point() else x[i : i + 1]
        task.loss(m64(xi), y[i : i + 1]).backward()
        total += float(sum(p.grad.square().sum() for p in m64.parameters()))
    return total / len(x) / sum(p.numel() for p in m64.parameters())


def no_reference_rows(proto, task: Task) -> Board:
    """The shared rows of a run without the exact reference (``--no-exact``): that row marked
    not run (no Spearman column), and random scores, the floor."""
    common = Board(proto, None)
    common.add("exact: not run (--no-exact)", None, status="not run", group="exact")
    gen = torch.Generator().manual_seed(0)
    shape = (len(task.query[0]), len(task.train[0]))
    common.add("random scores", torch.randn(shape, generator=gen), group="baseline")
    return common


def logra_rows(common: Board, base, task: Task, method: str, root: Path, rank: int) -> None:
    """LogIX's LoGra at ``rank`` (its LoRA projection, its own initialisation) with each of its
    scheduler's curvatures: its default damping and 0.1, 1 and 10 x τ_s, its rows' mean
    eigenvalue."""
    labels = ("default (0.1 × mean eigenvalue of the first module)", "0.1τ_s", "τ_s", "10τ_s")
    for hessian in ("raw", "kfac", "ekfac"):
        t = time.perf_counter()
        try:
            out, info = logix_scores(
                copy.deepcopy(base),
                task.train,
                task.query,
                root,
                f"logra_{task.name}_{method}_{hessian}",
                hessian,
                [None],
                task.loss,
                lora_rank=rank,
                relative_dampings=(0.1, 1.0, 10.0),
            )
        except Exception as e:
            traceback.print_exc()
            common.add(f"LogIX LoGra {hessian}", None, status=f"failed: {e}", group="peer")
            continue
        secs = (time.perf_counter() - t) / len(out)
        for label, lam, s in zip(labels, info["dampings"], out, strict=True):
            common.add(
                f"LogIX 0.1.1 LoGra rank {rank} {hessian.upper()}, λ = {label}",
                s,
                seconds=secs,
                group="peer",
                peer="logra",
                preconditioner=hessian,
                damping=lam,
                bytes_per_row=info["bytes_per_row"],
                columns=info["columns"],
                note=f"{info['bytes_per_row']:,} bytes per row",
            )


def store_bytes(store) -> int:
    """Bytes per stored row of an nnstat store (its columns x its dtype's size)."""
    return store.row_width * np.dtype(STORE_DTYPES[store.dtype][0]).itemsize


def bench_setting(task: Task, method: str, args, root: Path) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    train_fn = trainer(task, method, args)
    t = time.perf_counter()
    base = train_fn(torch.arange(len(task.train[0])))
    t_train = time.perf_counter() - t
    n_params = sum(p.numel() for p in base.parameters())
    gnorm = objective_grad_norm(base, task, args.wd)
    acc_train, acc_query = accuracy(base, task.train), accuracy(base, task.query)
    with torch.no_grad():
        loss_train = task.loss(base(task.train[0]), task.train[1]).item()
        loss_query = task.loss(base(task.query[0]), task.query[1]).item()

    def query_losses(model):
        return task.loss(model(task.query[0]), task.query[1], reduction="none")

    retrain_gnorms: list[float] = []

    def retrain(indices: torch.Tensor) -> nn.Module:
        model = train_fn(indices)
        retrain_gnorms.append(objective_grad_norm(model, task, args.wd, indices))
        return model

    t = time.perf_counter()
    proto = run_lds_protocol(retrain, len(task.train[0]), query_losses, m=args.m, seed=1)
    t_proto = time.perf_counter() - t

    t = time.perf_counter()
    if args.no_exact and not (args.quick or args.lean):
        raise ValueError("--no-exact: the full method set needs γ and λ_exact; add --quick")
    if args.no_exact:  # no Hessian: τ from per-example gradients, no γ, λ_exact = wd
        ex, tau_full, gamma = None, full_mean_eigenvalue(base, task), None
        lam_min = lam_max = float("nan")
        system = {"kind": "none", "lambda": args.wd, "lambda_heuristic": args.wd}
    else:
        ex = Explicit(base, task.train, task.query, task.loss)
        lam_min, lam_max = float(ex.evals.min()), float(ex.evals.max())
        system = reference_system(ex, args.wd)
        tau_full = float(ex.g_train.square().sum(1).mean()) / ex.g_train.shape[1]
        # lean runs estimate the GGN's trace (32 probes) rather than build it
        gamma = ex.ggn_mean_eigenvalue(probes=32 if args.lean else 0)
    t_explicit = time.perf_counter() - t
    lam_ref, lam_heur = system["lambda"], system["lambda_heuristic"]
    header = {
        "task": task.name,
        "describe": task.describe,
        "train": method,
        "n_params": n_params,
        "n_train": len(task.train[0]),
        "n_query": len(task.query[0]),
        "m": args.m,
        "train_seconds": t_train,
        "objective_grad_norm": gnorm,
        "retrain_grad_norm_median": float(np.median(retrain_gnorms)),
        "retrain_grad_norm_max": float(np.max(retrain_gnorms)),
        "retrain_grad_norm_quantiles": {
            q: float(np.quantile(retrain_gnorms, q)) for q in (0.1, 0.5, 0.9)
        },
        "train_accuracy": acc_train,
        "query_accuracy": acc_query,
        "train_loss": loss_train,
        "query_loss": loss_query,
        "protocol_seconds": t_proto,
        "explicit_seconds": t_explicit,
        "hessian_eig_min": lam_min,
        "hessian_eig_max": lam_max,
        "hessian_eig_mean": None if ex is None else float(ex.evals.mean()),
        "ggn_eig_mean": gamma,
        "lambda_heuristic": lam_heur,
        "lambda_exact": lam_ref,
        "reference_system": system,
        "tau_full": tau_full,
        "gamma": gamma,
        "wd": args.wd,
        "threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "peers": peer_versions(),
        **task.info,
    }
    rule = {
        "pinv": "wd, pseudo-inverse",
        "solve": "wd" if lam_ref == args.wd else "heuristic",
        "none": "not built (--no-exact)",
    }
    print(
        f"\n### {task.describe}, {method} ({n_params} parameters)\n\n"
        f"train {t_train:.1f} s, ‖∇objective‖ = {gnorm:.2e} (LDS retrainings: median "
        f"{header['retrain_grad_norm_median']:.1e}, max {header['retrain_grad_norm_max']:.1e}), "
        f"loss train {loss_train:.3f} / query {loss_query:.3f}, accuracy train {acc_train:.3f} / "
        f"query {acc_query:.3f}; LDS protocol {t_proto:.0f} s (m = {args.m}); explicit "
        f"{t_explicit:.0f} s; Hessian eigenvalues [{lam_min:.3g}, {lam_max:.3g}], "
        f"λ_exact = {lam_ref:.3g} ({rule[system['kind']]}), λ_heur = {lam_heur:.3g}; "
        f"reference system {system}\n",
        flush=True,
    )
    results = []
    if ex is None:
        common = no_reference_rows(proto, task)
    else:
        if system["kind"] == "pinv":
            explicit_ref = ex.pinv_scores(lam_ref, system["tol"])
        else:
            explicit_ref = ex.scores(ex.hessian, lam_ref)
        if args.lean:
            linear = module_mask(base, nn.Linear)
            common = lean_reference_rows(
                ex, proto, system, explicit_ref, args.wd, t_explicit, linear
            )
        else:
            common = reference_rows(ex, proto, system, explicit_ref, base, task, args)
            header["exact_vs_explicit_spearman"] = common.rows[0].pop("_explicit_spearman")
    sweep = damping_sweep(tau_full, gamma, args.wd)
    if args.quick or args.lean:  # a small sweep: the best peer setting is still searched for
        sweep = {k: sweep[k] for k in ("0.1τ", "τ", "0.1γ", "wd") if k in sweep}
    if "logra" in args.peers:
        logra_rows(common, base, task, method, root, args.logra_rank)
    if "logix" in args.peers:
        for hessian in ("kfac", "ekfac"):
            dampings = [None, *sweep.values()]
            labels = ["default (0.1 × mean eigenvalue of the first module)", *sweep]
            t = time.perf_counter()
            try:
                out, _ = logix_scores(
                    copy.deepcopy(base),
                    task.train,
                    task.query,
                    root,
                    f"logix_{task.name}_{method}_{hessian}",
                    hessian,
                    dampings,
                    task.loss,
                )
            except Exception as e:
                traceback.print_exc()
                common.add(f"LogIX {hessian}", None, status=f"failed: {e}", group="peer")
                continue
            secs = (time.perf_counter() - t) / len(dampings)
            for label, lam, s in zip(labels, dampings, out, strict=True):
                common.add(
                    f"LogIX 0.1.1 {hessian.upper()}, λ = {label}",
                    s,
                    seconds=secs,
                    group="peer",
                    peer="logix",
                    damping=lam,
                )
    if "kronfluence" in args.peers:
        short = args.quick or args.lean
        dampings = [1e-8, None, *([] if short else sweep.values())]
        labels = [
            "1e-8 (default)",
            "heuristic (damping_factor=None)",
            *([] if short else sweep),
        ]
        t = time.perf_counter()
        try:
            out = kronfluence_scores(
                base,
                task.train,
                task.query,
                root,
                f"kf_{task.name}_{method}",
                dampings,
                task.loss,
            )
            secs = (time.perf_counter() - t) / len(dampings)
            for label, lam, s in zip(labels, dampings, out, strict=True):
                common.add(
                    f"Kronfluence 1.0.1 EK-FAC, λ = {label}",
                    s,
                    seconds=secs,
                    group="peer",
                    peer="kronfluence",
                    damping=lam,
                )
        except Exception as e:
            traceback.print_exc()
            common.add("Kronfluence EK-FAC", None, status=f"failed: {e}", group="peer")
    results.append({**header, "projection": "shared (store-independent)", "rows": common.rows})
    print_table(common.rows)
    ctx = {
        "model": base,
        "train": task.train,
        "query": task.query,
        "tau_full": tau_full,
        "lam_ref": lam_ref,
        "gamma": gamma,
        "loss": task.loss,
    }
    # lean runs add a store of the nn.Linear modules only (what LogIX and Kronfluence cover) at
    # the first of the ranks
    stores = [(rank, None, None) for rank in args.ranks]
    stores += [(args.ranks[0], nn.Linear, None)] if args.lean else []
    # factored rows (--factors): each "rank:c" pair, of the modules the dense stores cover or
    # ("rank:c:linear") of the nn.Linear modules only
    stores += [(rank, nn.Linear if linear else None, c) for rank, c, linear in args.factors]
    for rank, types, factors in stores:
        project = f"{task.name}_{method}_" + ("full" if rank is None else f"rank{rank}")
        project += ("_linear" if types else "") + (f"_c{factors}" if factors else "")
        t = time.perf_counter()
        log, loader = nnstat_logs(
            base,
            task.train,
            task.query,
            root,
            project,
            rank,
            args.proj_init,
            task.loss,
            types,
            factors,
        )
        t_log = time.perf_counter() - t
        label = "unprojected" if rank is None else f"rank {rank} per side ({args.proj_init})"
        label += ", nn.Linear modules only" if types else ""
        store = loader.dataset.store
        width, nbytes = store.row_width, store_bytes(store)
        label += f", factored c = {factors}" if factors else ""
        label += f" ({width} columns, {nbytes:,} bytes per row)"
        print(f"\n#### nnstat store: {label} (logging {t_log:.1f} s)\n", flush=True)
        board = Board(proto, common.reference)
        bench_store(board, ctx, log, loader, args, projected=rank is not None)
        entry = {
            **header,
            "projection": label,
            "store": {
                "rank": rank,
                "factors": factors,
                "linear_only": types is not None,
                "columns": width,
                "bytes_per_row": nbytes,
                "factor_energy": store.meta.get("factor_energy"),
            },
            "logging_seconds": t_log,
            "rows": board.rows,
        }
        if rank is None and types is None and args.counterfactual:
            entry["counterfactual"] = counterfactual_check(
                train_fn, base, task, query_losses, log, loader, args
            )
        results.append(entry)
        print_table(board.rows)
    return results


def counterfactual_check(train_fn, base, task, query_losses, log, loader, args) -> dict:
    """Remove the k training examples most helpful to all queries jointly by EK-FAC influence,
    by its RelatIF form, by the highest training loss, and at random; retrain each from the
    same seeds (`nnstat.influence.counterfactual`) and report the queries' loss change."""
    k = args.counterfactual
    scores = {
        mode: compute_influence_all(log, loader, mode=mode, progress=False)
        for mode in ("dot", "relatif")
    }
    with torch.no_grad():
        train_loss = task.loss(base(task.train[0]), task.train[1], reduction="none")
    t = time.perf_counter()
    out = {}
    for mode, res in scores.items():
        cf = nnstat.influence.counterfactual(
            train_fn,
            query_losses,
            in_train_order(res),
            k,
            direction="helpful",
            baselines={"loss": train_loss} if mode == "dot" else None,
            random=mode == "dot",
            repeats=args.counterfactual_repeats,
        )
        for name, arm in cf.arms.items():
            label = {"scores": f"ekfac {mode}"}.get(name, name)
            out[label] = {"mean": arm.mean, "interval": list(arm.interval), "change": arm.change}
    secs = time.perf_counter() - t
    print(
        f"\ncounterfactual (k = {k} most helpful to the {len(task.query[0])} queries jointly "
        f"removed, retrained {args.counterfactual_repeats}x from the same seeds, {secs:.0f} s): "
        "mean query-loss change [95% interval]"
    )
    for label, row in out.items():
        lo, hi = row["interval"]
        print(f"  {label:<15} {row['mean']:+.4f} [{lo:+.4f}, {hi:+.4f}]")
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\n| method | LDS (mean ± s.e.) | Spearman vs exact | time (s) | products | passes | "
        "damping | note |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        if not row["method"].startswith("_"):
            print(fmt_row(row))
    print(flush=True)


# ------------------------------------------------------------------------------ summary
def _best(rows: list[dict[str, Any]], pred: Callable[[dict[str, Any]], bool]):
    ok = [r for r in rows if pred(r) and r.get("lds") is not None]
    return max(ok, key=lambda r: r["lds"]) if ok else None


def _one(rows: list[dict[str, Any]], method: str):
    return next((r for r in rows if r["method"] == method), None)


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task x training x projection: best peer, defaults and refinement side by side, from the rows above."""
    out = []
    shared = {
        (r["task"], r["train"]): r["rows"] for r in results if r["projection"].startswith("shared")
    }
    for res in results:
        if res["projection"].startswith("shared"):
            continue
        common = shared[(res["task"], res["train"])]
        rows = res["rows"]
        peer = _best(common, lambda r: r.get("group") == "peer")
        ex = common[0]
        default = _one(rows, "nnstat ekfac (default damping)")
        best_unref = _best(rows, lambda r: str(r.get("group", "")).startswith("unrefined"))
        k5 = {c: _one(rows, f"refine k=5, {c}, λ = default") for c in ("hessian", "ggn")}
        k10 = {c: _one(rows, f"refine k=10, {c}, λ = default") for c in ("hessian", "ggn")}
        best_k5 = _best(rows, lambda r: r.get("steps") == 5)
        best_k10 = _best(rows, lambda r: r.get("steps") == 10)

        def lds(r):
            return None if r is None else r.get("lds")

        def pair(r):
            if r is None or r.get("lds") is None:
                return None if r is None else r.get("status")
            return [r["lds"], r["sem"]]

        def refine_row(c, lam, rows=rows):
            return {k: pair(_one(rows, f"refine k={k}, {c}, λ = {lam}")) for k in (1, 2, 5, 10)}

        ks = {c: refine_row(c, "default") for c in ("hessian", "ggn")}
        # the Hessian's curve where it is positive definite along CG, else the GGN's
        curve = "hessian" if all(isinstance(v, list) for v in ks["hessian"].values()) else "ggn"
        library = {k: _one(rows, f"refine k={k}, default") for k in (1, 2, 5, 10)}
        if all(library.values()):  # runs with the library-default rows: those are the columns
            ks[curve] = {k: pair(r) for k, r in library.items()}
            marks = {
                k: ("ᴳ" if str(r.get("curvature_used", "")).startswith("ggn") else "")
                + ("ʳ" if "raised" in str(r.get("damping_rule", "")) else "")
                for k, r in library.items()
            }
        else:
            marks = {k: "ᴳ" if curve == "ggn" else "" for k in (1, 2, 5, 10)}
        logix_kfac = _one(
            common, "LogIX 0.1.1 KFAC, λ = default (0.1 × mean eigenvalue of the first module)"
        )
        kf_heur = _one(common, "Kronfluence 1.0.1 EK-FAC, λ = heuristic (damping_factor=None)")

        out.append(
            {
                "task": res["task"],
                "train": res["train"],
                "projection": res["projection"],
                "best_peer": None if peer is None else (peer["method"], peer["lds"]),
                "nnstat_default": lds(default),
                "best_unrefined": (
                    None if best_unref is None else (best_unref["method"], best_unref["lds"])
                ),
                "refine5_default": {c: lds(r) if r else None for c, r in k5.items()},
                "refine5_default_status": {
                    c: r.get("status") if r else None for c, r in k5.items()
                },
                "best_refine5": None if best_k5 is None else (best_k5["method"], best_k5["lds"]),
                "refine10_default": {c: lds(r) if r else None for c, r in k10.items()},
                "refine10_default_status": {
                    c: r.get("status") if r else None for c, r in k10.items()
                },
                "best_refine10": (
                    None if best_k10 is None else (best_k10["method"], best_k10["lds"])
                ),
                "exact": ex.get("lds"),
                "table": {
                    "best_peer": None if peer is None else [*pair(peer), peer["method"]],
                    "logix_kfac_default": pair(logix_kfac),
                    "kronfluence_heuristic": pair(kf_heur),
                    "nnstat_ekfac_default": pair(default),
                    "refine_curvature": curve,
                    "refine_default": ks[curve],
                    "refine_marks": marks,
                    "refine_default_other": ks["ggn" if curve == "hessian" else "hessian"],
                    "refine_wd": {
                        k: pair(_one(rows, f"refine k={k}, hessian, λ = wd")) for k in (5, 10)
                    },
                    "refine_cg": {
                        k: pair(_one(rows, f"refine k={k}, hessian, λ = default, solver=cg"))
                        for k in (5, 10)
                    },
                    "nnstat_kfac_default": pair(_one(rows, "nnstat kfac (default damping)")),
                    "refine5_fisher_true": pair(
                        _one(rows, "refine k=5, ggn, fisher=true, λ = default")
                    ),
                    "exact": pair(ex),
                },
                "refine5_passes_per_block": next(
                    (
                        r.get("passes_per_block")
                        for r in k5.values()
                        if r and r.get("passes_per_block")
                    ),
                    None,
                ),
            }
        )
    return out


def print_summary(summary: list[dict[str, Any]]) -> None:
    def f(x):
        if x is None:
            return "–"
        if isinstance(x, (tuple, list)):
            return f"{x[1]:.3f} ({x[0]})"
        return f"{x:.3f}"

    def g(d, s):
        return " / ".join(f(d[c]) if d[c] is not None else str(s.get(c) or "–") for c in d)

    print("\n## Summary (LDS; refine default = damping None, hessian / ggn)\n")
    print(
        "| task | training | store | best peer | nnstat default | best unrefined | refine k=5 "
        "default | best k=5 | refine k=10 default | best k=10 | exact | k=5 passes/block |"
    )
    print("| --- | --- | --- | --- | ---: | --- | ---: | --- | ---: | --- | ---: | ---: |")
    for s in summary:
        print(
            f"| {s['task']} | {s['train']} | {s['projection']} | {f(s['best_peer'])} | "
            f"{f(s['nnstat_default'])} | {f(s['best_unrefined'])} | "
            f"{g(s['refine5_default'], s['refine5_default_status'])} | {f(s['best_refine5'])} | "
            f"{g(s['refine10_default'], s['refine10_default_status'])} | {f(s['best_refine10'])} | {f(s['exact'])} | "
            f"{s['refine5_passes_per_block']} |"
        )


def storage_table(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per task x training, one row per store (nnstat's, and LogIX's LoGra): bytes per row, the
    factor against the first dense nnstat store of all modules, LDS of raw / K-FAC / EK-FAC at
    the default damping and refine k=5 (nnstat), LoGra's best over its dampings."""
    out = []
    for res in results:
        rows = res["rows"]
        if res["projection"].startswith("shared"):
            logra = [r for r in rows if r.get("peer") == "logra"]
            if logra:
                best = {
                    kind: _best(logra, lambda r, kind=kind: r.get("preconditioner") == kind)
                    for kind in ("raw", "kfac", "ekfac")
                }
                out.append(
                    {
                        "task": res["task"],
                        "train": res["train"],
                        "store": logra[0]["method"].split(" RAW")[0].split(" KFAC")[0],
                        "bytes_per_row": logra[0]["bytes_per_row"],
                        "lds": {
                            k: None if r is None else [r["lds"], r["sem"]] for k, r in best.items()
                        },
                        "damping": {
                            k: None if r is None else r["method"].split("λ = ")[1]
                            for k, r in best.items()
                        },
                    }
                )
            continue
        if "store" not in res:
            continue
        lds = {}
        for key, method in (
            ("raw", "nnstat raw (default damping)"),
            ("kfac", "nnstat kfac (default damping)"),
            ("ekfac", "nnstat ekfac (default damping)"),
            ("refine5", "refine k=5, default"),
        ):
            r = _one(rows, method)
            lds[key] = None if r is None or r["lds"] is None else [r["lds"], r["sem"]]
        out.append(
            {
                "task": res["task"],
                "train": res["train"],
                "store": store_name(res["store"]),
                "bytes_per_row": res["store"]["bytes_per_row"],
                "dense_all": res["store"]["factors"] is None and not res["store"]["linear_only"],
                "factor_energy": res["store"]["factor_energy"],
                "lds": lds,
            }
        )
    return out


def store_name(store: dict[str, Any]) -> str:
    """``nnstat rank 64, factored c = 4`` from an entry's ``store``."""
    name = "nnstat " + ("unprojected" if store["rank"] is None else f"rank {store['rank']}")
    name += ", nn.Linear modules only" if store["linear_only"] else ""
    return name + (f", factored c = {store['factors']}" if store["factors"] else "")


def print_storage_table(table: list[dict[str, Any]]) -> None:
    """`storage_table` as markdown, one table per task x training."""

    def f(x):
        return "–" if x is None else f"{x[0]:.3f} ± {x[1]:.3f}"

    for key in dict.fromkeys((t["task"], t["train"]) for t in table):
        rows = [t for t in table if (t["task"], t["train"]) == key]
        dense = next((t["bytes_per_row"] for t in rows if t.get("dense_all")), None)
        print(f"\n## Storage and LDS, {key[0]} / {key[1]} (LoGra: best of its dampings)\n")
        print("| store | bytes per row | vs dense | raw | K-FAC | EK-FAC | refine k=5 |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for t in rows:
            ratio = "" if dense is None else dense / t["bytes_per_row"]
            if ratio:
                ratio = f"{ratio:.2g}× fewer" if ratio >= 1 else f"{1 / ratio:.2g}× more"
            lds = t["lds"]
            print(
                f"| {t['store']} | {t['bytes_per_row']:,} | {ratio} | {f(lds['raw'])} | "
                f"{f(lds['kfac'])} | {f(lds['ekfac'])} | {f(lds.get('refine5'))} |"
            )


def print_doc_tables(summary: list[dict[str, Any]]) -> None:
    """One table per store projection: the columns of docs/benchmarks.md."""

    def f(x):
        if x is None:
            return "–"
        if isinstance(x, str):
            return x if x in ("indefinite", "not run") else "failed"
        return f"{x[0]:.3f} ± {x[1]:.3f}"

    for proj in dict.fromkeys(s["projection"] for s in summary):
        print(
            f"\n## LDS, store {proj} (refine: the library defaults; ᴳ the Gauss-Newton fallback, "
            "ʳ the default damping raised past negative Hessian curvature)\n"
        )
        print(
            "| task / training | best peer (setting) | LogIX K-FAC default | Kronfluence heuristic "
            "| nnstat kfac default | nnstat ekfac default | refine k=1 | k=2 | k=5 | k=10 "
            "| per-query CG k=5 | k=10 | exact |"
        )
        print(
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
            "| ---: |"
        )
        for s in summary:
            if s["projection"] != proj:
                continue
            t = s["table"]
            marks = t.get("refine_marks") or {}
            peer = t["best_peer"]
            peer_s = "–" if peer is None else f"{f(peer[:2])} ({peer[2]})"
            ref = " | ".join(f(t["refine_default"][k]) + marks.get(k, "") for k in (1, 2, 5, 10))
            print(
                f"| {s['task']} / {s['train']} | {peer_s} | {f(t['logix_kfac_default'])} | "
                f"{f(t['kronfluence_heuristic'])} | {f(t['nnstat_kfac_default'])} | "
                f"{f(t['nnstat_ekfac_default'])} | {ref} | "
                f"{f(t['refine_cg'][5])} | {f(t['refine_cg'][10])} | {f(t['exact'])} |"
            )


# ------------------------------------------------------------------------------ main
def parse_factors(spec: str) -> tuple[int, int, bool]:
    """``"64:4"`` -> ``(64, 4, False)``; ``"64:4:linear"`` -> ``(64, 4, True)`` (the store of
    the nn.Linear modules only)."""
    parts = spec.strip().split(":")
    if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "linear"):
        raise ValueError(f"--factors: {spec!r} is not rank:c or rank:c:linear")
    return int(parts[0]), int(parts[1]), len(parts) == 3


def main() -> None:
    from _lm_task import add_arguments as add_lm_arguments

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="mlp,logreg,cnn", help="of mlp, logreg, cnn, cancer, lm")
    # flags defaulting to None take the task's value from TASK_DEFAULTS
    ap.add_argument("--train", choices=["lbfgs", "adam", "both", "adam+lbfgs"], default=None)
    ap.add_argument("--n-train", type=int, default=None)
    ap.add_argument("--n-query", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=24)
    ap.add_argument("--steps", type=int, default=None, help="Adam steps")
    ap.add_argument("--lr", type=float, default=None, help="Adam learning rate")
    ap.add_argument("--lbfgs-iter", type=int, default=None, help="L-BFGS iterations (max)")
    ap.add_argument("--wd", type=float, default=None, help="L2 coefficient (both trainings)")
    ap.add_argument("--m", type=int, default=50, help="LDS subsets")
    ap.add_argument("--ranks", default=None, help="store projections: none and/or ranks")
    ap.add_argument("--proj-init", choices=["random", "pca"], default="random")
    ap.add_argument(
        "--factors",
        default="",
        help="factored stores as rank:c pairs, e.g. 64:8,256:8 (nnstat.setup(factors=c)); "
        "rank:c:linear for one of the nn.Linear modules only",
    )
    ap.add_argument("--threads", type=int, default=1, help="torch threads")
    ap.add_argument(
        "--peers",
        default="logix,logra,kronfluence",
        help="of logix (its K-FAC/EK-FAC, unprojected), logra (LogIX's LoGra), kronfluence",
    )
    ap.add_argument("--no-peers", action="store_true", help="--peers ''")
    ap.add_argument("--logra-rank", type=int, default=64, help="rank of LogIX's LoGra")
    ap.add_argument(
        "--no-exact",
        action="store_true",
        help="no explicit Hessian (models too large for it): no exact row, no Spearman",
    )
    ap.add_argument("--quick", action="store_true", help="only the methods of the docs' tables")
    ap.add_argument(
        "--lean", action="store_true", default=None, help="only the rows of the transformer table"
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON file for all results")
    ap.add_argument(
        "--counterfactual", type=int, default=None, help="k of the counterfactual check (0: off)"
    )
    ap.add_argument("--counterfactual-repeats", type=int, default=3)
    add_lm_arguments(ap)
    args = ap.parse_args()
    args.factors = [parse_factors(p) for p in args.factors.split(",") if p]
    args.peers = set() if args.no_peers else {p.strip() for p in args.peers.split(",") if p}
    unknown = args.peers - {"logix", "logra", "kronfluence"}
    if unknown:
        ap.error(f"--peers: unknown {sorted(unknown)}; choose of logix, logra, kronfluence")
    torch.set_num_threads(args.threads)
    print(f"nnstat refinement `fisher` field: {'yes' if HAS_FISHER else 'not yet'}")
    config = {k: v for k, v in vars(args).items() if k != "out"}
    results: list[dict[str, Any]] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        for name in args.tasks.split(","):
            targs = task_args(args, name.strip())
            task = make_task(name.strip(), targs)
            trainings = ["lbfgs", "adam"] if targs.train == "both" else [targs.train]
            for method in trainings:
                for res in bench_setting(task, method, targs, Path(d)):
                    res["args"] = {k: v for k, v in vars(targs).items() if k != "out"}
                    results.append(res)
                if args.out is not None:
                    payload = {"config": config, "has_fisher": HAS_FISHER, "results": results}
                    args.out.write_text(json.dumps(payload, indent=1, default=str))
    summary = summarize(results)
    print_summary(summary)
    print_doc_tables(summary)
    storage = storage_table(results)
    print_storage_table(storage)
    if args.out is not None:
        payload = {"config": config, "has_fisher": HAS_FISHER, "results": results}
        payload["summary"] = summary
        payload["storage"] = storage
        args.out.write_text(json.dumps(payload, indent=1, default=str))
    print(f"total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
