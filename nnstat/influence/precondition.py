"""Preconditioners ``(H + λI)⁻¹`` for influence scores, block-diagonal over modules.

``H`` approximates the curvature of the **mean** training loss in the logged (possibly projected)
space:

* ``identity``: ``H + λI`` replaced by ``I`` (plain gradient dot products; damping ignored).
* ``raw``: ``H = (1/n) Σ_i g_i g_iᵀ`` per module (empirical Fisher of the logged rows). A module
  wider than the number of rows ``n`` has ``rank H ≤ n``: it keeps its ``n`` rows ``X`` and the
  eigendecomposition of their ``n × n`` Gram matrix and applies the Woodbury identity
  ``(XᵀX/n + λI)⁻¹ = (I − Xᵀ(nλI + XXᵀ)⁻¹X)/λ`` (exactly the dense inverse, with no ``width²``
  matrix and no ``width³`` eigendecomposition); narrower modules accumulate the dense covariance,
  a few modules per pass over the rows so that at most ``DENSE_FIT_BUDGET`` bytes of them exist
  at once.
* ``kfac``: ``H = S ⊗ A`` per module (row-major ``vec``), with ``S = P_out S_full P_outᵀ`` and
  ``A = P_in A_full P_inᵀ`` from the statistics pass and the projection matrices.
* ``ekfac``: K-FAC eigenbases, eigenvalues corrected to ``(1/n) Σ_i (Q_Sᵀ G_i Q_A)²`` from the
  logged rows (George et al. 2018), i.e. exact in the logged space along those eigenbases.

Modules without a Kronecker structure (layernorm) use ``raw`` under ``kfac``/``ekfac``.
A K-FAC factor saved as its diagonal (1-D: an embedding's token counts, or a factor over the
statistics' ``max_factor_dim`` on an unprojected side) keeps an identity eigenbasis (``None``,
no ``d²`` matrix) while that side is logged unprojected; projected, ``P diag(a) Pᵀ`` is an
ordinary ``r × r`` factor. A factor saved already projected (``"{m}/{side}/projected_covariance"``,
over ``max_factor_dim`` on a projected side) is used as it is, after checking that the
projection saved beside it is the log's.
``damping=None`` uses ``0.1 × mean eigenvalue`` of each module's ``H`` (for ``raw``, of its
nonzero eigenvalues: a covariance of fewer rows than columns is singular, and its zeros would
dilute the damping to almost nothing). Eigendecompositions are
damping-free and computed once; damped inverses are cached by ``(kind, damping)`` so a second
call with another damping never reuses a stale inverse.

Example:
    >>> import torch
    >>> from nnstat.influence.sources import TensorSource
    >>> src = TensorSource(torch.randn(50, 6), layout=[ModuleSpec("fc", 0, 2, 3)])
    >>> pre = Preconditioner.fit(src, "raw")
    >>> pre.apply(torch.randn(4, 6), damping=0.1).shape
    torch.Size([4, 6])
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from nnstat.curvature.operations import factor_eig, rotate

from .arguments import check_damping
from .row_layout import ModuleSpec
from .sources import RowSource
from .woodbury import gram_eig, symmetric_eig, woodbury_apply, woodbury_core

PRECONDITIONERS = ("identity", "raw", "kfac", "ekfac")
DAMPING_HEURISTIC = 0.1  # λ = 0.1 × mean eigenvalue of the module's curvature when damping=None
#: bytes of float64 dense covariances accumulated in one pass over the rows (more: more passes)
DENSE_FIT_BUDGET = 1 << 30


# ----------------------------------------------------------------------------- pure maths
def resolve_damping(damping: float | None, evals: torch.Tensor) -> float:
    """``damping`` itself, or ``DAMPING_HEURISTIC × mean eigenvalue`` when it is ``None``.

    Example:
        >>> import torch
        >>> resolve_damping(None, torch.tensor([1.0, 3.0]))
        0.2
    """
    if damping is not None:
        return check_damping(damping)
    value = DAMPING_HEURISTIC * float(evals.mean()) if evals.numel() else 0.0
    # an all-zero module (dead layer) still needs a positive damping to be invertible
    return value if value > 0 else 1e-12


def nonzero_spectrum(evals: torch.Tensor) -> torch.Tensor:
    """The eigenvalues above round-off (``> 1e-10 ×`` the largest).

    A covariance of ``n`` rows wider than ``n`` has at most ``n`` nonzero eigenvalues; averaging
    the zeros in would scale the default damping down by ``width / n``. On unprojected digits
    stores (``benchmarks/influence_quality.py --quick``) ``raw`` at 0.1 x the full mean ranked
    below plain dot products (LDS 0.507-0.611 vs 0.550-0.612); at 0.1 x the nonzero mean it is
    above them (0.578-0.666).

    Example:
        >>> import torch
        >>> nonzero_spectrum(torch.tensor([0.0, 1e-18, 2.0, 4.0], dtype=torch.float64)).tolist()
        [2.0, 4.0]
    """
    if evals.numel() == 0:
        return evals
    return evals[evals > 1e-10 * evals.max()]


def damped_inverse(evals: torch.Tensor, evecs: torch.Tensor, damping: float) -> torch.Tensor:
    """``(U diag(evals) Uᵀ + damping I)⁻¹`` as a float32 matrix.

    Example:
        >>> import torch
        >>> damped_inverse(torch.tensor([1.0]), torch.eye(1), 1.0).item()
        0.5
    """
    denom = evals + damping
    if (denom <= 0).any():
        raise ValueError("curvature + damping is singular: use a damping > 0")
    return ((evecs / denom) @ evecs.T).to(torch.float32)


def kron_precondition(
    grads: torch.Tensor,
    q_out: torch.Tensor | None,
    q_in: torch.Tensor | None,
    denom: torch.Tensor,
) -> torch.Tensor:
    """Apply ``(Q_S ⊗ Q_A) diag(1/denom) (Q_S ⊗ Q_A)ᵀ`` to row-major ``vec`` of ``grads``.

    ``grads`` is ``[b, r_out, r_in]``; ``denom`` is ``[r_out, r_in]`` (eigenvalues + damping);
    a basis ``None`` is the identity (a diagonal factor).

    Example:
        >>> import torch
        >>> g = torch.ones(1, 2, 2)
        >>> kron_precondition(g, torch.eye(2), torch.eye(2), torch.full((2, 2), 2.0))[0, 0, 0].item()
        0.5
    """
    return rotate(rotate(grads, q_out, q_in, transpose=True) / denom, q_out, q_in)


# ----------------------------------------------------------------------------- factors
@dataclass
class DenseFactor:
    """``H = U diag(evals) Uᵀ`` for one module (float64)."""

    evals: torch.Tensor
    evecs: torch.Tensor


@dataclass
class LowRankFactor:
    """``H = XᵀX / n`` kept as its rows ``X`` ``[n, d]`` (float32, ``n < d``) and the
    eigendecomposition of ``K = XXᵀ`` (float64); ``evals`` are ``H``'s nonzero eigenvalues
    (and any zeros of ``K``)."""

    rows: torch.Tensor
    gram_evals: torch.Tensor
    gram_evecs: torch.Tensor

    @property
    def evals(self) -> torch.Tensor:
        return self.gram_evals / len(self.rows)


@dataclass
class KronFactor:
    """``H ≈ (Q_S ⊗ Q_A) diag(vec(eig)) (Q_S ⊗ Q_A)ᵀ`` for one module (``None``: identity)."""

    q_out: torch.Tensor | None
    q_in: torch.Tensor | None
    eig: torch.Tensor  # [r_out, r_in]


@dataclass
class _DampedBlock:
    damping: float
    matrix: torch.Tensor | None = None  # dense inverse
    rows: torch.Tensor | None = None  # low rank: X and the Woodbury core C
    core: torch.Tensor | None = None
    q_out: torch.Tensor | None = None
    q_in: torch.Tensor | None = None
    denom: torch.Tensor | None = None

    def to(self, device: torch.device) -> _DampedBlock:
        moved = {k: v.to(device) if torch.is_tensor(v) else v for k, v in vars(self).items()}
        return _DampedBlock(**moved)


def _stat(stats: Mapping[str, torch.Tensor], module: str, stream: str) -> torch.Tensor:
    key = f"{module}/{stream}/covariance"
    if key not in stats and f"{module}/{stream}/projected_covariance" in stats:
        raise ValueError(
            f"module {module!r}: the statistics hold its {stream} factor in the logged space of a "
            "projection only (the full factor was over max_factor_dim)"
        )
    if key not in stats:
        have = sorted({k.split("/")[0] for k in stats}) or "none"
        raise ValueError(
            f"K-FAC preconditioner needs statistic {key!r}, which the run did not collect "
            f"(modules with statistics: {have}); log with statistic='kfac' or use "
            "preconditioner='raw'"
        )
    return stats[key].to(torch.float64)


def without_statistics(layout: list[ModuleSpec], stats: Mapping[str, torch.Tensor]) -> list[str]:
    """Kronecker modules of ``layout`` that have no statistic at all while others have some:
    watched modules that received no gradient in the statistics pass (unused in the forward,
    or frozen with nothing trainable before them), whose stored rows are zeros. Their blocks
    are fitted from the rows (``raw``); with no statistics anywhere this is empty, and K-FAC
    refuses as before (the run collected none).

    Example:
        >>> st = {"fc/forward/covariance": torch.eye(3), "fc/backward/covariance": torch.eye(2)}
        >>> without_statistics([ModuleSpec("fc", 0, 2, 3), ModuleSpec("unused", 6, 2, 3)], st)
        ['unused']
    """
    have = {k.split("/")[0] for k in stats}
    kron = [m.name for m in layout if m.kronecker]
    missing = [name for name in kron if name not in have]
    return missing if len(missing) < len(kron) else []


def warn_without_statistics(missing: list[str]) -> None:
    """One warning naming the modules `without_statistics` fits from their rows."""
    if missing:
        warnings.warn(
            f"modules {missing} have no K-FAC statistics (they received no gradient in the "
            "statistics pass: unused in the forward, or frozen with nothing trainable before "
            "them; their stored rows are zeros): their blocks use the 'raw' preconditioner of "
            "their rows. Watch the model with a name_filter that leaves them out to drop them",
            RuntimeWarning,
            stacklevel=3,
        )


def _project(cov: torch.Tensor, proj: torch.Tensor | None, module: str, side: str) -> torch.Tensor:
    """``P C Pᵀ`` (a diagonal ``C`` stays 1-D when there is no projection)."""
    if proj is None:
        return cov
    proj = proj.to(torch.float64)
    if proj.shape[1] != cov.shape[0]:
        raise ValueError(
            f"module {module!r}: projection {side} has shape {tuple(proj.shape)} but the stored "
            f"covariance is {tuple(cov.shape)}"
        )
    if cov.dim() == 1:  # P diag(c) Pᵀ without the d x d matrix
        return (proj * cov) @ proj.T
    return proj @ cov @ proj.T


def _logged_factor(
    module: str,
    stats: Mapping[str, torch.Tensor],
    projections: Mapping[str, torch.Tensor],
    stream: str,
    side: str,
) -> torch.Tensor:
    """One K-FAC factor in the logged space: ``P C Pᵀ`` of a saved full (dense or diagonal)
    factor, or a factor the statistics pass saved already projected, after checking that its
    projection is the log's (a rank-``r`` factor of another space would be silently wrong)."""
    proj = projections.get(f"{module}/{side}")
    key = f"{module}/{stream}/projected_covariance"
    if key not in stats:
        return _project(_stat(stats, module, stream), proj, module, side)
    cov = stats[key].to(torch.float64)
    used = stats.get(f"{module}/{stream}/projection")
    same = (
        proj is not None
        and used is not None
        and tuple(used.shape) == tuple(proj.shape)
        and torch.equal(used.to(torch.float32), proj.to(torch.float32))
    )
    if not same:
        what = "unprojected" if proj is None else "projected with another matrix"
        raise ValueError(
            f"module {module!r}: the statistics hold its {stream} factor only in the logged "
            f"space of a rank-{cov.shape[0]} projection (the full factor was over "
            f"max_factor_dim), but this log's {side} side is {what}: score the rows of the "
            "store these statistics were logged with, or log the statistics again"
        )
    return cov


