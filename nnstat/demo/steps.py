"""The demo's explain-afterwards steps: noise scale during training, projected per-sample
gradients of the training set, influence for the misclassified test digits, the HTML report.

Each step takes the demo's state (see :mod:`nnstat.demo`); what they produce lives in
``state.extras`` (:class:`DemoExtras`).

Example:
    >>> from nnstat.demo import main
    >>> main(["--epochs", "1", "--no-wandb"])  # doctest: +SKIP
"""

from __future__ import annotations

import math
import platform
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

import nnstat

__all__ = [
    "DemoExtras",
    "watch_training",
    "log_training_gradients",
    "explain_misclassified",
    "write_report",
]

NOISE_SCALE_EVERY = 4  # logged steps between two noise-scale estimates
RANK = 16  # projection rank per module of the gradient store
REFINE_STEPS = 5  # conjugate-gradient steps of the influence refinement
TOP_K = 5


@dataclass
class DemoExtras:
    """What the explain-afterwards steps produce."""

    history: list[dict[str, Any]] = field(default_factory=list)
    run: Any = None
    misclassified: list[int] = field(default_factory=list)
    predicted: torch.Tensor | None = None
    influence: Any = None
    report_path: Path | None = None
    started: float = field(default_factory=time.perf_counter)
    timings: dict[str, float] = field(default_factory=dict)


def extras(state: Any) -> DemoExtras:
    """The :class:`DemoExtras` of a demo state (created on first use)."""
    if getattr(state, "extras", None) is None:
        state.extras = DemoExtras()
    return state.extras


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def watch_training(state: Any) -> None:
    """Keep every logged metric dict for the report, and estimate the noise scale (per-sample
    method, with its bootstrap interval) every few logged steps, logged like any statistic."""
    ex = extras(state)
    state.tracker.add_sink(
        lambda metrics, step: ex.history.append({**_scalars(metrics), "step": step})
    )
    calls = {"n": 0}
    data = (state.X_train, state.y_train)
    quick = state.config.quick

    def noise_scale() -> dict[str, float]:
        calls["n"] += 1
        if (calls["n"] - 1) % NOISE_SCALE_EVERY:
            return {}
        with warnings.catch_warnings():
            # near convergence |G|^2 can be estimated <= 0: b_simple is then inf, which the
            # report explains; one warning per estimate would only clutter the console
            warnings.filterwarnings("ignore", message=r"the \|G\|\^2 estimate")
            result = nnstat.noise_scale(
                state.model, nn.functional.cross_entropy, data, method="per_sample",
                big_batch=128 if quick else 512, n_estimates=4 if quick else 16, seed=calls["n"],
            )  # fmt: skip
        return {k: v for k, v in result.to_dict().items() if k.count("/") == 1}

    state.tracker.add_provider(noise_scale)


def log_training_gradients(state: Any) -> None:
    """The LogIX-style logging pass: EK-FAC statistics and rank-16 projected per-sample
    gradients of every training digit, written to a gradient store."""
    ex, cfg = extras(state), state.config
    t0 = time.perf_counter()
    root = cfg.log_dir / "gradients"
    # a new demo run logs a new model: the previous run's store would be refused (other
    # projection) or, with the same seed, resumed; the demo owns this folder, so start afresh
    shutil.rmtree(root / "digits", ignore_errors=True)
    run = nnstat.init(project="digits", root_dir=root)
    nnstat.setup({"log": "grad", "save": "grad", "statistic": "ekfac"})
    nnstat.watch(state.model)
    nnstat.add_projection(rank=RANK, init="random", seed=cfg.seed)
    model, X, y = state.model, state.X_train, state.y_train
    model.eval()
    from tqdm.auto import tqdm

    for i, _ in enumerate(run.schedule()):
        starts = range(0, len(X), 128)
        for s in tqdm(starts, desc=f"logging pass {i + 1}/2", leave=False):
            with run(data_id=list(range(s, min(s + 128, len(X))))):
                loss = nn.functional.cross_entropy(
                    model(X[s : s + 128]), y[s : s + 128], reduction="sum"
                )
                loss.backward()
            model.zero_grad(set_to_none=True)
    ex.run = run
    ex.timings["log gradients"] = time.perf_counter() - t0
    print(f"gradient store: {run.path} ({len(nnstat.GradientStore(run.path))} training digits)")


