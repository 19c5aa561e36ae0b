"""Where a Tracker's logged steps go: its sinks, and how their failures are raised.

Every sink gets every step, in order, as its own copy of the dict (a sink that pops or clears
keys must not empty it for the others); a sink that raises does not stop the others: the errors
are kept and the first is raised (the others as notes) once every sink has had the step.

Example:
    >>> seen = []
    >>> sinks = Sinks(); sinks.add(lambda m, step: seen.append((step, m)))
    >>> sinks.log({"a": 1.0}, 3); sinks.raise_errors(); seen
    [(3, {'a': 1.0})]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from nnstat.describe.hist_record import own_copy
from nnstat.tracker.guards import first_error

__all__ = ["Sink", "Sinks"]


@runtime_checkable
class Sink(Protocol):
    """Anything with ``log(metrics, step)``; plain callables ``f(metrics, step)`` work too.

    Example:
        >>> class Printer:
        ...     def log(self, metrics, step):
        ...         print(step, metrics)
        >>> sinks = Sinks()
        >>> sinks.add(Printer())
        >>> sinks.add(lambda metrics, step: print("callable got", sorted(metrics)))
        >>> sinks.log({"loss": 0.5}, 3)
        3 {'loss': 0.5}
        callable got ['loss']
    """

    def log(self, metrics: dict[str, Any], step: int) -> None: ...


def sink_list(sinks: Any) -> list[Any]:
    """The ``sinks=`` argument as a list, refusing one sink passed bare (not in a list).

    Args:
        sinks: a sequence of sinks.

    Returns:
        The sinks, in order.

    Raises:
        TypeError: `sinks` is a single sink or not iterable.

    Example:
        >>> sink_list((print,))
        [<built-in function print>]
    """
    if isinstance(sinks, (str, bytes)) or not hasattr(sinks, "__iter__") or hasattr(sinks, "log"):
        raise TypeError(
            f"sinks must be a list of sinks, got {sinks!r}; pass sinks=[...] around a single one"
        )
    return list(sinks)


class Sinks:
    """A Tracker's sinks: `log` hands a step to each, `raise_errors` raises what failed."""

    def __init__(self) -> None:
        self._logs: list[Callable[[dict[str, Any], int], None]] = []
        self.objects: list[Any] = []
        # (what failed, error) of sinks, raised once every sink has had the step
        self._errors: list[tuple[str, BaseException]] = []

    def add(self, sink: Any) -> None:
        """Send every logged dict to `sink` (``sink.log(metrics, step)`` or ``sink(metrics, step)``).

        Raises:
            TypeError: `sink` has no ``log`` method and is not callable.
        """
        if hasattr(sink, "log") and callable(sink.log):
            log = sink.log
        elif callable(sink):
            log = sink
        else:
            raise TypeError(
                f"a sink needs a log(metrics, step) method or must be callable, got {sink!r}"
            )
        self._logs.append(log)
        self.objects.append(sink)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Hand step `step` to every sink (a failure is kept for `raise_errors`)."""
        for log, sink in zip(self._logs, self.objects, strict=True):
            try:
                # each sink gets its own copy, histogram arrays too: one that pops or clears
                # keys or zeroes an array (some loggers do) changes no other sink's data
                log({k: own_copy(v) for k, v in metrics.items()}, step)
            except Exception as e:  # kept for raise_errors: the other sinks come first
                self._errors.append((f"sink {sink!r} failed on step {step}", e))

    def raise_errors(self) -> None:
        """Raise the first sink failure since the last call (the others as notes)."""
        errors, self._errors = self._errors, []
        if errors:
            raise first_error(errors, "every other sink received that step")

    def close(self, errors: list[tuple[str, BaseException]]) -> None:
        """Close every sink that has a ``close()``, appending failures to `errors`."""
        for s in self.objects:
            close = getattr(s, "close", None)
            if callable(close):
                try:
                    close()
                except BaseException as e:  # raised by the caller, once every sink is closed
                    errors.append((f"closing sink {s!r} failed", e))
