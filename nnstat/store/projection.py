"""LoGra projections of per-sample gradients: random Gaussian or PCA of K-FAC factors.

For a module whose per-sample gradient is ``G_i`` (``[d_out, d_in]``, bias as the last input
column) the logged vector is ``vec(P_out @ G_i @ P_in.T)`` with ``P_in`` ``[r_in, d_in]`` and
``P_out`` ``[r_out, d_out]``. Random entries are ``N(0, 1/r)`` so that
``E ||P_out G P_inᵀ||² = ||G||²``. A side whose rank reaches the layer's dimension is the
identity (nothing to compress, inner products exact); the real ranks are recorded.

Example:
    >>> import torch
    >>> spec = module_shape("fc", torch.nn.Linear(10, 3))
    >>> (spec.d_in, spec.d_out)
    (11, 3)
    >>> proj = random_projection(spec, rank=4, seed=0)
    >>> tuple(proj.p_in.shape), proj.p_out is None, proj.width  # d_out=3 <= rank: identity
    ((4, 11), True, 12)
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nnstat.store.factor_counts import FactorsSetting, factors_for
from nnstat.store.factored import factored_width, worth_factoring

PROJECTION_INITS = ("random", "pca")


@dataclass(frozen=True)
class ModuleShape:
    """Shape of one watched module's per-sample gradient: ``[d_out, d_in]`` (or ``[d_in]``)."""

    name: str
    kind: str
    d_in: int
    d_out: int | None  # None for kinds without a Kronecker structure (layernorm)


@dataclass
class ModuleProjection:
    """Projection matrices of one module (``None`` = identity on that side, i.e. no compression)."""

    spec: ModuleShape
    r_in: int
    r_out: int | None
    p_in: torch.Tensor | None
    p_out: torch.Tensor | None
    #: factor pairs per row when the store keeps this module factored (:mod:`.factored`)
    factors: int | None = None

    @property
    def width(self) -> int:
        """Columns this module takes in a stored row."""
        if self.factors:
            assert self.r_out is not None
            return factored_width(self.factors, self.r_out, self.r_in)
        return self.dense_width

    @property
    def dense_width(self) -> int:
        """Columns of this module's dense row (``r_out * r_in``): a query log's, or a store's
        without ``factors``."""
        return self.r_in * (self.r_out or 1)


def module_shape(name: str, module: nn.Module) -> ModuleShape:
    """Per-sample gradient shape of ``module``, from its capture kind.

    Example:
        >>> module_shape("e", torch.nn.Embedding(7, 2))
        ModuleShape(name='e', kind='embedding', d_in=7, d_out=2)
    """
    from nnstat.capture.kinds import detect_kind, unsupported_reason  # the kinds decide

    kind = detect_kind(module)
    if kind is None:
        raise TypeError(
            f"module {name!r} of type {type(module).__name__} cannot be logged: "
            f"{unsupported_reason(module)}"
        )
    d_in, d_out = kind.logged_dims(module)  # d_out None: a flat gradient (layernorm)
    return ModuleShape(name, str(kind), int(d_in), None if d_out is None else int(d_out))


