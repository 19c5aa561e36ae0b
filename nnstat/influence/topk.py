"""Selection of the per-query top-k of a block of influence scores (the streaming top-k mode).

Example:
    >>> s = torch.randn(4, 2000)
    >>> hv, hr, lv, lr = block_candidates(s, 3)
    >>> bool((s[0, hr[0]] == hv[0]).all())
    True
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .result import TopKInfluence

#: rows per chunk of the top-k pre-selection (see `block_candidates`)
TOPK_CHUNK = 64


def block_candidates(
    scores: torch.Tensor, k: int, chunk: int = TOPK_CHUNK
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidates for the per-query top-``k`` of a query-major block ``[n_test, b]``.

    Returns ``(hi_vals, hi_rows, lo_vals, lo_rows)``, each ``[n_test, m]`` (``m >= k``, rows
    are block positions) containing the ``k`` largest and the ``k`` smallest scores of every
    query. The block is cut into chunks of ``chunk`` columns; a query's top-k lies in the ``k``
    chunks with the largest maxima (each of those holds a score ≥ the k-th largest maximum, so
    the k-th largest score is ≥ it too), so after one max and one min reduction over the block
    only ``k * chunk`` scores per query go through a full selection, instead of two ``topk``
    over the whole block (together costing most of the matmul that produced it). Values are
    exact: this only selects.

    Example:
        >>> s = torch.randn(3, 1000)
        >>> hv, hr, lv, lr = block_candidates(s, 2)
        >>> bool((torch.topk(hv, 2).values == torch.topk(s, 2).values).all())
        True
    """
    n_test, b = scores.shape
    nc = b // chunk
    kk = min(k, b)
    if nc < 2 * k or k * chunk * 2 > b:  # little to prune: select on the whole block
        hv, hj = torch.topk(scores, kk, dim=1)
        lv, lj = torch.topk(scores, kk, dim=1, largest=False)
        return hv, hj, lv, lj
    scores = scores.detach().contiguous()
    # the two passes over the whole block are torch reductions (parallel, vectorised); the
    # small steps after them run in numpy, single-threaded: as a dozen small parallel kernels per
    # block each waited for every intra-op thread, which on a loaded machine cost far more than
    # the work itself
    chunks = scores[:, : nc * chunk].view(n_test, nc, chunk)
    maxima, minima = chunks.amax(dim=2).numpy(), chunks.amin(dim=2).numpy()
    flat = scores.numpy().reshape(-1)
    within = np.arange(chunk)
    base = (np.arange(n_test) * b)[:, None]
    tail = np.broadcast_to(np.arange(nc * chunk, b), (n_test, b - nc * chunk))
    out = []
    for largest in (True, False):
        key = -maxima if largest else minima  # [n_test, nc]
        cj = np.argpartition(key, k - 1, axis=1)[:, :k]  # the k best chunks of every query
        rows = (cj[:, :, None] * chunk + within).reshape(n_test, k * chunk)
        rows = np.concatenate([rows, tail], 1)
        out += [torch.from_numpy(flat[rows + base]), torch.from_numpy(rows)]
    return out[0], out[1], out[2], out[3]


