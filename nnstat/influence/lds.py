"""Linear Datamodeling Score (Park et al. 2023) and the retraining protocol that feeds it.

For query ``q`` and random training subsets ``S_1..S_m``, the LDS is the Spearman correlation
across subsets between the predicted effect ``Σ_{i∈S_j} score(q, i)`` and the measured outcome of
a model trained on ``S_j``. With nnstat's convention (positive = helpful) the outcome is the
**negative** query loss, so a good attribution method has a positive LDS. The reported value is
the mean over queries.

Example:
    >>> import torch
    >>> scores = torch.tensor([[1.0, 0.0, -1.0]])
    >>> masks = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=torch.bool)
    >>> losses = torch.tensor([[0.1], [0.5], [0.9]])
    >>> lds(scores, masks, losses)
    1.0
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.stats import rankdata
from tqdm.auto import tqdm


def _as_numpy(x: Any, name: str) -> np.ndarray:
    arr = x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)
    if arr.dtype != bool and not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN/Inf values")
    return arr


def lds_per_query(
    scores: Any, subset_masks: Any, subset_losses: Any, higher_is_better: bool = False
) -> np.ndarray:
    """Spearman correlation per query (``nan`` where either side is constant across subsets).

    Shapes: ``scores [n_query, n_train]``, ``subset_masks [m, n_train]`` (bool),
    ``subset_losses [m, n_query]``. ``higher_is_better=True`` for measurements such as margins or
    accuracies, where larger means the query is better off (they are then not negated).

    Example:
        >>> import numpy as np
        >>> lds_per_query(np.eye(3)[:2], np.eye(3, dtype=bool), 1 - np.eye(3)[:, :2])
        array([1., 1.])
    """
    s = _as_numpy(scores, "scores").astype(np.float64)
    masks = _as_numpy(subset_masks, "subset_masks")
    y = _as_numpy(subset_losses, "subset_losses").astype(np.float64)
    if s.ndim != 2 or masks.ndim != 2 or y.ndim != 2:
        raise ValueError(
            "expected scores [n_query, n_train], subset_masks [m, n_train], subset_losses "
            f"[m, n_query]; got {s.shape}, {masks.shape}, {y.shape}"
        )
    if masks.shape[1] != s.shape[1]:
        raise ValueError(
            f"subset_masks cover {masks.shape[1]} training examples but scores have {s.shape[1]}"
        )
    if y.shape != (masks.shape[0], s.shape[0]):
        raise ValueError(
            f"subset_losses must be [m={masks.shape[0]}, n_query={s.shape[0]}], got {y.shape}"
        )
    if masks.shape[0] < 3:
        raise ValueError(f"LDS needs at least 3 subsets, got {masks.shape[0]}")
    predicted = masks.astype(np.float64) @ s.T  # [m, n_query]
    outcome = y if higher_is_better else -y
    rp = rankdata(predicted, axis=0)
    ro = rankdata(outcome, axis=0)
    rp -= rp.mean(0)
    ro -= ro.mean(0)
    denom = np.sqrt((rp**2).sum(0) * (ro**2).sum(0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (rp * ro).sum(0) / np.where(denom > 0, denom, 1), np.nan)


def lds(
    scores: Any, subset_masks: Any, subset_losses: Any, higher_is_better: bool = False
) -> float:
    """Mean LDS over queries; queries whose correlation is undefined are left out (with a warning).

    Example:
        >>> import numpy as np
        >>> lds(np.eye(3), np.eye(3, dtype=bool), 1 - np.eye(3))
        1.0
    """
    per_query = lds_per_query(scores, subset_masks, subset_losses, higher_is_better)
    bad = np.isnan(per_query)
    if bad.all():
        raise ValueError("LDS is undefined: every query has constant predictions or outcomes")
    if bad.any():
        warnings.warn(
            f"{int(bad.sum())} of {len(bad)} queries have constant predictions or outcomes "
            "across subsets and are left out of the LDS",
            stacklevel=2,
        )
    return float(np.mean(per_query[~bad]))


@dataclass
class LDSProtocol:
    """Subsets and measured query losses of a retraining run; `evaluate` scores a method.

    Example:
        >>> import torch
        >>> p = LDSProtocol(torch.eye(3, dtype=torch.bool), torch.tensor([[0.1], [0.5], [0.9]]))
        >>> p.evaluate(torch.tensor([[1.0, 0.0, -1.0]]))
        1.0
    """

    subset_masks: torch.Tensor  # [m, n_train] bool
    subset_losses: torch.Tensor  # [m, n_query]
    alpha: float = 0.5
    seed: int = 0

    def evaluate(self, scores: Any, higher_is_better: bool = False) -> float:
        """LDS of ``scores [n_query, n_train]`` on these subsets."""
        return lds(scores, self.subset_masks, self.subset_losses, higher_is_better)


def subset_masks(n_train: int, m: int, alpha: float = 0.5, seed: int = 0) -> torch.Tensor:
    """``m`` random subsets of ``round(alpha · n_train)`` examples each, as a bool mask.

    Example:
        >>> subset_masks(10, 4, 0.5, seed=1).sum(1).tolist()
        [5, 5, 5, 5]
    """
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    size = int(round(alpha * n_train))
    if not 0 < size < n_train:
        raise ValueError(f"alpha={alpha} of n_train={n_train} gives an empty or full subset")
    rng = np.random.default_rng(seed)
    masks = np.zeros((m, n_train), dtype=bool)
    for j in range(m):
        masks[j, rng.choice(n_train, size=size, replace=False)] = True
    return torch.from_numpy(masks)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def run_lds_protocol(
    train_fn: Callable[[torch.Tensor], Any],
    n_train: int,
    query_loss_fn: Callable[[Any], Any],
    alpha: float = 0.5,
    m: int = 50,
    seed: int = 0,
    seeds_per_subset: int = 1,
    progress: bool | None = None,
) -> LDSProtocol:
    """Retrain on ``m`` random ``alpha``-subsets and record each query's loss.

    ``train_fn(subset_indices: LongTensor) -> model`` trains from scratch on those training
    indices; ``query_loss_fn(model) -> [n_query]`` returns each query's loss (or a measurement with
    ``higher_is_better`` at evaluation). Torch, numpy and ``random`` are seeded before every
    training run from ``seed``, the subset and the repeat, so the protocol is deterministic;
    with ``seeds_per_subset > 1`` the losses of the repeats are averaged (less training noise).

    Example:
        >>> import torch
        >>> proto = run_lds_protocol(lambda idx: idx.float().mean(), 10,
        ...                          lambda model: torch.stack([model, -model]), m=5, seed=0)
        >>> proto.subset_losses.shape
        torch.Size([5, 2])
    """
    if m < 3:
        raise ValueError(f"m must be >= 3 subsets, got {m}")
    if seeds_per_subset < 1:
        raise ValueError(f"seeds_per_subset must be >= 1, got {seeds_per_subset}")
    masks = subset_masks(n_train, m, alpha, seed)
    losses = []
    for j in tqdm(
        range(m), desc="LDS retraining", disable=None if progress is None else not progress
    ):
        indices = masks[j].nonzero().flatten()
        runs = []
        for r in range(seeds_per_subset):
            seed_everything(seed * 1_000_003 + j * 1_009 + r)
            with torch.enable_grad():
                model = train_fn(indices)
            with torch.no_grad():
                value = torch.as_tensor(query_loss_fn(model), dtype=torch.float64).flatten()
            if not torch.isfinite(value).all():
                raise ValueError(f"query_loss_fn returned NaN/Inf for subset {j} (repeat {r})")
            runs.append(value)
        losses.append(torch.stack(runs).mean(0))
    return LDSProtocol(masks, torch.stack(losses), alpha, seed)
