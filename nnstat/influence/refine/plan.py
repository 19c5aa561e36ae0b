"""How refinement fits a memory budget: the plan (block, chunk, placement) and its estimate.

Besides the model and its data, refinement holds the queries' rows and solutions (``n × W``
logged values each), the search space of one block of ``b`` queries (block CG: ``V`` and
``AV``, `krylov.block_directions` vectors of ``W`` each; per-query CG: a few vectors per
query), the preconditioner's damped blocks, and one curvature product at a time: a chunk of
``c`` vectors lifted to the ``P`` logged parameters, multiplied on one training batch (its
activations and autograd's graph of them) and projected back within that batch, so full
parameter vectors exist only ``c`` at a time and only inside a product. The product's cost is
measured on the first training batch at one and two vectors (`product_cost`); the rest is
counted from the shapes (`footprint`).

`choose_plan` keeps the requested solver and block (``query_batch``) and shrinks the chunk
first (same results, to rounding: only how the products are batched changes), then, on a GPU,
moves the search space and the rows to the host (same results), then halves the block (each
pass explores fewer directions: the same solution once converged, other iterates before), then
falls back to per-query CG; where even one query with one vector per product does not fit it
refuses, naming the bytes needed. ``result.meta["refine"]["memory"]`` reports the plan.

Example:
    >>> import torch
    >>> fp = Footprint(n=32, width=4096, params=10**6, itemsize=4, steps=5, start=True,
    ...                probes=8, fixed=50 * 2**20, per_vector=30 * 2**20)
    >>> plan = choose_plan(fp, memory=2**30, solver="block", block=32, cuda=False)
    >>> plan.solver, plan.block, plan.chunk <= 72, plan.estimate <= 2**30
    ('block', 32, True, True)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nnstat.curvature.products import twice_differentiable
from nnstat.curvature.streamed import StreamedCurvature

from ..krylov import block_directions
from .memory import measure_peak, size

#: the measured product cost is scaled by this (allocator rounding, batches unlike the first)
PRODUCT_MARGIN = 1.25


@dataclass
class Footprint:
    """What refinement's memory depends on: ``n`` queries of ``width`` logged values, ``params``
    logged parameters (a shared one counted per module), ``itemsize`` bytes per value, the
    solver's ``steps``, whether the first step starts from other directions (``start``) with
    ``probes`` trace probes, a product's measured bytes (``fixed`` + ``per_vector`` x chunk;
    ``measured=False``: counted from the shapes, activations left out) and the
    preconditioner's damped blocks (``preconditioner``)."""

    n: int
    width: int
    params: int
    itemsize: int
    steps: int
    start: bool
    probes: int
    fixed: int
    per_vector: int
    measured: bool = True
    preconditioner: int = 0


def matvec_rows(fp: Footprint, solver: str, block: int) -> int:
    """The most vectors one ``matvec`` of the solver takes: block CG's first (the block's
    directions and the trace probes) or second (twice the block, from other start directions);
    per-query CG's block, or the trace probes of its damping pass."""
    if solver == "cg":
        return max(block, fp.probes)
    return max(block + fp.probes, 2 * block if fp.start and fp.steps > 1 else block)


def footprint(fp: Footprint, solver: str, block: int, chunk: int, host: bool) -> dict[str, int]:
    """Bytes by part of the plan ``(solver, block, chunk)``, each part on the device unless
    ``host`` (the rows and the search space then live in host memory: ``"host_..."``)."""
    e, w = fp.itemsize, fp.width
    rows = fp.n * w * (e + 4) + fp.n * w * 4  # rhs and solutions, and the log's float32 rows
    if solver == "block":
        d = block_directions(block, fp.steps, fp.start, w)
        # V and AV, Vᵀ A V and its eigenvectors, the candidates' normalised, projected and
        # SVD copies (two blocks of them at the second step), the iterate, residual, products
        space = 2 * d * w * e + 4 * d * d * e + 24 * block * w * e + 6 * block * w * 4
    else:
        space = 12 * block * w * e + 6 * block * w * 4  # x, r, z, p, Ap, their gathers
    k = matvec_rows(fp, solver, block)
    per_vector = fp.per_vector if fp.measured else 6 * fp.params * e
    product = int(PRODUCT_MARGIN * (fp.fixed + chunk * per_vector)) + 4 * k * w * e
    where = "host_" if host else ""
    return {
        f"{where}rows": rows,
        f"{where}search_space": space,
        "preconditioner": fp.preconditioner,
        "products": product,
    }