def merge_topk(
    vals: torch.Tensor,
    pos: torch.Tensor,
    scores: torch.Tensor,
    offset: int,
    k: int,
    largest: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The running per-query top-``k`` ``(vals, pos)`` ``[n_test, ≤k]`` merged with a block of
    scores ``[n_test, b]`` whose columns are rows ``offset, offset + 1, ...``; every step stays
    on the scores' device (torch only, no host read: the device branch's selection).

    Example:
        >>> v, p = torch.empty(1, 0), torch.empty(1, 0, dtype=torch.long)
        >>> v, p = merge_topk(v, p, torch.tensor([[1.0, 5.0, 3.0]]), 0, 2, True)
        >>> v, p = merge_topk(v, p, torch.tensor([[4.0, 0.0]]), 3, 2, True)
        >>> v.tolist(), p.tolist()
        ([[5.0, 4.0]], [[1, 3]])
    """
    v, j = torch.topk(scores, min(k, scores.shape[1]), dim=1, largest=largest)
    vals, pos = torch.cat([vals, v], 1), torch.cat([pos, j + offset], 1)
    if vals.shape[1] > k:
        vals, j = torch.topk(vals, k, dim=1, largest=largest)
        pos = pos.gather(1, j)
    return vals, pos


class RunningTopK:
    """Running top-k (largest and smallest) per query; holds ``n_test × 2k`` scores plus the
    processed ids, never the score matrix (the host branch's selection).

    Example:
        >>> top = RunningTopK(1, 2)
        >>> top.update(torch.tensor([[1.0, 3.0], [2.0, 0.0]]), ["a", "b"])
        >>> top.finish(["q0", "q1"], {}).helpful_ids
        [['b'], ['a']]
    """

    def __init__(self, k: int, n_test: int) -> None:
        self.k = k
        self.ids: list = []
        self.hi_v = torch.empty(n_test, 0)
        self.lo_v = torch.empty(n_test, 0)
        self.hi_i = torch.empty(n_test, 0, dtype=torch.long)
        self.lo_i = torch.empty(n_test, 0, dtype=torch.long)

    def _merge(self, vals, pos, cand_v, cand_rows, offset, largest):
        # small arrays: numpy keeps this off the intra-op thread pool (see block_candidates)
        cand_v = np.concatenate([vals.numpy(), cand_v.numpy()], 1)
        cand_i = np.concatenate([pos.numpy(), cand_rows.numpy() + offset], 1)
        kk = min(self.k, cand_v.shape[1])
        if kk < cand_v.shape[1]:
            j = np.argpartition(-cand_v if largest else cand_v, kk - 1, axis=1)[:, :kk]
            cand_v = np.take_along_axis(cand_v, j, 1)
            cand_i = np.take_along_axis(cand_i, j, 1)
        return torch.from_numpy(cand_v), torch.from_numpy(cand_i)

    def update(self, scores: torch.Tensor, block_ids: list) -> None:
        """Merge a query-major block of scores ``[n_test, b]`` (columns = ``block_ids``)."""
        offset = len(self.ids)
        self.ids.extend(block_ids)
        hv, hr, lv, lr = block_candidates(scores, self.k)
        self.hi_v, self.hi_i = self._merge(self.hi_v, self.hi_i, hv, hr, offset, True)
        self.lo_v, self.lo_i = self._merge(self.lo_v, self.lo_i, lv, lr, offset, False)

    def _named(self, pos: torch.Tensor) -> list[list]:
        return [[self.ids[j] for j in row] for row in pos.tolist()]

    def finish(self, test_ids: list, meta: dict, gather: Any = None) -> TopKInfluence:
        """The result, over every rank's candidates (``gather``: one object per rank, in rank
        order, e.g. ``all_gather_object``; ``None``: this process only)."""
        parts = (gather or (lambda obj: [obj]))(
            (self.hi_v, self._named(self.hi_i), self.lo_v, self._named(self.lo_i))
        )
        hi_v = torch.cat([p[0] for p in parts], 1)
        lo_v = torch.cat([p[2] for p in parts], 1)
        if hi_v.shape[1] == 0:
            raise ValueError("the training log is empty")
        hi_ids = [sum((p[1][r] for p in parts), []) for r in range(len(test_ids))]
        lo_ids = [sum((p[3][r] for p in parts), []) for r in range(len(test_ids))]
        kk = min(self.k, hi_v.shape[1])
        hv, hi = torch.topk(hi_v, kk, dim=1, largest=True)
        lv, li = torch.topk(lo_v, kk, dim=1, largest=False)
        return TopKInfluence(
            list(test_ids),
            hv,
            [[hi_ids[r][j] for j in row] for r, row in enumerate(hi.tolist())],
            lv,
            [[lo_ids[r][j] for j in row] for r, row in enumerate(li.tolist())],
            meta,
        )
