"""Queries kept as factors: which preconditioners keep a factored query factored, the queries'
stored factors for `factored_scores.FactoredScores`, and self-influence of factored rows.

A query logged into a factored store is ``Q = U_qᵀ V_q`` per module (``c_q`` pairs). Scored
against factored training rows it costs ``c_q · c · (r_out + r_in)`` multiply-adds per pair of
rows instead of ``r_out · r_in`` (:func:`~nnstat.influence.factored_scores.cheapest_route`), but
only while the preconditioned query ``M(Q)`` is still of that form:

* ``identity``: ``M(Q) = Q``.
* ``kfac`` at ``damping=0`` on every factored module: ``M(Q) = S⁻¹ Q A⁻¹``, so
  ``U_q ← U_q S⁻¹`` and ``V_q ← V_q A⁻¹`` (``S``, ``A``: the module's K-FAC factors in the logged
  space; both symmetric).
* Not ``kfac`` at ``damping > 0``: nnstat damps the Kronecker product, ``(S ⊗ A + λI)⁻¹``
  (:mod:`nnstat.influence.precondition`), whose eigenvalues ``1 / (s_a a_b + λ)`` are no
  product of one per side: ``M(Q)`` has full rank, like the query of ``ekfac`` (corrected
  eigenvalues), ``raw`` (a dense Fisher) or refinement. Those score as dense queries
  (:func:`stored_queries` returns ``None``), with the same result.

Example:
    >>> from nnstat.influence.precondition import Preconditioner
    >>> factors_preserved(Preconditioner("identity", [], {}), None)
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from nnstat.store.factored import factor_plan, is_factored

from .factored_scores import StoredQueries
from .precondition import KronFactor, Preconditioner, damped_inverse
from .sources import LogSource, RowSource, StoreSource, all_rows

__all__ = [
    "factors_preserved",
    "norm_parts_as_stored",
    "self_influence_as_stored",
    "self_influence_view",
    "stored_queries",
]


def factors_preserved(
    pre: Preconditioner, damping: float | None, modules: Sequence[Mapping[str, Any]] = ()
) -> bool:
    """Whether ``pre`` at ``damping`` maps a factored query of ``modules`` (meta.json) to a
    factored one (the module's docstring): ``identity``, or ``kfac`` with a K-FAC factor and
    damping 0 for every factored module.

    Args:
        pre: the fitted preconditioner.
        damping: the damping asked for (``None``: the heuristic, never 0).
        modules: the queries' meta.json modules (those with ``factors`` are checked).

    Returns:
        ``True`` where the factored route may score these queries exactly.

    Example:
        >>> from nnstat.influence.precondition import Preconditioner
        >>> factors_preserved(Preconditioner("raw", [], {}), 0.1)
        False
    """
    if pre.kind == "identity":
        return True
    if pre.kind != "kfac":
        return False
    names = [m["name"] for m in modules if m.get("factors")]
    lams = pre.module_dampings(damping)
    return all(isinstance(pre.factors.get(n), KronFactor) and lams.get(n) == 0 for n in names)


def _side_inverse(f: KronFactor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(S⁻¹, A⁻¹)`` (float32) of an undamped K-FAC factor, whose ``eig`` is ``outer(s, a)``:
    ``s_x a_y = eig[x, 0] eig[0, y] / eig[0, 0]`` (every entry positive at damping 0, else the
    preconditioner refused it as singular)."""
    eig = f.eig.to(torch.float64)
    s, a = eig[:, 0], eig[0, :] / eig[0, 0]
    out = []
    for q, lam in ((f.q_out, s), (f.q_in, a)):
        basis = torch.eye(len(lam), dtype=torch.float64) if q is None else q.to(torch.float64)
        out.append(damped_inverse(lam, basis, 0.0))
    return out[0], out[1]


def _preconditioned(
    rows: torch.Tensor, modules: Sequence[Mapping[str, Any]], pre: Preconditioner
) -> torch.Tensor:
    """Stored factored query rows with ``pre`` (``kfac`` at damping 0) applied to each factored
    module's factors: ``U ← U S⁻¹``, ``V ← V A⁻¹`` (plain columns as they are)."""
    if pre.kind == "identity":
        return rows
    rows = rows.clone()
    for m in modules:
        if not m.get("factors"):
            continue
        c, r_out, r_in, at = int(m["factors"]), int(m["r_out"]), int(m["r_in"]), int(m["offset"])
        s_inv, a_inv = _side_inverse(pre.factors[m["name"]])
        u = rows[:, at : at + c * r_out].reshape(-1, r_out) @ s_inv
        v = rows[:, at + c * r_out : at + m["width"]].reshape(-1, r_in) @ a_inv
        rows[:, at : at + c * r_out] = u.reshape(len(rows), -1).to(rows.dtype)
        rows[:, at + c * r_out : at + m["width"]] = v.reshape(len(rows), -1).to(rows.dtype)
    return rows


def stored_queries(
    source: RowSource,
    pre: Preconditioner,
    damping: float | None,
    batch_size: int,
    device: torch.device,
) -> StoredQueries | None:
    """The queries of ``source`` as preconditioned factors (``(rows, meta.json modules)``, float32
    on ``device``, in the order of ``all_rows(source)``), for the factors route of
    `factored_scores.FactoredScores`; ``None`` where ``source`` is not factored (a query log or
    store logged dense) or ``pre`` does not keep a factored query factored
    (:func:`factors_preserved`).

    Args:
        source: the queries (a `LogSource` or `StoreSource`; other sources are dense).
        pre: the fitted preconditioner.
        damping: the damping asked for.
        batch_size: rows per block read from a store.
        device: where scoring runs.

    Returns:
        ``(rows, modules)`` or ``None``.

    Example:
        >>> from nnstat.influence.precondition import Preconditioner
        >>> from nnstat.influence.sources import TensorSource
        >>> q, pre = TensorSource(torch.ones(2, 3)), Preconditioner("identity", [], {})
        >>> stored_queries(q, pre, None, 8, torch.device("cpu")) is None  # dense rows
        True
    """
    if not is_factored(source.meta):
        return None
    modules = source.meta["modules"]
    if not factors_preserved(pre, damping, modules):
        return None
    if isinstance(source, LogSource):
        rows = torch.as_tensor(source.log.rows, dtype=torch.float32)
    elif isinstance(source, StoreSource):
        rows = all_rows(source.stored_rows(widen=True), batch_size)[1]
    else:
        return None
    return _preconditioned(rows, modules, pre).to(device, torch.float32), modules


def self_influence_view(source: Any, pre: Preconditioner) -> RowSource | None:
    """``source``'s rows as stored (`StoreSource.stored_rows`, float32) where its self-influence
    under ``pre`` is taken from its factors (:func:`self_influence_as_stored`: a store of
    factored rows under ``identity``), else ``None`` (its dense rows, with ``pre`` applied).

    Args:
        source: the rows whose self-influence is wanted.
        pre: the fitted preconditioner.

    Returns:
        The view, or ``None``.

    Example:
        >>> from nnstat.influence.precondition import Preconditioner
        >>> from nnstat.influence.sources import TensorSource
        >>> self_influence_view(TensorSource(torch.ones(2, 3)), Preconditioner("identity", [], {}))
    """
    if pre.kind != "identity" or not getattr(source, "factored", False):
        return None
    return source.stored_rows(widen=True) if hasattr(source, "stored_rows") else None


def self_influence_as_stored(
    rows: torch.Tensor, modules: Sequence[Mapping[str, Any]], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``‖g‖²`` (self-influence under ``identity``) of stored rows whose ``modules`` may be
    factored, without their dense form: ``Σ_{i,j} (u_i · u_j)(v_i · v_j)`` per factored module
    (two batched Gram products per module shape: ``c² (r_out + r_in)`` multiply-adds per
    module, against ``c · r_out · r_in`` to multiply it out), ``‖x‖²`` of the plain columns.

    Args:
        rows: ``[b, stored width]`` rows as stored, on any device.
        modules: the store's meta.json modules.
        dtype: of the products and sums (float64: no float32 row's norm under- or overflows).

    Returns:
        ``[b]`` of ``dtype`` on ``rows``' device.

    Example:
        >>> mods = [{"offset": 0, "width": 3, "r_out": 2, "r_in": 1, "factors": 1},
        ...         {"offset": 3, "width": 1, "r_out": None, "r_in": 1}]
        >>> self_influence_as_stored(torch.tensor([[1.0, 2.0, 3.0, 5.0]]), mods).tolist()
        [70.0]
    """
    plan = factor_plan(modules)
    n = rows.shape[0]
    if plan.plain:
        plain = rows.index_select(1, plan.plain_index(rows.device)[0]).to(dtype)
        out = plain.square().sum(1)
    else:
        out = torch.zeros(n, dtype=dtype, device=rows.device)
    for g in plan.groups:
        u, v = (f.to(dtype) for f in g.factors(rows))  # [b K, c, r]
        gram = torch.bmm(u, u.transpose(1, 2))
        gram.mul_(torch.bmm(v, v.transpose(1, 2)))
        out.add_(gram.view(n, -1).sum(1))
    return out


def norm_parts_as_stored(
    rows: torch.Tensor, modules: Sequence[Mapping[str, Any]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each stored row's ``‖g‖`` (the norm under ``identity``) from its factors, in
    `modes.m_norm_parts`' form ``(scale, unit)``: ``scale`` the float32 norm, ``unit`` 1.

    The squares are summed in float64 (:func:`self_influence_as_stored`), where no float32
    row's norm under- or overflows, so the norm needs no scaling by the row's largest entry
    (which the factors do not give). The floor is on the norm: a row whose norm is below
    float32's smallest normal number has ``scale`` 0 (numerically zero, it scores 0).

    Args:
        rows: ``[b, stored width]`` rows as stored, on any device.
        modules: the store's meta.json modules.

    Returns:
        ``(scale, unit)``, float32 ``[b]`` each.

    Example:
        >>> mods = [{"offset": 0, "width": 3, "r_out": 2, "r_in": 1, "factors": 1}]
        >>> scale, unit = norm_parts_as_stored(torch.tensor([[3e-20, 4e-20, 1e-10]]), mods)
        >>> f"{scale.item():.3g}", unit.tolist()
        ('5e-30', [1.0])
    """
    norm = self_influence_as_stored(rows, modules, torch.float64).sqrt()
    tiny = torch.finfo(torch.float32).tiny
    scale = torch.where(norm >= tiny, norm, torch.zeros_like(norm)).to(torch.float32)
    return scale, torch.ones_like(scale)
