"""The demo's HTML report: a page a researcher would keep. It answers, without the console,
how training went (loss and accuracy curves), which layers moved (the ``describe`` table,
heatmaps, trust ratios, receptive fields), which batch size (the noise scale over the stages of
training, with its spread), which labels look wrong (self-influence against planted wrong
labels) and why the model made its mistakes (influence).

Example:
    >>> from nnstat.demo import main
    >>> main(["--epochs", "1", "--no-wandb"])  # doctest: +SKIP
"""

from __future__ import annotations

import math
import platform
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import nnstat
from nnstat.demo.report import HtmlReport
from nnstat.demo.sections import (
    counterfactual_section,
    explained_summary,
    influence_section,
    mislabel_section,
)
from nnstat.demo.steps import (
    NOISE_SCALE_EVERY,
    DemoExtras,
    describe_table,
    extras,
)
from nnstat.netdict import trust_ratio

__all__ = ["write_report", "NoiseStage", "noise_stages", "batch_advice", "implied_critical"]

# the phases the report's timing table lists, in order ("of which" is part of the one above)
TIMED = (
    "training (with Tracker, evaluation, noise scale)",
    "of which noise scale",
    "log gradients",
    "influence",
    "self-influence",
    "counterfactual check",
    "save for nnstat view",
)
TOTALLED = {name for name in TIMED if not name.startswith("of which")} | {"report figures"}


@dataclass(frozen=True)
class NoiseStage:
    """The noise-scale estimates of one stage (a third of the steps) of training."""

    name: str
    first_step: int
    last_step: int
    values: tuple[float, ...]  # point estimates of B_simple (inf when |G|² was estimated <= 0)
    low: float  # lowest bootstrap 95% bound of the stage's estimates
    high: float  # highest bootstrap 95% bound
    train_loss: float  # mean training loss at the stage's estimates

    @property
    def median(self) -> float:
        return float(np.median(self.values))

    @property
    def spread(self) -> tuple[float, float]:
        return float(min(self.values)), float(max(self.values))


def noise_stages(history: list[dict[str, Any]]) -> list[NoiseStage]:
    """The noise-scale estimates of a metric history split into early / middle / late training
    (thirds of the logged steps); stages without an estimate are left out.

    Example:
        >>> h = [{"step": s, "noise_scale/b_simple": 10.0 + s, "noise_scale/low": 5.0,
        ...       "noise_scale/high": 50.0 + s, "train/loss": 1.0} for s in range(0, 90, 10)]
        >>> [(s.name, s.values) for s in noise_stages(h)][0]
        ('early', (10.0, 20.0, 30.0))
    """
    rows = [h for h in history if "noise_scale/b_simple" in h]
    if not rows:
        return []
    last = max(h["step"] for h in history)
    cuts = [last / 3, 2 * last / 3]
    stages = []
    for i, name in enumerate(("early", "middle", "late")):
        part = [
            h
            for h in rows
            if (i == 0 or h["step"] > cuts[i - 1]) and (i == 2 or h["step"] <= cuts[i])
        ]
        if not part:
            continue
        losses = [h["train/loss"] for h in part if "train/loss" in h]
        stages.append(
            NoiseStage(
                name=name,
                first_step=int(part[0]["step"]),
                last_step=int(part[-1]["step"]),
                values=tuple(float(h["noise_scale/b_simple"]) for h in part),
                low=float(min(h.get("noise_scale/low", math.nan) for h in part)),
                high=float(max(h.get("noise_scale/high", math.nan) for h in part)),
                train_loss=float(np.mean(losses)) if losses else math.nan,
            )
        )
    return stages


def _n(v: float) -> str:
    return "∞" if math.isinf(v) else f"{v:.0f}"


#: ``B_simple / B_crit`` measured by training (``benchmarks/critical_batch.py``, the table in
#: docs/noise-scale.md): the lowest and highest ratio over a digits MLP, a digits CNN and a
#: character LM at their first target loss (early) and their last (late). B_simple
#: over-estimated the critical batch size every time; the advice divides it by these factors.
B_SIMPLE_OVER_CRIT_EARLY = (2.1, 3.6)
B_SIMPLE_OVER_CRIT_LATE = (2.8, 13.8)


