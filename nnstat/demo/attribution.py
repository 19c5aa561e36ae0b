"""The demo's check of its own explanations: which score explains the misclassified test digits,
and does removing what it names change the model more than removing what an obvious baseline
names?

Two scores for the misclassified test digits (query loss: the cross-entropy of the *predicted*
class, so positive = the training digit supports the wrong prediction):

* ``raw``: the demo's influence ``g_qᵀ(H+λI)⁻¹g_i`` (refined, see ``explain_misclassified``);
* ``relatif``: ``compute_influence_all(..., mode="relatif")`` on the same store (EK-FAC, not
  refined: refinement is for ``mode="dot"``), the training side divided by ``‖g_i‖_M``
  (Barshan et al. 2020), so a few large-gradient digits cannot top every query's list.

`check_explanations` counts planted digits on both sides of each score's grid, then runs
`nnstat.influence.counterfactual`: for each ``k`` in :data:`KS` it removes the ``k`` training
digits that most support the wrong predictions (summed over the misclassified digits) by raw, by
relatif, the ``k`` of highest training loss and ``k`` random ones, retrains the demo's model
(`nnstat.demo.model.fit`, same initial weights, batch order per repeat) and measures the loss
of the wrong predictions (it should rise) and how many misclassified digits become correct. The
report's grid uses the score whose removals raised that loss most (:attr:`Explanations.chosen`).

Everything the report states is saved beside it (``explanations.npz``, ``counterfactual.json``)
so a test can recompute it.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

import nnstat
from nnstat.demo.model import fit, make_model
from nnstat.demo.steps import TOP_K, extras

__all__ = [
    "KS",
    "REPEATS",
    "SCORES",
    "GridCounts",
    "Explanations",
    "grid_counts",
    "check_explanations",
    "save_explanations",
]

KS = (10, 20, 40)  # training digits removed per counterfactual arm
REPEATS = 3  # retrainings per arm (the same batch orders across arms)
SCORES = ("raw", "relatif")  # the attribution scores offered for the grid
ARMS = ("raw", "relatif", "loss", "random")  # counterfactual arms, in the report's order


@dataclass(frozen=True)
class GridCounts:
    """Planted digits in one score's grid: the ``TOP_K`` most supportive (helpful to the wrong
    prediction) and most opposing (harmful) training digits of every misclassified test digit."""

    slots: int  # per side: queries x TOP_K
    helpful_planted: int
    harmful_planted: int
    both_sides: int  # training ids that are most helpful for one query and most harmful for one
    helpful_distinct: int
    harmful_distinct: int


def grid_counts(scores: torch.Tensor, planted: list[int], k: int = TOP_K) -> GridCounts:
    """Count planted ids on each side of the top-``k`` lists of ``scores`` ``[n_query, n_train]``.

    Example:
        >>> s = torch.tensor([[3.0, -1.0, 0.0, 2.0], [-2.0, 1.0, 0.5, 0.0]])
        >>> c = grid_counts(s, planted=[0], k=1)
        >>> c.helpful_planted, c.harmful_planted, c.both_sides
        (1, 1, 2)
    """
    s = torch.as_tensor(scores, dtype=torch.float64)
    helpful = torch.argsort(s, dim=1, descending=True, stable=True)[:, :k]
    harmful = torch.argsort(s, dim=1, stable=True)[:, :k]
    marked = set(planted)
    hel, har = helpful.flatten().tolist(), harmful.flatten().tolist()
    return GridCounts(
        slots=len(hel),
        helpful_planted=sum(i in marked for i in hel),
        harmful_planted=sum(i in marked for i in har),
        both_sides=len(set(hel) & set(har)),
        helpful_distinct=len(set(hel)),
        harmful_distinct=len(set(har)),
    )


@dataclass
class Explanations:
    """Both scores, their grid counts, and the counterfactual check per ``k``."""

    scores: dict[str, torch.Tensor]  # name -> [n_query, n_train]
    results: dict[str, Any]  # name -> the InfluenceResult (for the figure)
    counts: dict[str, GridCounts]
    train_loss: np.ndarray
    counterfactual: dict[int, Any] = field(default_factory=dict)  # k -> CounterfactualResult

    @property
    def support(self) -> dict[str, float]:
        """Per score: the mean rise of the wrong predictions' loss after removing its top ``k``,
        averaged over the ``k`` values (what picks the grid's score)."""
        return {
            name: float(np.mean([r.arms[name].mean for r in self.counterfactual.values()]))
            for name in SCORES
        }

    @property
    def chosen(self) -> str:
        """The score the grid shows: the one the counterfactual check supports best (``raw``
        when there was nothing to check)."""
        if not self.counterfactual:
            return "raw"
        support = self.support
        return max(SCORES, key=lambda name: (support[name], name == "raw"))


def _retrain(state: Any) -> Any:
    """``train_fn(kept)`` for `counterfactual`: the demo's model from the demo's initial weights,
    trained by the demo's loop on the kept training digits; the batch order comes from torch's
    global random state, which `counterfactual` seeds per repeat (the same in every arm)."""
    cfg = state.config

    def train_fn(kept: torch.Tensor) -> nn.Module:
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed)  # the start `build` gives the demo's model
            model = make_model(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        fit(model, opt, state.X_train[kept], state.y_train[kept], cfg)
        return model.eval()

    return train_fn


def check_explanations(state: Any) -> None:
    """Score the misclassified digits with RelatIF too, count planted digits on both sides of
    each grid, and run the counterfactual check (see the module docstring)."""
    ex = extras(state)
    if ex.influence is None:
        return
    t0 = time.perf_counter()
    model = state.model
    model.eval()
    with torch.no_grad():
        train_loss = nn.functional.cross_entropy(
            model(state.X_train), state.y_train, reduction="none"
        )
    relatif = nnstat.influence.compute_influence_all(
        ex.query_log, ex.run.path, mode="relatif", progress=False
    )
    results = {"raw": ex.influence, "relatif": relatif}
    scores = {name: r.scores.double() for name, r in results.items()}
    ex.explanations = exp = Explanations(
        scores=scores,
        results=results,
        counts={name: grid_counts(s, state.planted) for name, s in scores.items()},
        train_loss=train_loss.double().numpy(),
    )
    wrong, pred = ex.misclassified, ex.predicted
    Xq, wrong_label, true_label = state.X_test[wrong], pred[wrong], state.y_test[wrong]

    def query_loss(m: nn.Module) -> torch.Tensor:  # the loss of each wrong prediction
        return nn.functional.cross_entropy(m(Xq), wrong_label, reduction="none")

    def correct(m: nn.Module) -> torch.Tensor:
        return m(Xq).argmax(1) == true_label

    train_fn = _retrain(state)
    for k in (k for k in KS if k < len(state.X_train)):
        with torch.random.fork_rng():  # the retrainings' seeds stay out of the demo's state
            exp.counterfactual[k] = nnstat.influence.counterfactual(
                train_fn,
                query_loss,
                scores["raw"],
                k,
                direction="helpful",
                baselines={"relatif": scores["relatif"].sum(0), "loss": train_loss},
                repeats=REPEATS,
                correct_fn=correct,
                seed=state.config.seed,
            )
        arms = exp.counterfactual[k].arms
        arms["raw"] = arms.pop("scores")
        arms["raw"].name = "raw"
        exp.counterfactual[k].arms = {name: arms[name] for name in ARMS}
    ex.timings["counterfactual check"] = time.perf_counter() - t0
    support = exp.support
    print(
        "counterfactual check: removing the most supportive training digits raised the wrong "
        "predictions' loss by "
        + ", ".join(f"{support[s]:+.3f} ({s})" for s in SCORES)
        + f" on average over k = {', '.join(map(str, exp.counterfactual))}; the grid shows "
        f"{exp.chosen}"
    )


def save_explanations(state: Any) -> None:
    """The arrays behind the report's self-influence, grid and counterfactual numbers:
    ``explanations.npz`` and ``counterfactual.json`` in the run folder."""
    ex = extras(state)
    root = state.config.log_dir
    arrays: dict[str, Any] = {
        "planted": np.asarray(state.planted, dtype=np.int64),
        "y_train": state.y_train.numpy(),
        "y_train_true": state.y_train_true.numpy(),
    }
    if ex.mislabels is not None:
        arrays["self_influence"] = ex.mislabels.scores
        arrays["train_loss"] = ex.mislabels.loss
    exp = getattr(ex, "explanations", None)
    if exp is not None:
        arrays["misclassified"] = np.asarray(ex.misclassified, dtype=np.int64)
        arrays["predicted"] = ex.predicted[ex.misclassified].numpy()
        arrays["y_test"] = state.y_test[ex.misclassified].numpy()
        for name, s in exp.scores.items():
            arrays[f"scores_{name}"] = s.numpy()
        cf = {str(k): r.to_dict() for k, r in exp.counterfactual.items()}
        (root / "counterfactual.json").write_text(
            json.dumps({"chosen": exp.chosen, "support": exp.support, "by_k": cf}, indent=1)
        )
    np.savez(root / "explanations.npz", **arrays)
