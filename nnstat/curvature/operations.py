"""Statistics as basic operations over the three capture streams.

Each statistic is a small class with a pure ``contribution(cap, stream, prior)`` returning a
running-sum term and the count it adds; :class:`~nnstat.curvature.collector.StatisticsCollector`
keeps the sums, all-reduces them under ``torch.distributed`` and divides once in ``finalize()``.

Conventions (``docs/architecture.md``, curvature of the **mean** training loss, K-FAC expand):
``A = (1/#positions) Σ a aᵀ`` (forward covariance), ``S = (1/N) Σ_i Σ_t b bᵀ`` (backward
covariance), grad covariance ``(1/N) Σ_i g_i g_iᵀ`` and EK-FAC eigenvalues
``Λ = (1/N) Σ_i (Q_Sᵀ G_i Q_A)²``.

Factor forms (:class:`FactorForm`): a K-FAC factor is kept ``dense`` (``d × d``), ``diagonal``
or ``projected``. A diagonal factor is a 1-D tensor under the same key. An embedding's inputs
are one-hot, so its ``A = diag(token counts) / #positions`` exactly (``[vocab]``, not
``vocab²``: 50257 floats for GPT-2's ``wte`` instead of 10 GB). A factor over the size limit
(``max_factor_dim``, default :data:`MAX_FACTOR_DIM`; GPT-2's ``lm_head`` backward factor is
50257²) is kept as its diagonal too, an approximation (the per-dimension second moments), with
one warning, unless the gradient store projects that side: then the factor of the projected
stream, ``P C Pᵀ`` (``[r, r]``, exact for the logged rows), is kept under
``"{m}/{side}/projected_covariance"`` with ``P`` as ``"{m}/{side}/projection"``. A diagonal
factor's eigenbasis is the identity (no ``"{m}/{side}/eigenvectors"`` is stored) and its
eigenvalues are the diagonal in index order; every reader (`factor_eig`, `ekfac_apply`, the
influence preconditioners, PCA projections) accepts each form.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from nnstat.capture.capture import ModuleCapture

STREAMS = ("forward", "backward", "grad")

#: largest flattened per-sample gradient whose full covariance ("raw") may be accumulated
MAX_RAW_DIM = 8192
#: largest dense K-FAC factor (a 16384² float32 matrix is 1 GiB); ``setup({"max_factor_dim": d})``
MAX_FACTOR_DIM = 16384
FACTOR_FORMS = ("dense", "diagonal", "projected")
#: float32 elements of one chunk of rotated per-sample gradients in the EK-FAC pass
EKFAC_CHUNK = 1 << 24


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
    return cap.kind.tokens


def factor_eig(factor: torch.Tensor, psd: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Eigenvalues (float64) and eigenvectors of a symmetric factor, dense or diagonal.

    A diagonal factor's eigenvectors are the identity, returned as ``None`` (never a
    ``d × d`` matrix) with the diagonal, in index order, as its eigenvalues. ``psd``: the
    factor is a curvature estimate, positive semi-definite up to round-off: a dense one is
    symmetrised first and the eigenvalues are clamped at 0 (the preconditioners' use).

    Args:
        factor: ``[d, d]`` or its diagonal ``[d]``.
        psd: symmetrise and clamp as above.

    Returns:
        ``(eigenvalues [d] float64, eigenvectors [d, d] or None)``.

    Example:
        >>> import torch
        >>> vals, vecs = factor_eig(torch.tensor([2.0, 1.0]))
        >>> vals.tolist(), vecs
        ([2.0, 1.0], None)
        >>> factor_eig(torch.tensor([2.0, -1e-9]), psd=True)
        (tensor([2., 0.], dtype=torch.float64), None)
    """
    m = factor.to(torch.float64)
    if is_diagonal(factor):
        return (m.clamp_min(0.0) if psd else m), None
    if not psd:
        return torch.linalg.eigh(m)
    evals, evecs = torch.linalg.eigh((m + m.T) / 2)
    return evals.clamp_min(0.0), evecs


