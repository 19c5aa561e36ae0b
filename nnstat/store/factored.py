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

from collections.abc import Mapping, Sequence
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
        g = torch.bmm(bp.transpose(1, 2), ap)
        left, s, vh = torch.linalg.svd(g, full_matrices=False)
        k = min(c, s.shape[1])
        u = (left[:, :, :k] * s[:, None, :k]).transpose(1, 2)
        v = vh[:, :k, :]
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


def densify(rows: torch.Tensor, modules: Sequence[Mapping[str, Any]]) -> torch.Tensor:
    """Stored rows ``[N, row_width]`` of a store whose ``modules`` (meta.json) may be factored,
    as float32 dense rows (the layout of :func:`dense_modules`). A block at a time: the dense
    form is a transient of the reader, never stored.

    Example:
        >>> mods = [{"name": "a", "offset": 0, "width": 3, "r_out": 2, "r_in": 1, "factors": 1},
        ...         {"name": "b", "offset": 3, "width": 1, "r_out": None, "r_in": 1}]
        >>> densify(torch.tensor([[1.0, 2.0, 3.0, 5.0]]), mods).tolist()
        [[3.0, 6.0, 5.0]]
    """
    parts = []
    for m in modules:
        cols = rows[:, int(m["offset"]) : int(m["offset"]) + int(m["width"])]
        c = m.get("factors")
        if c:
            parts.append(unfactor(cols, int(c), int(m["r_out"]), int(m["r_in"])))
        else:
            parts.append(cols.to(torch.float32))
    return torch.cat(parts, dim=1) if parts else rows.to(torch.float32)


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
