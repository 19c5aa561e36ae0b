"""The demo's watch-and-explain steps: train/test curves and noise scale during training,
projected per-sample gradients of the training set, influence for the misclassified test digits,
self-influence against the planted wrong labels, and what the viewer needs to show examples.

Each step takes the demo's state (see :mod:`nnstat.demo`); what they produce lives in
``state.extras`` (:class:`DemoExtras`).

Example:
    >>> from nnstat.demo import main
    >>> main(["--epochs", "1", "--no-wandb"])  # doctest: +SKIP
"""

from __future__ import annotations

import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import nnstat
from nnstat.describe import Description

__all__ = [
    "DemoExtras",
    "MislabelSearch",
    "describe_table",
    "evaluate",
    "watch_training",
    "log_training_gradients",
    "explain_misclassified",
    "find_mislabels",
    "save_for_viewer",
]

NOISE_SCALE_EVERY = 2  # logged steps between two noise-scale estimates
RANK = 16  # projection rank per module of the gradient store
REFINE_STEPS = 5  # conjugate-gradient steps of the influence refinement
TOP_K = 3  # helpful and harmful training digits shown per misclassified test digit
#: The name each score of the report is saved under beside the gradient store
#: (`nnstat.viewer.save_scores`), so ``nnstat view`` shows the report's lists.
SAVED_SCORES = {"raw": "refined", "relatif": "relatif"}
QUERY_SET = "misclassified"  # the query set of the misclassified test digits beside the store


@dataclass
class MislabelSearch:
    """How well ranking the training digits by self-influence finds the planted wrong labels."""

    scores: np.ndarray  # self-influence per training position
    loss: np.ndarray  # each training digit's loss on its (given) label, for comparison
    planted: list[int]
    preconditioner: str
    hits: np.ndarray  # hits[k-1]: planted digits among the k highest self-influences
    loss_hits: np.ndarray  # the same for the ranking by training loss
    method: str = ""  # nnstat.viewer.method_line of the self-influence's meta

    @property
    def k(self) -> int:
        """Number planted: the top-k a perfect ranking would fill with them."""
        return len(self.planted)

    @property
    def found(self) -> int:
        """Planted digits among the ``k`` highest self-influences."""
        return int(self.hits[self.k - 1]) if self.k else 0

    @property
    def recall(self) -> float:
        """Recall at ``k`` = found / k."""
        return self.found / self.k if self.k else float("nan")

    @property
    def baseline(self) -> float:
        """Expected recall at ``k`` of a random order: k / n."""
        return self.k / len(self.scores)

    @property
    def all_found_at(self) -> int:
        """How far down the ranking one must read to have found every planted digit."""
        return int(np.searchsorted(self.hits, self.k) + 1) if self.k else 0

    @property
    def loss_found(self) -> int:
        """Planted digits among the ``k`` highest training losses."""
        return int(self.loss_hits[self.k - 1]) if self.k else 0

    @property
    def loss_all_found_at(self) -> int:
        """How far down the training-loss ranking every planted digit is found."""
        return int(np.searchsorted(self.loss_hits, self.k) + 1) if self.k else 0

    @property
    def random_all_found_at(self) -> float:
        """Expected rank of the last planted digit in a random order: k (n + 1) / (k + 1)."""
        return self.k * (len(self.scores) + 1) / (self.k + 1)


@dataclass
class DemoExtras:
    """What the watch-and-explain steps produce."""

    history: list[dict[str, Any]] = field(default_factory=list)
    final: dict[str, float] = field(default_factory=dict)  # evaluate() after the last step
    run: Any = None
    misclassified: list[int] = field(default_factory=list)
    predicted: torch.Tensor | None = None
    influence: Any = None
    query_log: Any = None  # the misclassified test digits' gradients (a GradientLog)
    mislabels: MislabelSearch | None = None
    viewer_examples: list[str] = field(default_factory=list)
    viewer_scores: list[str] = field(default_factory=list)  # names saved by save_scores
    explanations: Any = None  # nnstat.demo.attribution.Explanations
    report_path: Path | None = None
    timings: dict[str, float] = field(default_factory=dict)


def extras(state: Any) -> DemoExtras:
    """The :class:`DemoExtras` of a demo state (created on first use)."""
    if getattr(state, "extras", None) is None:
        state.extras = DemoExtras()
    return state.extras


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def watch_training(state: Any) -> None:
    """Keep every logged metric dict for the report; at every logged step add the loss and
    accuracy on all training and test digits, and every few logged steps the noise scale
    (per-sample method, with its bootstrap interval). All of it goes to every sink."""
    ex = extras(state)
    state.tracker.add_sink(
        lambda metrics, step: ex.history.append({**_scalars(metrics), "step": step})
    )
    state.tracker.add_provider(lambda: evaluate(state))
    calls = {"n": 0}
    data = (state.X_train, state.y_train)
    quick = state.config.quick

    def noise_scale() -> dict[str, float]:
        calls["n"] += 1
        if (calls["n"] - 1) % NOISE_SCALE_EVERY:
            return {}
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            # near convergence |G|^2 can be estimated <= 0: b_simple is then inf, which the
            # report explains; one warning per estimate would only clutter the console
            warnings.filterwarnings("ignore", message=r"the \|G\|\^2 estimate")
            result = nnstat.noise_scale(
                state.model,
                nn.functional.cross_entropy,
                data,
                method="per_sample",
                big_batch=128 if quick else 256,
                n_estimates=4 if quick else 16,
                seed=calls["n"],
            )
        key = "of which noise scale"
        ex.timings[key] = ex.timings.get(key, 0.0) + time.perf_counter() - t0
        return {k: v for k, v in result.to_dict().items() if k.count("/") == 1}

    state.tracker.add_provider(noise_scale)


