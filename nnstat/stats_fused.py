"""One blocked pass for the Tracker's default statistics of weights and their update.

For each parameter the pass reads ``W_t`` and the snapshot ``W_{t-1}`` block by block, and while
a block is in cache it computes ``sum(x^2)``, ``min`` and ``max`` of the block and of the
difference, and (optionally) writes ``W_t`` into a second snapshot buffer. Weights and updates
then cost three memory passes in total instead of about eight with separate reductions, a
subtraction and a copy.

Example:
    >>> import torch
    >>> w, prev = [torch.tensor([3.0, -4.0])], [torch.tensor([3.0, -5.0])]
    >>> out = [torch.empty(2)]
    >>> weight_update_norms(w, prev, out).tolist()
    [[25.0, -4.0, 3.0, 1.0, 0.0, 1.0]]
    >>> out[0].tolist()
    [3.0, -4.0]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nnstat.stats import Workspace

__all__ = ["weight_update_norms", "FUSED_STATS", "light_columns"]

#: Statistics the fused pass can produce.
FUSED_STATS = frozenset({"numel", "l2", "rms", "abs_max", "nonfinite"})
#: Block length: a block, its difference and the output stay in L2 cache.
BLOCK = 1 << 16


def weight_update_norms(
    current: Sequence[torch.Tensor],
    previous: Sequence[torch.Tensor],
    out: Sequence[torch.Tensor] | None = None,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """Per tensor ``[sumsq(W), min(W), max(W), sumsq(W-P), min(W-P), max(W-P)]`` (CPU float64).

    `previous` is left untouched; when `out` is given, ``current`` is copied into it on the way.
    Non-finite values propagate into the sums, so callers can detect them and recompute.
    """
    if len(current) != len(previous) or (out is not None and len(out) != len(current)):
        raise ValueError("current, previous and out must have the same number of tensors")
    ws = workspace or Workspace()
    rows = []
    for i, (w, p) in enumerate(zip(current, previous, strict=True)):
        if w.shape != p.shape:
            raise ValueError(f"tensor {i}: shapes {tuple(w.shape)} and {tuple(p.shape)} differ")
        w, p = w.detach().reshape(-1), p.reshape(-1)
        n = w.numel()
        if n == 0:
            rows.append(torch.zeros(6, dtype=torch.float64, device=w.device))
            continue
        o = out[i].reshape(-1) if out is not None else None
        block = BLOCK if w.device.type == "cpu" else n
        d_buf, _ = ws.get(min(block, n), w.dtype, w.device)
        parts = []
        for start in range(0, n, block):
            wb, pb = w[start : start + block], p[start : start + block]
            d = d_buf[: wb.numel()]
            torch.sub(wb, pb, out=d)
            # amin + amax are faster than the fused aminmax kernel on CPU
            parts.append(
                torch.stack(
                    [torch.dot(wb, wb), wb.amin(), wb.amax(), torch.dot(d, d), d.amin(), d.amax()]
                )
            )
            if o is not None:
                o[start : start + block].copy_(wb)
        r = torch.stack(parts).to(torch.float64)
        rows.append(
            torch.stack(
                [
                    r[:, 0].sum(),
                    r[:, 1].min(),
                    r[:, 2].max(),
                    r[:, 3].sum(),
                    r[:, 4].min(),
                    r[:, 5].max(),
                ]
            )
        )
    dev = rows[0].device if rows else torch.device("cpu")
    if not rows:
        return torch.zeros((0, 6), dtype=torch.float64)
    return torch.stack([r.to(dev) for r in rows]).cpu()


def light_columns(
    numel: torch.Tensor, sumsq: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The `FUSED_STATS` columns from element counts, sums of squares, minima and maxima.

    Example:
        >>> c = light_columns(*[torch.tensor([v], dtype=torch.float64) for v in (4, 16, -3, 1)])
        >>> [c[k].item() for k in ("l2", "rms", "abs_max")]
        [4.0, 2.0, 3.0]
    """
    l2 = sumsq.sqrt()
    return {
        "numel": numel,
        "l2": l2,
        "rms": l2 / numel.sqrt(),
        "abs_max": torch.maximum(hi, -lo),
        "nonfinite": torch.zeros_like(l2),
    }


def sumsq_min_max(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per tensor ``[sum(x^2), min(x), max(x)]`` (float64, on the tensors' device), blocked.

    Each block is reduced three times while it is in cache (dot product, min, max), so the
    tensor is read from memory once. Empty tensors give ``[0, nan, nan]``.

    Example:
        >>> sumsq_min_max([torch.tensor([3.0, -4.0])]).tolist()
        [[25.0, -4.0, 3.0]]
    """
    rows = []
    for t in tensors:
        x = t.detach().reshape(-1)
        n = x.numel()
        if n == 0:
            rows.append(torch.tensor([0.0, float("nan"), float("nan")], device=x.device))
            continue
        block = BLOCK if x.device.type == "cpu" else n
        parts = []
        for start in range(0, n, block):
            b = x[start : start + block]
            parts.append(torch.stack([torch.dot(b, b), b.amin(), b.amax()]))
        r = torch.stack(parts).to(torch.float64)
        rows.append(torch.stack([r[:, 0].sum(), r[:, 1].min(), r[:, 2].max()]))
    dev = rows[0].device if rows else torch.device("cpu")
    return torch.stack([r.to(device=dev, dtype=torch.float64) for r in rows])
