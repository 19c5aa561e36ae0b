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
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

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
    "train",
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

    Args:
        project: name of the store directory under ``root_dir``.
        root_dir: parent directory of projects.
        config: an initial :class:`RunConfig` or its dict form (as :func:`setup` takes).
        overwrite: let the first logging pass replace what the store holds.

    Returns:
        The new current :class:`Run`.

    Raises:
        ValueError: ``project`` is not a plain directory name, or ``config`` is invalid.

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
    """The run :func:`init` created last.

    Returns:
        The current :class:`Run`.

    Raises:
        RuntimeError: no run yet (call :func:`init` first).

    Example:
        >>> import tempfile
        >>> current_run() is init(project="doc", root_dir=tempfile.mkdtemp())
        False
        >>> run = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> current_run() is run
        True
    """
    if _CURRENT is None:
        raise RuntimeError("no current run: call nnstat.init(project=...) first")
    return _CURRENT


def setup(config: RunConfig | Mapping[str, Any]) -> Run:
    """:meth:`Run.setup` on the current run.

    Args:
        config: a :class:`RunConfig` (replaces the configuration) or a dict of its keys
            (updates the current one, keeping the rest).

    Returns:
        The current run.

    Raises:
        ValueError: an unknown key or an invalid value, named in the message.
        RuntimeError: no current run (call :func:`init` first).

    Example:
        >>> import tempfile
        >>> _ = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> setup({"log": "grad", "save": "grad", "statistic": "kfac"}).config.loss_reduction
        'sum'
    """
    return current_run().setup(config)


def watch(
    model: nn.Module,
    name_filter: str | Iterable[str] | None = None,
    type_filter: type | str | Iterable[type | str] | None = None,
) -> list[str]:
    """:meth:`Run.watch` on the current run.

    Args:
        model: the network whose supported modules are watched.
        name_filter: regex (or list of regexes) of module names to keep; ``None``: all.
        type_filter: module classes or class names to keep; ``None``: all supported.

    Returns:
        The names of the watched modules.

    Raises:
        RuntimeError: no current run (call :func:`init` first), or a logging pass is open
            (call :func:`finalize` first).
        ValueError: a filter selects a module that cannot be captured, or one already watched.
        TypeError: ``model`` is not an ``nn.Module``.

    Example:
        >>> import tempfile
        >>> model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
        >>> _ = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> watch(model)
        ['0', '2']
        >>> _ = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> watch(model, name_filter="^2$")  # only the last layer
        ['2']
    """
    return current_run().watch(model, name_filter=name_filter, type_filter=type_filter)


def unwatch() -> None:
    """:meth:`Run.unwatch` on the current run: every hook removed, the model as before.

    Raises:
        RuntimeError: no current run (call :func:`init` first).

    Example:
        >>> import tempfile
        >>> model = nn.Linear(4, 2)
        >>> _ = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> _ = watch(model)
        >>> unwatch()  # every hook removed: the model can be watched afresh
        >>> watch(model)
        ['model']
    """
    current_run().unwatch()


def add_projection(rank: int | None = 64, init: str = "random", seed: int = 0) -> dict:
    """:meth:`Run.add_projection` on the current run.

    Args:
        rank: per-side rank of each module's projection (``rank x rank`` rows); ``None``
            stores full per-sample gradients.
        init: ``"random"`` (Gaussian from ``seed``) or ``"pca"`` (top eigenvectors of a
            previous statistics pass).
        seed: seed of the random projections.

    Returns:
        The layout ``{module: (r_out, r_in)}``.

    Raises:
        RuntimeError: no current run (call :func:`init` first), no watched model, or a
            logging pass is open.
        ValueError: ``init="pca"`` without a statistics pass, or an invalid ``rank``/``init``.

    Example:
        >>> import tempfile
        >>> _ = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> _ = watch(nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2)))
        >>> add_projection(rank=4)  # each row: 4 x 4 per layer, min(4, dim) per side
        {'0': (4, 4), '2': (2, 4)}
    """
    return current_run().add_projection(rank=rank, init=init, seed=seed)


def run(data_id: Any = None, mask: torch.Tensor | None = None) -> Any:
    """``with nnstat.run(data_id=ids):`` on the current run: the block whose backward is
    logged (``data_id``: one id per sample; ``mask``: which positions count, for sequences).

    Example:
        >>> import tempfile
        >>> model = nn.Linear(4, 2)
        >>> _ = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> _ = setup({"log": "grad", "save": "grad"}), watch(model)
        >>> with run(data_id=[7, 8]):
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> finalize()
        >>> [ids for ids, _ in build_log_dataloader()]
        [[7, 8]]
    """
    return current_run()(data_id=data_id, mask=mask)


