"""Counterfactual check of an attribution: remove what it names, retrain, measure the query.

LDS (`nnstat.influence.lds`) scores a method over many random subsets; this asks the question a
researcher asks of one explanation: *if these k training examples are removed and the model is
retrained, does the query's loss (or prediction) change the way the scores say, and more than when
k random examples, or the k examples an obvious baseline names, are removed?*

Design:

* Every arm (the full data, the ranking under test, each baseline, random) is retrained with the
  user's ``train_fn(kept_indices)`` from the **same seeds**: repeat ``r`` of every arm starts from
  the same random state, so differences between arms come from the removed examples, not from
  the initialisation or the batch order (a paired design; `lds.seed_everything` seeds torch,
  numpy and ``random``).
* The removal set of a ranking is its top ``k`` for the chosen queries jointly (the scores summed
  over them): ``direction="harmful"`` removes the most harmful examples (lowest scores: the query's
  loss should fall), ``"helpful"`` the most helpful (it should rise).
* ``change`` is the query loss after removal minus the loss of the full-data model of the same
  repeat, averaged over the queries; its 95% interval is Student's t over the repeats.
* ``predicted`` is the first-order prediction of the scores for the removed set,
  ``Σ_{i∈S} score(q, i) / n_train`` averaged over the queries (with nnstat's convention, the
  curvature of the **mean** loss and positive = helpful: removing ``i`` moves the loss by
  ``+score/n``). It is exact to first order for a converged convex model and the exact inverse
  Hessian; for anything else it is what the scores claim, shown beside what retraining measured.

Example:
    >>> import torch
    >>> X, y = torch.randn(40, 3, generator=torch.Generator().manual_seed(0)), torch.randn(40)
    >>> def train_fn(idx):  # ridge regression, solved exactly
    ...     A = X[idx].T @ X[idx] / len(idx) + 0.1 * torch.eye(3)
    ...     return torch.linalg.solve(A, X[idx].T @ y[idx] / len(idx))
    >>> query_loss = lambda w: ((X[:2] @ w - y[:2]) ** 2) / 2
    >>> scores = torch.randn(2, 40)
    >>> res = counterfactual(train_fn, query_loss, scores, k=3, repeats=2)
    >>> sorted(res.arms)
    ['random', 'scores']
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from scipy import stats as sps

from .lds import seed_everything

DIRECTIONS = ("harmful", "helpful")


@dataclass
class Arm:
    """One removal rule's measurements: per repeat, the mean change in the queries' loss (and
    the fraction of queries whose measurement ``correct_fn`` says is correct after removal)."""

    name: str
    removed: list[list[int]]  # per repeat (random differs per repeat; rankings do not)
    change: list[float]
    correct: list[float] | None = None
    predicted: float | None = None

    @property
    def mean(self) -> float:
        return float(np.mean(self.change))

    @property
    def interval(self) -> tuple[float, float]:
        """95% Student-t interval of the mean change over the repeats (NaN with one repeat)."""
        n = len(self.change)
        if n < 2:
            return (math.nan, math.nan)
        half = float(sps.t.ppf(0.975, n - 1) * np.std(self.change, ddof=1) / math.sqrt(n))
        return (self.mean - half, self.mean + half)


@dataclass
class CounterfactualResult:
    """What removing each arm's ``k`` examples did to the queries (see the module docstring).

    Example:
        >>> import torch
        >>> X, y = torch.randn(40, 3, generator=torch.Generator().manual_seed(0)), torch.randn(40)
        >>> def train_fn(idx):  # ridge regression, solved exactly
        ...     A = X[idx].T @ X[idx] / len(idx) + 0.1 * torch.eye(3)
        ...     return torch.linalg.solve(A, X[idx].T @ y[idx] / len(idx))
        >>> query_loss = lambda w: ((X[:2] @ w - y[:2]) ** 2) / 2
        >>> scores = torch.arange(80.0).reshape(2, 40)  # examples 0, 1, 2 score lowest
        >>> res = counterfactual(train_fn, query_loss, scores, k=3, repeats=1, random=False)
        >>> arm = res.arms["scores"]
        >>> arm.removed, res.k, res.direction, res.queries
        ([[0, 1, 2]], 3, 'harmful', [0, 1])
        >>> after = query_loss(train_fn(torch.arange(3, 40))).mean().item()
        >>> abs(arm.change[0] - (after - res.full_loss[0])) < 1e-5  # the loss change, retrained
        True
    """

    k: int
    direction: str
    queries: list[int]
    full_loss: list[float]  # per repeat: the full-data model's mean query loss
    full_correct: list[float] | None
    arms: dict[str, Arm] = field(default_factory=dict)

    def table(self) -> str:
        """One line per arm: mean change with its interval, the scores' prediction, accuracy."""
        lines = [
            f"removed k={self.k} ({self.direction} first) for {len(self.queries)} "
            f"quer{'y' if len(self.queries) == 1 else 'ies'}, {len(self.full_loss)} repeat(s); "
            f"full-data query loss {np.mean(self.full_loss):.4g}"
        ]
        for arm in self.arms.values():
            lo, hi = arm.interval
            line = f"  {arm.name:<10} loss change {arm.mean:+.4g} [{lo:+.3g}, {hi:+.3g}]"
            if arm.predicted is not None:
                line += f"  predicted {arm.predicted:+.4g}"
            if arm.correct is not None and self.full_correct is not None:
                line += f"  correct {np.mean(self.full_correct):.2f} -> {np.mean(arm.correct):.2f}"
            lines.append(line)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON-ready)."""
        return {
            "k": self.k,
            "direction": self.direction,
            "queries": self.queries,
            "full_loss": self.full_loss,
            "full_correct": self.full_correct,
            "arms": {
                n: {
                    "mean": a.mean,
                    "interval": list(a.interval),
                    "change": a.change,
                    "predicted": a.predicted,
                    "correct": a.correct,
                    "removed": a.removed,
                }
                for n, a in self.arms.items()
            },
        }


def removal_order(values: torch.Tensor, direction: str) -> torch.Tensor:
    """Training indices in removal order for one joint score per example: ``harmful`` removes
    the lowest scores first, ``helpful`` the highest (stable: ties keep index order)."""
    return torch.argsort(values, descending=direction == "helpful", stable=True)


def _as_matrix(scores: Any) -> torch.Tensor:
    s = getattr(scores, "scores", scores)
    s = torch.as_tensor(s, dtype=torch.float64)
    if s.dim() == 1:
        s = s[None]
    if s.dim() != 2 or not torch.isfinite(s).all():
        raise ValueError(
            f"scores must be a finite [n_query, n_train] matrix (or an InfluenceResult), got "
            f"shape {tuple(s.shape)}"
        )
    return s


def _mean_loss(
    query_loss_fn: Callable[[Any], Any], model: Any, queries: list[int], n_query: int
) -> float:
    with torch.no_grad():
        v = torch.as_tensor(query_loss_fn(model), dtype=torch.float64).flatten()
    if v.numel() != n_query:  # shorter: an IndexError; longer: other queries' losses
        raise ValueError(
            f"query_loss_fn(model) returned {v.numel()} losses, but scores has {n_query} query "
            "rows: return one loss per query, in the order of scores' rows"
        )
    if not torch.isfinite(v).all():
        raise ValueError("query_loss_fn returned NaN/Inf")
    return float(v[queries].mean())


def counterfactual(
    train_fn: Callable[[torch.Tensor], Any],
    query_loss_fn: Callable[[Any], Any],
    scores: Any,
    k: int,
    *,
    queries: Sequence[int] | None = None,
    direction: str = "harmful",
    baselines: Mapping[str, Any] | None = None,
    repeats: int = 3,
    random: bool = True,
    correct_fn: Callable[[Any], Any] | None = None,
    seed: int = 0,
) -> CounterfactualResult:
    """Remove the ``k`` training examples ``scores`` names for ``queries``, retrain, compare.

    Args:
        train_fn: ``train_fn(kept_indices: LongTensor) -> model``, training from scratch on
            those training indices (the seeds are set before each call).
        query_loss_fn: ``query_loss_fn(model) -> [n_query]`` losses of every query.
        scores: ``[n_query, n_train]`` influence scores (or an `InfluenceResult`), positive =
            helpful, in nnstat's convention.
        k: examples removed per arm.
        queries: rows of ``scores`` (and of ``query_loss_fn``'s output) to target jointly
            (default: all).
        direction: ``"harmful"`` (remove the lowest joint scores; the loss should fall) or
            ``"helpful"`` (remove the highest; it should rise).
        baselines: other rankings, ``name -> [n_train]`` values, **higher removed first**
            (e.g. ``{"loss": train_losses}`` or ``{"grad norm": norms}``).
        repeats: retrainings per arm (the same seeds across arms).
        random: also remove ``k`` random examples (new ones every repeat).
        correct_fn: optional ``correct_fn(model) -> [n_query]`` booleans (e.g. prediction ==
            label): the fraction correct after removal is reported too.
        seed: base seed of the repeats and of the random arm.

    Example:
        >>> import torch
        >>> w_true = torch.tensor([1.0, -2.0])
        >>> X = torch.randn(30, 2, generator=torch.Generator().manual_seed(1))
        >>> y = X @ w_true
        >>> fit = lambda idx: torch.linalg.lstsq(X[idx], y[idx][:, None]).solution[:, 0]
        >>> res = counterfactual(fit, lambda w: (X[:1] @ w - y[:1]) ** 2, torch.zeros(1, 30),
        ...                      k=2, repeats=1, random=False)
        >>> abs(res.arms["scores"].mean) < 1e-9  # noiseless data: removing two changes nothing
        True
    """
    s = _as_matrix(scores)
    n_query, n_train = s.shape
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; valid: {', '.join(DIRECTIONS)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k < n_train:
        raise ValueError(f"k must be an int in [1, n_train={n_train}), got {k!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    qs = list(range(n_query)) if queries is None else [int(q) for q in queries]
    if not qs or any(not 0 <= q < n_query for q in qs):
        raise ValueError(f"queries must be row indices of scores (0..{n_query - 1}), got {qs}")
    joint = s[qs].sum(0)
    orders: dict[str, torch.Tensor] = {"scores": removal_order(joint, direction)}
    for name, values in (baselines or {}).items():
        v = torch.as_tensor(values, dtype=torch.float64).flatten()
        if v.shape != (n_train,) or not torch.isfinite(v).all():
            raise ValueError(f"baseline {name!r} must be {n_train} finite values, got {v.shape}")
        if name in orders or name == "random":
            raise ValueError(f"baseline name {name!r} is taken")
        orders[name] = removal_order(v, "helpful")  # higher removed first
    everyone = torch.arange(n_train)
    result = CounterfactualResult(k, direction, qs, [], [] if correct_fn else None)
    names = list(orders) + (["random"] if random else [])
    for name in names:
        result.arms[name] = Arm(name, [], [], [] if correct_fn else None)
    result.arms["scores"].predicted = float(s[qs][:, orders["scores"][:k]].sum(1).mean()) / n_train
    for r in range(repeats):
        run_seed = seed * 1_000_003 + r

        def trained(kept: torch.Tensor, run_seed: int = run_seed) -> Any:
            seed_everything(run_seed)
            with torch.enable_grad():
                return train_fn(kept)

        full = trained(everyone)
        base = _mean_loss(query_loss_fn, full, qs, n_query)
        result.full_loss.append(base)
        if correct_fn is not None:
            result.full_correct.append(_fraction(correct_fn, full, qs))  # type: ignore[union-attr]
        gen = torch.Generator().manual_seed(run_seed + 7919)
        for name in names:
            removed = (
                torch.randperm(n_train, generator=gen)[:k] if name == "random" else orders[name][:k]
            )
            keep = torch.ones(n_train, dtype=torch.bool)
            keep[removed] = False
            model = trained(everyone[keep])
            arm = result.arms[name]
            arm.removed.append(sorted(removed.tolist()))
            arm.change.append(_mean_loss(query_loss_fn, model, qs, n_query) - base)
            if correct_fn is not None:
                arm.correct.append(_fraction(correct_fn, model, qs))  # type: ignore[union-attr]
    return result


def _fraction(correct_fn: Callable[[Any], Any], model: Any, queries: list[int]) -> float:
    with torch.no_grad():
        ok = torch.as_tensor(correct_fn(model)).flatten()
    return float(ok[queries].double().mean())