def module_seed(seed: int, name: str) -> int:
    """Seed of one module's Gaussian matrices: ``seed * 1_000_003 + crc32(name)`` (recorded)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _gaussian(r: int, d: int, gen: torch.Generator) -> torch.Tensor | None:
    if r >= d:
        return None
    return torch.randn(r, d, generator=gen) / math.sqrt(r)


def random_projection(spec: ModuleShape, rank: int, seed: int = 0) -> ModuleProjection:
    """Gaussian projection ``N(0, 1/r)`` on both sides, from :func:`module_seed`."""
    _check_rank(rank)
    gen = torch.Generator().manual_seed(module_seed(seed, spec.name))
    r_in = min(rank, spec.d_in)
    p_in = _gaussian(r_in, spec.d_in, gen)
    if spec.d_out is None:
        return ModuleProjection(spec, r_in, None, p_in, None)
    r_out = min(rank, spec.d_out)
    return ModuleProjection(spec, r_in, r_out, p_in, _gaussian(r_out, spec.d_out, gen))


def _top_eigvecs(cov: torch.Tensor, r: int, what: str) -> torch.Tensor | None:
    if cov.dim() == 1:  # a diagonal factor (an embedding's token counts): eigenvectors e_i
        if not torch.isfinite(cov).all():
            raise ValueError(f"{what}: covariance has NaN/Inf entries")
        if r >= len(cov):
            return None
        # the r largest entries, largest first (ties: lower index first, as a stable sort gives)
        top = torch.sort(cov.double(), descending=True, stable=True).indices[:r]
        p = torch.zeros(r, len(cov))
        p[torch.arange(r), top] = 1.0
        return p
    if cov.dim() != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"{what}: expected a square covariance, got {tuple(cov.shape)}")
    if not torch.isfinite(cov).all():
        raise ValueError(f"{what}: covariance has NaN/Inf entries")
    if r >= cov.shape[0]:
        return None
    _, vecs = torch.linalg.eigh(cov.double())
    return vecs[:, -r:].flip(-1).T.contiguous().float()  # top-r, largest first


def pca_projection(
    spec: ModuleShape, rank: int, statistics: Mapping[str, torch.Tensor]
) -> ModuleProjection:
    """Top eigenvectors of the module's forward/backward covariances from a statistics pass.

    Raises ``ValueError`` naming the missing keys when the statistics do not contain them — there
    is no silent fallback to random projections.
    """
    _check_rank(rank)
    if spec.d_out is None:
        keys = [f"{spec.name}/grad/covariance"]
    else:
        keys = [f"{spec.name}/forward/covariance", f"{spec.name}/backward/covariance"]
    missing = [k for k in keys if k not in statistics]
    logged = [k for k in missing if k.replace("/covariance", "/projected_covariance") in statistics]
    if logged:
        raise ValueError(
            f"init='pca' needs the full covariances {logged}, but the statistics pass kept them "
            "only in the space of the previous projection (over max_factor_dim): collect the "
            "statistics without a projection (such a factor is then kept as its diagonal, whose "
            "PCA keeps the largest entries) or raise setup({'max_factor_dim': ...})"
        )
    if missing:
        raise ValueError(
            f"init='pca' needs the covariances of a previous statistics pass (e.g. statistic "
            f"'kfac'); missing {missing}"
        )
    r_in = min(rank, spec.d_in)
    p_in = _top_eigvecs(statistics[keys[0]], r_in, keys[0])
    if spec.d_out is None:
        return ModuleProjection(spec, r_in, None, p_in, None)
    r_out = min(rank, spec.d_out)
    return ModuleProjection(
        spec, r_in, r_out, p_in, _top_eigvecs(statistics[keys[1]], r_out, keys[1])
    )


def full_gradient(spec: ModuleShape) -> ModuleProjection:
    """No projection: the whole per-sample gradient is stored (``rank=None``)."""
    return ModuleProjection(spec, spec.d_in, spec.d_out, None, None)


def _check_rank(rank: Any) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int or None, got {rank!r}")


def build_projections(
    specs: list[ModuleShape],
    rank: int | None,
    init: str = "random",
    seed: int = 0,
    statistics: Mapping[str, torch.Tensor] | None = None,
    factors: FactorsSetting = None,
) -> dict[str, ModuleProjection]:
    """One :class:`ModuleProjection` per module, in ``specs`` order; with ``factors`` (one count,
    or one per module: :func:`~nnstat.store.factor_counts.factors_for`) the Kronecker modules
    whose factors are narrower than their dense rows are stored factored
    (:func:`~nnstat.store.factored.worth_factoring`).

    Raises:
        ValueError: an unknown ``init``, ``init="pca"`` without statistics, or a ``factors``
            mapping key that matches no module.

    Example:
        >>> specs = [module_shape("fc", torch.nn.Linear(4, 2))]
        >>> build_projections(specs, None)["fc"].width
        10
    """
    if init not in PROJECTION_INITS:
        raise ValueError(f"unknown projection init {init!r}; valid: {list(PROJECTION_INITS)}")
    if rank is None:
        return {s.name: full_gradient(s) for s in specs}
    if init == "pca":
        if not statistics:
            raise ValueError(
                "init='pca' needs the forward/backward covariances of a previous statistics pass "
                "(run a pass with statistic 'kfac' and finalize() first); none found"
            )
        out = {s.name: pca_projection(s, rank, statistics) for s in specs}
    else:
        out = {s.name: random_projection(s, rank, seed) for s in specs}
    counts = factors_for(factors, list(out))
    for name, p in out.items():
        if worth_factoring(counts[name], p.r_out, p.r_in):
            p.factors = counts[name]
    return out


def projection_tensors(projections: Mapping[str, ModuleProjection]) -> dict[str, torch.Tensor]:
    """The non-identity matrices as ``{"{module}/p_in": ..., "{module}/p_out": ...}``."""
    out: dict[str, torch.Tensor] = {}
    for name, p in projections.items():
        if p.p_in is not None:
            out[f"{name}/p_in"] = p.p_in.contiguous()
        if p.p_out is not None:
            out[f"{name}/p_out"] = p.p_out.contiguous()
    return out


def layout(projections: Mapping[str, ModuleProjection]) -> list[dict[str, Any]]:
    """Row layout for meta.json: ``[{name, kind, d_in, d_out, r_in, r_out, offset, width}]``."""
    rows, offset = [], 0
    for name, p in projections.items():
        s = p.spec
        rows.append(
            {
                "name": name,
                "kind": s.kind,
                "d_in": s.d_in,
                "d_out": s.d_out,
                "r_in": p.r_in,
                "r_out": p.r_out,
                "projected_in": p.p_in is not None,
                "projected_out": p.p_out is not None,
                "offset": offset,
                "width": p.width,
            }
        )
        if p.factors:  # only then: a dense store's meta.json is unchanged
            rows[-1]["factors"] = p.factors
        offset += p.width
    return rows


def project_capture(
    cap: Any, proj: ModuleProjection, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``[N, width]`` rows of one :class:`~nnstat.capture.ModuleCapture` under ``proj``.

    Uses the engine's ``project`` (projected forward/backward, never ``G_i``) when a side is
    compressed; stores the full per-sample gradient when neither side is. ``out`` (a float32
    ``[N, width]`` tensor, e.g. a column slice of a reused row buffer) receives the rows.

    Example:
        >>> import nnstat
        >>> lin = torch.nn.Linear(6, 5)
        >>> engine = nnstat.CaptureEngine(); _ = engine.watch(lin); caps = []
        >>> engine.add_consumer(caps.append)
        >>> with engine.batch():
        ...     lin(torch.randn(3, 6)).sum().backward()
        >>> proj = random_projection(module_shape("model", lin), rank=2)
        >>> project_capture(caps[0], proj).shape
        torch.Size([3, 4])
    """
    if proj.p_in is None and proj.p_out is None:
        g = cap.per_sample_grad()
        rows = g.reshape(g.shape[0], -1)
        return rows if out is None else out.copy_(rows)
    p_in, p_out = _kernels(proj, cap.device)
    if proj.spec.d_out is None:
        return cap.project(p_in, out=out)
    return cap.project(p_in, p_out, out=out)


