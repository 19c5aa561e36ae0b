"""Factored rows: a module's projected per-sample gradient stored as ``c`` factor pairs.

A Kronecker module's projected per-sample gradient is a sum over its positions,
``G = Σ_t (P_out δ_t)(P_in x_t)ᵀ`` (``r_out × r_in``). With ``factors=c`` the store keeps
``U`` ``[c, r_out]`` and ``V`` ``[c, r_in]`` with ``G ≈ Uᵀ V`` (``Σ_i U_i V_iᵀ``) instead of the
``r_out * r_in`` entries: ``c * (r_out + r_in)`` columns, row-major ``[U.flatten(), V.flatten()]``.

* ``T <= c`` positions: exact, ``U``/``V`` are the projected ``δ_t``/``x_t`` themselves,
  zero-padded to ``c`` pairs (no decomposition at all: a one-position Linear costs nothing).
* ``T > c``: the best rank-``c`` approximation (Eckart-Young), from a batched dense SVD of the
  ``r_out × r_in`` matrix (``r <= 256``: ``torch.linalg.svd`` on the rows' device; the Gram
  route ``eigh(G Gᵀ)`` would be cheaper but squares the condition number and computes the
  discarded energy by cancellation). The singular values go into ``U`` (``U_i = σ_i u_iᵀ``,
  ``V_i = v_iᵀ``). ``energy`` is the fraction of ``‖G‖²_F`` kept (``Σ_{i<c} σ_i² / Σ σ²``, 1
  for an exact or zero row).

Modules without a Kronecker structure (LayerNorm, flat rows) stay dense in the same row.
Stored factors are read back as dense rows per block (:func:`densify`), so every consumer sees
the logical ``r_out * r_in`` layout.

Example:
    >>> bp, ap = torch.randn(2, 3, 4), torch.randn(2, 3, 5)  # [N, T, r_out], [N, T, r_in]
    >>> rows, energy = factor_rows(bp, ap, 3)  # T <= c: exact
    >>> dense = torch.bmm(bp.transpose(1, 2), ap).reshape(2, -1)
    >>> torch.allclose(unfactor(rows, 3, 4, 5), dense), energy.tolist()
    (True, [1.0, 1.0])
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


def factored_width(c: int, r_out: int, r_in: int) -> int:
    """Columns of one factored module: ``c * (r_out + r_in)``.

    Example:
        >>> factored_width(8, 64, 64)
        1024
    """
    return c * (r_out + r_in)


def worth_factoring(c: int | None, r_out: int | None, r_in: int) -> bool:
    """Whether a module of ranks ``r_out``/``r_in`` is stored factored under ``factors=c``: a
    Kronecker module (``r_out`` not ``None``) whose factors take fewer columns than its dense
    row (otherwise the dense row is both exact and smaller).

    Example:
        >>> worth_factoring(8, 64, 64), worth_factoring(8, 4, 4), worth_factoring(8, None, 6)
        (True, False, False)
    """
    return c is not None and r_out is not None and factored_width(c, r_out, r_in) < r_out * r_in


def leading_pairs(g: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` leading singular pairs of each matrix of ``g``, as factors: ``U`` (left vectors
    scaled by their singular values) and ``V`` (right vectors), so that ``Uᵀ V`` is the best
    rank-``k`` approximation of each matrix; with every singular value.

    Args:
        g: ``[B, r_out, r_in]`` matrices (computed in their dtype and on their device).
        k: pairs to keep (fewer when a matrix has fewer singular values).

    Returns:
        ``(U [B, k, r_out], V [B, k, r_in], σ [B, min(r_out, r_in)])``.

    Example:
        >>> g = torch.tensor([[[3.0, 0.0], [0.0, 1.0]]])
        >>> u, v, s = leading_pairs(g, 1); (u.transpose(1, 2) @ v).abs().tolist(), s.tolist()
        ([[[3.0, 0.0], [0.0, 0.0]]], [[3.0, 1.0]])
    """
    left, s, vh = torch.linalg.svd(g, full_matrices=False)
    k = min(k, s.shape[-1])
    return (left[..., :k] * s[..., None, :k]).transpose(-1, -2), vh[..., :k, :], s


