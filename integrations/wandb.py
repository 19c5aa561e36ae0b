"""Weights & Biases sink: ``wandb.log`` of the flat dict, histograms as ``wandb.Histogram``.

``wandb`` is imported only when a `WandbSink` is constructed.

Example:
    >>> import os, tempfile, torch, nnstat  # doctest: +SKIP
    >>> from nnstat.integrations.wandb import WandbSink  # doctest: +SKIP
    >>> sink = WandbSink(project="demo", mode="offline", dir=tempfile.mkdtemp())  # doctest: +SKIP
    >>> tracker = nnstat.Tracker(torch.nn.Linear(2, 1), sinks=[sink])  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from nnstat.integrations._owners import FlushOwners

from nnstat.describe import Histogram, metric_scalar

__all__ = ["WandbSink", "to_wandb"]


def to_wandb(metrics: dict[str, Any]) -> dict[str, Any]:
    """Replace every `nnstat.describe.Histogram` by a ``wandb.Histogram`` and every scalar by the
    number the other sinks log (`nnstat.describe.metric_scalar`: a bool is 0/1, as in the JSON
    Lines and TensorBoard files, not W&B's boolean); other values (W&B media, tables) unchanged.

    Args:
        metrics: a Tracker's metrics dict.

    Returns:
        A new dict for ``wandb.log``.

    Raises:
        ImportError: the wandb package is missing.
    """
    import wandb

    out = {}
    for k, v in metrics.items():
        if isinstance(v, Histogram):
            out[k] = wandb.Histogram(np_histogram=(v.counts, v.edges))
        else:
            number = metric_scalar(v)
            out[k] = v if number is None else number
    return out


class WandbSink:
    """Log a Tracker's metrics to a W&B run.

    Uses `run` if given, else the active ``wandb.run``, else starts one with ``wandb.init(**kwargs)``
    (and finishes it on `close`). W&B keeps at most 512 histogram bins.

    Args:
        run: the W&B run to log to; ``None``: the active one, else a new one.
        **init_kwargs: ``wandb.init`` arguments for a new run.

    Raises:
        ImportError: the wandb package is missing.
        ValueError: both ``run`` and ``init_kwargs``.

    Example:
        >>> sink = WandbSink(project="nnstat", mode="offline")  # doctest: +SKIP
        >>> sink.log({"weight/fc.weight/l2": 1.0}, step=0); sink.close()  # doctest: +SKIP
    """

    def __init__(self, run: Any | None = None, **init_kwargs: Any) -> None:
        try:
            import wandb
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "WandbSink needs the wandb package: pip install 'nnstat[wandb]'"
            ) from e
        self._owns = False
        if run is None:
            run = wandb.run
            if run is None:
                run = wandb.init(**init_kwargs)
                self._owns = True
        elif init_kwargs:
            raise ValueError(
                f"pass either run or wandb.init arguments, not both: {list(init_kwargs)}"
            )
        self.run = run
        self._owners = FlushOwners()
        self._warned_step = False

    def attach(self, flush: Callable[[], None]) -> None:
        """Call ``flush`` (a Tracker's) before the run finishes (see ``_owners``).

        The run's ``finish`` is wrapped on this instance (``wandb.finish()`` calls it), so a
        loop ending in ``wandb.finish()`` still logs a background Tracker's last step.
        """
        self._owners.add(flush)
        if len(self._owners) > 1:
            return
        finish = self.run.finish

        def finish_after_flush(*args: Any, **kwargs: Any) -> Any:
            try:
                self._owners.flush()
            except BaseException:
                # a failing sink or statistics step must not leave the run unfinished: finish
                # with what it received, then raise
                finish(*args, **kwargs)
                raise
            return finish(*args, **kwargs)

        self.run.finish = finish_after_flush

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """``run.log(metrics, step=step)`` with histograms converted.

        W&B ignores a row whose step is below the run's current step (one past the last
        committed), with a line on its own console only: that step's metrics would be lost
        unseen (a Tracker restarted at step 0 on a resumed run), so it warns once.
        """
        current = getattr(self.run, "step", None)
        if isinstance(current, int) and step < current and not self._warned_step:
            self._warned_step = True
            warnings.warn(
                f"WandbSink: W&B drops the metrics of step {step}: the run is at step "
                f"{current} and its steps must increase (warned once). After resuming a run, "
                "continue its step count: tracker.step(step=global_step).",
                RuntimeWarning,
                stacklevel=2,
            )
        # commit now so the summary reflects this step without waiting for the next one
        self.run.log(to_wandb(metrics), step=step, commit=True)

    def close(self) -> None:
        """Finish the run if this sink started it."""
        if self._owns:
            self.run.finish()
            self._owns = False
