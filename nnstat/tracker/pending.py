"""Steps not yet handed to the sinks: their `StepMetrics`, torn statistics, the flush at exit.

A logged step whose statistics are still on their way (reduced by the worker thread,
`nnstat.tracker.worker`, or copied from a GPU, `nnstat.tracker.delivery`) returns a
`StepMetrics` that waits on first read. Its Tracker stays in `PENDING` until the step is
delivered: pending steps are flushed at exit (a forked child forgets its parent's); if that
fails, the errors are printed and the process exits with status 120 (CPython's status for a
failed finalization) instead of 0. SIGTERM/SIGINT/SIGHUP flush them too (`on_signal`).
`drop_keys` removes the statistics of tensors that changed in place before their step was read.

Example:
    >>> metrics = {"weight/fc/l2": 1.0, "trust_ratio/fc": 2.0, "grad/fc/l2": 3.0}
    >>> drop_keys(metrics, [("weight", "fc")]), metrics
    (['weight/fc'], {'grad/fc/l2': 3.0})
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
import weakref
from collections.abc import Callable
from typing import Any

from nnstat.background.deferred import Deferred
from nnstat.background.signals import CommitOnSignal

__all__ = ["PENDING", "StepMetrics", "drop_keys", "on_signal", "register_atexit"]


class StepMetrics(Deferred):
    """The metrics of a step whose statistics are still on their way: reduced by the background
    worker (CPU), or copied from the accelerator without waiting (`nnstat.tracker.delivery`).

    A read-only mapping (`nnstat.background.deferred.Deferred`): the first read waits for them
    (and hands the step to the sinks if that has not happened yet), so reading it every step
    gives up the overlap (on a GPU: makes the host wait for the device every step): log through
    sinks to keep it. ``dict(m)`` or ``m.copy()`` gives a plain dict, e.g. for ``json.dump``.

    Args:
        settle: waits for this step and hands it to the sinks (`Tracker.step` builds it).
        step: the step number.

    Raises:
        Exception: (on first read) the error of that step's statistics or of a sink.

    Example:
        >>> import torch, nnstat
        >>> model = torch.nn.Linear(2, 1); opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> m = nnstat.Tracker(model, opt, background=True, stats=["l2"], groups=["weight"]).step()
        >>> sorted(m)
        ['weight/bias/l2', 'weight/weight/l2']
    """

    def __init__(self, settle: Callable[[StepMetrics], None], step: int) -> None:
        # settle waits for this step and hands it to the sinks
        super().__init__(
            lambda: settle(self), f"the statistics of step {step} failed (raised before)"
        )
        self.step = step

    def __repr__(self) -> str:
        return f"StepMetrics(step={self.step}, {self._resolve()!r})"


def drop_keys(metrics: dict[str, Any], torn: list[tuple[str, str]]) -> list[str]:
    """Delete the metrics of each torn ``(group, layer)`` (a torn weight or update takes the
    layer's ratios along, a weight its update too); returns their ``"group/layer"`` labels."""
    prefixes = []
    for group, name in torn:
        prefixes.append(f"{group}/{name}/")
        if group in ("weight", "update"):
            prefixes += [f"trust_ratio/{name}", f"update_ratio/{name}"]
        if group == "weight":
            prefixes.append(f"update/{name}/")
    for key in [k for k in metrics if k.startswith(tuple(prefixes))]:
        del metrics[key]
    return [f"{g}/{n}" for g, n in torn]


# trackers with background statistics not yet handed to their sinks (kept alive until then)
PENDING: set[Any] = set()
_ATEXIT = [False]


def _forget_pending() -> None:
    # a forked child has no worker thread: its copies of pending steps would never complete,
    # and they belong to the parent, which delivers them (the child's sinks must not repeat them)
    for tracker in list(PENDING):
        tracker.forget_pending()  # device copies: the child has no CUDA context of its own
    PENDING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pending)


def on_signal(tracker: Any) -> CommitOnSignal:
    """The flush of `tracker`'s steps on their way on SIGTERM/SIGINT/SIGHUP (the shared handler,
    `nnstat.background.signals`): installed while a step is on its way, removed by ``close()``.

    It holds the Tracker weakly (never keeps it alive; removed when it is collected). A signal
    inside one of its `hold` sections (a step being built) waits for its end; a second one
    arriving there ends the process without a flush, which would deliver a half-built step.
    """
    ref = weakref.ref(tracker)

    def flush() -> None:
        live = ref()
        if live is not None and not guard.holding:
            live.flush()

    guard = CommitOnSignal(flush)
    weakref.finalize(tracker, guard.restore)
    return guard


def register_atexit() -> None:
    # registered at first use, i.e. after the sinks' own libraries (atexit runs last-in
    # first-out, so the statistics reach W&B/TensorBoard before those shut down)
    if not _ATEXIT[0]:
        atexit.register(_flush_all)
        _ATEXIT[0] = True


def _flush_all() -> None:
    errors = []
    for tracker in list(PENDING):
        try:
            tracker.flush()
        except BaseException as e:  # flush every tracker, then report every failure
            errors.append(e)
    if not errors:
        return
    # an exception leaving an atexit callback is printed as "ignored" and the exit status stays
    # 0: print them here and make the exit status say the run's last statistics were lost
    print(
        f"nnstat: {len(errors)} error(s) while delivering background statistics at interpreter "
        "exit (the last steps may be missing from some sinks); the process exits with status "
        "120. Call tracker.close() at the end of training to get this error there instead.",
        file=sys.stderr,
    )
    for e in errors:
        traceback.print_exception(type(e), e, e.__traceback__, file=sys.stderr)
    _fail_exit_status()


class _FailingFinalFlush:
    """Stands in for ``sys.stdout``/``sys.stderr``; its flush fails once the interpreter is
    finalizing.

    No API sets the exit status from an atexit callback; ``os._exit`` would skip the callbacks
    still to run (e.g. W&B's own teardown) and the flushing of open files. CPython flushes the
    standard streams after every atexit callback and, if that fails, exits with status 120
    (``Py_RunMain``), so the failure is reported without cutting anything short.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def __repr__(self) -> str:
        return f"<{self._stream!r}, failing its final flush for nnstat>"

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def write(self, text: str) -> int:
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()
        # only the interpreter's final flush fails (later atexit callbacks still flush freely)
        if sys.is_finalizing():
            raise RuntimeError(
                "nnstat: background statistics could not be delivered at exit (errors above): "
                "exit status 120"
            )


def _fail_exit_status() -> None:
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        if stream is not None and not getattr(stream, "closed", True):
            setattr(sys, name, _FailingFinalFlush(stream))
            return
    os._exit(120)  # no open standard stream to fail with: end now rather than exit with 0
