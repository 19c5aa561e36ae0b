"""The demo report's attribution sections: which labels look wrong (self-influence against the
training loss and a random order), why the model got its test digits wrong (the influence grid,
both sides counted, raw and RelatIF), and whether those explanations hold when what they name is
removed and the model retrained (the counterfactual check, against the loss and random).

Every number here is read from the state the steps left (:mod:`nnstat.demo.steps`,
:mod:`nnstat.demo.attribution`), which ``explanations.npz`` and ``counterfactual.json`` save.

Example:
    >>> from nnstat.demo import main
    >>> main(["--epochs", "1", "--no-wandb"])  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nnstat.demo.attribution import ARMS, REPEATS, SCORES, Explanations
from nnstat.demo.report import HtmlReport
from nnstat.demo.steps import (
    QUERY_SET,
    REFINE_STEPS,
    SAVED_SCORES,
    TOP_K,
    DemoExtras,
    MislabelSearch,
)

__all__ = ["mislabel_section", "influence_section", "counterfactual_section", "explained_summary"]

# an HTML figure of the self-influence ranking shows at most this many digits
MAX_RANKED_SHOWN = 45
#: How the report names each score and counterfactual arm.
NAMES = {
    "raw": "raw influence",
    "relatif": "RelatIF",
    "loss": "highest training loss",
    "random": "random",
}


def _compare(a: float, b: float, more: str, same: str, fewer: str) -> str:
    return more if a > b else same if a == b else fewer


def mislabel_section(rep: HtmlReport, state: Any, m: MislabelSearch | None) -> None:
    import nnstat.plot as nplt

    rep.section(
        "Which labels look wrong? Self-influence against the training loss",
        f"Before training, {len(state.planted)} training digits were given a wrong label on "
        "purpose (fixed seed). Self-influence g_iᵀ(H+λI)⁻¹g_i measures how much a training "
        "digit's own loss depends on having trained on it. The obvious baseline is the training "
        "loss itself: a digit whose label contradicts its image has a high loss until the "
        "network memorises it. Both rankings are shown against a random order.",
    )
    if m is None:
        rep.paragraph("No label was planted (mislabel_fraction = 0): nothing to find.")
        return
    n, k = len(m.scores), m.k
    verdict = _compare(
        m.found,
        m.loss_found,
        "more planted digits in its top k than the training loss",
        "as many planted digits in its top k as the training loss",
        "fewer planted digits in its top k than the training loss",
    )
    order = _compare(
        m.loss_all_found_at,
        m.all_found_at,
        "has found all of them sooner",
        "has found all of them at the same rank",
        "needs longer to find all of them",
    )
    rep.paragraph(
        f"Recall at k = {k} (the number planted, of n = {n}): self-influence "
        f"({m.preconditioner} preconditioner of the gradient store) finds {m.found} of the {k} "
        f"planted digits among its {k} highest, the training loss {m.loss_found} of {k}, a "
        f"random order {k * k / n:.1f} on average (recall {m.baseline:.3f}). Read down to the "
        f"end, self-influence has found every planted digit by rank {m.all_found_at}, the "
        f"training loss by rank {m.loss_all_found_at}, a random order by rank "
        f"{m.random_all_found_at:.0f} on average. Here self-influence puts {verdict} and "
        f"{order}"
        + (
            ": on this run the training loss alone finds the planted labels as well."
            if m.found <= m.loss_found and m.all_found_at >= m.loss_all_found_at
            else "."
        )
    )
    if m.method:
        rep.paragraph(
            f"Self-influence method: {m.method}. `nnstat view` computes its self-influence "
            "ranking the same way from the gradient store, so it lists the same digits."
        )
    rep.grid(
        ["ranking", f"planted in the top {k}", f"recall at {k}", "all planted found by rank"],
        [
            ["self-influence", m.found, m.recall, m.all_found_at],
            ["training loss", m.loss_found, m.loss_found / k, m.loss_all_found_at],
            ["random order (expected)", k * k / n, m.baseline, m.random_all_found_at],
        ],
    )
    if m.found < k:
        rep.paragraph(
            f"The planted digits self-influence misses in its top {k} rank " f"{_missed_ranks(m)}."
        )
    rep.figure(
        nplt.ranking_recall(
            {"self-influence": m.scores, "training loss": m.loss},
            m.planted,
            max_k=min(n, 6 * k),
            title=f"planted wrong labels found from the top of the ranking (k = {k})",
        ),
        "Planted digits found in the top k of each ranking. Dashed: a random order. Dotted: "
        "k = number planted.",
    )
    order_ = np.argsort(-np.where(np.isnan(m.scores), -np.inf, m.scores), kind="stable")
    shown = order_[: min(MAX_RANKED_SHOWN, max(k, 9))]
    planted = set(m.planted)
    y, y_true = state.y_train, state.y_train_true
    captions, colours = [], []
    for rank, i in enumerate(shown.tolist(), 1):
        if i in planted:
            captions.append(f"{rank}. #{i}\nlabel {int(y[i])} (true {int(y_true[i])})")
            colours.append("#b2182b")
        else:
            captions.append(f"{rank}. #{i}\nlabel {int(y[i])}")
            colours.append(None)
    rep.figure(
        nplt.image_grid(
            state.images_train[shown],
            captions,
            frame_colours=colours,
            title=f"the {len(shown)} training digits with the highest self-influence",
        ),
        "Rank, training index and the label trained on; red frame: a planted wrong label "
        "(with the true one).",
    )


def _missed_ranks(m: MislabelSearch) -> str:
    """Ranks (1 = highest self-influence) of the planted digits outside the top k."""
    order = np.argsort(-np.where(np.isnan(m.scores), -np.inf, m.scores), kind="stable")
    rank = np.empty(len(order), dtype=int)
    rank[order] = np.arange(1, len(order) + 1)
    return ", ".join(str(r) for r in sorted(int(rank[i]) for i in m.planted if rank[i] > m.k))


def explained_summary(ex: DemoExtras) -> str:
    """The summary table's line on the grid's score and the counterfactual check."""
    exp: Explanations | None = ex.explanations
    if exp is None or not exp.counterfactual:
        return "n/a"
    support = exp.support
    rest = [NAMES[s] + f" {support[s]:+.3f}" for s in SCORES if s != exp.chosen]
    return (
        f"grid by {NAMES[exp.chosen]}: removing its most supportive digits raised the wrong "
        f"predictions' loss by {support[exp.chosen]:+.3f} (mean over k = "
        f"{', '.join(map(str, exp.counterfactual))}; {', '.join(rest)})"
    )


def influence_section(rep: HtmlReport, state: Any, ex: DemoExtras) -> None:
    import nnstat.plot as nplt
    from nnstat.viewer import method_line

    rep.section(
        "Why did it get these digits wrong? Influence",
        "Each misclassified test digit (left) beside the training digits whose gradients most "
        "support the model's wrong prediction (green: training on them lowered the loss of "
        "predicting it) and most oppose it (red). Raw influence is g_qᵀ(H+λI)⁻¹g_i, H the "
        f"Gauss-Newton curvature of the training loss: solved by {REFINE_STEPS} "
        "conjugate-gradient steps preconditioned by the run's EK-FAC, then projected to the "
        "store's rank-16 gradient space. RelatIF (Barshan et al. 2020) divides the training side "
        "by ‖g_i‖ in the same metric (EK-FAC, unrefined), so that a few large-gradient digits "
        "cannot top every list.",
    )
    exp: Explanations | None = ex.explanations
    if ex.influence is None or exp is None:
        rep.paragraph("The model classified every test digit correctly: nothing to explain.")
        return
    _methods(rep, ex, exp)
    wrong, pred = ex.misclassified, ex.predicted
    n, planted = len(state.y_train), set(state.planted)
    rate = len(planted) / n
    slots = exp.counts["raw"].slots
    rep.paragraph(
        f"{len(planted)} of the {n} training digits are planted wrong labels ({rate:.1%}), so "
        f"{slots} slots filled at random ({TOP_K} per side for each of the {len(wrong)} "
        f"misclassified digits) would hold {slots * rate:.2f} planted digits per side. "
        "Planted digits the network has not memorised have a high loss, so large gradients: "
        "where they fill the most opposing side as often as the most supportive one, and the "
        "same digits appear on both sides for different queries, a digit's place in these lists "
        "follows its gradient size rather than the query."
    )
    rep.grid(
        [
            "score",
            f"planted among most supportive (of {slots})",
            f"planted among most opposing (of {slots})",
            "expected at random, per side",
            "ids on both sides",
            "distinct ids supportive / opposing",
        ],
        [
            [
                NAMES[name],
                c.helpful_planted,
                c.harmful_planted,
                slots * rate,
                c.both_sides,
                f"{c.helpful_distinct} / {c.harmful_distinct}",
            ]
            for name, c in exp.counts.items()
        ],
    )
    chosen = exp.chosen
    support = exp.support
    rep.paragraph(
        f"The grid shows {NAMES[chosen]}: in the counterfactual check below, removing its most "
        f"supportive training digits raised the wrong predictions' loss by "
        f"{support[chosen]:+.3f} on average over k = {', '.join(map(str, exp.counterfactual))}, "
        + ", ".join(f"{NAMES[s]}'s by {support[s]:+.3f}" for s in SCORES if s != chosen)
        + "."
        if exp.counterfactual
        else f"The grid shows {NAMES[chosen]} (no counterfactual check was run)."
    )
    result = exp.results[chosen]
    captions = [f"test #{i}\ntrue {int(state.y_test[i])} → {int(pred[i])}" for i in wrong]
    # "2*": the label trained on, starred when it is a planted wrong one
    labels = [f"{int(v)}{'*' if i in planted else ''}" for i, v in enumerate(state.y_train)]
    fig = nplt.influence_figure(
        {i: state.images_test[i] for i in wrong},
        state.images_train,
        result,
        k=TOP_K,
        train_labels=labels,
        query_captions=captions,
        max_queries=8,
        title=f"misclassified test digits and their {TOP_K} most helpful and harmful training "
        f"digits ({NAMES[chosen]})",
    )
    fig.savefig(state.config.log_dir / "influence.png")  # also on its own, for slides and docs
    rep.figure(
        fig,
        f"{min(len(wrong), 8)} of {len(wrong)} misclassified test digits, scored by "
        f"{NAMES[chosen]} ({method_line(result.meta)}). Above each training digit: score, "
        "training index and the label trained on (* a planted wrong label).",
    )
    top = result.top_k(TOP_K)

    def named(i: int) -> str:
        label = f"label {int(state.y_train[i])}"
        if i in planted:  # a planted wrong label among the reasons for a mistake
            label += f", planted: true {int(state.y_train_true[i])}"
        return f"#{i} ({label})"

    rep.paragraph(
        f"Every misclassified test digit's {TOP_K} most supportive and most opposing training "
        f"digits by {NAMES[chosen]} ({_in_viewer(ex, chosen)}):"
    )
    rep.bullets(
        [
            f"test #{q}: true {int(state.y_test[q])}, predicted {int(pred[q])}; most supportive "
            + ", ".join(named(int(i)) for i in top.helpful_ids[r])
            + "; most opposing "
            + ", ".join(named(int(i)) for i in top.harmful_ids[r])
            for r, q in enumerate(top.test_ids)
        ]
    )
    rep.figure(
        nplt.score_distribution(
            result, title=f"all {NAMES[chosen]} scores of the misclassified test digits"
        ),
        "Green: helpful (positive), red: harmful; dashed: 1% and 99% quantiles.",
    )


def _in_viewer(ex: DemoExtras, score: str) -> str:
    """Where ``nnstat view`` shows the same scores (or why it does not)."""
    name = SAVED_SCORES[score]
    if name not in ex.viewer_scores:
        return "not saved for nnstat view"
    return (
        f'nnstat view shows the same lists under scores "saved: {name}", query set ' f"{QUERY_SET}"
    )


def _methods(rep: HtmlReport, ex: DemoExtras, exp: Explanations) -> None:
    """How each list of the report was made, and where the viewer shows the same scores."""
    from nnstat.viewer import method_line

    rep.paragraph(
        "How each score was made (mode, preconditioner, damping, refinement), and where "
        '`nnstat view` shows the same scores. Its default lists ("computed here") come from '
        "the gradient store alone, unrefined (the store holds neither the model nor the data "
        "refinement needs), so they can differ from these; the viewer says so when they do."
    )
    rep.bullets(
        [
            f"{NAMES[score]}: {method_line(exp.results[score].meta)}; {_in_viewer(ex, score)}"
            for score in SAVED_SCORES
        ]
    )


def counterfactual_section(rep: HtmlReport, state: Any, ex: DemoExtras) -> None:
    exp: Explanations | None = ex.explanations
    if exp is None or not exp.counterfactual:
        return
    cfg, planted = state.config, set(state.planted)
    q = len(ex.misclassified)
    ks = list(exp.counterfactual)
    rep.section(
        "Do the explanations hold? Remove, retrain, compare",
        f"For the {q} misclassified test digits together, each rule names k training digits to "
        "remove: raw influence and RelatIF the k that most support the wrong predictions "
        "(highest scores summed over the misclassified digits; each score made as named in the "
        "influence section), the training loss its k "
        "highest-loss digits, random k random ones (new in every repeat). The demo's model is "
        "then retrained without them, from the demo's initial weights with the demo's training "
        f"loop ({cfg.epochs} epochs, batch {cfg.batch_size}), {REPEATS} times with {REPEATS} "
        "batch orders (the same in every arm), and once per repeat on every training digit. If "
        "the removed digits caused the wrong predictions, their loss rises and some digits "
        "become correct. Loss change: the wrong predictions' cross-entropy after removal minus "
        "that of the full-data retraining of the same repeat, averaged over the misclassified "
        f"digits, with a 95% Student-t interval over the {REPEATS} repeats.",
    )
    rows = []
    for k, res in exp.counterfactual.items():
        full = float(np.mean(res.full_correct)) * q
        for name in ARMS:
            arm = res.arms[name]
            lo, hi = arm.interval
            hits = np.mean([sum(i in planted for i in removed) for removed in arm.removed])
            rows.append(
                [
                    k,
                    NAMES[name],
                    arm.mean,
                    f"[{lo:+.3f}, {hi:+.3f}]",
                    f"{float(np.mean(arm.correct)) * q:.1f} (full data {full:.1f})",
                    round(hits, 1),
                ]
            )
    rep.grid(
        [
            "k",
            "removed by",
            "loss change",
            "95% interval",
            f"correct of {q} after removal (mean over repeats)",
            "planted among removed",
        ],
        rows,
    )
    support = exp.support
    lines = []
    for k, res in exp.counterfactual.items():
        best = res.arms[exp.chosen]
        above = [
            NAMES[name]
            for name in ARMS
            if name != exp.chosen and best.interval[0] > res.arms[name].interval[1]
        ]
        lines.append(
            f"k = {k}: {NAMES[exp.chosen]} {best.mean:+.3f}, its interval above "
            + (f"those of {', '.join(above)}" if above else "no other arm's")
        )
    other = next(s for s in SCORES if s != exp.chosen)
    resolved = [
        k
        for k, r in exp.counterfactual.items()
        if r.arms[exp.chosen].interval[0] > r.arms[other].interval[1]
    ]
    lines.append(
        f"against {NAMES[other]}, the choice is resolved (intervals apart) at k = "
        + ", ".join(map(str, resolved))
        if resolved
        else f"against {NAMES[other]}, the intervals overlap at every k: the choice between the "
        "two is not resolved by this check"
    )
    flips = {
        name: max(
            float(np.mean(r.arms[name].correct) - np.mean(r.full_correct)) * q
            for r in exp.counterfactual.values()
        )
        for name in ARMS
    }
    rep.paragraph(
        "Averaged over k = "
        + ", ".join(map(str, ks))
        + ", the wrong predictions' loss rose by "
        + ", ".join(
            f"{np.mean([r.arms[a].mean for r in exp.counterfactual.values()]):+.3f} ({NAMES[a]})"
            for a in ARMS
        )
        + f". The grid above shows {NAMES[exp.chosen]}, the score with the larger rise "
        f"({support[exp.chosen]:+.3f}). " + "; ".join(lines) + f" (with {REPEATS} repeats, "
        "overlapping intervals leave a difference unresolved). Misclassified digits made "
        "correct, at best over k (mean over repeats, against the full-data retraining): "
        + ", ".join(f"{flips[a]:+.1f} ({NAMES[a]})" for a in ARMS)
        + f" of {q}."
    )
