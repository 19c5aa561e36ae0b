"""Scores of queries against stored factored rows, without the block's dense rows.

A factored module keeps a training row's ``G = Uᵀ V`` (``c`` pairs, :mod:`nnstat.store.factored`).
A dense query ``Q`` (preconditioned) scores ``⟨Q, G⟩ = Σ_j u_jᵀ Q v_j``; a query that is itself
factored, ``Q = U_qᵀ V_q`` (``c_q`` pairs: queries logged into a factored store, scored with a
preconditioner that keeps the factored form, :mod:`nnstat.influence.factored_queries`), scores
``Σ_{i,j} (u_qi · u_j)(v_qi · v_j)``. Three routes, chosen per module shape by their
multiply-adds per row (:func:`cheapest_route`):

* **densify** a chunk of rows (``c · r_out · r_in``, shared by every query) and score it with one
  GEMM (``n_q · r_out · r_in``): ``(c + n_q) · r_out · r_in``. On the CPU the chunk is sized so
  that its dense rows stay in cache (:data:`SCRATCH_BYTES`): they are written, read once by the
  GEMM and overwritten, never sent to memory as a whole block. On a device (the scoring's device
  branch, ``per_block=True``) it is sized from the block: a chunk's dense rows take no more
  than the block's stored rows in float32 (:func:`chunk_rows`), so device memory per block stays
  within twice its stored bytes, whatever the model, and the chunks per block do not grow with
  the modules of a shape.
* **direct**: ``Q V_jᵀ`` for every pair, one GEMM of all queries, then the ``u_j`` dots:
  ``n_q · c · (r_out · r_in + r_out)``, cheaper only for one query (or ``c = 1`` with fewer
  queries than ``r_in``), see :func:`direct_is_cheaper`.
* **factors** (factored queries only): two GEMMs over all pairs, ``[b c, r_out] × [r_out, n_q
  c_q]`` and the same for ``V``, their elementwise product summed over the ``c × c_q`` pairs:
  ``n_q · c_q · c · (r_out + r_in + 1)``; at rank 64 and ``c = c_q = 1``, 129 against the dense
  store's 4,096 per query.

With dense queries no route reaches fewer multiply-adds than the dense store's
``n_q · r_out · r_in`` per row (factored rows then save bytes, not arithmetic); with factored
queries the factors route does while ``c · c_q · (r_out + r_in + 1) < r_out · r_in``
(:doc:`docs/benchmarks.md <benchmarks>`).

Example:
    >>> from nnstat.store.factored import densify
    >>> mods = [{"offset": 0, "width": 14, "r_out": 3, "r_in": 4, "factors": 2}]
    >>> rows, q = torch.randn(5, 14), torch.randn(2, 12)
    >>> scores = FactoredScores(q, mods)(rows)
    >>> torch.allclose(scores, densify(rows, mods) @ q.T, atol=1e-5)
    True
    >>> q_rows = torch.randn(2, 14)  # the queries as factors, the same layout
    >>> scores = FactoredScores(densify(q_rows, mods), mods, queries=(q_rows, mods))(rows)
    >>> torch.allclose(scores, densify(rows, mods) @ densify(q_rows, mods).T, atol=1e-4)
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nnstat.store.factored import FactorGroup, factor_plan

#: queries stored as factors: ``[n_q, stored width]`` float32 rows and their meta.json modules
StoredQueries = tuple[torch.Tensor, Sequence[Mapping[str, Any]]]

__all__ = [
    "SCRATCH_BYTES",
    "FactoredScores",
    "cheapest_route",
    "chunk_rows",
    "direct_is_cheaper",
    "scores_as_stored",
]

#: bytes of one chunk's dense rows (or of the direct route's ``Q Vᵀ``): in cache, and large
#: enough that the calls per block stay few (each is a barrier of the thread pool). On the
#: 2-core CPU the benchmark ran on, chunks of 32-128 rank-64 rows (1-4 MiB) scored alike; a
#: whole 512-row block (16 MiB) 15-25% slower
SCRATCH_BYTES = 4 << 20
#: fewest rows per chunk: below this the GEMM's fixed cost per call dominates
MIN_CHUNK = 16


def direct_is_cheaper(n_queries: int, c: int, r_out: int, r_in: int) -> bool:
    """Whether contracting the factors directly, ``Σ_j u_jᵀ (Q v_j)``, takes fewer multiply-adds
    per row than multiplying the row out and scoring it densely.

    Args:
        n_queries: queries scored at once.
        c: factor pairs per row.
        r_out: rows of each module's matrix.
        r_in: its columns.

    Returns:
        ``n_q · c · (r_out · r_in + r_out) < (c + n_q) · r_out · r_in``.

    Example:
        >>> direct_is_cheaper(1, 8, 64, 64), direct_is_cheaper(2, 8, 64, 64)
        (True, False)
    """
    return n_queries * c * (r_out * r_in + r_out) < (c + n_queries) * r_out * r_in


def cheapest_route(
    n_queries: int, c: int, r_out: int, r_in: int, query_c: int | None = None
) -> str:
    """The route of least multiply-adds per stored row for one shape of factored module:
    ``"densify"``, ``"direct"`` (dense queries, :func:`direct_is_cheaper`) or, for queries
    stored as ``query_c`` factor pairs, ``"factors"`` when
    ``n_q · c_q · c · (r_out + r_in + 1)`` is below the dense queries' route.

    Args:
        n_queries: queries scored at once.
        c: factor pairs per stored row.
        r_out: rows of each module's matrix.
        r_in: its columns.
        query_c: factor pairs per query; ``None``: dense queries.

    Returns:
        The route's name.

    Example:
        >>> cheapest_route(32, 4, 64, 64), cheapest_route(32, 4, 64, 64, query_c=4)
        ('densify', 'factors')
        >>> cheapest_route(32, 8, 8, 8, query_c=8)  # small modules, many pairs: not worth it
        'densify'
    """
    if direct_is_cheaper(n_queries, c, r_out, r_in):
        route, cost = "direct", n_queries * c * (r_out * r_in + r_out)
    else:
        route, cost = "densify", (c + n_queries) * r_out * r_in
    if query_c and n_queries * query_c * c * (r_out + r_in + 1) < cost:
        return "factors"
    return route


def chunk_rows(n: int, stored_width: int, per_row: int, budget: int | None = None) -> int:
    """Rows per chunk of a block of ``n`` stored rows whose transients take ``per_row`` bytes a
    row: within ``budget`` bytes, or (``None``) within the block's stored rows in float32
    (``n * stored_width * 4``: what a device holds for the block anyway); at least
    :data:`MIN_CHUNK`.

    Args:
        n: rows in the block.
        stored_width: columns of a stored row.
        per_row: bytes of a chunk's transients per row (its dense rows, say).
        budget: bytes of one chunk's transients; ``None``: sized from the block.

    Returns:
        The rows of one chunk (``n`` or more: one chunk).

    Example:
        >>> chunk_rows(512, 1024, 4 * 8192), chunk_rows(512, 1024, 4 * 8192, budget=1 << 20)
        (64, 32)
    """
    if budget is None:
        budget = n * stored_width * 4
    return max(MIN_CHUNK, budget // max(per_row, 1))


def scores_as_stored(
    q: torch.Tensor, source: Any, per_block: bool = False, queries: StoredQueries | None = None
) -> FactoredScores | None:
    """The :class:`FactoredScores` of queries ``q`` for ``source``'s blocks as stored
    (``source.stored_rows()``), or ``None`` when ``source`` is not a store of factored rows.

    Args:
        q: ``[n_q, dense row width]`` preconditioned queries.
        source: the training rows (a `RowSource`).
        per_block: chunks sized from each block, not from a CPU's cache (a device's chunks,
            :class:`FactoredScores`).
        queries: the same queries as factors (``(stored rows, meta.json modules)``,
            preconditioned: `factored_queries.stored_queries`), or ``None``.

    Returns:
        The scorer, or ``None`` (score ``source``'s dense blocks as they come).

    Example:
        >>> from nnstat.influence.sources import TensorSource
        >>> scores_as_stored(torch.ones(1, 2), TensorSource(torch.ones(3, 2))) is None
        True
    """
    if not getattr(source, "factored", False) or not hasattr(source, "stored_rows"):
        return None
    return FactoredScores(q, source.meta["modules"], per_block, queries)


class FactoredScores:
    """``q @ densify(rows).T`` of stored rows whose ``modules`` (meta.json) may be factored, made
    once per query set and applied to each block (the signature of
    :func:`nnstat.influence.modes.raw_scores`).

    Args:
        q: ``[n_q, dense row width]`` float32 queries (preconditioned), on the scoring device.
        modules: the training store's meta.json ``modules`` (stored layout).
        per_block: size each block's chunks from the block: a chunk's dense rows (or the direct
            route's transients) no larger than the block's stored rows in float32
            (:func:`chunk_rows`: a device's memory per block stays bounded, and its chunks per
            block few). Default: :data:`SCRATCH_BYTES`, a CPU's cache.
        queries: the queries ``q`` as factors (stored rows on ``q``'s device and their
            meta.json modules, with ``q``'s dense layout): the modules both sides store as
            factors take the factors route where it is the cheapest (:func:`cheapest_route`);
            ``q`` still scores the plain columns and the other modules.

    Raises:
        ValueError: ``q`` or ``queries`` do not have the store's dense layout.

    Example:
        >>> mods = [{"offset": 0, "width": 3, "r_out": 2, "r_in": 1, "factors": 1},
        ...         {"offset": 3, "width": 1, "r_out": None, "r_in": 1}]
        >>> FactoredScores(torch.tensor([[1.0, 0.0, 2.0]]), mods)(
        ...     torch.tensor([[1.0, 2.0, 3.0, 5.0]])).tolist()
        [[13.0]]
    """

    def __init__(
        self,
        q: torch.Tensor,
        modules: Sequence[Mapping[str, Any]],
        per_block: bool = False,
        queries: StoredQueries | None = None,
    ) -> None:
        self.plan = factor_plan(modules)
        self.per_block = per_block
        if q.shape[1] != self.plan.dense_width:
            raise ValueError(
                f"queries have {q.shape[1]} columns, the store's dense rows "
                f"{self.plan.dense_width}: score queries logged with the store's configuration"
            )
        n_q = q.shape[0]
        self.n_queries = n_q
        self._parts: list[tuple[FactorGroup, bool, torch.Tensor, int]] = []
        # the factors route: (training modules, U_q and V_q as [K, c_q n_q, r], per-row bytes)
        self._pairs: list[tuple[FactorGroup, torch.Tensor, torch.Tensor, int]] = []
        by_query_c = _query_factors(queries, self.plan.dense_width)
        for g in self.plan.groups:
            for c_q, sub, q_group in _split(g, by_query_c):
                route = cheapest_route(n_q, g.c, g.r_out, g.r_in, c_q)
                if route == "factors":
                    self._pairs.append(_factors_part(sub, q_group, queries[0].to(q.device)))
                else:
                    self._parts.append(_dense_part(sub, q, n_q, route == "direct"))
        self._plain_q = None
        if self.plan.plain:
            self._plain_q = q.index_select(1, self.plan.plain_index(q.device)[1])
        # one chunk's dense rows, reused by every block (a fresh tensor per block would be
        # page-faulted in again each time)
        self._scratch: torch.Tensor | None = None

    def __call__(
        self, rows: torch.Tensor, out: torch.Tensor | None = None, query_major: bool = False
    ) -> torch.Tensor:
        """Scores of a block of stored ``rows`` ``[b, stored width]``: ``[b, n_q]``, or
        ``[n_q, b]`` with ``query_major`` (into ``out`` when given, as `raw_scores`)."""
        n = rows.shape[0]
        res = out if out is not None and not query_major else None
        if res is None:
            res = torch.empty(n, self.n_queries, dtype=torch.float32, device=rows.device)
        first = True
        budget = None if self.per_block else SCRATCH_BYTES
        if self._plain_q is not None:
            stored, _ = self.plan.plain_index(rows.device)
            plain = rows.index_select(1, stored).to(torch.float32)
            torch.mm(plain, self._plain_q.T, out=res)
            first = False
        for g, uq, vq, per_row in self._pairs:
            chunk = chunk_rows(n, rows.shape[1], per_row, budget)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                got = _pair_scores(g, rows[s:e], uq, vq, self.n_queries)
                if first:
                    res[s:e].copy_(got)
                else:
                    res[s:e].add_(got)
            first = False
        for g, direct, qg, per_row in self._parts:
            chunk = chunk_rows(n, rows.shape[1], per_row, budget)
            for s in range(0, n, chunk):
                e = min(n, s + chunk)
                if direct:
                    got = _direct(g, rows[s:e], qg)
                    res[s:e] = got if first else res[s:e] + got
                    continue
                dense = g.products(rows[s:e], self._chunk(e - s, g.dense_width, rows.device))
                if first:
                    torch.mm(dense, qg.T, out=res[s:e])
                else:
                    res[s:e].addmm_(dense, qg.T)
            first = False
        if first:  # no module at all
            res.zero_()
        if not query_major:
            return res
        if out is not None:
            return out.copy_(res.T)
        return res.T.contiguous()

    def _chunk(self, n: int, width: int, device: torch.device) -> torch.Tensor:
        """A contiguous ``[n, width]`` float32 view of the reused scratch buffer."""
        s = self._scratch
        if s is None or s.numel() < n * width or s.device != device:
            s = self._scratch = torch.empty(n * width, dtype=torch.float32, device=device)
        return s[: n * width].view(n, width)


def _direct(g: FactorGroup, rows: torch.Tensor, qd: torch.Tensor) -> torch.Tensor:
    """``[b, n_q]``: ``Σ_k Σ_j u_kjᵀ Q_k v_kj`` of a chunk, ``qd`` the queries as
    ``[K, r_in, n_q * r_out]``. Only one query or ``c = 1`` take this route
    (:func:`direct_is_cheaper`), the two cases whose last contraction needs no copy."""
    n, k, c, r_out = rows.shape[0], g.modules, g.c, g.r_out
    n_q = qd.shape[2] // r_out
    x = g.block(rows)  # [b, K, c (r_out + r_in)]
    v = x[..., c * r_out :].transpose(0, 1).reshape(k, n * c, g.r_in)
    qv = torch.bmm(v, qd)  # [K, b c, n_q r_out]: Q_k v_kj for every row, pair and query
    u = x[..., : c * r_out].transpose(0, 1)  # [K, b, c r_out]
    if n_q == 1:
        return (qv.view(k, n, c * r_out) * u).sum(2).sum(0).unsqueeze(1)
    qv = qv.view(k * n, c, n_q, r_out).transpose(1, 2).reshape(k * n, n_q, c * r_out)
    return torch.bmm(qv, u.reshape(k * n, c * r_out, 1)).view(k, n, n_q).sum(0)


def _dense_part(g: FactorGroup, q: torch.Tensor, n_q: int, direct: bool) -> tuple:
    """``(g, direct, its queries' columns, transient bytes per row)``: the dense queries' route
    for the modules of ``g``, ``direct`` or densify (:func:`cheapest_route`)."""
    span = g.dense_span
    if span is not None:
        qg = q[:, span[0] : span[1]]
    else:
        qg = q.index_select(1, g.index("dense", q.device))
    if direct:  # [K, r_in, n_q * r_out]: one GEMM per module gives Q v_j for all q
        shape = (n_q, g.modules, g.r_out, g.r_in)
        qg = qg.reshape(shape).permute(1, 3, 0, 2).reshape(g.modules, g.r_in, -1)
        # its transients per row: V's copy, Q V_jᵀ and its product with U
        per_row = 4 * g.modules * g.c * (2 * n_q * g.r_out + g.r_in + g.r_out)
    else:  # the GEMM reads the transpose as it is
        qg = qg.contiguous()
        per_row = g.dense_width * 4
    return g, direct, qg, per_row


def _query_factors(queries: StoredQueries | None, dense_width: int) -> dict[int, tuple[int, int]]:
    """``{dense offset: (c_q, stored offset)}`` of the modules the queries store as factors."""
    if queries is None:
        return {}
    plan = factor_plan(queries[1])
    if plan.dense_width != dense_width or queries[0].shape[1] != plan.stored_width:
        raise ValueError(
            f"factored queries of {queries[0].shape[1]} stored columns ({plan.dense_width} "
            f"dense) for a store of {dense_width} dense columns: score queries logged with the "
            "store's configuration"
        )
    return {d: (qg.c, s) for qg in plan.groups for s, d in zip(qg.stored, qg.dense, strict=True)}


def _split(
    g: FactorGroup, by_query_c: Mapping[int, tuple[int, int]]
) -> list[tuple[int | None, FactorGroup, FactorGroup | None]]:
    """The modules of ``g`` by the queries' factor pairs for them: ``(c_q, the training
    modules, the queries' modules)``, ``c_q`` ``None`` (no query group) where the queries are
    dense. ``g`` itself where every module has the same ``c_q``."""
    parts: dict[int, list[tuple[int, int, int]]] = {}
    for s, d in zip(g.stored, g.dense, strict=True):
        c_q, q_at = by_query_c.get(d, (0, -1))
        parts.setdefault(c_q, []).append((s, d, q_at))
    out = []
    for c_q, mods in parts.items():
        stored, dense, q_at = (tuple(x) for x in zip(*mods, strict=True))
        sub = g if len(parts) == 1 else FactorGroup(g.c, g.r_out, g.r_in, stored, dense)
        q_group = FactorGroup(c_q, g.r_out, g.r_in, q_at, dense) if c_q else None
        out.append((c_q or None, sub, q_group))
    return out


def _factors_part(
    g: FactorGroup, q_group: FactorGroup, q_rows: torch.Tensor
) -> tuple[FactorGroup, torch.Tensor, torch.Tensor, int]:
    """``(g, U_q, V_q, transient bytes per row)`` of the factors route: the queries' factors of
    the modules of ``g`` as ``[K, c_q n_q, r_out]`` and ``[K, c_q n_q, r_in]``, pair-major (the
    products' sum over the pairs then reduces a middle dimension: a strided reduction over
    the queries' pairs took half the pass)."""
    n_q, k, c_q = q_rows.shape[0], g.modules, q_group.c
    u, v = q_group.factors(q_rows)  # [n_q K, c_q, r]
    uq = u.view(n_q, k, c_q, g.r_out).permute(1, 2, 0, 3).reshape(k, c_q * n_q, g.r_out)
    vq = v.view(n_q, k, c_q, g.r_in).permute(1, 2, 0, 3).reshape(k, c_q * n_q, g.r_in)
    # per row: the copies of U and V, the two products of every pair
    per_row = 4 * k * g.c * (g.r_out + g.r_in + 2 * n_q * c_q)
    return g, uq, vq, per_row


def _pair_scores(
    g: FactorGroup, rows: torch.Tensor, uq: torch.Tensor, vq: torch.Tensor, n_q: int
) -> torch.Tensor:
    """``[b, n_q]``: ``Σ_k Σ_{i,j} (u_qi · u_j)(v_qi · v_j)`` of a chunk of stored rows: one
    batched GEMM for the ``U`` sides of every module, one for the ``V`` sides, their product
    summed over the modules and both sides' pairs (ops per chunk: not per module)."""
    n, k, c = rows.shape[0], g.modules, g.c
    x = g.block(rows)  # [b, K, c (r_out + r_in)]
    u = x[..., : c * g.r_out].transpose(0, 1).reshape(k, n * c, g.r_out)
    v = x[..., c * g.r_out :].transpose(0, 1).reshape(k, n * c, g.r_in)
    prod = torch.bmm(u, uq.transpose(1, 2))  # [K, b c, c_q n_q]
    prod.mul_(torch.bmm(v, vq.transpose(1, 2)))
    # the modules' sum, then the pairs' (a middle dimension: reduced along the queries)
    return prod.view(k, -1).sum(0).view(n, -1, n_q).sum(1)