def explain_misclassified(state: Any) -> None:
    """Influence of every training digit on the model's (wrong) prediction for each
    misclassified test digit: the query loss uses the predicted class, so the most helpful
    training digits are those that pushed the model towards that prediction."""
    ex = extras(state)
    t0 = time.perf_counter()
    model, run = state.model, ex.run
    model.eval()
    with torch.no_grad():
        pred = model(state.X_test).argmax(1)
    wrong = (pred != state.y_test).nonzero().flatten().tolist()
    ex.misclassified, ex.predicted = wrong, pred
    if not wrong:
        print("no misclassified test digit: nothing to explain")
        return
    nnstat.eval()
    with run(data_id=wrong):
        loss = nn.functional.cross_entropy(model(state.X_test[wrong]), pred[wrong], reduction="sum")
        loss.backward()
    model.zero_grad(set_to_none=True)
    # refined: 5 conjugate-gradient steps on the exact Gauss-Newton curvature of the training
    # loss, preconditioned by the run's EK-FAC (5 passes over the training digits)
    refine = nnstat.influence.Refinement(
        model,
        nn.functional.cross_entropy,
        (state.X_train, state.y_train),
        query_data=(state.X_test[wrong], pred[wrong]),
        steps=REFINE_STEPS,
        curvature="ggn",
        progress=False,
    )
    ex.influence = nnstat.influence.compute_influence_all(nnstat.get_log(), run.path, refine=refine)
    ex.timings["influence"] = time.perf_counter() - t0
    print(
        f"influence: {len(wrong)} misclassified test digits x {len(state.X_train)} training digits "
        f"({REFINE_STEPS} refinement steps, {ex.influence.meta['refine']['seconds']:.1f} s)"
    )


def _images(state: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw 8x8 images in the demo's order (the training tensors are standardised)."""
    if getattr(state, "images_train", None) is not None:
        return state.images_train, state.images_test
    from sklearn.datasets import load_digits

    X = torch.tensor(load_digits().images, dtype=torch.float32)
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(state.config.seed))
    X = X[perm][: len(state.X_train) + len(state.X_test)]
    return X[: len(state.X_train)], X[len(state.X_train) :]


def write_report(state: Any) -> None:
    """The HTML report: statistics over training, trust ratios, noise scale, and each
    misclassified digit beside the training digits that most drove its prediction."""
    import nnstat.plot as nplt
    from nnstat.demo.report import HtmlReport

    ex, cfg = extras(state), state.config
    hist = ex.history
    rep = HtmlReport(
        "nnstat demo: a small MLP on scikit-learn digits",
        f"{time.strftime('%Y-%m-%d %H:%M')} · {platform.machine()} CPU, torch {torch.__version__}"
        f" · nnstat {nnstat.__version__}",
    )
    noise = [h for h in hist if "noise_scale/b_simple" in h]
    last_noise = noise[-1] if noise else {}
    b = last_noise.get("noise_scale/b_simple", math.nan)
    rep.section("Summary")
    rep.table(
        {
            "training / test digits": f"{len(state.X_train)} / {len(state.X_test)}",
            "epochs, batch size": f"{cfg.epochs}, {cfg.batch_size}",
            "test accuracy": f"{state.accuracy:.3f}",
            "misclassified test digits": len(ex.misclassified),
            "noise scale B_simple (last estimate)": _interval(last_noise) if noise else "n/a",
            "gradient store": str(ex.run.path) if ex.run else "n/a",
            "TensorBoard logs": str(cfg.log_dir / "tensorboard"),
            "time from training to report": f"{time.perf_counter() - ex.started:.1f} s",
        }
    )
    rep.section(
        "Statistics over training",
        "Every 5th step the Tracker reduced each parameter, gradient, Adam state and update to a "
        "few statistics in one fused pass; these are the same numbers TensorBoard/W&B received.",
    )
    rep.figure(
        nplt.stat_heatmap(hist, "l2", prefix="grad/"),
        "Gradient L2 norm per layer (log colour scale).",
    )
    rep.figure(
        nplt.stat_heatmap(hist, "rms", prefix="update/"), "RMS of each step's update per layer."
    )
    W = nnstat.get_weight(state.model)
    first = next(iter(W))
    rep.figure(
        nplt.weight_heatmap(W, first),
        f"Final weights of {first}: rows are hidden units, columns the 64 pixels.",
    )
    rep.figure(
        nplt.histogram(W, [n for n in W if n.endswith("weight")]),
        "Distribution of the final weights per layer.",
    )
    rep.section(
        "Trust ratios",
        "‖W‖ / ‖ΔW‖ per layer: how many steps of the current size it would take to move a layer "
        "by its own norm. Layers far below the others are being changed aggressively; LARS/LAMB "
        "equalise this ratio.",
    )
    rep.figure(nplt.trust_ratio_plot(hist), "Trust ratio per parameter over training.")
    rep.section("Noise scale: is the batch size right?")
    rep.paragraph(_noise_text(b, cfg.batch_size, len(state.X_train)))
    if noise:
        rep.figure(
            nplt.noise_scale_plot(hist, batch_size=cfg.batch_size),
            "Per-sample estimate with its 95% bootstrap interval (shaded).",
        )
    _influence_section(rep, state, ex)
    ex.report_path = rep.write(cfg.log_dir / "report.html")
    print(f"\nHTML report: {ex.report_path}")


