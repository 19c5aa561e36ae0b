"""nnstat.store: the on-disk store of (projected) per-sample gradients.

Example:
    >>> from nnstat.store import GradientStore
    >>> store = GradientStore("./nnstat_logs/my_project")  # doctest: +SKIP
"""

from nnstat.store.errors import ModelChangedError, StoreLockedError, StoreWriteError
from nnstat.store.ids import content_id
from nnstat.store.meta import FORMAT_VERSION
from nnstat.store.reader import (
    GradientLog,
    GradientStore,
    LogBlockDataset,
    make_log_dataloader,
    module_view,
)
from nnstat.store.writer import StoreWriter

__all__ = [
    "FORMAT_VERSION",
    "GradientLog",
    "GradientStore",
    "LogBlockDataset",
    "ModelChangedError",
    "StoreLockedError",
    "StoreWriteError",
    "StoreWriter",
    "content_id",
    "make_log_dataloader",
    "module_view",
]
