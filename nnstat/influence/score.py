"""Streaming influence scoring: all-pairs, top-k and self-influence.

The query rows are preconditioned once (``Q' = Q (H + λI)⁻¹``); the training log is then
streamed shard by shard and each block costs one matrix product ``Q' Tᵀ``. Memory is bounded by
one block plus the output (or only ``n_test × 2k`` entries in top-k mode). Under
``torch.distributed`` each rank scores every ``world_size``-th shard and the pieces are
gathered on every rank.

The modes (``dot``, ``relatif``, ``cosine``, ``l2``) are defined in :mod:`nnstat.influence.modes`.

Scoring runs where the queries are (``device=``, default: the query rows' device). On the CPU
the blocks are scored straight from the memory-mapped shards (the OS is asked to read the next
shard ahead: an asynchronous hint, no thread). On a GPU (the device branch, :mod:`nnstat.influence.ondevice`) a reader
thread reads each block into a pinned buffer while the device scores the previous one, the copy
runs on a side stream, the top-k selection stays on the device, and the results come back in two
reads at the end (no host read per block).

Example:
    >>> import torch
    >>> from nnstat.influence.sources import TensorSource
    >>> train = TensorSource(torch.randn(20, 6))
    >>> query = TensorSource(torch.randn(3, 6))
    >>> compute_influence_all(query, train, preconditioner="raw", damping=0.1).scores.shape
    torch.Size([3, 20])
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from nnstat.distributed import rank_world

from .arguments import check_scoring_args
from .cache import default_preconditioner, fitted, has_kfac_statistics, has_stored_ekfac
from .factored_queries import (
    norm_parts_as_stored,
    self_influence_as_stored,
    self_influence_view,
    stored_queries,
)
from .factored_scores import FactoredScores, StoredQueries, scores_as_stored
from .lowrank_queries import lowrank_queries
from .modes import MODES, m_norms, normalise, raw_scores
from .ondevice import stream_scores, stream_self_influence
from .pipeline import Block, stream_to, units
from .precondition import PRECONDITIONERS, Preconditioner
from .refine import Refinement, refine_queries
from .result import InfluenceResult, SelfInfluenceResult, TopKInfluence
from .row_layout import check_compatible, check_same_weights
from .sources import (
    LogSource,
    RowSource,
    all_finite,
    all_rows,
    as_source,
    describe,
    nonfinite_error,
)
from .topk import RunningTopK

__all__ = ["MODES", "auto_batch_size", "compute_influence_all", "compute_self_influence"]


def _dist() -> tuple[int, int]:
    return rank_world()


def _gather(obj: Any) -> list[Any]:
    rank, world = _dist()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def _my_units(source: RowSource, batch_size: int) -> Iterator[Block]:
    """``(unit key, ids, rows)`` blocks of this rank's shards (see `pipeline.units`)."""
    rank, world = _dist()
    return units(source, batch_size, rank, world)


def scoring_device(device: Any, source: RowSource) -> torch.device:
    """``device``, else where the rows of ``source`` (the queries) are, else the CPU.

    Example:
        >>> from nnstat.influence.sources import TensorSource
        >>> scoring_device(None, TensorSource(torch.ones(2, 3))).type
        'cpu'
    """
    if device is not None:
        return torch.device(device)
    rows = getattr(source, "rows", None)
    return rows.device if isinstance(rows, torch.Tensor) else torch.device("cpu")


def _device_branch(device: torch.device) -> bool:
    """Score on ``device`` with the device branch (`ondevice`); the CPU keeps the host branch.
    (Tests switch the CPU to the device branch here, to run it without a GPU.)"""
    return device.type != "cpu"