def _noise_text(b: float, batch: int, n: int) -> str:
    text = (
        "B_simple = tr(Σ)/‖G‖² estimates the critical batch size (McCandlish et al. 2018): "
        "below it, doubling the batch almost halves the number of steps; above it, extra samples "
        "are mostly wasted. "
    )
    if not math.isfinite(b) or b > n:
        return text + (
            f"The last estimate exceeds the {n} training digits: near convergence the mean "
            "gradient is small next to its per-sample noise, so even full-batch steps would pay off."
        )
    if b > 2 * batch:
        return text + (
            f"At B_simple ≈ {b:.0f}, batch size {batch} is small: a larger batch would still cut "
            "the number of steps almost proportionally."
        )
    return text + f"At B_simple ≈ {b:.0f}, batch size {batch} is about right or more than needed."


def _interval(h: dict[str, float]) -> str:
    lo, hi = h.get("noise_scale/low", math.nan), h.get("noise_scale/high", math.nan)
    return f"{h['noise_scale/b_simple']:.0f} (95% interval {lo:.0f} to {hi:.0f})"


def _influence_section(rep: Any, state: Any, ex: DemoExtras) -> None:
    import nnstat.plot as nplt

    rep.section(
        "Why did it get these digits wrong?",
        "Each misclassified test digit (left) beside the training digits whose gradients most "
        "support the model's wrong prediction (green: helpful for that prediction, i.e. "
        "training on them lowered the loss of predicting it) and most oppose it (red). Scores are "
        "g_qᵀ(H+λI)⁻¹g_i, H the Gauss-Newton curvature of the training loss: solved by 5 "
        "conjugate-gradient steps preconditioned by the run's EK-FAC, then projected to the "
        "store's rank-16 gradient space.",
    )
    if ex.influence is None:
        rep.paragraph("The model classified every test digit correctly: nothing to explain.")
        return
    img_train, img_test = _images(state)
    wrong, pred = ex.misclassified, ex.predicted
    captions = [f"test #{i}\ntrue {int(state.y_test[i])} → pred {int(pred[i])}" for i in wrong]
    fig = nplt.influence_figure(
        {i: img_test[i] for i in wrong}, img_train, ex.influence, k=TOP_K,
        train_labels=state.y_train, query_captions=captions, max_queries=12,
    )  # fmt: skip
    fig.savefig(state.config.log_dir / "influence.png")  # also on its own, for slides and docs
    rep.figure(fig, "Top helpful and harmful training digits (score, training index, label).")
    top = ex.influence.top_k(3)
    rep.bullets(
        [
            f"test #{q}: true {int(state.y_test[q])}, predicted {int(pred[q])}; most helpful "
            + ", ".join(f"#{i} (label {int(state.y_train[i])})" for i in top.helpful_ids[r])
            + "; most harmful "
            + ", ".join(f"#{i} (label {int(state.y_train[i])})" for i in top.harmful_ids[r])
            for r, q in enumerate(top.test_ids)
        ]
    )
    rep.figure(
        nplt.score_distribution(ex.influence), "All influence scores of the misclassified digits."
    )
