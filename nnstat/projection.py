"""LoGra projections of per-sample gradients: random Gaussian or PCA of K-FAC factors.

For a module whose per-sample gradient is ``G_i`` (``[d_out, d_in]``, bias as the last input
column) the logged vector is ``vec(P_out @ G_i @ P_in.T)`` with ``P_in`` ``[r_in, d_in]`` and
``P_out`` ``[r_out, d_out]``. Random entries are ``N(0, 1/r)`` so that
``E ||P_out G P_inᵀ||² = ||G||²``. A side whose rank reaches the layer's dimension is the
identity (nothing to compress, inner products exact); the real ranks are recorded.

Example:
    >>> import torch
    >>> spec = module_spec("fc", torch.nn.Linear(10, 3))
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

PROJECTION_INITS = ("random", "pca")
KRONECKER_KINDS = ("linear", "conv", "conv1d_hf", "embedding")


@dataclass(frozen=True)
class ModuleSpec:
    """Shape of one watched module's per-sample gradient: ``[d_out, d_in]`` (or ``[d_in]``)."""

    name: str
    kind: str
    d_in: int
    d_out: int | None  # None for kinds without a Kronecker structure (layernorm)


@dataclass
class ModuleProjection:
    """Projection matrices of one module (``None`` = identity on that side, i.e. no compression)."""

    spec: ModuleSpec
    r_in: int
    r_out: int | None
    p_in: torch.Tensor | None
    p_out: torch.Tensor | None

    @property
    def width(self) -> int:
        """Columns this module takes in a stored row."""
        return self.r_in * (self.r_out or 1)


def module_spec(name: str, module: nn.Module) -> ModuleSpec:
    """Per-sample gradient shape of ``module``, from the capture engine's rules.

    Example:
        >>> module_spec("e", torch.nn.Embedding(7, 2))
        ModuleSpec(name='e', kind='embedding', d_in=7, d_out=2)
    """
    from nnstat.capture import rules  # the engine decides what is supported and the shapes

    kind = rules.detect_kind(module)
    if kind is None:
        raise TypeError(
            f"module {name!r} of type {type(module).__name__} cannot be logged: "
            f"{rules.unsupported_reason(module)}"
        )
    d_in, d_out = rules.dims(kind, module)
    if kind == "layernorm":  # flat gradient: weight then bias
        return ModuleSpec(name, kind, int(d_in) * (1 + rules.has_bias(module)), None)
    return ModuleSpec(name, kind, int(d_in), int(d_out))


def module_seed(seed: int, name: str) -> int:
    """Seed of one module's Gaussian matrices: ``seed * 1_000_003 + crc32(name)`` (recorded)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


def _gaussian(r: int, d: int, gen: torch.Generator) -> torch.Tensor | None:
    if r >= d:
        return None
    return torch.randn(r, d, generator=gen) / math.sqrt(r)


def random_projection(spec: ModuleSpec, rank: int, seed: int = 0) -> ModuleProjection:
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
    if cov.dim() != 2 or cov.shape[0] != cov.shape[1]:
        raise ValueError(f"{what}: expected a square covariance, got {tuple(cov.shape)}")
    if not torch.isfinite(cov).all():
        raise ValueError(f"{what}: covariance has NaN/Inf entries")
    if r >= cov.shape[0]:
        return None
    _, vecs = torch.linalg.eigh(cov.double())
    return vecs[:, -r:].flip(-1).T.contiguous().float()  # top-r, largest first


def pca_projection(
    spec: ModuleSpec, rank: int, statistics: Mapping[str, torch.Tensor]
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


def full_gradient(spec: ModuleSpec) -> ModuleProjection:
    """No projection: the whole per-sample gradient is stored (``rank=None``)."""
    return ModuleProjection(spec, spec.d_in, spec.d_out, None, None)


def _check_rank(rank: Any) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be a positive int or None, got {rank!r}")


def build_projections(
    specs: list[ModuleSpec],
    rank: int | None,
    init: str = "random",
    seed: int = 0,
    statistics: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, ModuleProjection]:
    """One :class:`ModuleProjection` per module, in ``specs`` order.

    Example:
        >>> specs = [module_spec("fc", torch.nn.Linear(4, 2))]
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
        return {s.name: pca_projection(s, rank, statistics) for s in specs}
    return {s.name: random_projection(s, rank, seed) for s in specs}


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
        >>> proj = random_projection(module_spec("model", lin), rank=2)
        >>> project_capture(caps[0], proj).shape
        torch.Size([3, 4])
    """
    if proj.p_in is None and proj.p_out is None:
        g = cap.per_sample_grad()
        rows = g.reshape(g.shape[0], -1)
        return rows if out is None else out.copy_(rows)
    p_in, p_out = _kernels(proj)
    if proj.spec.d_out is None:
        return cap.project(p_in, out=out)
    return cap.project(p_in, p_out, out=out)


def _kernels(proj: ModuleProjection) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``p_in``, ``p_out`` as the engine multiplies them, cached on ``proj``.

    Same values, column-major storage: the engine multiplies by ``p.T`` (and ``p_in[:, :-1].T``
    with a bias), which is then a contiguous operand, the fastest matmul layout.
    """
    cached = proj.__dict__.get("_kernels")
    if cached is not None and cached[0] is proj.p_in and cached[1] is proj.p_out:
        return cached[2], cached[3]
    p_in = proj.p_in if proj.p_in is not None else _eye(proj.spec.d_in)
    p_out = None
    if proj.spec.d_out is not None:
        p_out = proj.p_out if proj.p_out is not None else _eye(proj.spec.d_out)
        p_out = p_out.T.contiguous().T
    p_in = p_in.T.contiguous().T
    proj.__dict__["_kernels"] = (proj.p_in, proj.p_out, p_in, p_out)
    return p_in, p_out