@dataclass
class Plan:
    """A chosen plan: ``solver``, ``block`` (queries solved together), ``chunk`` (vectors per
    curvature product), where the search space lives (``directions``: ``"device"``/``"host"``),
    the bytes it is estimated at on the device (``estimate``) out of ``budget``, by part
    (``parts``), what it changed from what was asked (``changed``) and what it will cost
    (``cost``: passes, products, estimated time)."""

    solver: str
    block: int
    chunk: int
    directions: str
    estimate: int
    budget: int
    parts: dict[str, int]
    footprint: Footprint
    changed: list[str] = field(default_factory=list)
    cost: Any = None  # a `cost.Cost` (passes, products, time), set once the plan is chosen

    def meta(self) -> dict[str, Any]:
        """``result.meta["refine"]["memory"]``."""
        return {
            "budget": self.budget,
            "estimate": self.estimate,
            "parts": dict(self.parts),
            "solver": self.solver,
            "block": self.block,
            "chunk": self.chunk,
            "directions": self.directions,
            "vectors": (
                f"logged space (width {self.footprint.width}); full parameter vectors "
                f"({self.footprint.params}) only inside a product, {self.chunk} at a time"
            ),
            "product_measured": self.footprint.measured,
            "footprint": asdict(self.footprint),
            "changed": list(self.changed),
        }


def _halvings(n: int) -> list[int]:
    out = [n]
    while out[-1] > 1:
        out.append((out[-1] + 1) // 2)
    return out


def choose_plan(fp: Footprint, memory: int, solver: str, block: int, cuda: bool) -> Plan:
    """The first plan whose device bytes fit ``memory``: ``solver`` and ``block`` kept with the
    largest chunk that fits, then (``cuda``) the search space on the host, then smaller blocks,
    then per-query CG; a ``ValueError`` naming the bytes needed when none fits."""
    block = max(1, min(block, fp.n))
    solvers = [solver] if solver == "cg" else [solver, "cg"]
    for s in solvers:
        for b in _halvings(block):
            for host in (False, True) if cuda else (False,):
                for c in range(matvec_rows(fp, s, b), 0, -1):  # the largest chunk that fits
                    parts = footprint(fp, s, b, c, host)
                    need = sum(v for k, v in parts.items() if not k.startswith("host_"))
                    if need <= memory:
                        changed = [
                            f"{what}"
                            for what, moved in (
                                (f"solver {solver!r} -> {s!r}", s != solver),
                                (f"block {block} -> {b}", b != block),
                                ("search space on the host", host),
                            )
                            if moved
                        ]
                        directions = "host" if host else "device"
                        return Plan(s, b, c, directions, need, memory, parts, fp, changed)
    parts = footprint(fp, "cg", 1, 1, cuda)
    need = sum(v for k, v in parts.items() if not k.startswith("host_"))
    product = parts["products"]
    raise ValueError(
        f"refinement needs {size(need)} on the device even with per-query CG, one query and one "
        f"vector per curvature product ({', '.join(f'{k} {size(v)}' for k, v in parts.items())}), "
        f"but memory={size(memory)}. Pass Refinement(memory=...) of at least {need} bytes if "
        f"that much is free, lower batch_size (one training batch's product takes "
        f"{size(product)} of it), log a projected store (a smaller width than "
        f"{fp.width}), or use a device with more memory"
    )


def product_cost(
    curv: StreamedCurvature,
    lift: Callable[[torch.Tensor], torch.Tensor],
    project: Callable[[list[torch.Tensor]], torch.Tensor],
    width: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[int, int, bool]:
    """``(fixed, per_vector, measured)`` bytes of one chunk's product on the first training
    batch: measured at one and two vectors (the difference is a vector's share, the rest the
    batch's own: its data on the device, its graph). ``measured=False`` (zeros) where the
    device's allocations cannot be measured."""
    batch = curv.first_batch()
    gen = torch.Generator().manual_seed(0)
    peaks = []
    for c in (1, 2):
        y = torch.randn(c, width, generator=gen, dtype=dtype).to(device)

        def run(y: torch.Tensor = y) -> None:
            with torch.enable_grad(), twice_differentiable():
                state = curv.prepare(batch)
            curv.batch_product(state, y, lift, project)

        _, peak = measure_peak(run, device)
        if peak is None:
            return 0, 0, False
        peaks.append(peak)
    per_vector = max(peaks[1] - peaks[0], 0)
    return max(peaks[0] - per_vector, 0), per_vector, True


def warn_changed(plan: Plan) -> None:
    """Warn where the plan changed the solve itself (block, solver), not only its batching."""
    changed = [c for c in plan.changed if not c.startswith("search space")]
    if changed:
        warnings.warn(
            f"nnstat: refinement's search space would not fit memory={size(plan.budget)}: "
            f"{', '.join(changed)}{': ' + plan.cost.multiplied if plan.cost else ''} "
            f"(estimated {size(plan.estimate)}; "
            "result.meta['refine']['memory']). Solutions agree once converged; iterates "
            "before differ. Pass a larger memory, lower query_batch, or project the store",
            stacklevel=4,
        )
