"""The current-run functions (LogIX's vocabulary): each acts on the run :func:`init` made last.

Example:
    >>> import nnstat, torch
    >>> model = torch.nn.Linear(4, 2)
    >>> run = nnstat.init(project="doc", root_dir=__import__("tempfile").mkdtemp())
    >>> _ = nnstat.setup({"log": "grad", "save": "grad", "statistic": "none"})
    >>> nnstat.watch(model)
    ['model']
    >>> with run(data_id=[10, 11]):
    ...     model(torch.randn(2, 4)).sum().backward()
    >>> nnstat.finalize()
    >>> nnstat.GradientStore(run.path).ids
    [10, 11]
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nnstat.run.config import RunConfig
from nnstat.run.core import Run
from nnstat.store.reader import GradientLog

__all__ = [
    "init",
    "current_run",
    "setup",
    "watch",
    "unwatch",
    "add_projection",
    "run",
    "schedule",
    "finalize",
    "eval",
    "get_log",
    "build_log_dataloader",
]

_CURRENT: Run | None = None


# ------------------------------------------------------------------ module-level API
def init(
    project: str,
    root_dir: str | Path = "./nnstat_logs",
    config: RunConfig | Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Run:
    """Create a new current :class:`Run` (calling it again starts another one).

    ``overwrite=True``: its first logging pass replaces what the store holds (see :class:`Run`).

    Example:
        >>> run = init(project="my_project")  # doctest: +SKIP
    """
    global _CURRENT
    if _CURRENT is not None and _CURRENT._logger is not None:
        warnings.warn(
            f"init(): the current run {_CURRENT.project!r} has a logging pass that was not "
            "finalize()d; it stays open (call its finalize() to flush it)",
            stacklevel=2,
        )
    _CURRENT = Run(project, root_dir=root_dir, config=config, overwrite=overwrite)
    return _CURRENT


def current_run() -> Run:
    """The run :func:`init` created last."""
    if _CURRENT is None:
        raise RuntimeError("no current run: call nnstat.init(project=...) first")
    return _CURRENT


def setup(config: RunConfig | Mapping[str, Any]) -> Run:
    """:meth:`Run.setup` on the current run."""
    return current_run().setup(config)


def watch(model: nn.Module, name_filter: Any = None, type_filter: Any = None) -> list[str]:
    """:meth:`Run.watch` on the current run."""
    return current_run().watch(model, name_filter=name_filter, type_filter=type_filter)


def unwatch() -> None:
    """:meth:`Run.unwatch` on the current run."""
    current_run().unwatch()


def add_projection(rank: int | None = 64, init: str = "random", seed: int = 0) -> dict:
    """:meth:`Run.add_projection` on the current run."""
    return current_run().add_projection(rank=rank, init=init, seed=seed)


def run(data_id: Any = None, mask: torch.Tensor | None = None) -> Any:
    """``with nnstat.run(data_id=ids):`` on the current run."""
    return current_run()(data_id=data_id, mask=mask)


def schedule() -> Iterator[int]:
    """:meth:`Run.schedule` on the current run."""
    return current_run().schedule()


def finalize() -> None:
    """:meth:`Run.finalize` on the current run."""
    current_run().finalize()


def eval() -> Run:  # noqa: A001 - the seed's API name
    """:meth:`Run.eval` on the current run."""
    return current_run().eval()


def get_log() -> GradientLog:
    """:meth:`Run.get_log` on the current run."""
    return current_run().get_log()


def build_log_dataloader(batch_size: int = 1024, num_workers: int = 0) -> Any:
    """:meth:`Run.build_log_dataloader` on the current run."""
    return current_run().build_log_dataloader(batch_size=batch_size, num_workers=num_workers)