def kfac_factor(
    spec: ModuleSpec,
    stats: Mapping[str, torch.Tensor],
    projections: Mapping[str, torch.Tensor],
) -> KronFactor:
    """K-FAC factor of one module in the logged space: eigenbases of ``P S Pᵀ`` and ``P A Pᵀ``.

    Example:
        >>> import torch
        >>> st = {"fc/forward/covariance": torch.eye(3), "fc/backward/covariance": torch.eye(2)}
        >>> kfac_factor(ModuleSpec("fc", 0, 2, 3), st, {}).eig.shape
        torch.Size([2, 3])
    """
    s = _logged_factor(spec.name, stats, projections, "backward", "p_out")
    a = _logged_factor(spec.name, stats, projections, "forward", "p_in")
    if s.shape[0] != spec.r_out or a.shape[0] != spec.r_in:
        raise ValueError(
            f"module {spec.name!r}: statistics give a {s.shape[0]}x{a.shape[0]} gradient but the "
            f"log stores {spec.r_out}x{spec.r_in}"
        )
    ls, qs = factor_eig(s, psd=True)
    la, qa = factor_eig(a, psd=True)
    return KronFactor(qs, qa, torch.outer(ls, la))


def _unprojected(spec: ModuleSpec, projections: Mapping[str, torch.Tensor]) -> bool:
    for side in ("p_out", "p_in"):
        p = projections.get(f"{spec.name}/{side}")
        if p is not None and (p.shape[0] != p.shape[1] or not torch.equal(p, torch.eye(len(p)))):
            return False
    return True


