"""Dense queries of low rank, factored exactly on the query side for the factors route.

Queries are logged dense (``nnstat.eval()``, a query pass's ``get_log()``), but a query's
per-module gradient ``Q = Σ_t δ_t x_tᵀ`` has rank at most its positions ``T``: exactly 1 for a
model that sees one position per sample (an MLP, a CNN's linear head). Against a store of
factored training rows, with a preconditioner that keeps a factored query factored
(`factored_queries.factors_preserved`: identity, K-FAC at damping 0), such a query scores by its
factors (`factored_scores.cheapest_route`'s ``"factors"``: at rank 64 and ``c = 1``, 129
multiply-adds per row and query instead of 4,096).

Per factored module of the training store, :func:`lowrank_queries` takes the singular values of
every preconditioned query ``M(Q)`` (float64, batched ``torch.linalg.svdvals``) and its numerical
rank: the singular values above

    ``tol = σ_max · eps · max(r_out, r_in)``

(``eps`` of the queries' float32: numpy.linalg.matrix_rank's tolerance). A module's ``k`` is its
largest rank over the queries. Where the factors route with ``c_q = k`` pairs is the cheapest,
``M(Q)`` is replaced by its top ``k`` singular triplets ``M(Q)_k`` (``U_q = σ_i u_iᵀ``,
``V_q = v_iᵀ``, from a float64 SVD of those modules only); elsewhere (sequence models: rank
``≈ min(T, r)``) the module stays dense. The error of a score is at most

    ``|⟨M(Q) − M(Q)_k, G⟩| ≤ ‖M(Q) − M(Q)_k‖_F ‖G‖_F ≤ √(min(r_out, r_in)) · tol · ‖G‖_F``
    ``≤ r_out · r_in · eps · ‖M(Q)‖_F ‖G‖_F``,

within the rounding bound of the float32 dot product ``⟨M(Q), G⟩`` the dense route computes
(``n · eps · Σ|q_a g_a|`` over its ``n = r_out · r_in`` terms). The factors are those of the
preconditioned query, so no preconditioner is applied to them afterwards.

The singular values cost a host read (one per call, before any block) and
``SVD_COST · r_out · r_in · min(r_out, r_in) + SVD_CALL`` multiply-adds per query and module (a
single thread of the CPU, measured by ``benchmarks/scoring_throughput.py``'s machine: ~10 µs for
16 × 12, ~150 µs for 64 × 64). A shape is tried only where that is at most :data:`SVD_SHARE` of
its dense scoring over the training rows (:func:`worth_trying`), so queries of high rank pay at
most that share for finding out.

Example:
    >>> from nnstat.influence.precondition import Preconditioner
    >>> from nnstat.influence.sources import TensorSource
    >>> pre = Preconditioner("identity", [], {})
    >>> lowrank_queries(torch.ones(1, 4), TensorSource(torch.ones(3, 4)), pre, None) is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nnstat.store.factored import FactorGroup, factor_plan, leading_pairs

from .factored_queries import factors_preserved
from .factored_scores import StoredQueries, cheapest_route
from .precondition import Preconditioner

__all__ = [
    "SVD_BYTES",
    "SVD_CALL",
    "SVD_COST",
    "SVD_SHARE",
    "lowrank_queries",
    "numerical_ranks",
    "worth_trying",
]

#: multiply-adds of one float64 ``svdvals`` per ``r_out · r_in · min(r_out, r_in)`` (measured
#: ~17 at 64 × 64, ~10 at 128 × 128 against a float32 GEMM's rate, on one CPU thread)
SVD_COST = 20
#: fixed cost of one small matrix's ``svdvals``, in multiply-adds (~10 µs on one CPU thread)
SVD_CALL = 200_000
#: bytes of one chunk of queries' float64 matrices and their SVD's transients
SVD_BYTES = 256 << 20
#: the largest share of a shape's dense scoring that its queries' singular values may cost: what
#: queries of high rank (a sequence model's) pay at most for finding out that they keep the dense
#: route
SVD_SHARE = 0.1


def worth_trying(n_queries: int, n_rows: int, c: int, r_out: int, r_in: int) -> bool:
    """Whether the singular values of ``n_queries`` dense queries of an ``r_out × r_in`` module
    are worth taking against ``n_rows`` training rows of ``c`` factor pairs: the factors route
    at rank 1 is the cheapest (`factored_scores.cheapest_route`), and the singular values cost at
    most :data:`SVD_SHARE` of the dense queries' route over the rows.

    Args:
        n_queries: queries scored at once.
        n_rows: training rows scored.
        c: factor pairs per training row.
        r_out: rows of the module's matrix.
        r_in: its columns.

    Returns:
        ``True`` where the ranks should be taken.

    Example:
        >>> worth_trying(32, 100_000, 1, 64, 64), worth_trying(32, 1_000, 1, 64, 64)
        (True, False)
    """
    if cheapest_route(n_queries, c, r_out, r_in, query_c=1) != "factors":
        return False
    dense = min(
        n_queries * c * (r_out * r_in + r_out), (c + n_queries) * r_out * r_in
    )  # per row: `cheapest_route`'s direct and densify routes
    svd = n_queries * (SVD_COST * r_out * r_in * min(r_out, r_in) + SVD_CALL)
    return svd <= SVD_SHARE * n_rows * dense


def numerical_ranks(mats: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Numerical rank of each matrix of ``mats`` ``[B, r_out, r_in]``: its singular values
    (float64) above ``σ_max · eps(dtype) · max(r_out, r_in)`` (numpy.linalg.matrix_rank's
    tolerance); 0 for a zero matrix.

    Args:
        mats: the matrices, finite, on any device.
        dtype: the precision the matrices were computed in (``eps``).

    Returns:
        ``[B]`` long ranks on ``mats``' device (no host read).

    Example:
        >>> a = torch.outer(torch.ones(4), torch.arange(3.0))
        >>> numerical_ranks(torch.stack([a, a + torch.eye(4, 3), 0 * a])).tolist()
        [1, 3, 0]
    """
    s = torch.linalg.svdvals(mats.to(torch.float64))
    tol = s[:, :1] * (torch.finfo(dtype).eps * max(mats.shape[1], mats.shape[2]))
    return (s > tol).sum(1)