def _f(v: float) -> str:
    return f"{v:g}"


def implied_critical(
    b_simple: tuple[float, float], over: tuple[float, float]
) -> tuple[float, float]:
    """The critical batch size range that ``B_simple`` estimates in ``[lo, hi]`` imply, given the
    measured over-estimate factors ``over = (least, most)``.

    Example:
        >>> implied_critical((100.0, 200.0), (2.0, 10.0))
        (10.0, 100.0)
    """
    return b_simple[0] / over[1], b_simple[1] / over[0]


def batch_advice(stages: list[NoiseStage], batch: int, n_train: int) -> tuple[str, str]:
    """(one-line summary, paragraph): the batch size the noise scale suggests at each stage of
    training, and how sure that is (the spread of the late estimates and their bootstrap
    intervals). B_simple is read through the over-estimate of the critical batch size measured
    by training (``B_SIMPLE_OVER_CRIT_*``), not taken as the critical batch size itself.

    Example:
        >>> h = [{"step": 10 * i, "noise_scale/b_simple": v, "noise_scale/low": 0.8 * v,
        ...       "noise_scale/high": 1.2 * v, "train/loss": 1.0} for i, v in
        ...      enumerate([50.0, 60.0, 55.0, 900.0, 1100.0, 1000.0])]
        >>> batch_advice(noise_stages(h), batch=64, n_train=5000)[0]
        '64 is about right (late B_simple 1000–1100, critical batch size about 72–393)'
    """
    if not stages:
        return "n/a", "No noise-scale estimate was logged."
    early, late = stages[0], stages[-1]
    lo, hi = late.spread
    ce = implied_critical((early.median, early.median), B_SIMPLE_OVER_CRIT_EARLY)
    cl = implied_critical((lo, hi), B_SIMPLE_OVER_CRIT_LATE)
    (e0, e1), (l0, l1) = B_SIMPLE_OVER_CRIT_EARLY, B_SIMPLE_OVER_CRIT_LATE
    parts = [
        f"B_simple grew from a median of {_n(early.median)} early in training (steps "
        f"{early.first_step}–{early.last_step}, training loss {early.train_loss:.2f}) to "
        f"{_n(late.median)} late (steps {late.first_step}–{late.last_step}, loss "
        f"{late.train_loss:.2f}): as the mean gradient shrinks next to its per-sample noise, "
        "larger batches stay useful for longer.",
        f"B_simple is not the critical batch size itself: measured by training on three small "
        f"tasks (docs/noise-scale.md), it was {_f(e0)}–{_f(e1)} times the critical batch size "
        f"early in training and {_f(l0)}–{_f(l1)} times late, never below it. Read that way, "
        f"these estimates put the critical batch size at about {_n(ce[0])}–{_n(ce[1])} early "
        f"and {_n(cl[0])}–{_n(cl[1])} late.",
    ]
    if ce[0] > 2 * batch:
        parts.append(f"Even early on, batch {batch} was well below that.")
    elif ce[1] < batch / 2:
        parts.append(f"Early on, batch {batch} was above it: a smaller batch would do.")
    else:
        parts.append(f"Early on, batch {batch} was about the critical batch size.")
    crit = f"critical batch size about {_n(cl[0])}–{_n(cl[1])}"
    if cl[0] > 2 * batch:
        # conservative: a power of two below the lowest bootstrap bound of the late estimates
        # divided by the largest over-estimate measured, at most the whole training set
        low = late.low / l1
        floor = low if math.isfinite(low) and low > batch else cl[0]
        target = (
            n_train if math.isinf(floor) else min(int(2 ** math.floor(math.log2(floor))), n_train)
        )
        parts.append(
            f"Late in training every estimate ({_n(lo)}–{_n(hi)}) puts it above 2 × {batch}: a "
            "larger "
            f"batch there would cut the number of steps. {target} is a safe choice: the power of "
            f"two below {_n(floor)}, the lowest bootstrap bound of the late estimates divided by "
            f"{_f(l1)}. A batch that grows during training ({batch} → {target}) follows the "
            "measured noise scale."
        )
        summary = f"{batch} early, {target} late (late B_simple {_n(lo)}–{_n(hi)}, {crit})"
    elif cl[1] < batch / 2:
        parts.append(
            f"Late in training every estimate ({_n(lo)}–{_n(hi)}) puts it below half the batch "
            "size: a "
            f"smaller batch than {batch} would give the same progress per step for less compute."
        )
        summary = f"smaller than {batch} (late B_simple {_n(lo)}–{_n(hi)}, {crit})"
    else:
        parts.append(
            f"Late in training the range the estimates ({_n(lo)}–{_n(hi)}) imply brackets the "
            f"batch size {batch}: it is about right."
        )
        summary = f"{batch} is about right (late B_simple {_n(lo)}–{_n(hi)}, {crit})"
    if hi > n_train:
        # |G|² is then a small difference of two noisy squared norms: the estimate is bounded
        # below by what the data can show, not measured, and its interval runs off the top
        parts.append(
            f"Some late estimates exceed the {n_train} training digits (bootstrap intervals up "
            f"to {_n(late.high)}): the estimator has lost resolution there, because the mean "
            "gradient it divides by is then smaller than its own noise. Read them as "
            f'"B_simple is at least about {n_train}", not as a measured value, and not as '
            "evidence that full-batch steps would pay off."
        )
    spread = hi / lo if lo > 0 and math.isfinite(hi) else math.inf
    parts.append(
        f"How sure: the {len(late.values)} late estimates span a factor {spread:.1f}, and their "
        f"bootstrap 95% intervals together cover {_n(late.low)}–{_n(late.high)}; the advice "
        "is read from that whole range, not from the last estimate alone."
        if math.isfinite(spread)
        else "How sure: some late estimates are infinite (|G|² estimated ≤ 0), so only a lower "
        "bound is known."
    )
    return summary, " ".join(parts)