def row_factors(cap: Any, proj: ModuleProjection) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(P_out b_i, P_in [a_i, 1])`` ``[N, r_out]``, ``[N, r_in]`` whose outer products are
    :func:`project_capture`'s rows, or ``None`` when the rows are not one outer product per
    sample (several positions, no Kronecker structure, or an uncompressed layer).

    Example:
        >>> import nnstat
        >>> lin = torch.nn.Linear(6, 5)
        >>> engine = nnstat.CaptureEngine(); _ = engine.watch(lin); caps = []
        >>> engine.add_consumer(caps.append)
        >>> with engine.batch():
        ...     lin(torch.randn(3, 6)).sum().backward()
        >>> proj = random_projection(module_shape("model", lin), rank=2)
        >>> b, a = row_factors(caps[0], proj)
        >>> torch.equal((b[:, :, None] * a[:, None, :]).reshape(3, -1), project_capture(caps[0], proj))
        True
    """
    if (proj.p_in is None and proj.p_out is None) or proj.spec.d_out is None:
        return None
    p_in, p_out = _kernels(proj, cap.device)
    assert p_out is not None
    return cap.row_factors(p_in, p_out)


def projected_factors(cap: Any, proj: ModuleProjection) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P_out δ_t, P_in x_t)`` per position, ``[N, T, r_out]`` and ``[N, T, r_in]``: the
    factors whose summed outer products are :func:`project_capture`'s rows (a Kronecker kind).

    Example:
        >>> import nnstat
        >>> lin = torch.nn.Linear(6, 5)
        >>> engine = nnstat.CaptureEngine(); _ = engine.watch(lin); caps = []
        >>> engine.add_consumer(caps.append)
        >>> with engine.batch():
        ...     lin(torch.randn(3, 6)).sum().backward()
        >>> proj = random_projection(module_shape("model", lin), rank=2)
        >>> [tuple(t.shape) for t in projected_factors(caps[0], proj)]
        [(3, 1, 2), (3, 1, 2)]
    """
    p_in, p_out = _kernels(proj, cap.device)
    assert p_out is not None
    return cap.projected_factors(p_in, p_out)


def _kernels(
    proj: ModuleProjection, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``p_in``, ``p_out`` as the engine multiplies them, cached on ``proj`` (per device).

    Same values, column-major storage: the engine multiplies by ``p.T`` (and ``p_in[:, :-1].T``
    with a bias), which is then a contiguous operand, the fastest matmul layout. On an
    accelerator the matrices are copied there once: a copy from pageable host memory per module
    per batch would wait for the device's queue to drain each time (a blocking transfer).
    """
    cached = proj.__dict__.get("_kernels")
    if cached is None or cached[0] is not proj.p_in or cached[1] is not proj.p_out:
        p_in = proj.p_in if proj.p_in is not None else _eye(proj.spec.d_in)
        p_out = None
        if proj.spec.d_out is not None:
            p_out = proj.p_out if proj.p_out is not None else _eye(proj.spec.d_out)
            p_out = p_out.T.contiguous().T
        p_in = p_in.T.contiguous().T
        cached = (proj.p_in, proj.p_out, {p_in.device: (p_in, p_out)})
        proj.__dict__["_kernels"] = cached
    by_device = cached[2]
    home = next(iter(by_device))
    device = home if device is None else torch.device(device)
    if device not in by_device:
        p_in, p_out = by_device[home]
        # .to keeps the column-major strides (preserve_format); non_blocking: the copy from
        # pageable memory is staged by the driver and does not wait for the queued kernels
        # (the first logged batch runs inside a training loop's backward too)
        by_device[device] = (
            p_in.to(device=device, dtype=torch.float32, non_blocking=True),
            (
                None
                if p_out is None
                else p_out.to(device=device, dtype=torch.float32, non_blocking=True)
            ),
        )
    return by_device[device]


_EYES: dict[int, torch.Tensor] = {}


def _eye(d: int) -> torch.Tensor:
    if d not in _EYES:
        _EYES[d] = torch.eye(d)
    return _EYES[d]
