"""TensorBoard sink: scalars with ``group/layer/stat`` tags and device-computed histograms.

``tensorboard`` is imported only when a `TensorBoardSink` is constructed.

Example:
    >>> import tempfile, torch, nnstat
    >>> from nnstat.integrations.tensorboard import TensorBoardSink
    >>> model = torch.nn.Linear(2, 1)
    >>> with nnstat.Tracker(model, sinks=[TensorBoardSink(tempfile.mkdtemp())]) as tracker:
    ...     _ = tracker.step()
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from nnstat.integrations._owners import FlushOwners

from nnstat.describe import Histogram, metric_scalar

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Write a Tracker's flat metrics dict to TensorBoard event files.

    Numbers go through ``add_scalar`` (one tag per key, so all layers share one run — unlike
    ``add_scalars``, which opens a run per key), bools as 0/1 like every sink
    (`nnstat.describe.metric_scalar`); `nnstat.describe.Histogram` values through
    ``add_histogram_raw`` (already binned on device, no copy of the tensor to the host).

    Args:
        log_dir: directory of the event files; ``None``: TensorBoard's default (``runs/...``).
        writer: an existing ``SummaryWriter`` to write through instead.
        **kwargs: further ``SummaryWriter`` arguments.

    Raises:
        ImportError: the tensorboard package is missing.

    Example:
        >>> import tempfile
        >>> sink = TensorBoardSink(tempfile.mkdtemp())
        >>> sink.log({"weight/fc.weight/l2": 1.5}, step=0); sink.close()
    """

    def __init__(self, log_dir: str | Path | None = None, writer: Any | None = None, **kwargs: Any):
        if writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise ImportError(
                    "TensorBoardSink needs the tensorboard package: pip install 'nnstat[tensorboard]'"
                ) from e
            writer = SummaryWriter(log_dir=None if log_dir is None else str(log_dir), **kwargs)
        self.writer = writer
        self._owners = FlushOwners()

    def attach(self, flush: Callable[[], None]) -> None:
        """Call ``flush`` (a Tracker's) when this sink closes, before the writer does."""
        self._owners.add(flush)

    @property
    def log_dir(self) -> str:
        """Directory of the event files."""
        return self.writer.log_dir

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Write every scalar and histogram in `metrics` at `step`."""
        for key, value in metrics.items():
            if not isinstance(key, str):  # TensorBoard's own error names neither key nor sink
                raise TypeError(
                    f"TensorBoardSink: metric keys must be strings (TensorBoard tags), got "
                    f"{key!r} of type {type(key).__name__}"
                )
            if isinstance(value, Histogram):
                if value.num <= 0:
                    continue  # TensorBoard rejects empty histograms
                self.writer.add_histogram_raw(
                    key,
                    min=value.min,
                    max=value.max,
                    num=int(value.num),
                    sum=value.sum,
                    sum_squares=value.sum_squares,
                    bucket_limits=value.edges[1:].tolist(),
                    bucket_counts=value.counts.tolist(),
                    global_step=step,
                )
            elif (number := metric_scalar(value)) is not None:
                # a bool is 0/1, as in the JSON Lines and W&B sinks
                self.writer.add_scalar(key, float(number), global_step=step)
            else:
                raise TypeError(
                    f"TensorBoardSink cannot log {key!r} of type {type(value).__name__} "
                    "(expected a number, a bool, a one-element tensor/array or "
                    "nnstat.describe.Histogram)"
                )

    def flush(self) -> None:
        """Flush pending events to disk."""
        self.writer.flush()

    def close(self) -> None:
        """Deliver the attached Trackers' pending steps, then flush and close the writer (also
        when delivering fails: what was written is kept; the error is raised after)."""
        try:
            self._owners.flush()
        finally:
            self.writer.close()