def factor_rows(bp: torch.Tensor, ap: torch.Tensor, c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Factored rows of ``G_n = bp[n]ᵀ ap[n]`` and the energy each keeps.

    Args:
        bp: ``[N, T, r_out]`` projected output gradients per position.
        ap: ``[N, T, r_in]`` projected inputs per position.
        c: factor pairs per row.

    Returns:
        ``(rows, energy)``: float32 ``[N, c * (r_out + r_in)]`` and ``[N]`` (kept ``σ²`` over
        ``‖G‖²_F``; 1 where exact or ``G = 0``).

    Example:
        >>> rows, energy = factor_rows(torch.ones(1, 4, 2), torch.ones(1, 4, 2), 1)
        >>> unfactor(rows, 1, 2, 2).round().tolist(), energy.tolist()  # rank 1: kept whole
        ([[4.0, 4.0, 4.0, 4.0]], [1.0])
    """
    n, t, r_out = bp.shape
    r_in = ap.shape[2]
    bp, ap = bp.to(torch.float32), ap.to(torch.float32)
    if t <= c:
        u, v = bp, ap
        energy = torch.ones(n, dtype=torch.float32, device=bp.device)
    else:
        u, v, s = leading_pairs(torch.bmm(bp.transpose(1, 2), ap), c)
        k = u.shape[1]
        sq = s.square()
        total = sq.sum(1)
        kept = sq[:, :k].sum(1)
        energy = torch.where(total > 0, kept / torch.where(total > 0, total, 1.0), 1.0)
    rows = torch.zeros(n, factored_width(c, r_out, r_in), dtype=torch.float32, device=bp.device)
    k = u.shape[1]
    rows[:, : c * r_out].view(n, c, r_out)[:, :k] = u
    rows[:, c * r_out :].view(n, c, r_in)[:, :k] = v
    return rows, energy


def split(rows: torch.Tensor, c: int, r_out: int, r_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``U`` ``[N, c, r_out]`` and ``V`` ``[N, c, r_in]`` of factored rows ``[N, c(r_out+r_in)]``.

    Example:
        >>> [tuple(t.shape) for t in split(torch.zeros(3, 14), 2, 3, 4)]
        [(3, 2, 3), (3, 2, 4)]
    """
    n = rows.shape[0]
    return rows[:, : c * r_out].reshape(n, c, r_out), rows[:, c * r_out :].reshape(n, c, r_in)


def unfactor(rows: torch.Tensor, c: int, r_out: int, r_in: int) -> torch.Tensor:
    """Dense ``[N, r_out * r_in]`` rows ``vec(Uᵀ V)`` of factored rows (row-major, ``r_out``
    major, as a dense store holds them).

    Example:
        >>> unfactor(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), 1, 2, 2).tolist()
        [[3.0, 4.0, 6.0, 8.0]]
    """
    u, v = split(rows.to(torch.float32), c, r_out, r_in)
    return torch.bmm(u.transpose(1, 2), v).reshape(rows.shape[0], r_out * r_in)


def is_factored(meta: Mapping[str, Any]) -> bool:
    """Whether a store's ``meta`` has a module stored as factors.

    Example:
        >>> is_factored({"modules": [{"name": "fc", "factors": 4}]}), is_factored({})
        (True, False)
    """
    return any(isinstance(m, dict) and m.get("factors") for m in meta.get("modules") or [])


def dense_modules(modules: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """meta.json's ``modules`` as the dense rows :func:`densify` makes: every factored module
    ``r_out * r_in`` wide, offsets re-tiled, no ``factors`` key.

    Example:
        >>> mods = [{"name": "a", "offset": 0, "width": 14, "r_out": 3, "r_in": 4, "factors": 2}]
        >>> dense_modules(mods)[0]["width"]
        12
    """
    out, offset = [], 0
    for m in modules:
        d = {k: v for k, v in m.items() if k != "factors"}
        if m.get("factors"):
            d["width"] = int(m["r_out"]) * int(m["r_in"])
        d["offset"] = offset
        offset += int(d["width"])
        out.append(d)
    return out


def dense_layout(meta: Mapping[str, Any]) -> dict[str, Any]:
    """``modules`` and ``row_width`` of ``meta`` as its dense rows lay them out (the form a
    query log of a factored store has, and the one two logs are compared in).

    Example:
        >>> mods = [{"name": "a", "offset": 0, "width": 14, "r_out": 3, "r_in": 4, "factors": 2}]
        >>> dense_layout({"modules": mods, "row_width": 14})["row_width"]
        12
    """
    if not is_factored(meta):
        return {k: meta[k] for k in ("modules", "row_width") if k in meta}
    modules = dense_modules(meta["modules"])
    return {"modules": modules, "row_width": sum(int(m["width"]) for m in modules)}


@dataclass(frozen=True)
class FactorGroup:
    """The factored modules of one shape ``(c, r_out, r_in)`` in a row layout, in row order:
    one batched product densifies all of them (:meth:`products`), not one call per module.

    Example:
        >>> g = factor_plan([{"offset": 0, "width": 14, "r_out": 3, "r_in": 4, "factors": 2}])
        >>> g.groups[0].modules, g.groups[0].dense_span
        (1, (0, 12))
    """

    c: int
    r_out: int
    r_in: int
    stored: tuple[int, ...]  # each module's offset in the stored row
    dense: tuple[int, ...]  # each module's offset in the dense row (dense_modules)
    # long column indices per device, made on first use (a CUDA block needs them there)
    _index: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def modules(self) -> int:
        """Modules in the group (``K``)."""
        return len(self.stored)

    @property
    def width(self) -> int:
        """Stored columns of one module: ``c * (r_out + r_in)``."""
        return factored_width(self.c, self.r_out, self.r_in)

    @property
    def dense_width(self) -> int:
        """Dense columns of the whole group: ``K * r_out * r_in``."""
        return self.modules * self.r_out * self.r_in

    @property
    def stored_span(self) -> tuple[int, int] | None:
        """``(start, stop)`` when the modules are adjacent in the stored row, else ``None``."""
        return _span(self.stored, self.width)

    @property
    def dense_span(self) -> tuple[int, int] | None:
        """``(start, stop)`` when the modules are adjacent in the dense row, else ``None``."""
        return _span(self.dense, self.r_out * self.r_in)

    def index(self, which: str, device: torch.device) -> torch.Tensor:
        """Long column indices on ``device``: ``"stored"`` (the modules' factor columns, module
        by module) or ``"dense"`` (their dense columns)."""
        key = (which, str(device))
        if key not in self._index:
            starts, w = (self.stored, self.width) if which == "stored" else (self.dense, None)
            w = w or self.r_out * self.r_in
            cols = torch.cat([torch.arange(s, s + w) for s in starts])
            self._index[key] = cols.to(device)
        return self._index[key]

    def block(self, rows: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, K, c * (r_out + r_in)]``: each module's stored columns of ``rows``, a
        view where the modules are adjacent, one gather of their columns where not."""
        span = self.stored_span
        if span is not None:
            x = rows[:, span[0] : span[1]]
        else:
            x = rows.index_select(1, self.index("stored", rows.device))
        return x.to(torch.float32).unflatten(1, (self.modules, self.width))

    def factors(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``U`` ``[N * K, c, r_out]`` and ``V`` ``[N * K, c, r_in]`` of stored ``rows``
        (row-major: row ``n``'s module ``k`` is entry ``n * K + k``)."""
        n, k, c = rows.shape[0], self.modules, self.c
        x = self.block(rows)
        u = x[..., : c * self.r_out].reshape(n * k, c, self.r_out)
        v = x[..., c * self.r_out :].reshape(n * k, c, self.r_in)
        return u, v

    def products(self, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The group's dense columns ``[N, K * r_out * r_in]`` (module by module, ``vec(UᵀV)``
        each) of stored ``rows``: one ``bmm``, into ``out`` (contiguous) when given."""
        u, v = self.factors(rows)
        if out is not None:
            torch.bmm(u.transpose(1, 2), v, out=out.view(-1, self.r_out, self.r_in))
            return out
        return torch.bmm(u.transpose(1, 2), v).view(rows.shape[0], self.dense_width)


def _span(starts: tuple[int, ...], width: int) -> tuple[int, int] | None:
    adjacent = all(b - a == width for a, b in zip(starts, starts[1:], strict=False))
    return (starts[0], starts[-1] + width) if adjacent else None


@dataclass(frozen=True)
class FactorPlan:
    """Where a row layout's modules are stored and where they go in its dense rows: the
    factored modules grouped by shape (:class:`FactorGroup`), the plain ones (stored dense) as
    column runs ``(stored offset, dense offset, width)``. Made once per layout (cached).

    Example:
        >>> mods = [{"offset": 0, "width": 3, "r_out": 2, "r_in": 1, "factors": 1},
        ...         {"offset": 3, "width": 1, "r_out": None, "r_in": 1}]
        >>> plan = factor_plan(mods)
        >>> len(plan.groups), plan.plain, plan.dense_width
        (1, ((3, 2, 1),), 3)
    """

    groups: tuple[FactorGroup, ...]
    plain: tuple[tuple[int, int, int], ...]
    stored_width: int
    dense_width: int
    _index: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def plain_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Long indices of the plain columns on ``device``: ``(stored, dense)``."""
        key = str(device)
        if key not in self._index:
            stored = [torch.arange(s, s + w) for s, _, w in self.plain] or [torch.zeros(0)]
            dense = [torch.arange(d, d + w) for _, d, w in self.plain] or [torch.zeros(0)]
            self._index[key] = (
                torch.cat(stored).long().to(device),
                torch.cat(dense).long().to(device),
            )
        return self._index[key]


def factor_plan(modules: Sequence[Mapping[str, Any]]) -> FactorPlan:
    """The :class:`FactorPlan` of meta.json's ``modules`` (cached per layout).

    Args:
        modules: meta.json's ``modules`` (``offset``, ``width``, ``r_out``, ``r_in`` and, for a
            factored module, ``factors``).

    Returns:
        The plan; its groups list each shape once, in the order first met.

    Example:
        >>> mods = [{"offset": 14 * k, "width": 14, "r_out": 3, "r_in": 4, "factors": 2}
        ...         for k in range(3)]
        >>> [(g.modules, g.stored_span) for g in factor_plan(mods).groups]
        [(3, (0, 42))]
    """
    key = tuple(
        (
            int(m["offset"]),
            int(m["width"]),
            m.get("r_out"),
            int(m.get("r_in") or 0),
            int(m.get("factors") or 0),
        )
        for m in modules
    )
    return _plan(key)


@functools.lru_cache(maxsize=32)
def _plan(key: tuple) -> FactorPlan:
    shapes: dict[tuple[int, int, int], tuple[list[int], list[int]]] = {}
    plain: list[list[int]] = []
    dense = 0
    for offset, width, r_out, r_in, c in key:
        if c:
            stored, at = shapes.setdefault((c, int(r_out), r_in), ([], []))
            stored.append(offset)
            at.append(dense)
            dense += int(r_out) * r_in
            continue
        if plain and plain[-1][0] + plain[-1][2] == offset and plain[-1][1] + plain[-1][2] == dense:
            plain[-1][2] += width  # adjacent in both rows: one run
        else:
            plain.append([offset, dense, width])
        dense += width
    groups = tuple(
        FactorGroup(c, r_out, r_in, tuple(s), tuple(d))
        for (c, r_out, r_in), (s, d) in shapes.items()
    )
    stored = max((o + w for o, w, *_ in key), default=0)
    return FactorPlan(groups, tuple(tuple(p) for p in plain), stored, dense)


def densify(
    rows: torch.Tensor, modules: Sequence[Mapping[str, Any]], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Stored rows ``[N, row_width]`` of a store whose ``modules`` (meta.json) may be factored,
    as float32 dense rows (the layout of :func:`dense_modules`). A block at a time: the dense
    form is a transient of the reader, never stored. One batched product per shape of factored
    module (:func:`factor_plan`), written in place: no per-module product, no concatenation.

    Args:
        rows: ``[N, stored row width]`` rows as the shards hold them, on any device.
        modules: meta.json's ``modules``.
        out: an optional contiguous float32 ``[N, dense width]`` to write into.

    Returns:
        float32 ``[N, dense width]`` on ``rows``' device (``out`` when given).

    Example:
        >>> mods = [{"name": "a", "offset": 0, "width": 3, "r_out": 2, "r_in": 1, "factors": 1},
        ...         {"name": "b", "offset": 3, "width": 1, "r_out": None, "r_in": 1}]
        >>> densify(torch.tensor([[1.0, 2.0, 3.0, 5.0]]), mods).tolist()
        [[3.0, 6.0, 5.0]]
    """
    plan = factor_plan(modules)
    n = rows.shape[0]
    if out is None:
        out = torch.empty(n, plan.dense_width, dtype=torch.float32, device=rows.device)
    for g in plan.groups:
        span = g.dense_span
        if span == (0, plan.dense_width):  # the whole dense row: the product writes it
            g.products(rows, out)
        elif span is not None:
            out[:, span[0] : span[1]] = g.products(rows)
        else:
            out.index_copy_(1, g.index("dense", rows.device), g.products(rows))
    if len(plan.plain) > 2:  # many runs (norm layers between the linears): one gather
        stored, dense = plan.plain_index(rows.device)
        out.index_copy_(1, dense, rows.index_select(1, stored).to(torch.float32))
        return out
    for stored, dense, width in plan.plain:
        out[:, dense : dense + width] = rows[:, stored : stored + width]
    return out


class EnergyTally:
    """Per-module captured energy over the rows of a pass: mean and min, kept on the rows'
    device (no host read until :meth:`summary`).

    Running totals, not a list per block: a pass of millions of rows keeps one sum and one
    minimum per module (a list would hold two small device tensors per module per block).

    Example:
        >>> tally = EnergyTally()
        >>> tally.add("fc", torch.tensor([1.0, 0.5]))
        >>> tally.summary()
        {'fc': {'rows': 2, 'mean': 0.75, 'min': 0.5}}
    """

    def __init__(self) -> None:
        self._sum: dict[str, torch.Tensor] = {}  # float64 on the rows' device
        self._min: dict[str, torch.Tensor] = {}
        self._rows: dict[str, int] = {}  # known on the host: no read

    def add(self, name: str, energy: torch.Tensor) -> None:
        """Count one block's ``[N]`` energies of module ``name``."""
        if not energy.numel():
            return
        e = energy.detach()
        total, low = e.sum(dtype=torch.float64), e.min()
        if name in self._sum:
            self._sum[name].add_(total)
            self._min[name] = torch.minimum(self._min[name], low)
        else:
            self._sum[name], self._min[name] = total, low
        self._rows[name] = self._rows.get(name, 0) + e.numel()

    def summary(self) -> dict[str, dict[str, float]]:
        """``{module: {rows, mean, min}}`` of everything added (one host read per module)."""
        out = {}
        for name, rows in self._rows.items():
            total, low = torch.stack([self._sum[name], self._min[name].double()]).tolist()
            out[name] = {"rows": rows, "mean": total / rows, "min": low}
        return out


def merge_energy(
    old: Mapping[str, Mapping[str, float]] | None, new: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    """Two :meth:`EnergyTally.summary` records combined (a store logged in several passes).

    Example:
        >>> merge_energy({"fc": {"rows": 1, "mean": 1.0, "min": 1.0}},
        ...              {"fc": {"rows": 1, "mean": 0.5, "min": 0.5}})
        {'fc': {'rows': 2, 'mean': 0.75, 'min': 0.5}}
    """
    out = {k: dict(v) for k, v in (old or {}).items()}
    for name, e in new.items():
        if name not in out:
            out[name] = dict(e)
            continue
        a = out[name]
        rows = int(a["rows"]) + int(e["rows"])
        mean = (a["mean"] * a["rows"] + e["mean"] * e["rows"]) / max(rows, 1)
        out[name] = {"rows": rows, "mean": mean, "min": min(a["min"], e["min"])}
    return out