def auto_batch_size(row_width: int, budget_bytes: int = 16 << 20) -> int:
    """Rows per block so that one float32 block stays near ``budget_bytes`` (256 to 65536 rows).

    Example:
        >>> auto_batch_size(1024)
        4096
    """
    return int(min(65536, max(256, budget_bytes // (4 * max(row_width, 1)))))


def _check_pair(q: RowSource, t: RowSource) -> None:
    """Refuse a query and a training log that were not made with the same projection/layout."""
    if q.meta and t.meta:  # a bare TensorSource has no meta: its layout is checked below
        check_compatible(q.meta, t.meta)
        check_same_weights(q.meta, t.meta, describe(q), describe(t))
    if [(m.name, m.offset, m.r_out, m.r_in, m.width) for m in q.layout] != [
        (m.name, m.offset, m.r_out, m.r_in, m.width) for m in t.layout
    ]:
        raise ValueError(
            "query and training logs have different module layouts: "
            f"query {[(m.name, m.r_out, m.r_in) for m in q.layout]} vs "
            f"train {[(m.name, m.r_out, m.r_in) for m in t.layout]}"
        )


def _prepare(
    query: Any, train: Any, preconditioner: str | None, batch_size: int
) -> tuple[RowSource, RowSource, Preconditioner]:
    q, t = as_source(query), as_source(train)
    _check_pair(q, t)
    kind = preconditioner or default_preconditioner(t)
    if kind not in PRECONDITIONERS:
        raise ValueError(f"unknown preconditioner {kind!r}; valid: {list(PRECONDITIONERS)}")
    return q, t, fitted(t, kind, batch_size)


def _refined_meta(
    refine: Refinement, damping: float | None, report: dict, train: RowSource
) -> dict[str, Any]:
    """``result.meta`` of refined scores: the damping asked for, the one every module used."""
    return {
        "preconditioner": "refined",
        "damping": refine.damping if refine.damping is not None else damping,
        "module_damping": {m.name: report["damping"] for m in train.layout},
        "refine": report,
    }


def _unrefined_meta(pre: Preconditioner, damping: float | None, refine: Any) -> dict[str, Any]:
    """``result.meta`` of scores with ``pre`` (a ``refine`` that ran no step says so)."""
    meta = {
        "preconditioner": pre.kind,
        "damping": damping,
        "module_damping": pre.module_dampings(damping),
    }
    if refine is not None:
        meta["refine"] = {"steps": 0, "products": 0, "passes": 0}
    return meta


def _score_block(
    q_pre: torch.Tensor,
    q_norm: torch.Tensor | None,
    rows: torch.Tensor,
    ids: list,
    pre: Preconditioner,
    damping: float | None,
    mode: str,
    out: torch.Tensor | None = None,
    check_finite: bool = True,
    query_major: bool = False,
    source: RowSource | None = None,
    shard: Any = None,
    factored: FactoredScores | None = None,
) -> torch.Tensor:
    """The host branch's scores of a block (see `modes.raw_scores` for the layouts).

    With ``factored`` (its queries are ``q_pre``) ``rows`` are a factored store's rows as stored,
    scored without their dense form; the modes other than ``dot`` densify them for the norms.

    Non-finite rows are always an error naming their file (``shard`` of ``source``); with
    ``check_finite`` non-finite scores of finite rows (float32 overflow) are one too."""
    if factored is not None:
        scores = factored(rows, out, query_major)
    else:
        rows = rows.to(torch.float32)
        scores = raw_scores(q_pre, rows, out, query_major)
    # NaN and Inf in a row reach every score of that row (times zero too), so checking the
    # [b, n_test] scores stands in for checking the [b, row_width] rows at 1/row_width the cost
    if not all_finite(scores):
        if source is not None and (err := nonfinite_error(source, shard, ids, rows)) is not None:
            raise err
        if check_finite:
            bad_rows = ~torch.isfinite(scores.T if query_major else scores)
            bad = bad_rows.any(1).nonzero().flatten()[:5].tolist()
            raise ValueError(f"training rows {[ids[i] for i in bad]} contain NaN/Inf values")
    t_parts = None  # the training rows' norms, where they come from the factors
    if factored is not None and mode != "dot" and pre.kind == "identity":
        t_parts = norm_parts_as_stored(rows, source.meta["modules"])
    elif factored is not None and mode != "dot":
        rows = source.dense(rows)  # the norms of the training rows need their dense form
    return normalise(scores, q_norm, rows, pre, damping, mode, query_major, t_parts)


def _shards(t: RowSource, one_process: bool = False) -> list | None:
    """The shard of each unit key's first entry in `_my_units` (``None``: units are not per
    shard, with fewer shards than ranks)."""
    shards = t.iter_shards()
    world = 1 if one_process else _dist()[1]
    return shards if world == 1 or len(shards) >= world else None


def _recheck(t: RowSource, batch_size: int, check: Any, one_process: bool = False) -> Any:
    """``verify`` for the device branch: the blocks whose device results were not finite are
    read again on the host and handed to ``check(shard, ids, rows)``, which raises as the host
    branch would (naming the shard); blocks it passes (a float32 overflow in a store that may
    hold it) keep their results."""

    def verify(bad: list[tuple]) -> None:
        if not bad:
            return
        shards = _shards(t, one_process)
        blocks = units(t, batch_size) if one_process else _my_units(t, batch_size)
        for unit, ids, rows in blocks:
            if unit in bad:
                check(None if shards is None else shards[unit[0]], ids, rows)

    return verify


def compute_influence_all(
    query: Any,
    train: Any,
    *,
    mode: str = "dot",
    preconditioner: str | None = None,
    damping: float | None = None,
    top_k: int | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
    refine: Refinement | None = None,
    device: torch.device | str | None = None,
) -> InfluenceResult | TopKInfluence:
    """Influence of every training example on every query.

    ``query`` and ``train`` may each be a `GradientLog`, a `GradientStore`, a store path, a log
    dataloader or a `TensorSource`; they must share projection and configuration. The
    preconditioner is fitted on ``train`` (default: ``ekfac`` when the run collected K-FAC
    statistics, else ``raw``). With ``top_k`` the full score matrix is never held: a
    `TopKInfluence` with the ``k`` most helpful and harmful examples per query is returned.

    With ``refine=Refinement(...)`` each query's ``(H + λI)⁻¹ g_q`` is refined by preconditioned
    conjugate gradient on the exact curvature of the training loss (``mode="dot"`` only; see
    :mod:`nnstat.influence.refine`); ``result.meta["refine"]`` reports the cost.

    ``device`` scores there (default: where the query rows are, else the CPU): on a GPU the
    training shards are streamed to it through pinned, double-buffered reads and only the
    results come back (on the CPU, like every result).

    Example:
        >>> import torch
        >>> from nnstat.influence.sources import TensorSource
        >>> train, query = TensorSource(torch.randn(30, 4)), TensorSource(torch.randn(2, 4))
        >>> compute_influence_all(query, train, top_k=3).helpful_scores.shape
        torch.Size([2, 3])
    """
    check_scoring_args(damping, top_k, batch_size, mode)
    q, t = as_source(query), as_source(train)
    dev = scoring_device(device, q)
    if not batch_size:
        batch_size = auto_batch_size(max(m.stop for m in t.layout))
        if top_k or _device_branch(dev):
            # per-block selection (and on a device, each launch) has a fixed cost per call:
            # fewer, larger blocks amortise it
            batch_size = min(65536, 4 * batch_size)
    if refine is not None and refine.steps > 0:
        if mode != "dot":
            raise ValueError(f"refinement scores mode='dot' only, got mode={mode!r}")
        _check_pair(q, t)
        test_ids, _, q_pre, report = refine_queries(
            refine, q, t, damping, preconditioner, batch_size, refine.query_data
        )
        q_pre = q_pre.to(dev, torch.float32)
        pre, q_norm = Preconditioner("identity", list(t.layout), {}), None  # dot mode: unused
        queries = None  # refined queries are full rank
        meta = {"mode": mode, **_refined_meta(refine, damping, report, t)}
    else:
        q, t, pre = _prepare(q, t, preconditioner, batch_size)
        test_ids, q_rows = all_rows(q, batch_size)
        q_rows = q_rows.to(dev)
        q_pre = pre.apply(q_rows, damping)
        q_norm = m_norms(q_rows, q_pre) if mode != "dot" else None
        meta = {"mode": mode, **_unrefined_meta(pre, damping, refine)}
        # queries logged as factors, where the preconditioner keeps them factors
        queries = stored_queries(q, pre, damping, batch_size, dev)
        if queries is None:  # dense queries of low rank: factored exactly where it pays
            queries = lowrank_queries(q_pre, t, pre, damping)
    job = _Scoring(q_pre, q_norm, pre, damping, mode, top_k, batch_size, test_ids, meta, queries)
    rank, _ = _dist()
    disable = True if rank != 0 else _quiet(progress)
    with tqdm(total=len(t), desc="influence", unit="row", disable=disable) as bar:
        return _on_device(job, t, bar) if _device_branch(dev) else _on_host(job, t, bar)


@dataclass
class _Scoring:
    """One call's preconditioned queries ``Q M`` (``q_norm``: their ``‖g_q‖_M``) and
    options, as both branches read them."""

    q_pre: torch.Tensor
    q_norm: torch.Tensor | None
    pre: Preconditioner
    damping: float | None
    mode: str
    top_k: int | None
    batch_size: int
    test_ids: list
    meta: dict
    queries: StoredQueries | None = None  # the queries as factors (`stored_queries`)


def _on_device(job: _Scoring, t: RowSource, bar: Any) -> InfluenceResult | TopKInfluence:
    """The device branch of `compute_influence_all` (see :mod:`nnstat.influence.ondevice`)."""
    _, world = _dist()

    def check(shard: Any, ids: list, rows: torch.Tensor) -> None:  # a block to refuse, or not
        q_norm = None if job.q_norm is None else job.q_norm.cpu()
        args = (job.q_pre.cpu(), q_norm, rows, ids, job.pre, job.damping, job.mode)
        _score_block(*args, None, not t.finite, False, t, shard)

    blocks = stream_to(
        t, lambda s: _my_units(s, job.batch_size), job.q_pre.device, max_rows=job.batch_size
    )
    got = stream_scores(
        job.q_pre,
        job.q_norm,
        blocks,
        job.pre,
        job.damping,
        job.mode,
        job.top_k,
        len(t) if world == 1 else None,
        _recheck(t, job.batch_size, check),
        bar.update,
        t,  # a factored store's blocks: scored as stored (`FactoredScores`)
        job.queries,
    )
    if got.top is not None:
        # one process: the blocks came in the source's row order, so positions index its ids
        ids = t.ids if world == 1 else [i for _, unit_ids in got.units for i in unit_ids]
        hi_v, hi_p, lo_v, lo_p = got.top  # on the host already: named without reading again
        if world > 1 or not ids:
            top = RunningTopK(job.top_k or 1, len(job.test_ids))
            top.ids, top.hi_v, top.lo_v = ids, torch.tensor(hi_v), torch.tensor(lo_v)
            top.hi_i, top.lo_i = torch.tensor(hi_p).long(), torch.tensor(lo_p).long()
            return top.finish(job.test_ids, job.meta, _gather)
        return TopKInfluence(
            list(job.test_ids),
            torch.tensor(hi_v),
            [[ids[int(p)] for p in row] for row in hi_p],
            torch.tensor(lo_v),
            [[ids[int(p)] for p in row] for row in lo_p],
            job.meta,
        )
    if got.scores is not None:
        return InfluenceResult(got.scores.T, job.test_ids, list(t.ids), job.meta)
    units = [(key, ids, s) for (key, ids), s in zip(got.units, got.pieces, strict=True)]
    return _gathered(units, job.test_ids, job.meta)


def _gathered(units: list, test_ids: list, meta: dict) -> InfluenceResult:
    """Every rank's ``(unit key, ids, scores)`` in single-process order, as one result."""
    pieces = sorted((u for part in _gather(units) for u in part), key=lambda u: u[0])
    train_ids = [i for _, ids, _ in pieces for i in ids]
    if not pieces:
        raise ValueError("the training log is empty")
    scores = torch.cat([s for _, _, s in pieces], dim=0).T
    return InfluenceResult(scores, test_ids, train_ids, meta)


def _on_host(job: _Scoring, t: RowSource, bar: Any) -> InfluenceResult | TopKInfluence:
    """The CPU branch of `compute_influence_all`: blocks scored straight from the shards' memory
    maps (the next shard hinted to the OS by `pipeline.units`), checked and selected block by
    block. No reader thread: on the CPU it would only add a hand-off per block."""
    _, world = _dist()
    n_test, batch_size = len(job.test_ids), job.batch_size
    top: RunningTopK | None = RunningTopK(job.top_k, n_test) if job.top_k else None
    # single process: one preallocated [n_train, n_test] buffer, each block written in place
    buffer = torch.empty(len(t), n_test) if top is None and world == 1 else None
    # top-k: every block's scores go to one reused buffer (a fresh multi-MB tensor per block
    # costs page faults), they are consumed before the next block
    scratch = torch.empty(n_test, batch_size) if top is not None else None
    units: list[tuple[tuple, list, torch.Tensor]] = []
    filled = 0
    strict, major, shards = not t.finite, top is not None, _shards(t)
    # a factored store's blocks come as stored and are scored without their dense form
    factored = scores_as_stored(job.q_pre, t, queries=job.queries)
    blocks = _my_units(t.stored_rows(widen=True) if factored is not None else t, batch_size)
    for unit, ids, rows in blocks:
        if buffer is not None:
            out = buffer[filled : filled + len(ids)]
        elif scratch is not None and len(ids) == batch_size:
            out = scratch
        else:
            out = None
        shard = None if shards is None else shards[unit[0]]
        args = (job.q_pre, job.q_norm, rows, ids, job.pre, job.damping, job.mode)
        scores = _score_block(*args, out, strict, major, t, shard, factored)
        if top is not None:
            top.update(scores, ids)
        elif buffer is None:
            units.append((unit, ids, scores))
        filled += len(ids)
        bar.update(len(ids))
    if top is not None:
        return top.finish(job.test_ids, job.meta, _gather)
    if buffer is not None:
        if filled != len(t):
            raise RuntimeError(f"the training log yielded {filled} rows, expected {len(t)}")
        # blocks come in the source's row order, so its id list is the column order; a
        # transposed view of the train-major buffer: packing it would cost another full pass
        return InfluenceResult(buffer.T, job.test_ids, list(t.ids), job.meta)
    return _gathered(units, job.test_ids, job.meta)


def _self_default(data: RowSource, train: RowSource, no_train: bool) -> str:
    if no_train and isinstance(data, LogSource):
        # the rows of a query log are not training data: curvature must come from its statistics
        if has_stored_ekfac(data):
            return "ekfac"
        return "kfac" if has_kfac_statistics(data) else "raw"
    return default_preconditioner(train)


def compute_self_influence(
    data: Any,
    train: Any | None = None,
    *,
    preconditioner: str | None = None,
    damping: float | None = None,
    batch_size: int | None = None,
    progress: bool | None = None,
    refine: Refinement | None = None,
    device: torch.device | str | None = None,
) -> SelfInfluenceResult:
    """Self-influence ``g_iᵀ (H + λI)⁻¹ g_i`` of every row of ``data``.

    The preconditioner is fitted on ``train`` when given, else on ``data`` itself. For an in-memory
    query log without ``train`` (the seed's uncertainty use), the default uses only the training
    statistics the log carries: the saved EK-FAC factor when present, else K-FAC, else ``raw`` on
    the log's own rows. Equals the diagonal of ``compute_influence_all(data, train)``
    (``mode="dot"``) with the same preconditioner.

    With ``refine=Refinement(...)`` every row's ``(H + λI)⁻¹ g_i`` is refined on the exact
    curvature (one solve per row: ``steps`` passes over the training data per ``query_batch``
    rows); the rows' full gradients come from ``refine.query_data``, else ``refine.train_data``,
    in the order of ``data``.

    ``device`` computes there (default: where the rows of ``data`` are, else the CPU); the
    values come back on the CPU.

    Example:
        >>> import torch
        >>> from nnstat.influence.sources import TensorSource
        >>> compute_self_influence(TensorSource(torch.randn(10, 4))).scores.shape
        torch.Size([10])
    """
    check_scoring_args(damping, batch_size=batch_size)
    d = as_source(data)
    t = d if train is None else as_source(train)
    batch_size = batch_size or auto_batch_size(max(m.stop for m in t.layout))
    if t is not d:
        _check_pair(d, t)
    if refine is not None and refine.steps > 0:
        grads_of = refine.query_data if refine.query_data is not None else refine.train_data
        ids, rows, solved, report = refine_queries(
            refine, d, t, damping, preconditioner, batch_size, grads_of
        )
        meta = _refined_meta(refine, damping, report, t)
        return SelfInfluenceResult((solved * rows).sum(1), ids, meta)
    kind = preconditioner or _self_default(d, t, train is None)
    pre = fitted(t, kind, batch_size)
    dev = scoring_device(device, d)
    bar = tqdm(total=len(d), desc="self-influence", unit="row", disable=_quiet(progress))
    with bar:
        if _device_branch(dev):
            ids, values = _self_on_device(d, pre, damping, batch_size, dev, bar)
        else:
            ids, parts = [], []
            stored = self_influence_view(d, pre)  # factored rows: never multiplied out
            for b_ids, rows in (d if stored is None else stored).iter_blocks(batch_size):
                rows = rows.to(torch.float32)
                ids.extend(b_ids)
                if stored is not None:
                    parts.append(self_influence_as_stored(rows, d.meta["modules"]))
                else:
                    parts.append((pre.apply(rows, damping) * rows).sum(1))
                bar.update(len(b_ids))
            values = torch.cat(parts) if parts else torch.empty(0)
    if not ids:
        raise ValueError("the log is empty")
    return SelfInfluenceResult(values, ids, _unrefined_meta(pre, damping, refine))


def _self_on_device(
    d: RowSource,
    pre: Preconditioner,
    damping: float | None,
    batch_size: int,
    dev: torch.device,
    bar: Any,
) -> tuple[list, torch.Tensor]:
    """The device branch of `compute_self_influence`: the rows streamed to ``dev``, the values
    read back once; NaN/Inf rows of a store that says it holds none are refused, naming the
    shard, as the host branch's reads do."""

    def check(shard: Any, ids: list, rows: torch.Tensor) -> None:
        if d.finite and (err := nonfinite_error(d, shard, ids, rows)) is not None:
            raise err

    blocks = stream_to(d, lambda s: units(s, batch_size), dev, max_rows=batch_size)
    verify = _recheck(d, batch_size, check, one_process=True)
    return stream_self_influence(blocks, pre, damping, len(d), dev, verify, bar.update, d)


def _quiet(progress: bool | None) -> bool | None:
    return None if progress is None else not progress
