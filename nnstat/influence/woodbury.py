"""The low-rank (Woodbury) path of the ``raw`` preconditioner, pure maths on float64.

A module wider than its ``n`` rows ``X`` has ``H = XᵀX / n`` of rank ``n``: its damped inverse is
applied through the ``n × n`` Gram matrix (`gram_eig`, `woodbury_core`, `woodbury_apply`),
exactly the dense inverse with no ``width²`` matrix.
"""

from __future__ import annotations

import torch


def symmetric_eig(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (clamped at 0: curvature estimates are PSD up to round-off) and eigenvectors.

    Example:
        >>> import torch
        >>> symmetric_eig(torch.eye(2) * 3)[0].tolist()
        [3.0, 3.0]
    """
    m = matrix.to(torch.float64)
    evals, evecs = torch.linalg.eigh((m + m.T) / 2)
    return evals.clamp_min(0.0), evecs


def gram_eig(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecomposition of the Gram matrix ``K = X Xᵀ`` of ``rows`` ``X`` ``[n, d]`` (float64).

    ``K`` and ``XᵀX`` share their nonzero eigenvalues, so ``eig(K) / n`` is the nonzero
    spectrum of ``H = XᵀX / n`` at ``O(n² d)`` cost instead of ``O(d³)``.

    Example:
        >>> import torch
        >>> gram_eig(torch.tensor([[3.0, 4.0]]))[0].tolist()
        [25.0]
    """
    return symmetric_eig(rows.to(torch.float64) @ rows.to(torch.float64).T)


def woodbury_core(
    gram_evals: torch.Tensor, gram_evecs: torch.Tensor, n: int, damping: float
) -> torch.Tensor:
    """``C = (nλI + K)⁻¹ / λ`` so that ``(XᵀX/n + λI)⁻¹ = I/λ − Xᵀ C X`` (Woodbury identity).

    Example:
        >>> import torch
        >>> f64 = torch.float64
        >>> woodbury_core(torch.tensor([2.0], dtype=f64), torch.eye(1, dtype=f64), 1, 2.0).item()
        0.125
    """
    if not damping > 0:
        raise ValueError("curvature + damping is singular: use a damping > 0")
    return (gram_evecs / (damping * (n * damping + gram_evals))) @ gram_evecs.T


def woodbury_apply(
    x: torch.Tensor, rows: torch.Tensor, core: torch.Tensor, damping: float
) -> torch.Tensor:
    """``x (XᵀX/n + λI)⁻¹ = x/λ − ((x Xᵀ) C) X`` for ``x`` ``[b, d]`` (float64 inside).

    Example:
        >>> import torch
        >>> f64 = torch.float64
        >>> core = woodbury_core(torch.tensor([1.0], dtype=f64), torch.eye(1, dtype=f64), 1, 1.0)
        >>> woodbury_apply(torch.ones(1, 1), torch.ones(1, 1), core, 1.0).item()
        0.5
    """
    x64, r64 = x.to(torch.float64), rows.to(torch.float64)
    return x64 / damping - ((x64 @ r64.T) @ core) @ r64