def stored_ekfac_factor(
    spec: ModuleSpec,
    stats: Mapping[str, torch.Tensor],
    projections: Mapping[str, torch.Tensor],
) -> KronFactor | None:
    """The statistics pass's own EK-FAC factor when it applies to the logged space, else ``None``.

    It applies when the module is logged unprojected and the run saved both K-FAC eigenbases and
    the corrected eigenvalues (``"{m}/ekfac/eigenvalues"``) with matching shapes.

    Example:
        >>> import torch
        >>> st = {"fc/backward/eigenvectors": torch.eye(2), "fc/forward/eigenvectors": torch.eye(3),
        ...       "fc/ekfac/eigenvalues": torch.ones(2, 3)}
        >>> stored_ekfac_factor(ModuleSpec("fc", 0, 2, 3), st, {}).eig.shape
        torch.Size([2, 3])
    """
    eig = stats.get(f"{spec.name}/ekfac/eigenvalues")
    if eig is None or not _unprojected(spec, projections):
        return None
    q_out = _stored_basis(stats, spec.name, "backward", spec.r_out)
    q_in = _stored_basis(stats, spec.name, "forward", spec.r_in)
    if q_out is False or q_in is False or eig.shape != (spec.r_out, spec.r_in):
        return None
    return KronFactor(q_out, q_in, eig.to(torch.float64).clamp_min(0.0))