@dataclass(frozen=True, eq=False)  # holds a tensor: compared by .form, never ==
class FactorForm:
    """How one K-FAC factor (a module's ``forward`` or ``backward`` covariance) is kept.

    * ``dense``: the ``size × size`` covariance under ``"{m}/{side}/covariance"``.
    * ``diagonal``: its diagonal ``[size]`` under the same key. Exact for one-hot inputs (an
      embedding's forward factor); for a factor over ``max_factor_dim`` whose side is not
      projected it is an approximation (the per-dimension second moments).
    * ``projected``: ``P C Pᵀ`` ``[rank, rank]`` under ``"{m}/{side}/projected_covariance"``,
      for a factor over ``max_factor_dim`` whose side the gradient store projects with ``P``
      (``[rank, size]``, saved as ``"{m}/{side}/projection"``): exact for the logged rows.

    Example:
        >>> FactorForm("diagonal", 50257, "over max_factor_dim").key("lm_head", "backward")
        'lm_head/backward/covariance'
    """

    form: str
    size: int
    reason: str = ""
    projection: torch.Tensor | None = None

    @property
    def rank(self) -> int | None:
        return None if self.projection is None else int(self.projection.shape[0])

    def key(self, module: str, side: str) -> str:
        stat = "projected_covariance" if self.form == "projected" else "covariance"
        return f"{module}/{side}/{stat}"

    def shape(self) -> tuple[int, ...]:
        """Shape of the stored tensor."""
        if self.form == "projected":
            return (int(self.rank), int(self.rank))  # type: ignore[arg-type]
        return (self.size,) if self.form == "diagonal" else (self.size, self.size)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"form": self.form, "size": self.size}
        if self.reason:
            out["reason"] = self.reason
        if self.form == "projected":
            out["rank"] = self.rank
        return out


def factor_form(
    cap: ModuleCapture,
    stream: str,
    limit: int | None = None,
    projection: torch.Tensor | None = None,
) -> FactorForm:
    """The form of ``cap``'s ``stream`` factor: diagonal for one-hot inputs, dense up to
    ``limit`` (default :data:`MAX_FACTOR_DIM`), above it projected with ``projection`` (that
    side's ``[r, d]`` store projection) when given, else diagonal."""
    d = int(cap.d_in if stream == "forward" else cap.d_out)
    limit = MAX_FACTOR_DIM if limit is None else int(limit)
    if stream == "forward" and diagonal_forward(cap):
        return FactorForm("diagonal", d, "one-hot inputs")
    if d <= limit:
        return FactorForm("dense", d)
    if projection is not None:
        return FactorForm("projected", d, "over max_factor_dim", projection.detach())
    return FactorForm("diagonal", d, "over max_factor_dim")


def diagonal_fallback_message(cap: ModuleCapture, stream: str, d: int, limit: int) -> str:
    """The one warning of a factor kept as its diagonal because it is over the limit."""
    mib = 4 * d * d / 2**20
    size = f"{mib / 1024:.1f} GiB" if mib >= 1024 else f"{mib:.1f} MiB"
    return (
        f"nnstat: {cap.name} ({type(cap.module).__name__}): its {stream} K-FAC factor would be "
        f"{d}x{d} ({size} in float32), over max_factor_dim={limit}; it is kept as its diagonal "
        f"instead ({d} per-dimension second moments, an identity eigenbasis). To keep it exact, "
        "project that side in the gradient store (add_projection(rank=...) or "
        "setup({'rank': ...}): the factor is then kept in the logged space), or raise the limit "
        f"with setup({{'max_factor_dim': {d}}}); or leave the module out with "
        "watch(name_filter=...)"
    )