def write_report(state: Any) -> None:
    """Build the HTML report, measure the run's wall time once, write the page."""
    import nnstat.plot as nplt

    ex, cfg = extras(state), state.config
    t0 = time.perf_counter()
    hist = ex.history
    rep = HtmlReport(
        "nnstat demo: a small MLP on scikit-learn digits",
        f"{time.strftime('%Y-%m-%d %H:%M')} · {platform.machine()} CPU, torch {torch.__version__}"
        f" · nnstat {nnstat.__version__}",
    )
    stages = noise_stages(hist)
    advice, advice_text = batch_advice(stages, cfg.batch_size, len(state.X_train))
    final = ex.final
    m = ex.mislabels
    rep.section("Summary")
    rep.table(
        {
            "training / test digits": f"{len(state.X_train)} / {len(state.X_test)}",
            "planted wrong labels": f"{len(state.planted)} training digits "
            f"({100 * cfg.mislabel_fraction:.1f}%, seed {cfg.seed + 1})",
            "epochs, batch size, optimiser": f"{cfg.epochs}, {cfg.batch_size}, AdamW lr {cfg.lr}",
            "final loss train / test": f"{final.get('train/loss', math.nan):.4f} / "
            f"{final.get('test/loss', math.nan):.4f}",
            "test accuracy": f"{state.accuracy:.3f} ({len(ex.misclassified)} misclassified)",
            "planted labels found by self-influence": (
                f"{m.found} of {m.k} in the top {m.k} (training loss: {m.loss_found} of {m.k}; "
                f"random order: {m.baseline * m.k:.1f} expected)"
                if m
                else "n/a"
            ),
            "explanations for the misclassified digits": explained_summary(ex),
            "batch size the noise scale suggests": advice,
            "run folder (replaced by each run)": str(cfg.log_dir),
            "wall time, data to report": lambda: f"{state.wall_seconds:.1f} s",
        }
    )
    _training_section(rep, hist)
    _layers_section(rep, state, hist)
    rep.section("Which batch size? The gradient noise scale")
    rep.paragraph(
        "B_simple = tr(Σ)/‖G‖² is the noise scale that predicts the critical batch size "
        "(McCandlish et al. 2018): below the critical batch size, doubling the batch almost "
        "halves the number of steps; above it, extra samples are mostly wasted. Estimated every "
        f"{NOISE_SCALE_EVERY * cfg.log_every} steps from per-sample gradients (bootstrap 95% "
        "interval)."
    )
    rep.paragraph(advice_text)
    if stages:
        rep.grid(
            ["stage", "steps", "train loss", "estimates", "median B_simple", "range", "95% band"],
            [
                [
                    s.name,
                    f"{s.first_step}–{s.last_step}",
                    s.train_loss,
                    len(s.values),
                    _n(s.median),
                    f"{_n(s.spread[0])}–{_n(s.spread[1])}",
                    f"{_n(s.low)}–{_n(s.high)}",
                ]
                for s in stages
            ],
        )
        rep.figure(
            nplt.noise_scale_plot(
                hist, batch_size=cfg.batch_size, title="gradient noise scale B_simple over training"
            ),
            "Per-sample estimate with its 95% bootstrap interval (shaded), against the batch size "
            "used (dashed).",
        )
    mislabel_section(rep, state, m)
    influence_section(rep, state, ex)
    counterfactual_section(rep, state, ex)
    rep.section("Where everything is")
    rep.table(
        {
            "TensorBoard": f"tensorboard --logdir {cfg.log_dir / 'tensorboard'}",
            "W&B (offline)": f"wandb sync {cfg.log_dir / 'wandb'}" if state.wandb_dir else "off",
            "nnstat view": f"nnstat view {cfg.log_dir}  (metrics, and the gradient store with "
            "the digits as images in the influence explorer"
            + (
                f"; the report's scores saved as {', '.join(ex.viewer_scores)}: pick them "
                "under scores"
                if ex.viewer_scores
                else ""
            )
            + ")",
            "metrics as JSON lines": str(cfg.log_dir / "metrics" / "metrics.jsonl"),
            "gradient store": str(ex.run.path) if ex.run else "n/a",
            "re-runs": "each run replaces this folder's TensorBoard, W&B, store and report: "
            "one run per folder, so no curve is drawn twice",
        }
    )
    rep.section("Timings")
    rep.table(_timings(state, ex))
    ex.timings["report figures"] = time.perf_counter() - t0
    # the one measurement of the run's wall time: the console prints this same number
    state.wall_seconds = time.perf_counter() - state.started
    ex.report_path = rep.write(cfg.log_dir / "report.html")
    print(f"\nHTML report: {ex.report_path}")


