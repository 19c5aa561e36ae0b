"""The device branch of scoring: no host read per block.

The training rows come through `pipeline.read_ahead` (read on a thread into pinned buffers, copied
to the device on a side stream). For each block the device queues one matrix product, the mode's
normalisation, a running top-k merge (`topk.merge_topk`) or a write into the all-pairs buffer, and
one sum that catches NaN/Inf. Nothing is read back until the end: the sums in one read, then the
results in one more (all-pairs scores on a GPU are copied block by block into pinned host memory
as they are made, without waiting). A block whose sum is not finite is handed to ``verify`` (the
CPU branch's checks, which name the shard: `nnstat.influence.score`) before any result is
returned.

A store of factored rows arrives as stored (the host-to-device copy carries the factors, not the
dense rows) and is scored by the CPU branch's `FactoredScores` (``per_block=True``): chunk by
chunk, each chunk's dense rows (or, for one query, the direct contraction's transients) no larger
than the block's stored rows, so no dense block is ever held. The modes with norms and
self-influence multiply the rows out a chunk of the same bound at a time (`dense_chunks`).

Example:
    >>> from nnstat.influence.precondition import Preconditioner
    >>> from nnstat.influence.pipeline import read_ahead
    >>> rows = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    >>> blocks = read_ahead(iter([((0, 0), [7, 8], rows[:2]), ((0, 1), [9], rows[2:])]), "cpu")
    >>> out = stream_scores(torch.eye(2), None, blocks, Preconditioner("identity", [], {}), None,
    ...                     "dot", top_k=1, n_rows=3, verify=print)  # keys of non-finite blocks
    []
    >>> out.top[0], out.top[1]  # per query: the largest score and its row
    ([[3.0], [3.0]], [[2.0], [2.0]])
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from nnstat.background.transfer import host_empty

from .factored_queries import norm_parts_as_stored, self_influence_as_stored, self_influence_view
from .factored_scores import StoredQueries, chunk_rows, scores_as_stored
from .modes import normalise, raw_scores
from .pipeline import Block
from .topk import merge_topk

#: dense transients per row of a chunk whose norms are taken: the rows, ``M`` applied, a product
NORM_TRANSIENTS = 3


@dataclass
class Streamed:
    """What one pass over the training rows left, on the host.

    ``units``: ``(key, ids)`` per block in the order scored; ``scores``: the all-pairs scores
    ``[rows, n_test]`` (train-major) or, per block, ``pieces`` of them (``buffer=False``);
    ``top``: ``[hi_vals, hi_pos, lo_vals, lo_pos]``, each ``n_test`` lists of ``k`` floats (best
    first), positions counting the rows in the order scored.
    """

    units: list[tuple[tuple, list]] = field(default_factory=list)
    scores: torch.Tensor | None = None
    pieces: list[torch.Tensor] = field(default_factory=list)
    top: list[list[list[float]]] | None = None


def _all_pairs_buffer(n_rows: int, n_test: int, device: torch.device) -> torch.Tensor:
    """``[n_rows, n_test]`` for the all-pairs scores. On a GPU: pinned host memory, which each
    block's scores are copied into as they are made (``non_blocking``: the copies queue behind
    the products, nothing waits; the one read at the end drains them), else pageable memory where
    pinning so much is refused (each copy then waits for its block). Elsewhere: on ``device``."""
    if device.type != "cuda":
        return torch.empty(n_rows, n_test, device=device)
    return host_empty(n_rows * n_test, pin=True, fallback=True).view(n_rows, n_test)


def dense_chunks(
    rows: torch.Tensor, dense: Callable[[torch.Tensor], torch.Tensor] | None, dense_width: int
) -> Iterator[tuple[slice, torch.Tensor]]:
    """``(rows' slice, its dense float32 rows)`` chunk by chunk: ``rows`` whole where ``dense`` is
    ``None`` (dense already), else chunks whose dense transients take no more than ``rows``
    (:func:`chunk_rows`).

    Args:
        rows: ``[b, stored width]`` rows of a block.
        dense: multiplies stored rows out (`StoreSource.dense`), or ``None``.
        dense_width: columns of a dense row.

    Returns:
        An iterator of ``(slice of the block, float32 dense rows of that slice)``.

    Example:
        >>> [(s.start, s.stop) for s, _ in dense_chunks(torch.ones(40, 2), lambda r: r, 8)]
        [(0, 16), (16, 32), (32, 40)]
    """
    n = rows.shape[0]
    if dense is None:
        yield slice(0, n), rows.to(torch.float32)
        return
    chunk = chunk_rows(n, rows.shape[1], NORM_TRANSIENTS * dense_width * 4)
    for s in range(0, n, chunk):
        yield slice(s, min(n, s + chunk)), dense(rows[s : s + chunk])


def _normalised(
    scores: torch.Tensor,
    q_norm: torch.Tensor | None,
    rows: torch.Tensor,
    dense: Callable[[torch.Tensor], torch.Tensor] | None,
    dense_width: int,
    norms: tuple[Any, float | None, str],
    query_major: bool,
    modules: Any = None,
) -> torch.Tensor:
    """`normalise` of a block's scores, chunk by chunk of `dense_chunks` (it works in place,
    row by row: a chunk's columns, or rows, of ``scores`` are normalised as a whole block's);
    under ``identity`` a factored block's norms come from its factors (``modules``: the
    store's meta.json modules), and no chunk is multiplied out."""
    pre, damping, mode = norms
    if mode == "dot":
        return scores
    if dense is not None and pre.kind == "identity":  # ‖g‖ from the factors: no dense chunk
        t_parts = norm_parts_as_stored(rows, modules)
        return normalise(scores, q_norm, rows, pre, damping, mode, query_major, t_parts)
    for part, chunk in dense_chunks(rows, dense, dense_width):
        sub = scores[:, part] if query_major else scores[part]
        normalise(sub, q_norm, chunk, pre, damping, mode, query_major=query_major)
    return scores


