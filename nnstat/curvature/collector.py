"""`StatisticsCollector`: a capture consumer that keeps running sums and finalizes them once."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from nnstat.capture.capture import ModuleCapture
from nnstat.curvature import operations
from nnstat.curvature.operations import (
    STREAMS,
    Covariance,
    FactorForm,
    Statistic,
    check_factor_forms,
    diagonal_fallback_message,
    factor_eig,
    factor_form,
    is_diagonal,
)
from nnstat.curvature.passes import (
    PassSpec,
    StatisticSpec,
    grad_only,
    parse_max_factor_dim,
    parse_statistic,
    parse_streams,
    plan_passes,
    preset_of,
    statistic_json,
)
from nnstat.distributed import is_distributed

TENSORS_FILE = "statistics.safetensors"
JSON_FILE = "statistics.json"
#: the keys of a run configuration the collector reads (and ``statistics.json`` records)
CONFIG_KEYS = ("log", "save", "statistic", "max_factor_dim")


class StatisticsCollector:
    """Accumulate the statistics of a configuration over one or more passes.

    ``finalize()`` ends the current pass: sums (and counts) are all-reduced across
    ``torch.distributed`` ranks when initialised, divided once, and the next pass (if any)
    begins. Results: :meth:`state_dict` with keys ``"{module}/{stream}/{statistic}"``.

    K-FAC factors over ``max_factor_dim`` (the configuration's key, default
    :data:`~nnstat.curvature.operations.MAX_FACTOR_DIM`) are kept in the logged space of the
    side's store projection (:meth:`set_projections`) or, without one, as their diagonal with
    one warning per factor; :attr:`factor_forms` records each factor's form
    (:class:`~nnstat.curvature.operations.FactorForm`) and :meth:`save` writes it to
    ``statistics.json``.

    Args:
        config: a preset name, a statistic spec ``{stream: [statistics]}``, a dict of
            :data:`CONFIG_KEYS` or a run's :class:`nnstat.run.RunConfig`; ``None``: defaults
            (no statistics).
        prior: tensors of finalized statistics to start from (:meth:`load`).

    Raises:
        ValueError: an unknown configuration key or preset.
        TypeError: ``config`` of another type.

    Example:
        >>> import torch, nnstat
        >>> from nnstat.curvature import StatisticsCollector
        >>> model = torch.nn.Linear(3, 2)
        >>> engine = nnstat.CaptureEngine(); _ = engine.watch(model)
        >>> collector = StatisticsCollector("kfac"); engine.add_consumer(collector)
        >>> with engine.batch():
        ...     model(torch.randn(8, 3)).sum().backward()
        >>> collector.finalize()
        >>> sorted(collector.state_dict())
        ['model/backward/covariance', 'model/forward/covariance']
    """

    def __init__(
        self,
        config: Any = None,
        prior: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        values = _config_values(config)
        self.statistic: StatisticSpec = parse_statistic(values.get("statistic"))
        self._log = parse_streams("log", values.get("log", grad_only()))
        self._save = parse_streams("save", values.get("save", grad_only()))
        self._max_factor_dim = parse_max_factor_dim(values.get("max_factor_dim"))
        self._passes = plan_passes(self.statistic, self._log, self._save)
        self._pass = 0
        self._sums: dict[str, torch.Tensor] = {}
        # floats, or 0-d device tensors (a mask's count): read once, in finalize()
        self._counts: dict[str, float | torch.Tensor] = {}
        self._state: dict[str, torch.Tensor] = {
            k: v.detach().clone() for k, v in (prior or {}).items()
        }
        self.counts: dict[str, float] = {}
        self.kinds: dict[str, str] = {}
        #: ``{"{module}/{side}": FactorForm}`` of every K-FAC factor, decided at its first batch
        self.factor_forms: dict[str, FactorForm] = {}
        self._projections: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        # per factor side: the store projection its form was checked against (the Run passes
        # the same tensors every batch: compared by identity, not by value, per batch)
        self._checked: dict[str, torch.Tensor] = {}
        # (side, device) -> the factor form with its projection copied to that device once
        self._on_device: dict[tuple[str, torch.device], FactorForm] = {}

    @property
    def max_factor_dim(self) -> int:
        """Largest dense K-FAC factor (the configuration's ``max_factor_dim``, else the default)."""
        limit = self._max_factor_dim
        return operations.MAX_FACTOR_DIM if limit is None else int(limit)

    @property
    def preset(self) -> str | None:
        """The preset name when the statistic spec equals one, else ``None``."""
        return preset_of(self.statistic)

    def set_projections(
        self, projections: Mapping[str, tuple[torch.Tensor | None, torch.Tensor | None]]
    ) -> None:
        """The gradient store's ``{module: (p_in, p_out)}`` (``None``: that side unprojected):
        a factor over ``max_factor_dim`` on a projected side is kept as ``P C Pᵀ``."""
        self._projections = dict(projections)

    # ------------------------------------------------------------------ passes
    @property
    def current_pass(self) -> PassSpec | None:
        """The pass being accumulated, or ``None`` when every pass is finalized."""
        return self._passes[self._pass] if self._pass < len(self._passes) else None

    @property
    def passes(self) -> list[PassSpec]:
        return list(self._passes)

    @property
    def done(self) -> bool:
        return self._pass >= len(self._passes)

    # ---------------------------------------------------------------- consumer
    def on_capture(self, cap: ModuleCapture) -> None:
        """Add one module's batch to the running sums of the current pass."""
        spec = self.current_pass
        if spec is None:
            raise RuntimeError("all passes of this collector are finalized; create a new one")
        self.kinds[cap.name] = cap.kind
        for stream, classes in spec.statistic.items():
            for cls in classes:
                if spec.kfac and not cap.is_kronecker and stream != "grad":
                    # no Kronecker structure: K-FAC degenerates to the full gradient covariance
                    if stream == "forward" and cls is Covariance:
                        self._add(Covariance.key(cap.name, "grad"), cap, Covariance, "grad")
                    continue
                if spec.kfac and not cap.is_kronecker and cls.name == "eigenvalues":
                    continue  # the covariance above is exact; its eigenbasis needs no correction
                self._add(cls.key(cap.name, stream), cap, cls, stream)

    __call__ = on_capture

    def _form(self, cap: ModuleCapture, stream: str) -> FactorForm:
        """The form of ``cap``'s ``stream`` factor, decided at its first batch (one warning
        when it falls back to the diagonal), the same projection at every later batch."""
        side = f"{cap.name}/{stream}"
        p = self._projections.get(cap.name, (None, None))[0 if stream == "forward" else 1]
        form = self.factor_forms.get(side)
        if form is None:
            form = factor_form(cap, stream, self.max_factor_dim, p)
            self.factor_forms[side] = form
            if form.form == "projected":
                assert form.projection is not None
                self._state[f"{side}/projection"] = form.projection.detach().float().clone()
            elif form.form == "diagonal" and form.reason == "over max_factor_dim":
                warnings.warn(
                    diagonal_fallback_message(cap, stream, form.size, self.max_factor_dim),
                    stacklevel=5,
                )
        elif form.form == "projected" and p is not None and p is not self._checked.get(side):
            # a projection object not seen yet (a new store projection): compared by value once
            saved = self._state[f"{side}/projection"]
            if tuple(p.shape) != tuple(saved.shape) or not torch.equal(
                p.float().cpu(), saved.cpu()
            ):
                raise ValueError(
                    f"{side}: its factor is kept in the logged space of the projection of its "
                    "first batch, but the store's projection changed since; statistics and rows "
                    "would describe different spaces: start a new collector (a new project)"
                )
        if p is not None:
            self._checked[side] = p
        return self._near(form, side, cap.device)

    def _near(self, form: FactorForm, side: str, device: torch.device) -> FactorForm:
        """``form`` with its projection on ``device``, copied there once (a copy from pageable
        host memory every batch would wait for the device's queue each time)."""
        if form.projection is None or form.projection.device == device:
            return form
        key = (side, device)
        near = self._on_device.get(key)
        if near is None or near.form != form.form:
            near = dataclasses.replace(form, projection=form.projection.to(device))
            self._on_device[key] = near
        return near

    def _add(self, key: str, cap: ModuleCapture, cls: type[Statistic], stream: str) -> None:
        if cls is Covariance and stream in ("forward", "backward"):
            form = self._form(cap, stream)
            key = form.key(cap.name, stream)
            term, count = Covariance.contribution(cap, stream, self._state, form)
        else:
            term, count = cls.contribution(cap, stream, self._state)
        term = term.detach().to(torch.float32)
        # nothing is read back per batch: a NaN/Inf term leaves its running sum non-finite for
        # good, and finalize() checks every sum (one host read) and names the statistics
        if key in self._sums:
            self._sums[key] += term
        else:
            self._sums[key] = term.clone()
        if isinstance(count, torch.Tensor):  # float64: exact over a pass, like a Python float
            count = count.detach().to(torch.float64)
        self._counts[key] = self._counts.get(key, 0.0) + count

    def finalize(self) -> None:
        """End the current pass: all-reduce (if distributed), divide once, start the next pass."""
        spec = self.current_pass
        if spec is None:
            raise RuntimeError("finalize() called after the last pass")
        keys = sorted(self._sums)
        if not keys and any(spec.statistic.values()):
            raise RuntimeError(
                f"finalize(): nothing was captured in pass {spec.name!r}; add the collector to the "
                "engine (engine.add_consumer(collector)) and run backward inside engine.batch()"
            )
        _check_finite(keys, self._sums)
        counts = _host_counts(keys, self._counts)
        if is_distributed():
            _all_reduce(keys, self._sums, counts)
        self._counts = counts
        for k in keys:
            if self._counts[k] <= 0:
                raise ValueError(f"{k}: no positions were captured (all masked?)")
        for k in keys:
            # in place: the sums are this collector's own tensors, and a second copy of every
            # factor (1.3 GB for GPT-2 small) would be held until the loop ends
            c = self._counts[k]
            self._state[k] = self._sums.pop(k).div_(c)
            self.counts[k] = c
        self._sums, self._counts = {}, {}
        self._pass += 1
        if any(self._needs_eigens(p) for p in self._passes[self._pass :]):
            self._add_eigenbases()

    @staticmethod
    def _needs_eigens(p: PassSpec) -> bool:
        return any(c.name == "eigenvalues" for c in p.statistic.get("grad", ()))

    def _add_eigenbases(self) -> None:
        for key in list(self._state):
            mod, stream, stat = key.rsplit("/", 2)
            if stat in ("covariance", "projected_covariance") and stream in ("forward", "backward"):
                vals, vecs = factor_eig(self._state[key])
                pre = f"{mod}/{stream}/" + ("projected_" if stat != "covariance" else "")
                if vecs is not None:  # a diagonal factor's eigenbasis is the identity: not stored
                    self._state[f"{pre}eigenvectors"] = vecs.float().contiguous()
                self._state[f"{pre}eigenvalues"] = vals.float()

    # ---------------------------------------------------------------- results
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Finalized results (and K-FAC eigenbases when computed), keyed by state key."""
        return dict(self._state)

    def spectral_summary(self) -> dict[str, float]:
        """Per factor: ``{"kfac/<module>/<factor>/<stat>": float}`` (a Tracker provider).

        ``stat`` ∈ trace, max_eig, condition_number (λmax / λmin with λmin floored at
        λmax·eps(float32)), effective_rank (exp of the entropy of λ/Σλ, Roy & Vetterli 2007).
        Factors: ``forward`` (A), ``backward`` (S), ``grad`` (full gradient covariance).
        """
        out: dict[str, float] = {}
        for key, value in self._state.items():
            mod, stream, stat = key.rsplit("/", 2)
            if stat != "covariance" or value.dim() not in (1, 2):
                continue
            for k, v in spectrum_stats(value).items():
                out[f"kfac/{mod}/{stream}/{k}"] = v
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``statistics.safetensors`` + ``statistics.json`` into directory ``path``."""
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.contiguous() for k, v in self._state.items()}
        save_tensors_file(tensors, root / TENSORS_FILE)
        meta = {
            "config": {
                "log": dict(self._log),
                "save": dict(self._save),
                "statistic": statistic_json(self.statistic),
                "max_factor_dim": self._max_factor_dim,
            },
            "passes_done": [p.name for p in self._passes[: self._pass]],
            "counts": self.counts,
            "kinds": self.kinds,
            "factors": {k: f.to_json() for k, f in sorted(self.factor_forms.items())},
        }
        (root / JSON_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True))
        return root

    @classmethod
    def load(cls, path: str | os.PathLike) -> StatisticsCollector:
        """Reload a saved collector (safetensors + JSON; nothing is unpickled)."""

        root = Path(path)
        meta = json.loads((root / JSON_FILE).read_text())
        prior = load_file(str(root / TENSORS_FILE))
        factors = meta.get("factors")
        if factors is not None:  # statistics.json of nnstat before factor forms: not checked
            shape_of = lambda k: tuple(prior[k].shape) if k in prior else None  # noqa: E731
            check_factor_forms(factors, shape_of, list(prior), str(root))
        # statistics.json of older nnstat also recorded the run's capture and store keys
        # (loss_reduction, dtype, ...): they do not shape the statistics and are not read
        config = {k: v for k, v in meta["config"].items() if k in CONFIG_KEYS}
        col = cls(config, prior=prior)
        col._pass = len(meta["passes_done"])
        col.counts = {k: float(v) for k, v in meta["counts"].items()}
        col.kinds = dict(meta["kinds"])
        for side, info in (factors or {}).items():
            p = prior.get(f"{side}/projection") if info["form"] == "projected" else None
            col.factor_forms[side] = FactorForm(
                info["form"], int(info["size"]), info.get("reason", ""), p
            )
        return col


