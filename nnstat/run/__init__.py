"""nnstat.run: the Run, LogIX-style logging over one capture engine, statistics and the store.

A :class:`Run` composes one :class:`~nnstat.capture.CaptureEngine` (the only hooks), the
statistics collector and the gradient store's logger as consumers. The module-level functions
(`init`, `setup`, `watch`, `finalize`, `get_log`, `build_log_dataloader`, ...) act on the current
run, the last one `init` created; ``nnstat.run`` itself is callable, so
``with nnstat.run(data_id=ids):`` works as ``with run(data_id=ids):`` does.

Example:
    >>> import nnstat, torch, tempfile
    >>> model = torch.nn.Linear(4, 2)
    >>> run = nnstat.init(project="doc", root_dir=tempfile.mkdtemp())
    >>> _ = nnstat.setup({"log": "grad", "save": "grad", "statistic": "none"})
    >>> nnstat.watch(model)
    ['model']
    >>> with nnstat.run(data_id=[10, 11]):
    ...     model(torch.randn(2, 4)).sum().backward()
    >>> nnstat.finalize()
    >>> nnstat.GradientStore(run.path).ids
    [10, 11]
"""

import sys
import types
from typing import Any

import torch

from nnstat.run.config import RunConfig
from nnstat.run.core import Run
from nnstat.run.current import (
    add_projection,
    build_log_dataloader,
    current_run,
    eval,
    finalize,
    get_log,
    init,
    run,
    schedule,
    setup,
    train,
    unwatch,
    watch,
)

__all__ = [
    "Run",
    "RunConfig",
    "add_projection",
    "build_log_dataloader",
    "current_run",
    "eval",
    "finalize",
    "get_log",
    "init",
    "run",
    "schedule",
    "setup",
    "train",
    "unwatch",
    "watch",
]


class _CallableModule(types.ModuleType):
    """Makes ``nnstat.run`` (this package) usable as ``with nnstat.run(data_id=ids):``."""

    def __call__(self, data_id: Any = None, mask: torch.Tensor | None = None) -> Any:
        return run(data_id=data_id, mask=mask)


sys.modules[__name__].__class__ = _CallableModule
