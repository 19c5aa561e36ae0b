"""Pieces of :class:`nnstat.run.Run` that are plain functions: configuration, meta, I/O, DDP.

Example:
    >>> settings = parse_config({"log": "grad", "save": "grad", "statistic": "kfac"})
    >>> settings.save_grad, settings.store.nonfinite
    (True, 'error')
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

import nnstat
from nnstat.projection import ModuleProjection, ModuleSpec, layout, projection_tensors
from nnstat.store import format as fmt
from nnstat.store.logger import StoreOptions

# keys of setup() handled by the store; everything else belongs to nnstat.config.RunConfig
STORE_KEYS = ("param_grads", *StoreOptions.keys())
# store options that do not change what is stored (excluded from meta.json's configuration)
_OPERATIONAL = {"shard_rows", "queue_size", "size_budget_bytes", "num_samples", "on_stored_id"}


@dataclass
class RunSettings:
    """The parsed configuration of a run: the capture/statistics part and the store part."""

    raw: dict[str, Any] = field(default_factory=dict)
    run_config: Any = None
    store: StoreOptions = field(default_factory=StoreOptions)
    param_grads: bool = True

    @property
    def save_grad(self) -> bool:
        return bool(_stream_flag(self.run_config, "save", "grad"))

    @property
    def statistics_on(self) -> bool:
        return _has_statistics(self.run_config)

    @property
    def loss_reduction(self) -> str:
        return str(getattr(self.run_config, "loss_reduction", "sum"))

    def content(self) -> dict[str, Any]:
        """Configuration recorded in meta.json (and compared when resuming)."""
        out = {"run": _jsonable(_config_dict(self.run_config))}
        out["store"] = {k: v for k, v in self.store.as_dict().items() if k not in _OPERATIONAL}
        return out


def parse_config(config: Mapping[str, Any], base: RunSettings | None = None) -> RunSettings:
    """Merge ``config`` into ``base`` (or the defaults); unknown keys name the valid ones."""
    from nnstat.config import RunConfig

    if not isinstance(config, Mapping):
        raise TypeError(f"setup() takes a dict, got {type(config).__name__}")
    base = base or RunSettings()
    raw = {**base.raw, **dict(config)}
    store_part = {k: v for k, v in raw.items() if k in STORE_KEYS}
    run_part = {k: v for k, v in raw.items() if k not in STORE_KEYS}
    try:
        run_config = RunConfig.from_dict(run_part)
    except (KeyError, ValueError) as e:
        unknown = [k for k in run_part if k not in RunConfig.keys()]
        if unknown:
            valid = sorted([*RunConfig.keys(), *STORE_KEYS])
            raise ValueError(f"unknown setup keys {unknown}; valid keys: {valid}") from e
        raise
    param_grads = store_part.pop("param_grads", True)
    if not isinstance(param_grads, bool):
        raise ValueError(f"param_grads must be True or False, got {param_grads!r}")
    store = replace(StoreOptions(), **store_part)
    return RunSettings(raw, run_config, store, param_grads)


def _config_dict(cfg: Any) -> Any:
    for attr in ("to_dict", "as_dict"):
        if callable(getattr(cfg, attr, None)):
            return getattr(cfg, attr)()
    return repr(cfg)


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, type):
        return x.__name__
    if x is None or isinstance(x, bool | int | float | str):
        return x
    return getattr(x, "__name__", None) or type(x).__name__


def _stream_flag(cfg: Any, section: str, stream: str) -> bool:
    value = getattr(cfg, section, None)
    if isinstance(value, Mapping):
        return bool(value.get(stream, False))
    return bool(getattr(value, stream, False))


def _has_statistics(cfg: Any) -> bool:
    stat = getattr(cfg, "statistic", None)
    if isinstance(stat, Mapping):
        return any(bool(v) for v in stat.values())
    return bool(stat) and stat != "none"


def config_passes(settings: RunSettings) -> list[Any]:
    """The passes the configuration needs (``RunConfig.passes()``)."""
    return list(settings.run_config.passes())


def make_collector(settings: RunSettings, pass_index: int) -> Any:
    """The statistics collector of one pass."""
    from nnstat.statistics import StatisticsCollector

    return StatisticsCollector(settings.run_config, pass_index=pass_index)


def save_statistics(collector: Any, path: Path, rank: int) -> None:
    """Finalize ``collector`` (all-reduced under DDP) and save it in the store directory."""
    collector.finalize()
    if rank == 0:
        Path(path).mkdir(parents=True, exist_ok=True)
        collector.save(path)


def finalized_statistics(collector: Any, path: Path) -> dict[str, torch.Tensor]:
    """Statistics of the current run, else ``statistics.safetensors`` of the store, else ``{}``."""
    if collector is not None and getattr(collector, "finalized", False):
        return dict(collector.state_dict())
    return load_tensors(Path(path) / fmt.STATISTICS_FILE)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """safetensors file as a dict, ``{}`` when absent."""
    if not Path(path).exists():
        return {}
    from safetensors.torch import load_file

    return load_file(str(path))


def dist_info() -> tuple[int, int]:
    """``(rank, world_size)`` under an initialised ``torch.distributed``, else ``(0, 1)``."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def build_meta(
    project: str,
    settings: RunSettings,
    projection_args: Mapping[str, Any],
    projections: Mapping[str, ModuleProjection],
) -> dict[str, Any]:
    """meta.json for rows made with ``projections`` (see docs/architecture.md)."""
    mods = layout(projections)
    tensors = projection_tensors(projections)
    return {
        "format_version": fmt.FORMAT_VERSION,
        "nnstat_version": nnstat.__version__,
        "project": project,
        "config": settings.content(),
        "dtype": settings.store.dtype,
        "row_width": sum(m["width"] for m in mods),
        "modules": mods,
        "projection": {
            "rank": projection_args["rank"],
            "init": projection_args["init"] if projection_args["rank"] is not None else None,
            "seed": projection_args["seed"],
            "seed_rule": "torch.Generator().manual_seed(seed * 1000003 + crc32(name)); "
            "p_in then p_out, N(0, 1/r); identity where r >= dim",
        },
        "projection_seed": projection_args["seed"],
        "projection_sha256": fmt.tensors_hash(tensors),
        "nonfinite": settings.store.nonfinite,
        "skipped_rows": 0,
    }


