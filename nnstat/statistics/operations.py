"""Statistics as basic operations over the three capture streams.

Each statistic is a small class with a pure ``contribution(cap, stream, prior)`` returning a
running-sum term and the count it adds; :class:`~nnstat.statistics.collector.StatisticsCollector`
keeps the sums, all-reduces them under ``torch.distributed`` and divides once in ``finalize()``.

Conventions (``docs/architecture.md``, curvature of the **mean** training loss, K-FAC expand):
``A = (1/#positions) Σ a aᵀ`` (forward covariance), ``S = (1/N) Σ_i Σ_t b bᵀ`` (backward
covariance), grad covariance ``(1/N) Σ_i g_i g_iᵀ`` and EK-FAC eigenvalues
``Λ = (1/N) Σ_i (Q_Sᵀ G_i Q_A)²``.

Diagonal factors: a factor known to be diagonal is kept as its diagonal, a 1-D tensor under the
same key. An embedding's inputs are one-hot, so its ``A = diag(token counts) / #positions``
(``[vocab]``, not ``vocab²``: 50257 floats for GPT-2's ``wte`` instead of 10 GB). Its
eigenbasis is the identity (no ``"{m}/forward/eigenvectors"`` is stored) and its eigenvalues
are the diagonal in index order; every reader (`factor_eig`, `ekfac_apply`, the influence
preconditioners, PCA projections) accepts either form.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from nnstat.capture.capture import ModuleCapture

STREAMS = ("forward", "backward", "grad")

#: largest flattened per-sample gradient whose full covariance ("raw") may be accumulated
MAX_RAW_DIM = 8192
#: largest dense K-FAC factor (a 16384² float32 matrix is 1 GiB)
MAX_FACTOR_DIM = 16384


def is_diagonal(factor: torch.Tensor) -> bool:
    """True for a factor stored as its diagonal (a 1-D tensor).

    Example:
        >>> import torch
        >>> is_diagonal(torch.ones(3)), is_diagonal(torch.eye(3))
        (True, False)
    """
    return factor.dim() == 1


def diagonal_forward(cap: ModuleCapture) -> bool:
    """True when the module's forward covariance is diagonal by construction (one-hot inputs)."""
    return cap.kind == "embedding"