def check_factor_forms(
    factors: Mapping[str, Mapping[str, Any]],
    shape_of: Callable[[str], tuple[int, ...] | None],
    keys: list[str],
    where: str,
) -> None:
    """Refuse statistics whose tensors disagree with the factor forms recorded beside them.

    ``factors``: ``statistics.json``'s ``{"{m}/{side}": FactorForm.to_json()}``; ``shape_of``
    gives a stored tensor's shape (``None``: absent); ``keys``: every stored key.

    Example:
        >>> shapes = {"fc/backward/covariance": (5, 5)}
        >>> check_factor_forms({"fc/backward": {"form": "diagonal", "size": 5}}, shapes.get,
        ...                    list(shapes), "stats")
        Traceback (most recent call last):
        ...
        ValueError: stats: statistics.json records the backward factor of 'fc' as diagonal, shape (5,), but statistics.safetensors holds 'fc/backward/covariance' with shape (5, 5): the two files were not written together; log the statistics again
    """
    for side_key, info in factors.items():
        module, side = side_key.rsplit("/", 1)
        form = info.get("form")
        if form not in FACTOR_FORMS:
            raise ValueError(f"{where}: unknown factor form {form!r} for {side_key!r}")
        size = int(info["size"])
        if form == "projected":
            key, want = f"{side_key}/projected_covariance", (int(info["rank"]),) * 2
        else:
            key = f"{side_key}/covariance"
            want = (size,) if form == "diagonal" else (size, size)
        got = shape_of(key)
        got = None if got is None else tuple(int(x) for x in got)
        if got != want:
            held = "no such tensor" if got is None else f"{key!r} with shape {got}"
            raise ValueError(
                f"{where}: statistics.json records the {side} factor of {module!r} as {form}, "
                f"shape {want}, but statistics.safetensors holds {held}: the two files were "
                "not written together; log the statistics again"
            )
    for key in keys:
        side_key, stat = key.rsplit("/", 1)
        if side_key.rsplit("/", 1)[-1] not in ("forward", "backward"):
            continue
        if stat in ("covariance", "projected_covariance") and side_key not in factors:
            raise ValueError(
                f"{where}: statistics.safetensors holds {key!r}, which statistics.json does not "
                "record (its form, dense, diagonal or projected, is unknown): the two files were "
                "not written together; log the statistics again"
            )


def factor_contribution(
    cap: ModuleCapture, stream: str, form: FactorForm
) -> tuple[torch.Tensor, float]:
    """One batch's sum for a ``forward``/``backward`` factor of ``form`` and its count."""
    # position_count: the masked count stays on the device (the collector reads it at the end)
    count = cap.position_count if stream == "forward" else cap.num_samples
    if form.form == "dense":
        return (cap.forward_gram() if stream == "forward" else cap.backward_gram()), count
    if form.form == "diagonal":
        if stream == "forward" and diagonal_forward(cap):
            # one-hot rows: Σ a aᵀ = diag(Σ a), the token counts (padding_idx rows excluded)
            return cap.forward_sum(), count
        return (cap.forward_sq_sum() if stream == "forward" else cap.backward_sq_sum()), count
    p = form.projection
    assert p is not None
    return (cap.forward_gram(p) if stream == "forward" else cap.backward_gram(p)), count


class Statistic:
    """Base class: a running sum and a count per (module, stream), divided once at the end.

    Example:
        >>> [(c.__name__, c.key("fc", "forward")) for c in (Mean, Covariance)]
        [('Mean', 'fc/forward/mean'), ('Covariance', 'fc/forward/covariance')]
    """

    name: ClassVar[str] = ""
    streams: ClassVar[tuple[str, ...]] = STREAMS

    @classmethod
    def key(cls, module: str, stream: str) -> str:
        """State key ``"{module}/{stream}/{statistic}"``.

        Args:
            module: the module's name.
            stream: ``"forward"``, ``"backward"`` or ``"grad"``.

        Returns:
            The key of this statistic in a collector's :meth:`state_dict`.
        """
        return f"{module}/{stream}/{cls.name}"

    @classmethod
    def contribution(
        cls, cap: ModuleCapture, stream: str, prior: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, float]:
        raise NotImplementedError


class Mean(Statistic):
    """Mean of a stream: forward per position, backward and grad per sample.

    Example:
        >>> from nnstat.curvature import Mean
        >>> Mean.key("fc1", "grad")
        'fc1/grad/mean'
    """

    name = "mean"

    @classmethod
    def contribution(cls, cap, stream, prior):
        if stream == "forward":
            return cap.forward_sum(), cap.position_count
        if stream == "backward":
            return cap.backward_sum(), cap.num_samples
        return cap.per_sample_grad().sum(0), cap.num_samples


