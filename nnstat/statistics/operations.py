"""Statistics as basic operations over the three capture streams.

Each statistic is a small class with a pure ``contribution(cap, stream, prior)`` returning a
running-sum term and the count it adds; :class:`~nnstat.statistics.collector.StatisticsCollector`
keeps the sums, all-reduces them under ``torch.distributed`` and divides once in ``finalize()``.

Conventions (``docs/architecture.md``, curvature of the **mean** training loss, K-FAC expand):
``A = (1/#positions) Σ a aᵀ`` (forward covariance), ``S = (1/N) Σ_i Σ_t b bᵀ`` (backward
covariance), grad covariance ``(1/N) Σ_i g_i g_iᵀ`` and EK-FAC eigenvalues
``Λ = (1/N) Σ_i (Q_Sᵀ G_i Q_A)²``.
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

        Never modifies ``a`` or ``s``.
        """
        ea, qa = torch.linalg.eigh(a.double())
        es, qs = torch.linalg.eigh(s.double())
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
        qa = prior.get(f"{cap.name}/forward/eigenvectors")
        qs = prior.get(f"{cap.name}/backward/eigenvectors")
        if qa is None or qs is None:
            raise RuntimeError(
                f"{cap.name}: EKFAC needs the K-FAC eigenbases of a previous pass "
                "(run the 'factors' pass and finalize() first)"
            )
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


def ekfac_apply(
    g: torch.Tensor, qa: torch.Tensor, qs: torch.Tensor, lam: torch.Tensor, damping: float
) -> torch.Tensor:
    """Precondition ``G`` in the eigenbasis: ``Q_S [(Q_Sᵀ G Q_A) / (Λ + damping)] Q_Aᵀ``."""
    if damping < 0:
        raise ValueError(f"damping must be >= 0, got {damping}")
    dt = g.dtype
    qa, qs = qa.to(torch.float64), qs.to(torch.float64)
    # a new tensor: the stored eigenvalues are never damped in place
    denom = lam.to(torch.float64) + damping
    if bool((denom <= 0).any()):
        raise ValueError("eigenvalues + damping must be > 0; increase damping")
    rot = qs.T @ g.to(torch.float64) @ qa
    return (qs @ (rot / denom) @ qa.T).to(dt)


STATISTICS: dict[str, type[Statistic]] = {c.__name__: c for c in (Mean, Covariance, KFAC, EKFAC)}