def _stored_basis(
    stats: Mapping[str, torch.Tensor], module: str, stream: str, size: int
) -> torch.Tensor | None | bool:
    """The saved eigenbasis of a factor, ``None`` for a diagonal factor of ``size`` (identity
    basis), ``False`` when there is none of that size."""
    q = stats.get(f"{module}/{stream}/eigenvectors")
    if q is not None:
        return q.to(torch.float64) if tuple(q.shape) == (size, size) else False
    cov = stats.get(f"{module}/{stream}/covariance")
    if cov is not None and cov.dim() == 1 and len(cov) == size:
        return None
    return False


# ----------------------------------------------------------------------------- fitting
def dense_groups(widths: list[int], budget: int = DENSE_FIT_BUDGET) -> list[list[int]]:
    """Indices of ``widths`` in groups whose float64 ``width²`` covariances fit in ``budget``
    bytes (a wider module is a group of its own): one pass over the rows per group.

    Example:
        >>> dense_groups([4, 4, 8], budget=8 * 32)
        [[0, 1], [2]]
    """
    groups: list[list[int]] = []
    used = budget + 1
    for i, w in enumerate(widths):
        size = 8 * w * w
        if used + size > budget:
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += size
    return groups


def fit_from_rows(
    source: RowSource,
    dense: list[ModuleSpec],
    kron: dict[str, KronFactor],
    batch_size: int,
    budget: int = DENSE_FIT_BUDGET,
) -> dict[str, DenseFactor | LowRankFactor | KronFactor]:
    """Curvature of ``dense`` modules from the rows, corrected eigenvalues of ``kron``.

    A module wider than the number of rows keeps its rows (`LowRankFactor`); the others
    accumulate ``XᵀX`` in float64, at most ``budget`` bytes of covariances per pass over the
    rows (the first pass also gathers the low-rank rows and the EK-FAC sums)."""
    n_rows = len(source)
    low = [m for m in dense if n_rows < m.width]
    full = [m for m in dense if n_rows >= m.width]
    groups = dense_groups([m.width for m in full], budget) or [[]]
    specs = {m.name: m for m in source.layout}
    out: dict[str, DenseFactor | LowRankFactor | KronFactor] = {}
    for g_idx, group in enumerate(groups):
        first = g_idx == 0
        covs = {
            full[i].name: torch.zeros(full[i].width, full[i].width, dtype=torch.float64)
            for i in group
        }
        kept = {m.name: torch.empty(n_rows, m.width) for m in low} if first else {}
        sq = {name: torch.zeros_like(f.eig) for name, f in kron.items()} if first else {}
        n = 0
        for _, rows in source.iter_blocks(batch_size):
            b = rows.shape[0]
            if first and n + b > n_rows:
                raise RuntimeError(f"the training log yielded more than its {n_rows} rows")
            for name in kept:
                m = specs[name]
                kept[name][n : n + b] = rows[:, m.offset : m.stop]
            # float64 one module's slice at a time: a whole block would double in size
            for name, cov in covs.items():
                m = specs[name]
                x = rows[:, m.offset : m.stop].to(torch.float64)
                cov += x.T @ x
            for name, f in kron.items() if first else ():
                m = specs[name]
                grads = rows[:, m.offset : m.stop].to(torch.float64).reshape(-1, m.r_out, m.r_in)
                sq[name] += (rotate(grads, f.q_out, f.q_in, transpose=True) ** 2).sum(0)
            n += b
        if n == 0:
            root = getattr(source, "root", None)
            where = f"the store {root}" if root is not None else "the in-memory log"
            raise ValueError(
                f"cannot fit a preconditioner on an empty log: {where} holds no rows; log rows "
                "into it first (a logging pass with save='grad' over the training data)"
            )
        if n != n_rows:
            raise RuntimeError(f"the training log yielded {n} rows, expected {n_rows}")
        for name, cov in covs.items():
            out[name] = DenseFactor(*symmetric_eig(cov / n))
            covs[name] = cov = torch.empty(0)  # freed before the next module's eigh
        for name, x in kept.items():
            out[name] = LowRankFactor(x, *gram_eig(x))
        for name, f in kron.items() if first else ():
            out[name] = KronFactor(f.q_out, f.q_in, sq[name] / n)
    return out