def evaluate(state: Any) -> dict[str, float]:
    """Loss and accuracy on every training digit (on the labels trained on, planted ones
    included) and every test digit, and the share of planted digits the model predicts as
    their wrong label (memorised)."""
    model = state.model
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}
    with torch.no_grad():
        for split, X, y in (
            ("train", state.X_train, state.y_train),
            ("test", state.X_test, state.y_test),
        ):
            logits = model(X)
            out[f"{split}/loss"] = float(nn.functional.cross_entropy(logits, y))
            out[f"{split}/accuracy"] = float((logits.argmax(1) == y).float().mean())
            if split == "train" and state.planted:
                pred = logits[state.planted].argmax(1)
                out["train/planted_memorised"] = float((pred == y[state.planted]).float().mean())
    model.train(was_training)
    return out


def describe_table(state: Any) -> Description:
    """The per-layer ``describe`` table of the final weights (console and report show it)."""
    return nnstat.get_weight(state.model).describe(
        layerwise=True, stats=["numel", "mean", "std", "skew", "kurtosis", "l2"]
    )


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
        for s in tqdm(starts, desc=f"logging pass {i + 1}/2", leave=False, disable=None):
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
    ex.query_log = nnstat.get_log()
    ex.influence = nnstat.influence.compute_influence_all(ex.query_log, run.path, refine=refine)
    ex.timings["influence"] = time.perf_counter() - t0
    print(
        f"influence: {len(wrong)} misclassified test digits x {len(state.X_train)} training digits "
        f"({REFINE_STEPS} refinement steps, {ex.influence.meta['refine']['seconds']:.1f} s)"
    )


def find_mislabels(state: Any) -> None:
    """Self-influence ``g_iᵀ(H+λI)⁻¹g_i`` of every training digit from the gradient store (the
    store's EK-FAC preconditioner), ranked: how many of the planted wrong labels are at the top,
    against a random order (expected recall k/n) and against ranking by the training loss."""
    from nnstat.viewer import method_line

    ex = extras(state)
    if not state.planted or ex.run is None:
        return
    t0 = time.perf_counter()
    result = nnstat.influence.compute_self_influence(ex.run.path, progress=False)
    n = len(state.X_train)
    positions = torch.as_tensor([int(i) for i in result.ids])
    if sorted(positions.tolist()) != list(range(n)):
        raise RuntimeError("the gradient store's ids are not the training positions 0..n-1")
    scores = np.full(n, np.nan)
    scores[positions.numpy()] = result.scores.double().numpy()
    state.model.eval()
    with torch.no_grad():
        loss = nn.functional.cross_entropy(
            state.model(state.X_train), state.y_train, reduction="none"
        )
    from nnstat.plot.frames import ranking_hits

    ex.mislabels = MislabelSearch(
        scores=scores,
        loss=loss.double().numpy(),
        planted=list(state.planted),
        preconditioner=str(result.meta.get("preconditioner", "?")),
        method=method_line(result.meta),
        hits=ranking_hits(scores, state.planted),
        loss_hits=ranking_hits(loss.double().numpy(), state.planted),
    )
    ex.timings["self-influence"] = time.perf_counter() - t0
    m = ex.mislabels
    print(
        f"self-influence: {m.found} of the {m.k} planted wrong labels are among the {m.k} "
        f"highest of {n} (recall {m.recall:.2f}; the training loss finds {m.loss_found}; a "
        f"random order expects {m.baseline:.3f})"
    )


def save_for_viewer(state: Any) -> None:
    """What ``nnstat view``'s influence explorer needs to show the examples as images and the
    report's lists: the training digits (with the labels trained on) beside the gradient store,
    the misclassified test digits as a query set of that store, and the scores the report used
    (refined raw influence and RelatIF, with their methods) under `SAVED_SCORES`."""
    from nnstat.viewer import save_examples, save_queries, save_scores

    ex = extras(state)
    if ex.run is None:
        return
    t0 = time.perf_counter()
    n = len(state.X_train)
    save_examples(
        ex.run.path,
        list(range(n)),
        images=state.images_train,
        labels=[int(v) for v in state.y_train],
    )
    ex.viewer_examples.append(str(ex.run.path))
    if ex.query_log is not None:
        wrong, pred = ex.misclassified, ex.predicted
        queries = save_queries(ex.query_log, ex.run.path, name=QUERY_SET)
        save_examples(
            queries,
            wrong,
            images=state.images_test[wrong],
            labels=[f"true {int(state.y_test[i])}, predicted {int(pred[i])}" for i in wrong],
        )
        ex.viewer_examples.append(str(queries))
    exp = ex.explanations
    if exp is not None:
        for score, name in SAVED_SCORES.items():
            what = "the report's grid and lists" if score == exp.chosen else "in the report"
            label = f"{'refined raw influence' if score == 'raw' else 'RelatIF'}: {what}"
            save_scores(ex.run.path, name, exp.results[score], queries=QUERY_SET, label=label)
            ex.viewer_scores.append(name)
    ex.timings["save for nnstat view"] = time.perf_counter() - t0
    print(f"for nnstat view: examples beside {', '.join(ex.viewer_examples)}")
    if ex.viewer_scores:
        print(f"for nnstat view: the report's scores saved as {', '.join(ex.viewer_scores)}")