def schedule() -> Iterator[int]:
    """:meth:`Run.schedule` on the current run: one loop per pass the configuration needs
    (EK-FAC: ``factors``, then ``eigenvalues`` with the rows), each finalized.

    Example:
        >>> import tempfile
        >>> model = nn.Linear(4, 2)
        >>> r = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> _ = setup({"log": "grad", "save": "grad", "statistic": "ekfac"}), watch(model)
        >>> for spec in schedule():
        ...     with r(data_id=[0, 1]):
        ...         model(torch.randn(2, 4)).sum().backward()
        ...     print(spec.name)
        factors
        eigenvalues
    """
    return current_run().schedule()


def finalize() -> None:
    """:meth:`Run.finalize` on the current run: flush the store, save statistics.

    Raises:
        RuntimeError: no current run (call :func:`init` first).
        Exception: the store writer's error (disk full, a failed write), re-raised here.

    Example:
        >>> import tempfile
        >>> model = nn.Linear(4, 2)
        >>> run = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> _ = setup({"log": "grad", "save": "grad"}), watch(model)
        >>> with run(data_id=["a", "b"]):
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> finalize()  # the rows are on disk now
        >>> [ids for ids, rows in build_log_dataloader()]
        [['a', 'b']]
    """
    current_run().finalize()


def eval() -> Run:  # noqa: A001 - the seed's API name
    """:meth:`Run.eval` on the current run: capture query rows in memory, save nothing.

    Returns:
        The current run, in eval mode.

    Raises:
        RuntimeError: no current run (call :func:`init` first), or a logging pass is open
            (call :func:`finalize` first).

    Example:
        >>> import tempfile
        >>> _ = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> eval()  # doctest: +ELLIPSIS
        Run(project='doc', path='...', mode='eval')
    """
    return current_run().eval()


def train() -> Run:
    """:meth:`Run.train` on the current run: back to logging mode (the opposite of :func:`eval`).

    Returns:
        The current run, in logging mode: its next ``run(...)`` blocks are saved to the store
        (and feed the statistics) as before :func:`eval`.

    Raises:
        RuntimeError: no current run (call :func:`init` first).

    Example:
        >>> import tempfile
        >>> _ = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> eval().mode, train().mode
        ('eval', 'log')
    """
    return current_run().train()


def get_log() -> GradientLog:
    """:meth:`Run.get_log` on the current run.

    Returns:
        A :class:`~nnstat.store.GradientLog` of the rows captured since :func:`eval` (or the
        previous ``get_log``), which are then cleared.

    Raises:
        RuntimeError: no current run (call :func:`init` first), the run is not in eval mode,
            or nothing was captured.

    Example:
        >>> import tempfile
        >>> model = nn.Linear(4, 2)
        >>> run = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> _ = watch(model), eval()
        >>> with run(data_id=["q0", "q1"]):
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> log = get_log()  # the query rows, in memory: score them with nnstat.influence
        >>> log.ids, tuple(log.rows.shape)
        (['q0', 'q1'], (2, 10))
    """
    return current_run().get_log()


def build_log_dataloader(batch_size: int = 1024, num_workers: int = 0) -> DataLoader:
    """:meth:`Run.build_log_dataloader` on the current run.

    Args:
        batch_size: rows per block.
        num_workers: DataLoader worker processes.

    Returns:
        A DataLoader of ``(ids, rows)`` blocks over the run's store.

    Raises:
        RuntimeError: no current run (call :func:`init` first), or a logging pass is open
            (call :func:`finalize` first).

    Example:
        >>> import tempfile
        >>> model = nn.Linear(4, 2)
        >>> run = init(project="doc", root_dir=tempfile.mkdtemp())
        >>> _ = watch(model)
        >>> with run(data_id=[0, 1, 2]):
        ...     model(torch.randn(3, 4)).sum().backward()
        >>> finalize()
        >>> [(ids, tuple(rows.shape)) for ids, rows in build_log_dataloader(batch_size=2)]
        [([0, 1], (2, 10)), ([2], (1, 10))]
    """
    return current_run().build_log_dataloader(batch_size=batch_size, num_workers=num_workers)