def _timings(state: Any, ex: DemoExtras) -> dict[str, Any]:
    """The phases' times, the rest, and the total, each rendered when the page is written (the
    report's own figures and the total are measured last)."""
    rows: dict[str, Any] = {}
    for name in (*TIMED, "report figures"):
        if name in ex.timings or name == "report figures":
            rows[name] = lambda name=name: f"{ex.timings[name]:.1f} s"

    def rest() -> str:
        counted = sum(v for k, v in ex.timings.items() if k in TOTALLED)
        return f"{state.wall_seconds - counted:.1f} s"

    rows["everything else (data, log set-up, console)"] = rest
    rows["wall time, data to report (as in the console)"] = lambda: f"{state.wall_seconds:.1f} s"
    return rows


def _training_section(rep: HtmlReport, hist: list[dict[str, Any]]) -> None:
    import nnstat.plot as nplt

    rep.section(
        "How did training go?",
        "Loss and accuracy on every training digit (on the labels trained on, the planted wrong "
        "ones included) and every test digit, evaluated at each logged step.",
    )
    accuracy = {"train": "train/accuracy", "test": "test/accuracy"}
    if any("train/planted_memorised" in h for h in hist):
        accuracy["planted digits fitted to their wrong label"] = "train/planted_memorised"
    curves = nplt.training_curves(
        hist,
        {"loss": {"train": "train/loss", "test": "test/loss"}, "accuracy": accuracy},
        title="loss and accuracy, train and test",
    )
    rep.figure(curves, _curves_caption(hist))