class Preconditioner:
    """A fitted block-diagonal preconditioner; `apply` multiplies rows by ``(H + λI)⁻¹``.

    Example:
        >>> import torch
        >>> from nnstat.influence.sources import TensorSource
        >>> pre = Preconditioner.fit(TensorSource(torch.randn(8, 4)), "identity")
        >>> bool((pre.apply(torch.ones(1, 4), damping=None) == 1).all())
        True
    """

    def __init__(
        self,
        kind: str,
        layout: list[ModuleSpec],
        factors: dict[str, DenseFactor | LowRankFactor | KronFactor],
    ) -> None:
        if kind not in PRECONDITIONERS:
            raise ValueError(f"unknown preconditioner {kind!r}; valid: {list(PRECONDITIONERS)}")
        self.kind = kind
        self.layout = layout
        self.factors = factors
        self._cache: dict[tuple, list[_DampedBlock]] = {}  # by kind, damping (and device)
        # where each module's curvature came from: "rows", "statistics" or "statistics+rows"
        self.origin: dict[str, str] = {}

    @classmethod
    def fit(cls, source: RowSource, kind: str, batch_size: int = 4096) -> Preconditioner:
        """Fit ``kind`` on a training source (a streamed pass over its rows when needed)."""
        if kind not in PRECONDITIONERS:
            raise ValueError(f"unknown preconditioner {kind!r}; valid: {list(PRECONDITIONERS)}")
        layout = list(source.layout)
        if kind == "identity":
            return cls(kind, layout, {})
        if kind == "raw":
            return cls(kind, layout, fit_from_rows(source, layout, {}, batch_size))
        stats, projections = source.statistics(), source.projections()
        missing = without_statistics(layout, stats)
        warn_without_statistics(missing)
        kron = {
            m.name: kfac_factor(m, stats, projections)
            for m in layout
            if m.kronecker and m.name not in missing
        }
        dense = [m for m in layout if m.name not in kron]
        if kind == "kfac":
            factors: dict[str, DenseFactor | LowRankFactor | KronFactor] = dict(kron)
            if dense:
                factors.update(fit_from_rows(source, dense, {}, batch_size))
            return cls(kind, layout, factors)
        stored = {
            m.name: stored_ekfac_factor(m, stats, projections) for m in layout if m.name in kron
        }
        factors = {name: f for name, f in stored.items() if f is not None}
        todo = {name: f for name, f in kron.items() if stored.get(name) is None}
        if dense or todo:
            factors.update(fit_from_rows(source, dense, todo, batch_size))
        pre = cls(kind, layout, factors)
        pre.origin = {
            m.name: (
                "rows"
                if m.name not in kron
                else "statistics+rows" if m.name in todo else "statistics"
            )
            for m in layout
        }
        return pre

    def module_dampings(self, damping: float | None) -> dict[str, float]:
        """The damping each module actually uses (resolves ``None`` with the heuristic)."""
        out = {}
        for m in self.layout:
            f = self.factors.get(m.name)
            if f is None:
                continue
            dense = isinstance(f, (DenseFactor, LowRankFactor))
            evals = nonzero_spectrum(f.evals) if dense else f.eig.flatten()
            out[m.name] = resolve_damping(damping, evals)
        return out

    def _blocks(self, damping: float | None, device: torch.device | None = None) -> list:
        key = (self.kind, None if damping is None else float(damping))
        if key not in self._cache:
            lams = self.module_dampings(damping)
            blocks = []
            for m in self.layout:
                f, lam = self.factors[m.name], lams[m.name]
                if isinstance(f, DenseFactor):
                    blocks.append(_DampedBlock(lam, matrix=damped_inverse(f.evals, f.evecs, lam)))
                elif isinstance(f, LowRankFactor):
                    core = woodbury_core(f.gram_evals, f.gram_evecs, len(f.rows), lam)
                    blocks.append(_DampedBlock(lam, rows=f.rows, core=core))
                else:
                    denom = f.eig + lam
                    if (denom <= 0).any():
                        raise ValueError("curvature + damping is singular: use a damping > 0")
                    q_out, q_in = (q if q is None else q.float() for q in (f.q_out, f.q_in))
                    blocks.append(_DampedBlock(lam, q_out=q_out, q_in=q_in, denom=denom.float()))
            self._cache[key] = blocks
        if device is None or device.type == "cpu":
            return self._cache[key]
        if (*key, device) not in self._cache:  # scoring on a GPU: the blocks are copied there once
            self._cache[(*key, device)] = [b.to(device) for b in self._cache[key]]
        return self._cache[(*key, device)]

    def damped_bytes(self) -> int:
        """Bytes of one damping's blocks (`apply` keeps them per damping and device)."""
        total = 0
        for m in self.layout:
            f = self.factors.get(m.name)
            if isinstance(f, KronFactor):  # float32 bases and denominators
                total += 4 * (m.r_out**2 * (f.q_out is not None) + m.r_in**2 * (f.q_in is not None))
            total += {
                DenseFactor: 4 * m.width**2,
                LowRankFactor: 8 * len(getattr(f, "rows", ())) ** 2,
                KronFactor: 4 * m.width,
            }.get(type(f), 0)
        return total

    def apply(self, rows: torch.Tensor, damping: float | None) -> torch.Tensor:
        """``rows (H + λI)⁻¹`` block by block (``H`` symmetric), on ``rows``' device."""
        if self.kind == "identity":
            return rows.to(torch.float32)
        rows = rows.to(torch.float32)
        out = torch.empty_like(rows)
        for m, b in zip(self.layout, self._blocks(damping, rows.device), strict=True):
            x = rows[:, m.offset : m.stop]
            if b.matrix is not None:
                out[:, m.offset : m.stop] = x @ b.matrix
            elif b.core is not None:
                out[:, m.offset : m.stop] = woodbury_apply(x, b.rows, b.core, b.damping)
            else:
                g = x.reshape(-1, m.r_out, m.r_in)
                y = kron_precondition(g, b.q_out, b.q_in, b.denom)
                out[:, m.offset : m.stop] = y.reshape(x.shape)
        return out