class Covariance(Statistic):
    """Uncentered covariance of a stream (``grad``: the "raw" per-sample gradient covariance).

    Example:
        >>> from nnstat.curvature import Covariance
        >>> Covariance.key("fc1", "forward")
        'fc1/forward/covariance'
    """

    name = "covariance"

    @classmethod
    def contribution(cls, cap, stream, prior, form: FactorForm | None = None):
        """One batch's sum of ``stream``'s uncentered covariance and its count.

        Args:
            cap: the module's capture.
            stream: ``"forward"``, ``"backward"`` or ``"grad"``.
            prior: finalized statistics of previous passes (unused).
            form: of a forward/backward factor (default: `factor_form` with the default
                limit and no projection; the collector passes its own).

        Returns:
            ``(sum, count)``.

        Raises:
            ValueError: the ``grad`` covariance would be wider than ``MAX_RAW_DIM`` (use
                ``kfac`` or ``ekfac`` for that layer).
        """
        if stream in ("forward", "backward"):
            return factor_contribution(cap, stream, form or factor_form(cap, stream))
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
        >>> from nnstat.curvature import KFAC
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

        Args:
            g: gradients ``[..., d_out, d_in]``.
            a: the forward factor ``[d_in, d_in]`` (or its diagonal ``[d_in]``).
            s: the backward factor ``[d_out, d_out]`` (or its diagonal).
            damping: added to every eigenvalue of ``A ⊗ S``.

        Returns:
            The preconditioned gradients, shaped like ``g``.
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
        >>> from nnstat.curvature import EKFAC
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
        m_in, m_out = _rotation(prior, cap, "forward"), _rotation(prior, cap, "backward")
        return sq_rotated(cap, m_in, m_out), cap.num_samples

    @staticmethod
    def precondition(
        g: torch.Tensor,
        qa: torch.Tensor,
        qs: torch.Tensor,
        eigenvalues: torch.Tensor,
        damping: float = 0.0,
    ) -> torch.Tensor:
        """``Q (Λ + damping)⁻¹ Qᵀ vec(G)`` for ``G`` ``[..., d_out, d_in]``; inputs untouched.

        Args:
            g: gradients ``[..., d_out, d_in]``.
            qa: eigenvectors of the forward factor ``[d_in, d_in]``.
            qs: eigenvectors of the backward factor ``[d_out, d_out]``.
            eigenvalues: the corrected eigenvalues ``[d_out, d_in]``.
            damping: added to every eigenvalue.

        Returns:
            The preconditioned gradients, shaped like ``g``.
        """
        return ekfac_apply(g, qa, qs, eigenvalues, damping)


def _rotation(prior: Mapping[str, torch.Tensor], cap: ModuleCapture, stream: str):
    """``Qᵀ`` ``[d, d]`` of a dense factor from the previous pass, ``Q_rᵀ P`` ``[r, d]`` of a
    projected one (its eigenbasis in the logged space after the projection), ``None`` (the
    identity) for a diagonal one."""
    q = prior.get(f"{cap.name}/{stream}/eigenvectors")
    if q is not None:
        return q.T.to(torch.float32)
    q = prior.get(f"{cap.name}/{stream}/projected_eigenvectors")
    if q is not None:
        p = prior.get(f"{cap.name}/{stream}/projection")
        if p is None:
            raise RuntimeError(
                f"{cap.name}: the projection of its projected {stream} factor is missing"
            )
        return (q.T.double() @ p.double()).to(torch.float32)
    cov = prior.get(f"{cap.name}/{stream}/covariance")
    if cov is not None and is_diagonal(cov):
        return None
    raise RuntimeError(
        f"{cap.name}: EKFAC needs the K-FAC eigenbases of a previous pass "
        "(run the 'factors' pass and finalize() first)"
    )