def _bad_units(sums: list[torch.Tensor], units: list[tuple[tuple, list]]) -> list[tuple]:
    """Keys of the blocks whose score sum is NaN/Inf (one host read for all of them)."""
    if not sums:
        return []
    finite = torch.isfinite(torch.stack(sums)).tolist()
    return [key for (key, _), ok in zip(units, finite, strict=True) if not ok]


def stream_scores(
    q_pre: torch.Tensor,
    q_norm: torch.Tensor | None,
    blocks: Iterator[Block],
    pre: Any,
    damping: float | None,
    mode: str,
    top_k: int | None,
    n_rows: int | None,
    verify: Callable[[list[tuple]], None],
    progress: Callable[[int], Any] | None = None,
    source: Any = None,
    queries: StoredQueries | None = None,
) -> Streamed:
    """Score every block of ``blocks`` against the preconditioned queries ``q_pre`` (on their
    device); ``n_rows``: the rows ``blocks`` will yield, for one all-pairs buffer (``None``:
    unknown, one piece per block). ``verify`` gets the keys of the blocks with non-finite scores
    before any result is read back, and raises where they must be refused.

    ``source`` (the training rows' `RowSource`, optional): where it is a store of factored rows,
    its blocks come as stored (`pipeline.stream_to`) and are scored by `FactoredScores` with
    chunks sized from each block; ``source.dense`` multiplies them out, a chunk at a time, for
    the norms of the modes other than ``dot``. ``queries``: the queries as factors
    (`factored_queries.stored_queries`), for the modules both sides store as factors."""
    device, n_test = q_pre.device, q_pre.shape[0]
    out = Streamed()
    sums: list[torch.Tensor] = []
    if top_k:
        empty_v = torch.empty(n_test, 0, device=device)
        empty_p = torch.empty(n_test, 0, dtype=torch.long, device=device)
        hi, lo = (empty_v, empty_p), (empty_v, empty_p)
    buffer = _all_pairs_buffer(n_rows, n_test, device) if not top_k and n_rows else None
    seen, width = 0, q_pre.shape[1]
    factored = scores_as_stored(q_pre, source, per_block=True, queries=queries)
    dense = source.dense if factored is not None else None
    modules = source.meta["modules"] if factored is not None else None
    for key, ids, rows in blocks:
        b = len(ids)
        target = buffer[seen : seen + b] if buffer is not None and buffer.device == device else None
        if factored is not None:
            scores = factored(rows, target, query_major=bool(top_k))
        else:
            scores = raw_scores(q_pre, rows, target, query_major=bool(top_k))
        norms = (pre, damping, mode)
        scores = _normalised(scores, q_norm, rows, dense, width, norms, bool(top_k), modules)
        sums.append(scores.sum())
        if top_k:
            hi = merge_topk(*hi, scores, seen, top_k, largest=True)
            lo = merge_topk(*lo, scores, seen, top_k, largest=False)
        elif buffer is None:
            out.pieces.append(scores)
        elif target is None:
            buffer[seen : seen + b].copy_(scores, non_blocking=True)  # to the host buffer
        out.units.append((key, ids))
        seen += b
        if progress is not None:
            progress(b)
    verify(_bad_units(sums, out.units))
    if n_rows is not None and seen != n_rows:
        raise RuntimeError(f"the training log yielded {seen} rows, expected {n_rows}")
    if top_k:
        # best first (the merges sort only once more than k rows were seen), and one read back:
        # values and positions (exact in float64 below 2**53) in one tensor
        parts = []
        for (vals, pos), largest in ((hi, True), (lo, False)):
            vals, j = torch.sort(vals, dim=1, descending=largest, stable=True)
            parts += [vals.double(), pos.gather(1, j).double()]
        out.top = torch.stack(parts).tolist()
    elif buffer is not None:
        out.scores = buffer.cpu()  # a GPU's copies were drained by `_bad_units`' read
    elif out.pieces:
        sizes = [len(ids) for _, ids in out.units]
        out.pieces = list(torch.cat(out.pieces).cpu().split(sizes))
    return out


