"""Rows formed from their per-sample factors after the batch: ``row_i = vec(b_i ⊗ a_i)``.

A one-position Linear's projected row is the outer product of two short vectors (``P_out g_i``
and ``P_in [x_i, 1]``). Writing those products is the memory-bound part of logging (a 64x64
block per sample and module, 6.6 MB per batch of 128 on a 10M-parameter MLP), and reading them
back for the NaN/Inf check is as much again. The Run hands the factors to the store instead:

* the NaN/Inf check is a certificate on the factors (:func:`certified`): every entry of
  ``b ⊗ a`` is finite when the product of the two factors' norms is well within float32 range,
  so the training thread decides the policy from the factors, before the rows exist;
* the writer thread forms the rows (:func:`fill`) in the row buffer right before writing them,
  on its own core when torch leaves one idle.

The rows are bit-identical to :meth:`~nnstat.capture.ModuleCapture.project` (one float32
multiply per entry either way).

Example:
    >>> b, a = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, 4.0, 5.0]])
    >>> rows = torch.empty(1, 6)
    >>> factors = [OuterFactors(slice(0, 6), b, a)]
    >>> certified(factors)
    True
    >>> fill(rows, factors).tolist()
    [[3.0, 4.0, 5.0, 6.0, 8.0, 10.0]]
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


@dataclass(frozen=True)
class OuterFactors:
    """One module's rows still to be formed: ``rows[:, cols][i] = vec(outer(b[i], a[i]))``.

    Attributes:
        cols: the module's columns in the row buffer.
        b: ``[N, r_out]`` float32 projected output gradients.
        a: ``[N, r_in]`` float32 projected inputs.
    """

    cols: slice
    b: torch.Tensor
    a: torch.Tensor


def certified(factors: list[OuterFactors], limit: float = math.inf) -> bool:
    """True when every entry of every row the factors make is finite (one host sync), and
    below ``limit`` in magnitude (a 16-bit store's overflow threshold) when one is given.

    Each entry of a module's rows is ``b_k a_l`` with ``|b_k a_l| <= ||b||_F ||a||_F`` (the
    Frobenius norms of the module's whole factor blocks), and a float32 product whose exact
    value is at most the largest float32 rounds to a finite number: norm products within half
    of that range (slack for the norms' own rounding) prove the block finite. One multi-tensor
    norm call for all modules, much cheaper than per-tensor max-abs reductions. ``False`` means "check the rows" (NaN/Inf in a factor, or
    norms too large to decide), not that a row is bad.
    """
    if not factors:
        return True
    norms = torch.stack(
        torch._foreach_norm([t.detach() for f in factors for t in (f.b, f.a)], 2)
    ).tolist()
    bound = min(limit, _FLOAT32_MAX) / 2
    # NaN compares False
    return all(nb * na <= bound for nb, na in zip(norms[0::2], norms[1::2], strict=True))


def fill(rows: torch.Tensor, factors: list[OuterFactors]) -> torch.Tensor:
    """Write each module's outer products into its columns of ``rows`` (float32 ``[N, W]``).

    One torch multiply per module, on the calling thread's torch threads (the writer thread has
    one: :func:`nnstat.background.start_one_thread_worker`). Each product is rounded once, as in
    :meth:`~nnstat.capture.ModuleCapture.project`: same bits.
    """
    for f in factors:
        n, r_out, r_in = f.b.shape[0], f.b.shape[1], f.a.shape[1]
        out = rows[:, f.cols].view(n, r_out, r_in)
        torch.mul(f.b.detach().view(n, r_out, 1), f.a.detach().view(n, 1, r_in), out=out)
    return rows


def idle_core() -> bool:
    """True when torch's threads leave a core of this machine free (for the writer thread).

    Processes of one node under ``torchrun`` (``LOCAL_WORLD_SIZE``) share its cores.
    """
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return torch.get_num_threads() * local < cores
