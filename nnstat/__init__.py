"""nnstat: watch a PyTorch network while it trains and explain it afterwards.

The public API is resolved lazily so that ``import nnstat`` stays fast and never imports
optional dependencies (wandb, tensorboard, transformers, lightning, matplotlib).

Example:
    >>> import nnstat, torch
    >>> model = torch.nn.Linear(4, 2)
    >>> W = nnstat.get_weight(model)
    >>> round(float(W.norm(2)), 3) >= 0
    True
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # foundation
    "NetDict": "nnstat.netdict",
    "get_weight": "nnstat.netdict",
    "get_grad": "nnstat.netdict",
    "get_optimizer_state": "nnstat.netdict",
    "get_update": "nnstat.netdict",
    "compute_stats": "nnstat.netdict",
    "UnknownStateKeyError": "nnstat.netdict",
    "trust_ratio": "nnstat.netdict",
    "update_ratio": "nnstat.netdict",
    "Tracker": "nnstat.tracker",
    "StepMetrics": "nnstat.tracker",
    # capture engine and statistics
    "CaptureEngine": "nnstat.capture",
    "Mean": "nnstat.curvature",
    "Covariance": "nnstat.curvature",
    "KFAC": "nnstat.curvature",
    "EKFAC": "nnstat.curvature",
    "StatisticsCollector": "nnstat.curvature",
    "ModuleCapture": "nnstat.capture",
    # runs and the gradient store
    "Run": "nnstat.run",
    "RunConfig": "nnstat.run",
    "init": "nnstat.run",
    "setup": "nnstat.run",
    "watch": "nnstat.run",
    "unwatch": "nnstat.run",
    "add_projection": "nnstat.run",
    "finalize": "nnstat.run",
    "eval": "nnstat.run",
    "train": "nnstat.run",
    "get_log": "nnstat.run",
    "build_log_dataloader": "nnstat.run",
    "GradientStore": "nnstat.store",
    "GradientLog": "nnstat.store",
    # noise scale
    "noise_scale": "nnstat.gradient_noise",
    "NoiseScale": "nnstat.gradient_noise",
    "NoiseScaleResult": "nnstat.gradient_noise",
    "critical_batch_size": "nnstat.gradient_noise",
    # recorder
    "Recorder": "nnstat.recorder",
}
_SUBMODULES = {
    "capture",
    "describe",
    "gradient_noise",
    "influence",
    "integrations",
    "netdict",
    "plot",
    "recorder",
    "run",
    "curvature",
    "store",
    "tracker",
    "viewer",
}

# old subpackage names, still importable with one DeprecationWarning (their shims in nnstat/)
_DEPRECATED_SUBMODULES = {"gns": "gradient_noise", "statistics": "curvature"}

__all__ = sorted([*_EXPORTS, *_SUBMODULES, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES or name in _DEPRECATED_SUBMODULES:
        module = importlib.import_module(f"nnstat.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'nnstat' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
