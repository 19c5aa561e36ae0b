"""Result types of `nnstat.influence`.

Scores follow the pinned convention ``score(q, i) = g_qᵀ (H + λI)⁻¹ g_i``: positive = training
example ``i`` helps query ``q`` (upweighting it lowers the query loss). Koh & Liang's
``I_up,loss`` is the negative of this score.

Example:
    >>> import torch
    >>> r = InfluenceResult(torch.tensor([[1.0, -2.0, 3.0]]), ["q"], ["a", "b", "c"])
    >>> r.top_k(1).helpful_ids, r.top_k(1).harmful_ids
    ([['c']], [['b']])
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from .arguments import check_count


@dataclass
class TopKInfluence:
    """The ``k`` most helpful (largest score) and most harmful (smallest score) training examples
    per query, best first.

    Example:
        >>> import torch
        >>> t = TopKInfluence(["q"], torch.tensor([[2.0]]), [["a"]], torch.tensor([[-1.0]]), [["b"]])
        >>> t.to_frame()["train_id"].tolist()
        ['a', 'b']
    """

    test_ids: list
    helpful_scores: torch.Tensor  # [n_test, k], descending
    helpful_ids: list[list]
    harmful_scores: torch.Tensor  # [n_test, k], ascending
    harmful_ids: list[list]
    meta: dict = field(default_factory=dict)

    @property
    def k(self) -> int:
        return int(self.helpful_scores.shape[1])

    def to_frame(self) -> pd.DataFrame:
        """Long format: ``test_id, kind ('helpful'|'harmful'), rank, train_id, score``."""
        records = []
        for kind, scores, ids in (
            ("helpful", self.helpful_scores, self.helpful_ids),
            ("harmful", self.harmful_scores, self.harmful_ids),
        ):
            for q, test_id in enumerate(self.test_ids):
                for rank, (train_id, s) in enumerate(zip(ids[q], scores[q].tolist(), strict=True)):
                    records.append((test_id, kind, rank, train_id, s))
        return pd.DataFrame.from_records(
            records, columns=["test_id", "kind", "rank", "train_id", "score"]
        )


def top_k_from_scores(
    scores: torch.Tensor, test_ids: list, train_ids: list, k: int, meta: dict | None = None
) -> TopKInfluence:
    """Top-``k`` helpful and harmful training examples from a full score matrix.

    Example:
        >>> import torch
        >>> top_k_from_scores(torch.tensor([[0.0, 5.0]]), [0], ["a", "b"], 1).helpful_ids
        [['b']]
    """
    k = min(check_count("k", k), scores.shape[1])
    scores = scores.contiguous()  # top-k along a contiguous dimension is several times faster
    hv, hi = torch.topk(scores, k, dim=1, largest=True)
    lv, li = torch.topk(scores, k, dim=1, largest=False)
    return TopKInfluence(
        list(test_ids),
        hv,
        [[train_ids[j] for j in row] for row in hi.tolist()],
        lv,
        [[train_ids[j] for j in row] for row in li.tolist()],
        dict(meta or {}),
    )


@dataclass
class InfluenceResult:
    """All-pairs influence: ``scores[q, i]`` for query ``test_ids[q]`` and train ``train_ids[i]``.

    ``meta`` records how the scores were made (mode, preconditioner, damping per module).
    ``scores`` from the streaming scorer is a transposed view of a train-major buffer (no extra
    pass to pack it); call ``.contiguous()`` if an operation needs a packed layout.

    Example:
        >>> import torch
        >>> InfluenceResult(torch.zeros(2, 3), [0, 1], [5, 6, 7]).to_frame().shape
        (6, 3)
    """

    scores: torch.Tensor
    test_ids: list
    train_ids: list
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        expected = (len(self.test_ids), len(self.train_ids))
        if tuple(self.scores.shape) != expected:
            raise ValueError(
                f"scores have shape {tuple(self.scores.shape)}, ids give {expected} "
                "(n_test, n_train)"
            )

    def top_k(self, k: int = 10) -> TopKInfluence:
        """The ``k`` most helpful and most harmful training examples per query, with ids."""
        return top_k_from_scores(self.scores, self.test_ids, self.train_ids, k, self.meta)

    def to_frame(self) -> pd.DataFrame:
        """Long format: one row per (test_id, train_id) pair with its ``score``."""
        n_test, n_train = self.scores.shape
        return pd.DataFrame(
            {
                "test_id": np.repeat(_objects(self.test_ids), n_train),
                "train_id": np.tile(_objects(self.train_ids), n_test),
                "score": self.scores.detach().cpu().numpy().reshape(-1),
            }
        )


def _objects(values: list) -> np.ndarray:
    # filled one by one so tuple or list ids stay single objects instead of becoming a 2-D array
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


@dataclass
class SelfInfluenceResult:
    """Self-influence ``g_iᵀ (H + λI)⁻¹ g_i`` per example (high = unusual/uncertain/mislabelled).

    Example:
        >>> import torch
        >>> SelfInfluenceResult(torch.tensor([3.0, 1.0]), ["a", "b"]).to_frame()["id"].tolist()
        ['a', 'b']
    """

    scores: torch.Tensor
    ids: list
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scores.shape != (len(self.ids),):
            raise ValueError(
                f"scores have shape {tuple(self.scores.shape)} for {len(self.ids)} ids"
            )

    def top_k(self, k: int = 10) -> list:
        """Ids of the ``k`` examples with the highest self-influence, highest first."""
        k = min(k, len(self.ids))
        return [self.ids[i] for i in torch.topk(self.scores, k).indices.tolist()]

    def to_frame(self) -> pd.DataFrame:
        """Columns ``id, score``."""
        return pd.DataFrame({"id": _objects(self.ids), "score": self.scores.cpu().numpy()})