def sq_rotated(
    cap: ModuleCapture, m_in: torch.Tensor | None, m_out: torch.Tensor | None
) -> torch.Tensor:
    """``Σ_i (M_out G_i M_inᵀ)²`` ``[k_out, k_in]`` (``None``: the identity) without all the
    ``[N, d_out, d_in]`` per-sample gradients: an identity side rotates nothing and the others
    are multiplied into ``a`` and ``b`` first; embedding rows come from the (sample, token)
    pairs that occur, other kinds in chunks of samples of at most :data:`EKFAC_CHUNK`
    elements."""
    if cap.kind.tokens and m_in is None:
        return _embedding_sq_rotated(cap, m_out)
    if m_in is not None and m_out is not None:
        k_out, k_in = m_out.shape[0], m_in.shape[0]
        rotated = cap.project(m_in.to(torch.float32), m_out.to(torch.float32))
        return rotated.pow(2).sum(0).reshape(k_out, k_in)
    a, b = cap.forward, cap.backward  # [N, T, d_in(+1)], [N, T, d_out]
    if m_in is not None:
        a = a @ m_in.to(a).T
    if m_out is not None:
        b = b @ m_out.to(b).T
    k_out, k_in = b.shape[-1], a.shape[-1]
    out = b.new_zeros(k_out, k_in)
    step = max(1, EKFAC_CHUNK // (k_out * k_in))
    for lo in range(0, cap.num_samples, step):
        g = torch.bmm(b[lo : lo + step].transpose(1, 2), a[lo : lo + step])
        out += g.pow_(2).sum(0)
    return out


def _embedding_sq_rotated(cap: ModuleCapture, m_out: torch.Tensor | None) -> torch.Tensor:
    """``Σ_i (M_out G_i)²`` ``[k_out, vocab]`` of an embedding without its ``[N, d_out, vocab]``
    per-sample gradients: column ``v`` of ``G_i`` is the sum of ``b`` over the positions of
    sample ``i`` holding token ``v``, so only (sample, token) pairs that occur are formed.

    The pairs are grouped by a stable sort of their keys, in fixed-size ``[N*T]`` tensors: no
    ``unique`` or boolean selection, whose data-dependent sizes read the device back. Positions
    without a gradient share one key past every pair and add zeros."""
    idx, b = cap.indices, cap.backward
    n, t = idx.shape
    valid = (idx >= 0).reshape(-1)
    rows = torch.arange(n, device=idx.device).unsqueeze(1).expand_as(idx).reshape(-1)
    pair = torch.where(valid, rows * cap.d_in + idx.reshape(-1), n * cap.d_in)
    key, order = torch.sort(pair, stable=True)
    first = torch.ones_like(key, dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]
    group = first.cumsum(0) - 1  # the (sample, token) pair of each sorted position
    src = torch.where(valid.unsqueeze(1), b.reshape(n * t, cap.d_out), 0.0)[order]
    col = b.new_zeros(n * t, cap.d_out).index_add_(0, group, src)
    # row k = (M_out g_k)² of one (sample, token) column (rows past the last pair are zero)
    sq = (col if m_out is None else col @ m_out.to(col).T).pow(2)
    token = torch.zeros_like(key).scatter_(0, group, key % cap.d_in)
    out = b.new_zeros(cap.d_in, sq.shape[1]).index_add_(0, token, sq)
    return out.T


def ekfac_apply(
    g: torch.Tensor,
    qa: torch.Tensor | None,
    qs: torch.Tensor | None,
    lam: torch.Tensor,
    damping: float,
) -> torch.Tensor:
    """Precondition ``G`` in the eigenbasis: ``Q_S [(Q_Sᵀ G Q_A) / (Λ + damping)] Q_Aᵀ``.

    ``None`` stands for an identity eigenbasis (a diagonal factor).

    Example:
        >>> g = torch.tensor([[2.0, 4.0]])  # identity bases: G / (Λ + damping) entrywise
        >>> ekfac_apply(g, None, None, torch.tensor([[1.0, 3.0]]), damping=1.0)
        tensor([[1., 1.]])
    """
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