def stream_self_influence(
    blocks: Iterator[Block],
    pre: Any,
    damping: float | None,
    n_rows: int,
    device: torch.device,
    verify: Callable[[list[tuple]], None],
    progress: Callable[[int], Any] | None = None,
    source: Any = None,
) -> tuple[list, torch.Tensor]:
    """``(ids, g_iᵀ M g_i)`` of every row of ``blocks`` computed on ``device``, read back once;
    ``verify`` gets the keys of the blocks with non-finite values first. Where ``source`` is a
    store of factored rows its blocks come as stored (`pipeline.stream_to`) and are multiplied
    out a chunk at a time (`dense_chunks`), or under ``identity`` not at all
    (`factored_queries.self_influence_as_stored`)."""
    dense, dense_width = None, 0
    if getattr(source, "factored", False):
        dense, dense_width = source.dense, max(m.stop for m in source.layout)
    # identity: ``‖g‖²`` of the factors as stored, no chunk multiplied out
    as_stored = dense is not None and self_influence_view(source, pre) is not None
    values = torch.empty(n_rows, device=device)
    units: list[tuple[tuple, list]] = []
    seen = 0
    for key, ids, rows in blocks:
        if as_stored:
            values[seen : seen + len(ids)] = self_influence_as_stored(rows, source.meta["modules"])
        else:
            for part, chunk in dense_chunks(rows, dense, dense_width):
                own = values[seen + part.start : seen + part.stop]
                torch.sum(pre.apply(chunk, damping) * chunk, 1, out=own)
        units.append((key, ids))
        seen += len(ids)
        if progress is not None:
            progress(len(ids))
    if seen != n_rows:
        raise RuntimeError(f"the log yielded {seen} rows, expected {n_rows}")
    host = values.cpu()
    bad = []
    if not bool(torch.isfinite(host).all()):  # rare: find the blocks (the values are on the host)
        starts = [0, *itertools.accumulate(len(ids) for _, ids in units)]
        finite = torch.isfinite(host).numpy()
        spans = zip(units, starts[:-1], starts[1:], strict=True)
        bad = [key for (key, _), lo, hi in spans if not finite[lo:hi].all()]
    verify(bad)
    return [i for _, ids in units for i in ids], host