_EYES: dict[int, torch.Tensor] = {}


def _eye(d: int) -> torch.Tensor:
    if d not in _EYES:
        _EYES[d] = torch.eye(d)
    return _EYES[d]


def forward_factor(proj: ModuleProjection, x: torch.Tensor, bias: bool) -> torch.Tensor:
    """``[N, r_in]`` = ``[x, 1] @ P_inᵀ`` (``x @ P_inᵀ`` without bias): the input half of a row.

    Example:
        >>> lin = torch.nn.Linear(6, 5)
        >>> proj = random_projection(module_spec("fc", lin), rank=2)
        >>> forward_factor(proj, torch.randn(3, 6), bias=True).shape
        torch.Size([3, 2])
    """
    p_in, _ = _kernels(proj)
    if bias:
        return torch.addmm(p_in[:, -1], x, p_in[:, :-1].T)
    return x @ p_in.T


def outer_rows(
    proj: ModuleProjection, ap: torch.Tensor, b: torch.Tensor, out: torch.Tensor
) -> bool:
    """Write ``vec(P_out b_i ⊗ ap_i)`` (one position per sample) into ``out``; True = all finite.

    ``ap`` ``[N, r_in]`` from :func:`forward_factor`, ``b`` ``[N, d_out]`` output gradients. The
    finiteness certificate costs two ``[N, r]`` reductions instead of a pass over the rows: when
    both factors are finite and ``max|bp_i| * max|ap_i|`` does not overflow, no entry of row i
    (a rounded product bounded by that one) can be NaN/Inf.

    Example:
        >>> lin = torch.nn.Linear(6, 5)
        >>> proj = random_projection(module_spec("fc", lin), rank=2)
        >>> ap = forward_factor(proj, torch.randn(3, 6), bias=True)
        >>> outer_rows(proj, ap, torch.randn(3, 5), torch.empty(3, 4))
        True
    """
    if proj.p_out is None:  # identity output side (d_out <= rank): no product needed
        bp = b
    else:
        bp = b @ _kernels(proj)[1].T  # type: ignore[union-attr]
    n, r_out, r_in = bp.shape[0], bp.shape[1], ap.shape[1]
    torch.mul(bp.view(n, r_out, 1), ap.view(n, 1, r_in), out=out.view(n, r_out, r_in))
    bound = bp.abs().amax(1).mul_(ap.abs().amax(1))
    return bool(torch.isfinite(bound).all())


class ForwardFactors:
    """Input halves of projected rows computed in the forward hook, while the input is in cache.

    A Linear called once per batch on ``[N, d_in]`` float32 input has a one-position
    per-sample gradient ``b_i a_iᵀ``: its projected row is the outer product of
    ``P_out b_i`` and ``P_in [a_i, 1]``. The second factor is computed here from the forward
    input (cheaper than re-reading the input from memory after the backward); :meth:`rows`
    finishes the row from the capture. Anything else (a second call in the batch, a sequence,
    a mask, another kind, autocast dtypes) is left to :func:`project_capture`.

    Example:
        >>> import nnstat
        >>> lin = torch.nn.Linear(6, 5)
        >>> proj = {"model": random_projection(module_spec("model", lin), rank=2)}
        >>> engine = nnstat.CaptureEngine(); _ = engine.watch(lin)
        >>> ff = ForwardFactors(); ff.start(proj); engine.add_consumer(ff); caps = []
        >>> engine.add_consumer(caps.append)
        >>> with engine.batch():
        ...     lin(torch.randn(3, 6)).sum().backward()
        >>> out = torch.empty(3, 4)
        >>> ff.rows(caps[0], proj["model"], out)
        True
        >>> torch.allclose(out, project_capture(caps[0], proj["model"]), atol=1e-6)
        True
    """

    def __init__(self) -> None:
        self.projections: Mapping[str, ModuleProjection] = {}
        self.active = False
        self._ap: dict[str, torch.Tensor | None] = {}

    def start(self, projections: Mapping[str, ModuleProjection]) -> None:
        """Collect factors under ``projections`` for the batch that begins (until :meth:`stop`)."""
        self.projections = projections
        self._ap.clear()
        self.active = True

    def stop(self) -> None:
        self.active = False
        self._ap.clear()

    def on_forward(self, name: str, module: nn.Module, x: Any, output: Any) -> None:
        if not self.active:
            return
        if name in self._ap:  # a second call in this batch: no single outer product
            self._ap[name] = None
            return
        proj = self.projections.get(name)
        ok = (
            proj is not None
            and proj.spec.kind == "linear"
            and isinstance(x, torch.Tensor)
            and x.dim() == 2
            and x.dtype == torch.float32
            and torch.is_grad_enabled()
        )
        bias = ok and getattr(module, "bias", None) is not None
        self._ap[name] = forward_factor(proj, x.detach(), bias) if ok else None  # type: ignore

    def rows(self, cap: Any, proj: ModuleProjection, out: torch.Tensor) -> bool | None:
        """Fill ``out`` from the stored factor: True/False = rows certified finite or not;
        None = this capture is not the single-call case (use :func:`project_capture`)."""
        ap = self._ap.get(cap.name)
        if ap is None or cap.kind != "linear" or ap.shape[0] != cap.num_samples:
            return None
        b = cap.backward
        if b.dim() != 3 or b.shape[1] != 1 or cap.num_positions != cap.num_samples:
            return None
        return outer_rows(proj, ap, b.view(b.shape[0], b.shape[2]), out)