def save_tensors_file(tensors: Mapping[str, torch.Tensor], path: Path) -> None:
    """Save ``tensors`` as a safetensors file at ``path``, atomically (a temporary file renamed
    over it), with the mode any new file of the process gets (``0o666`` less the umask).

    safetensors' ``save_file`` streams the tensors to disk (``save`` would hold a second copy
    of them in memory, gigabytes of K-FAC factors) but creates its file ``0600``: the mode is
    taken from a file created the ordinary way at the temporary name, which ``save_file`` then
    replaces.

    Args:
        tensors: contiguous tensors by name.
        path: the file to write (replaced when it exists).

    Example:
        >>> import tempfile
        >>> p = Path(tempfile.mkdtemp()) / "t.safetensors"
        >>> save_tensors_file({"a": torch.zeros(2)}, p); sorted(load_file(str(p)))
        ['a']
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            mode = os.fstat(fd).st_mode & 0o777  # the umask (or a default ACL) applied
        finally:
            os.close(fd)
        save_file(dict(tensors), str(tmp))
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _config_values(config: Any) -> dict[str, Any]:
    """The :data:`CONFIG_KEYS` values of what the collector accepts: ``None`` (defaults), a
    preset name, a statistic spec ``{stream: [...]}``, a dict of configuration keys, or a
    run configuration (``nnstat.run.RunConfig``, read by attribute: this package is below
    ``nnstat.run`` and does not import it)."""
    if config is None:
        return {}
    if isinstance(config, str):
        return {"statistic": config}
    if isinstance(config, Mapping):
        if set(config) <= set(STREAMS):
            return {"statistic": dict(config)}  # a bare low-level statistic spec
        unknown = [k for k in config if k not in CONFIG_KEYS]
        if unknown:
            raise ValueError(
                f"unknown statistics key {unknown[0]!r}; valid keys: {', '.join(CONFIG_KEYS)} "
                "(or the stream names of a statistic spec); a run's other keys configure "
                "capture and the store: pass its RunConfig itself"
            )
        return dict(config)
    if all(hasattr(config, k) for k in CONFIG_KEYS):
        return {k: getattr(config, k) for k in CONFIG_KEYS}
    raise TypeError(
        f"config must be a preset name, a dict or a RunConfig, got {type(config).__name__}"
    )


def spectrum_stats(m: torch.Tensor) -> dict[str, float]:
    """Trace, largest eigenvalue, condition number and effective rank of a PSD matrix (a 1-D
    tensor is a diagonal factor: its entries are the eigenvalues).

    Example:
        >>> s = spectrum_stats(torch.tensor([4.0, 1.0]))  # eigenvalues 4 and 1
        >>> s["trace"], s["max_eig"], s["condition_number"], round(s["effective_rank"], 4)
        (5.0, 4.0, 4.0, 1.6494)
    """
    ev = m.double() if is_diagonal(m) else torch.linalg.eigvalsh(m.double())
    ev = ev.sort().values.clamp(min=0)
    top = float(ev[-1])
    trace = float(ev.sum())
    if top <= 0:
        return {"trace": trace, "max_eig": 0.0, "condition_number": math.inf, "effective_rank": 0.0}
    floor = top * torch.finfo(torch.float32).eps
    p = ev / ev.sum()
    p = p[p > 0]
    return {
        "trace": trace,
        "max_eig": top,
        "condition_number": top / max(float(ev[0]), floor),
        "effective_rank": float(torch.exp(-(p * p.log()).sum())),
    }


def _check_finite(keys: list[str], sums: Mapping[str, torch.Tensor]) -> None:
    """Refuse a pass whose running sums hold NaN/Inf (a batch's contribution had them; a sum
    that overflowed float32 too): one host read for all of them."""
    if not keys:
        return
    ok = torch.stack([torch.isfinite(sums[k]).all().to(sums[keys[0]].device) for k in keys])
    bad = [k for k, fine in zip(keys, ok.tolist(), strict=True) if not fine]
    if bad:
        raise FloatingPointError(
            f"{bad[:5]}{' ...' if len(bad) > 5 else ''}: non-finite values in the statistics "
            "of this pass (a batch's contribution held NaN/Inf, or the sum overflowed float32); "
            "nothing was finalized. Find the batch with non-finite inputs or gradients (e.g. "
            "torch.autograd.set_detect_anomaly) and log the pass again without it"
        )


def _host_counts(keys: list[str], counts: Mapping[str, float | torch.Tensor]) -> dict[str, float]:
    """The counts as floats; those left on the device (masked positions) in one host read."""
    on_device = [k for k in keys if isinstance(counts[k], torch.Tensor)]
    out = {k: float(counts[k]) for k in keys if k not in on_device}
    if on_device:
        device = counts[on_device[0]].device
        values = torch.stack([counts[k].to(device, torch.float64) for k in on_device])
        out.update(zip(on_device, values.tolist(), strict=True))
    return out


def _all_reduce(keys: list[str], sums: dict[str, torch.Tensor], counts: dict[str, float]) -> None:
    # every rank must hold the same keys, or the flat buffers would be summed misaligned
    sig = torch.tensor([len(keys), zlib.crc32("\n".join(keys).encode())], dtype=torch.float64)
    ref = sig.clone()
    dist.broadcast(ref, src=0)
    if not torch.equal(sig, ref):
        raise RuntimeError(
            f"rank {dist.get_rank()} holds statistics {keys} that differ from rank 0's; "
            "every rank must watch the same modules and capture at least one batch"
        )
    if not keys:
        return
    flat = torch.cat([sums[k].reshape(-1).double() for k in keys])
    cnt = torch.tensor([counts[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(flat)
    dist.all_reduce(cnt)
    off = 0
    for i, k in enumerate(keys):
        n = sums[k].numel()
        sums[k] = flat[off : off + n].reshape(sums[k].shape).float()
        counts[k] = float(cnt[i])
        off += n


def check_saved_forms(stats: Mapping[str, Any], root: str | os.PathLike) -> None:
    """Refuse ``stats`` (the tensors of ``root``'s ``statistics.safetensors``) when they disagree
    with the factor forms its ``statistics.json`` records (dense, diagonal or projected): a
    diagonal factor read as a dense one, or the reverse, would precondition with another matrix.
    Statistics without a ``statistics.json``, or one written before factor forms, are not
    checked (their only 1-D factors are embeddings' token counts)."""
    path = Path(root) / JSON_FILE
    if not stats or not path.exists():
        return
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the factor forms of the statistics: {e}") from e
    factors = meta.get("factors") if isinstance(meta, dict) else None
    if factors is None:
        return
    shape = getattr(stats, "shape", None)  # LazyStatistics: shapes without reading the data

    def shape_of(key: str) -> tuple[int, ...] | None:
        if key not in stats:
            return None
        return tuple(shape(key)) if callable(shape) else tuple(stats[key].shape)

    check_factor_forms(factors, shape_of, list(stats), str(path))