def write_projections(path: Path, projections: Mapping[str, ModuleProjection], rank: int) -> None:
    """Save ``projections.safetensors`` once (rank 0); a resumed store keeps its file."""
    target = Path(path) / fmt.PROJECTIONS_FILE
    if rank != 0 or target.exists():
        return
    from safetensors.torch import save

    Path(path).mkdir(parents=True, exist_ok=True)
    tensors = projection_tensors(projections)
    fmt.atomic_write_bytes(target, save(tensors) if tensors else save({}))


def projection_tensors_of(
    projections: Mapping[str, ModuleProjection] | None,
) -> dict[str, torch.Tensor]:
    return projection_tensors(projections) if projections else {}


def projections_from_store(path: Path, engine: Any) -> dict[str, ModuleProjection]:
    """Rebuild the projections of a store so a new process logs queries in the same space."""
    from nnstat.store.reader import GradientStore

    store = GradientStore(path)
    tensors = store.projections()
    watched = list(engine.watched)
    stored = [m["name"] for m in store.modules]
    if watched != stored:
        raise ValueError(
            f"the watched modules {watched} differ from the store's {stored} ({path}); watch the "
            "same modules of the same model to log queries against this store"
        )
    out: dict[str, ModuleProjection] = {}
    for m in store.modules:
        spec = ModuleSpec(m["name"], m["kind"], int(m["d_in"]), m["d_out"])
        out[m["name"]] = ModuleProjection(
            spec,
            int(m["r_in"]),
            m["r_out"],
            tensors.get(f"{m['name']}/p_in"),
            tensors.get(f"{m['name']}/p_out"),
        )
    return out


def freeze_params(engine: Any) -> Callable[[], None]:
    """Turn off ``requires_grad`` of watched modules' parameters; return the restore function."""
    saved: list[tuple[torch.nn.Parameter, bool]] = []
    seen: set[int] = set()
    for module in engine.watched.values():
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                saved.append((p, p.requires_grad))
    for p, _ in saved:
        p.requires_grad_(False)

    def restore() -> None:
        for p, flag in saved:
            p.requires_grad_(flag)

    return restore