def _curves_caption(hist: list[dict[str, Any]]) -> str:
    """What the curves say, in numbers: where the test loss bottomed out, and how many planted
    digits ended up fitted to their wrong label (memorised)."""
    tested = [h for h in hist if "test/loss" in h]
    if not tested:
        return "No evaluation was logged."
    best = min(tested, key=lambda h: h["test/loss"])
    end = tested[-1]
    text = (
        f"Test loss is lowest at step {best['step']} ({best['test/loss']:.3f}); at the last "
        f"logged step ({end['step']}) it is {end['test/loss']:.3f}, test accuracy "
        f"{end['test/accuracy']:.3f}, training accuracy {end['train/accuracy']:.3f}."
    )
    if "train/planted_memorised" in end:
        share = end["train/planted_memorised"]
        verdict = (
            "the network has started to memorise them."
            if share > 0.25
            else "the network mostly still predicts their true class, so their loss stays high."
        )
        text += (
            f" At the end {100 * share:.0f}% of the planted digits are predicted as their wrong "
            f"label: {verdict}"
        )
    return text


def _layers_section(rep: HtmlReport, state: Any, hist: list[dict[str, Any]]) -> None:
    import nnstat.plot as nplt

    W = nnstat.get_weight(state.model)
    moved = {
        name: float((W[name] - state.W_init[name]).norm() / state.W_init[name].norm()) for name in W
    }
    ratios = trust_ratio(state.W_before_last_step, W)
    table = describe_table(state)
    stats = list(next(iter(table.values())))
    rep.section(
        "Which layers moved?",
        "`describe` of the final weights per layer (the console prints the same table), with "
        "how far each layer moved from its initialisation and its trust ratio ‖W‖/‖ΔW‖ at the "
        "last step (how many steps of that size would move it by its own norm).",
    )
    rep.grid(
        ["layer", *stats, "‖W−W₀‖/‖W₀‖", "trust ratio"],
        [
            [
                name,
                *(int(v) if s == "numel" else v for s, v in row.items()),
                moved[name],
                ratios[name],
            ]
            for name, row in table.items()
        ],
    )
    rep.paragraph(
        "Every 5th step the Tracker reduced each parameter, gradient, Adam state and update to "
        "a few statistics in one fused pass; these are the numbers TensorBoard and W&B received."
    )
    grad_map = nplt.stat_heatmap(
        hist,
        "l2",
        prefix="grad/",
        log=True,
        robust=True,
        title="gradient L2 norm per layer over training",
    )
    rep.figure(
        grad_map,
        "Log colour scale limited to the 2nd–98th percentile of all values (arrows: beyond).",
    )
    later = [h for h in hist if h["step"] > 0]
    update_map = nplt.stat_heatmap(
        later or hist,
        "rms",
        prefix="update/",
        log=True,
        robust=True,
        title="RMS of each step's update per layer (step 0 left out)",
    )
    rep.figure(
        update_map,
        "Step 0 is left out: Adam's first update is sign-like (≈ lr for every weight) and would "
        "set the colour scale on its own. Log colour scale limited to the 2nd–98th percentile "
        "of the rest, so the late, small updates still show their differences.",
    )
    rep.figure(
        nplt.trust_ratio_plot(hist, include="weight$", title="trust ratio ‖W‖/‖ΔW‖ per weight"),
        "Layers far below the others are being changed aggressively; LARS/LAMB equalise this.",
    )
    first = next(iter(W))
    fields = nplt.receptive_fields(
        W[first] - state.W_init[first],
        image_shape=(8, 8),
        label="change of weight (shared scale)",
        title=f"what the first layer learned: {first} minus its initial value, per unit as 8×8",
    )
    rep.figure(
        fields,
        f"Each hidden unit's change of its 64 input weights ({first}, final minus initial; "
        "largest change first) as an 8×8 image: training made red pixels excite the unit more, "
        "blue ones less. The final weights are this change plus the random initialisation "
        f"(the layer moved by {moved[first]:.0%} of its initial norm), whose noise would hide "
        "it. One shared colour scale, symmetric around 0.",
    )
    rep.figure(
        nplt.histogram(
            W, [n for n in W if n.endswith("weight")], title="distribution of the final weights"
        ),
        "One histogram per weight matrix, on shared bins.",
    )
