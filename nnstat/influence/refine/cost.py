"""What a refinement will cost, stated before it runs: passes over the training data,
curvature-vector products, and an estimated time from a product timed on the first batch.

A pass is one product of the solver's ``A + λI`` with a block's vectors, streamed over every
training batch. The solve spends ``steps`` passes per block of queries (fewer once every query
of the block has converged), per-query CG one more to find the default damping, a refit
Fisher two. A product on one batch is timed at one and two vectors (`product_time`): a fixed
part (the batch's forward and backward) and a share per vector; a chunked product repeats the
fixed part once per chunk. The estimate is ``passes x batches x (chunks x fixed + vectors x
per_vector)``: the first batch stands for the others.

Example:
    >>> cost = Cost(passes=10, products=80, batches=4, fixed_s=0.02, per_vector_s=0.005,
    ...             seconds=1.2, multiplied="")
    >>> print(cost.describe())
    10 passes over 4 training batches, 80 curvature-vector products; a first-batch product took 20 ms + 5 ms per vector: about 1.2 s in all (an estimate)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from nnstat.curvature.products import twice_differentiable
from nnstat.curvature.streamed import StreamedCurvature

from .plan import Plan, matvec_rows


def duration(seconds: float) -> str:
    """``seconds`` for a message.

    Example:
        >>> duration(0.0123), duration(75), duration(7300)
        ('12 ms', '1.2 min', '2.0 h')
    """
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def product_time(
    curv: StreamedCurvature,
    lift: Callable[[torch.Tensor], torch.Tensor],
    project: Callable[[list[torch.Tensor]], torch.Tensor],
    width: int,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[float, float]:
    """``(fixed, per_vector)`` seconds of one chunk's product on the first training batch, timed
    at one vector (the faster of two: a busy machine's pauses excluded) and at two. Run after
    `plan.product_cost`'s products on the same batch, so no one-off set-up is timed."""
    batch = curv.first_batch()
    gen = torch.Generator().manual_seed(0)
    times: dict[int, float] = {1: math.inf, 2: math.inf}
    for c in (1, 2, 1):
        y = torch.randn(c, width, generator=gen, dtype=dtype).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.enable_grad(), twice_differentiable():
            state = curv.prepare(batch)
        curv.batch_product(state, y, lift, project)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times[c] = min(times[c], time.perf_counter() - start)
        del state
    per_vector = max(times[2] - times[1], 0.0)
    return max(times[1] - per_vector, 0.0), per_vector


@dataclass
class Cost:
    """A refinement's cost: ``passes`` over ``batches`` training batches (``None``: data of
    unknown length), ``products`` single-vector curvature products, the first batch's product
    time (``fixed_s`` + ``per_vector_s`` x vectors), the estimate ``seconds`` (``None`` where
    the batches are unknown) and ``multiplied``: what the memory budget multiplied (``""``)."""

    passes: int
    products: int
    batches: int | None
    fixed_s: float
    per_vector_s: float
    seconds: float | None
    multiplied: str

    def describe(self) -> str:
        """The cost in a sentence (what refinement prints before it runs)."""
        over = f"{self.batches} training batches" if self.batches else "the training data"
        text = (
            f"{self.passes} passes over {over}, {self.products} curvature-vector products; "
            f"a first-batch product took {duration(self.fixed_s)} + "
            f"{duration(self.per_vector_s)} per vector"
        )
        if self.seconds is not None:
            text += f": about {duration(self.seconds)} in all (an estimate)"
        return text + (f". {self.multiplied}" if self.multiplied else "")

    def meta(self) -> dict[str, Any]:
        """``result.meta["refine"]["cost"]``."""
        return asdict(self)


def _block_passes(n: int, block: int, steps: int) -> int:
    return -(-n // block) * steps


def estimate_cost(
    plan: Plan,
    asked_block: int,
    batches: int | None,
    times: tuple[float, float],
    refit: bool,
) -> Cost:
    """The `Cost` of ``plan`` (``asked_block``: the queries per block asked for; ``times``:
    `product_time`; ``refit``: two passes for the Fisher's statistics)."""
    fp = plan.footprint
    n, steps, block = fp.n, fp.steps, plan.block
    fixed, per_vector = times
    passes = seconds_per_batch = 0.0
    products = 0
    for lo in range(0, n, block):
        b = min(block, n - lo)
        for step in range(steps):
            k = b
            if plan.solver == "block" and step == 1 and fp.start:
                k = 2 * b  # the second step adds the preconditioned rows beside the residuals
            if lo == 0 and step == 0 and plan.solver == "block":
                k += fp.probes  # the default damping's probes ride along the first product
            products += k
            passes += 1
            seconds_per_batch += -(-k // plan.chunk) * fixed + k * per_vector
    if plan.solver == "cg" and fp.probes:  # per-query CG's pass to find the default damping
        products += fp.probes
        passes += 1
        seconds_per_batch += -(-fp.probes // plan.chunk) * fixed + fp.probes * per_vector
    if refit:
        passes += 2
        seconds_per_batch += 2 * fixed
    multiplied = []
    asked = min(asked_block, n)
    if block < asked:
        factor = _block_passes(n, block, steps) / _block_passes(n, asked, steps)
        multiplied.append(
            f"memory={plan.budget / 2**30:.2f} GiB holds blocks of {block} queries, not "
            f"{asked}: {factor:.1f} x the passes"
        )
    k = matvec_rows(fp, plan.solver, block)
    if plan.chunk < k:
        multiplied.append(
            f"products in chunks of {plan.chunk} vectors, not {k}: each batch's fixed work "
            f"{-(-k // plan.chunk)} x per pass"
        )
    seconds = seconds_per_batch * batches if batches else None
    return Cost(int(passes), products, batches, fixed, per_vector, seconds, "; ".join(multiplied))