def lowrank_queries(
    q_pre: torch.Tensor, source: Any, pre: Preconditioner, damping: float | None
) -> StoredQueries | None:
    """Dense preconditioned queries ``q_pre`` as exact factors (the module's docstring) for the
    factored modules of ``source`` where their rank makes the factors route the cheapest;
    ``None`` where no module does, ``source`` is not a store of factored rows, or ``pre`` does
    not keep a factored query factored. One host read (the ranks), before any block.

    Args:
        q_pre: ``[n_q, dense row width]`` float32 preconditioned queries, on the scoring device.
        source: the training rows (a `RowSource`).
        pre: the fitted preconditioner.
        damping: the damping asked for.

    Returns:
        ``(rows, meta.json modules)`` on ``q_pre``'s device (the modules left dense keep
        ``q_pre``'s columns), for `factored_scores.FactoredScores`' ``queries``, or ``None``.

    Example:
        >>> from nnstat.influence.precondition import Preconditioner
        >>> class Store:  # a store of factored rows: 1 module, 8 x 8, one pair per row
        ...     factored, meta = True, {"modules": [{"name": "fc", "offset": 0, "width": 16,
        ...                                          "r_out": 8, "r_in": 8, "factors": 1}]}
        ...     def __len__(self): return 10**6
        >>> q = torch.outer(torch.ones(8), torch.arange(8.0)).reshape(1, 64)  # rank 1
        >>> rows, mods = lowrank_queries(q, Store(), Preconditioner("identity", [], {}), None)
        >>> rows.shape, mods[0]["factors"]
        (torch.Size([1, 16]), 1)
    """
    if not getattr(source, "factored", False):
        return None
    modules = source.meta["modules"]
    if not factors_preserved(pre, damping, modules):
        return None
    n_q, n_rows = q_pre.shape[0], len(source)
    plan = factor_plan(modules)
    tried = [g for g in plan.groups if worth_trying(n_q, n_rows, g.c, g.r_out, g.r_in)]
    if not tried:
        return None
    ranks, finite = [], []
    for g in tried:
        r, ok = _ranks(q_pre, g)
        ranks.append(r)
        finite.append(ok)
    flag = torch.stack(finite).all().long().view(1)
    got = torch.cat([*ranks, flag]).tolist()  # the one host read
    if not got[-1]:  # NaN/Inf: the dense route scores them as the training rows' checks expect
        return None
    factored: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # dense offset: (U, V)
    at = 0
    for g in tried:
        k_mods = [max(1, k) for k in got[at : at + g.modules]]
        at += g.modules
        factored.update(_factored_modules(q_pre, g, k_mods))
    if not factored:
        return None
    return _query_rows(q_pre, modules, factored)