def factor_eig(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eigenvalues (float64) and eigenvectors of a symmetric factor, dense or diagonal.

    A diagonal factor's eigenvectors are the identity, returned as ``None`` (never a
    ``d × d`` matrix) with the diagonal, in index order, as its eigenvalues.

    Example:
        >>> import torch
        >>> vals, vecs = factor_eig(torch.tensor([2.0, 1.0]))
        >>> vals.tolist(), vecs
        ([2.0, 1.0], None)
    """
    if is_diagonal(factor):
        return factor.to(torch.float64), None
    return torch.linalg.eigh(factor.to(torch.float64))


def _check_factor(cap: ModuleCapture, stream: str, d: int) -> None:
    if d > MAX_FACTOR_DIM:
        raise ValueError(
            f"{cap.name} ({type(cap.module).__name__}): the {stream} covariance would be "
            f"{d}x{d} (limit {MAX_FACTOR_DIM}); leave this module out with watch(name_filter=...)"
        )


class Statistic:
    """Base class: a running sum and a count per (module, stream), divided once at the end."""

    name: ClassVar[str] = ""
    streams: ClassVar[tuple[str, ...]] = STREAMS

    @classmethod
    def key(cls, module: str, stream: str) -> str:
        """State key ``"{module}/{stream}/{statistic}"``."""
        return f"{module}/{stream}/{cls.name}"

    @classmethod
    def contribution(
        cls, cap: ModuleCapture, stream: str, prior: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, float]:
        raise NotImplementedError


class Mean(Statistic):
    """Mean of a stream: forward per position, backward and grad per sample.

    Example:
        >>> from nnstat.statistics import Mean
        >>> Mean.key("fc1", "grad")
        'fc1/grad/mean'
    """

    name = "mean"

    @classmethod
    def contribution(cls, cap, stream, prior):
        if stream == "forward":
            return cap.forward_sum(), cap.num_positions
        if stream == "backward":
            return cap.backward_sum(), cap.num_samples
        return cap.per_sample_grad().sum(0), cap.num_samples


class Covariance(Statistic):
    """Uncentered covariance of a stream (``grad``: the "raw" per-sample gradient covariance).

    Example:
        >>> from nnstat.statistics import Covariance
        >>> Covariance.key("fc1", "forward")
        'fc1/forward/covariance'
    """

    name = "covariance"

    @classmethod
    def contribution(cls, cap, stream, prior):
        if stream == "forward" and diagonal_forward(cap):
            # one-hot rows: Σ a aᵀ = diag(Σ a), the token counts (padding_idx rows excluded)
            return cap.forward_sum(), cap.num_positions
        if stream == "forward":
            _check_factor(cap, stream, cap.d_in)
            return cap.forward_gram(), cap.num_positions
        if stream == "backward":
            _check_factor(cap, stream, cap.d_out)
            return cap.backward_gram(), cap.num_samples
        g = cap.per_sample_grad().reshape(cap.num_samples, -1)
        if g.shape[1] > MAX_RAW_DIM:
            raise ValueError(
                f"{cap.name}: the raw gradient covariance would be {g.shape[1]}x{g.shape[1]} "
                f"(limit {MAX_RAW_DIM}); use the 'kfac' or 'ekfac' statistic for this layer"
            )
        return g.T @ g, cap.num_samples


class KFAC(Statistic):
    """K-FAC: forward covariance ⊗ backward covariance (``A ⊗ S ≈ (1/N) Σ g gᵀ``).

    In a configuration, ``KFAC`` on the ``grad`` stream stands for ``Covariance`` on the forward
    and backward streams; its results are ``"{m}/forward/covariance"`` and
    ``"{m}/backward/covariance"``.

    Example:
        >>> import torch
        >>> from nnstat.statistics import KFAC
        >>> A, S = torch.eye(3), 2 * torch.eye(2)
        >>> KFAC.precondition(torch.ones(1, 2, 3), A, S, damping=0.0)[0, 0, 0].item()
        0.5
    """

    name = "kfac"
    streams = ("grad",)

    @staticmethod
    def precondition(
        g: torch.Tensor, a: torch.Tensor, s: torch.Tensor, damping: float = 0.0
    ) -> torch.Tensor:
        """``(A ⊗ S + damping)⁻¹ vec(G)`` for ``G`` of shape ``[..., d_out, d_in]``.

        ``a`` or ``s`` may be diagonal factors (1-D). Never modifies ``a`` or ``s``.
        """
        ea, qa = factor_eig(a)
        es, qs = factor_eig(s)
        lam = es.clamp(min=0)[:, None] * ea.clamp(min=0)[None, :]
        return ekfac_apply(g, qa, qs, lam, damping)


class EKFAC(Statistic):
    """EK-FAC eigenvalues corrected with per-sample gradients (George et al., 2018).

    Needs the K-FAC eigenbases ``Q_A``, ``Q_S`` from a previous pass; accumulates
    ``Σ_i (Q_Sᵀ G_i Q_A)²`` and divides by N exactly once. Result key ``"{m}/ekfac/eigenvalues"``.

    Example:
        >>> import torch
        >>> from nnstat.statistics import EKFAC
        >>> q = torch.eye(2)
        >>> EKFAC.precondition(torch.ones(1, 2, 2), q, q, torch.full((2, 2), 3.0), 1.0)[0, 0, 0]
        tensor(0.2500)
    """

    name = "eigenvalues"
    streams = ("grad",)

    @classmethod
    def key(cls, module: str, stream: str = "grad") -> str:
        return f"{module}/ekfac/eigenvalues"

    @classmethod
    def contribution(cls, cap, stream, prior):
        qa, qs = _eigenbasis(prior, cap, "forward"), _eigenbasis(prior, cap, "backward")
        if qs is None:
            raise RuntimeError(f"{cap.name}: a diagonal backward factor is not supported")
        if qa is None and cap.kind == "embedding":
            return _embedding_sq_rotated(cap, qs.to(torch.float32)), cap.num_samples
        qa = torch.eye(cap.d_in) if qa is None else qa
        rotated = cap.project(qa.T.to(torch.float32), qs.T.to(torch.float32))
        return rotated.pow(2).sum(0).reshape(cap.d_out, cap.d_in), cap.num_samples

    @staticmethod
    def precondition(
        g: torch.Tensor,
        qa: torch.Tensor,
        qs: torch.Tensor,
        eigenvalues: torch.Tensor,
        damping: float = 0.0,
    ) -> torch.Tensor:
        """``Q (Λ + damping)⁻¹ Qᵀ vec(G)`` for ``G`` ``[..., d_out, d_in]``; inputs untouched."""
        return ekfac_apply(g, qa, qs, eigenvalues, damping)


def _eigenbasis(prior: dict[str, torch.Tensor], cap: ModuleCapture, stream: str):
    """``Q`` of a factor from the previous pass; ``None`` when the factor is diagonal."""
    q = prior.get(f"{cap.name}/{stream}/eigenvectors")
    if q is not None:
        return q
    cov = prior.get(f"{cap.name}/{stream}/covariance")
    if cov is not None and is_diagonal(cov):
        return None
    raise RuntimeError(
        f"{cap.name}: EKFAC needs the K-FAC eigenbases of a previous pass "
        "(run the 'factors' pass and finalize() first)"
    )


def _embedding_sq_rotated(cap: ModuleCapture, qs: torch.Tensor) -> torch.Tensor:
    """``Σ_i (Q_Sᵀ G_i)²`` ``[d_out, vocab]`` of an embedding without its ``[N, d_out, vocab]``
    per-sample gradients: column ``v`` of ``G_i`` is the sum of ``b`` over the positions of
    sample ``i`` holding token ``v``, so only (sample, token) pairs that occur are formed."""
    idx, b = cap.indices, cap.backward
    valid = idx >= 0
    rows = torch.arange(idx.shape[0], device=idx.device).unsqueeze(1).expand_as(idx)
    pair = (rows * cap.d_in + idx)[valid]
    uniq, inverse = torch.unique(pair, return_inverse=True)
    col = b.new_zeros(len(uniq), cap.d_out).index_add_(0, inverse, b[valid])
    sq = (col @ qs).pow(2)  # row k = (Q_Sᵀ g_k)² of one (sample, token) column
    out = b.new_zeros(cap.d_in, cap.d_out).index_add_(0, uniq % cap.d_in, sq)
    return out.T


def ekfac_apply(
    g: torch.Tensor,
    qa: torch.Tensor | None,
    qs: torch.Tensor | None,
    lam: torch.Tensor,
    damping: float,
) -> torch.Tensor:
    """Precondition ``G`` in the eigenbasis: ``Q_S [(Q_Sᵀ G Q_A) / (Λ + damping)] Q_Aᵀ``.

    ``None`` stands for an identity eigenbasis (a diagonal factor)."""
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    dt = g.dtype
    # a new tensor: the stored eigenvalues are never damped in place
    denom = lam.to(torch.float64) + damping
    if bool((denom <= 0).any()):
        raise ValueError("eigenvalues + damping must be > 0; increase damping")
    rot = rotate(g.to(torch.float64), qs, qa, transpose=True)
    return rotate(rot / denom, qs, qa).to(dt)


def rotate(
    g: torch.Tensor, q_out: torch.Tensor | None, q_in: torch.Tensor | None, transpose: bool = False
) -> torch.Tensor:
    """``Q_out G Q_inᵀ`` (or ``Q_outᵀ G Q_in`` with ``transpose``), ``None`` = identity; the
    bases are cast to ``g``'s dtype.

    Example:
        >>> import torch
        >>> rotate(torch.ones(1, 2, 2), None, 2 * torch.eye(2))[0, 0].tolist()
        [2.0, 2.0]
    """
    if q_out is not None:
        q_out = q_out.to(g.dtype)
        g = (q_out.T if transpose else q_out) @ g
    if q_in is not None:
        q_in = q_in.to(g.dtype)
        g = g @ (q_in if transpose else q_in.T)
    return g


STATISTICS: dict[str, type[Statistic]] = {c.__name__: c for c in (Mean, Covariance, KFAC, EKFAC)}