def _query_chunks(n_q: int, modules: int, r_out: int, r_in: int) -> list[slice]:
    """Slices of the queries whose float64 matrices of ``modules`` modules (and their SVD's
    transients: about four copies) take at most :data:`SVD_BYTES`."""
    step = max(1, SVD_BYTES // (4 * 8 * modules * r_out * r_in))
    return [slice(s, min(n_q, s + step)) for s in range(0, n_q, step)]


def _matrices(
    q_pre: torch.Tensor, g: FactorGroup, modules: Sequence[int] | None = None
) -> torch.Tensor:
    """float64 ``[n_q K, r_out, r_in]``: the queries' matrices of the modules of ``g`` (of its
    ``modules``, indices into the group, when given), query-major."""
    index = g.index("dense", q_pre.device)
    if modules is not None:
        index = index.view(g.modules, -1)[list(modules)].flatten()
    cols = q_pre.index_select(1, index).to(torch.float64)
    return cols.view(-1, g.r_out, g.r_in)


def _ranks(q_pre: torch.Tensor, g: FactorGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """``([K] largest numerical rank over the queries per module of g, all finite)``, on
    ``q_pre``'s device, the queries a chunk at a time (:func:`_query_chunks`)."""
    n_q, k = q_pre.shape[0], g.modules
    ranks = torch.zeros(k, dtype=torch.long, device=q_pre.device)
    finite = torch.ones((), dtype=torch.bool, device=q_pre.device)
    for part in _query_chunks(n_q, k, g.r_out, g.r_in):
        mats = _matrices(q_pre[part], g)
        finite = finite & mats.isfinite().all()
        got = numerical_ranks(mats.nan_to_num(0.0, 0.0, 0.0))
        ranks = torch.maximum(ranks, got.view(-1, k).amax(0))
    return ranks, finite


def _factored_modules(
    q_pre: torch.Tensor, g: FactorGroup, ranks: Sequence[int]
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """``{dense offset: (U [n_q, c_q, r_out], V [n_q, c_q, r_in])}`` of the modules of ``g``
    whose rank makes the factors route the cheapest: those of rank at most the largest ``k`` for
    which it is (the route's cost grows with ``c_q``), all with that group's largest such rank
    as ``c_q`` (one group of the factors route per shape; the extra pairs are the next singular
    triplets, below the tolerance: more exact, not less)."""
    n_q = q_pre.shape[0]
    fits = [k for k in ranks if cheapest_route(n_q, g.c, g.r_out, g.r_in, query_c=k) == "factors"]
    if not fits:
        return {}
    c_q = max(fits)
    chosen = [j for j, k in enumerate(ranks) if k <= c_q]
    us, vs = [], []
    for part in _query_chunks(n_q, len(chosen), g.r_out, g.r_in):
        u, v, _ = leading_pairs(_matrices(q_pre[part], g, chosen), c_q)
        us.append(u.to(torch.float32).view(-1, len(chosen), c_q, g.r_out))
        vs.append(v.to(torch.float32).view(-1, len(chosen), c_q, g.r_in))
    u, v = torch.cat(us), torch.cat(vs)
    return {g.dense[j]: (u[:, i], v[:, i]) for i, j in enumerate(chosen)}


def _query_rows(
    q_pre: torch.Tensor,
    modules: Sequence[Mapping[str, Any]],
    factored: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
) -> StoredQueries:
    """The queries' stored rows and meta.json modules: the modules of ``factored`` (by dense
    offset) as their factor pairs, every other module as ``q_pre``'s dense columns."""
    n_q, parts, out_mods = q_pre.shape[0], [], []
    dense_at = stored_at = 0
    for m in modules:
        r_out, r_in = m.get("r_out"), int(m.get("r_in") or 0)
        width = int(r_out) * r_in if m.get("factors") else int(m["width"])
        entry = {k: v for k, v in m.items() if k != "factors"}
        if dense_at in factored:
            u, v = factored[dense_at]
            parts += [u.reshape(n_q, -1), v.reshape(n_q, -1)]
            entry.update(factors=u.shape[1], width=u.shape[1] * (int(r_out) + r_in))
        else:
            parts.append(q_pre[:, dense_at : dense_at + width])
            entry["width"] = width
        entry["offset"] = stored_at
        stored_at += entry["width"]
        dense_at += width
        out_mods.append(entry)
    return torch.cat(parts, 1).to(torch.float32), out_mods
