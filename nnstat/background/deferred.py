"""Results still on their way: filled in later, resolved on first read, delivered in order.

`Deferred` is a read-only mapping whose values arrive later (a Tracker step reduced by the
worker thread or copied from a GPU without waiting, a noise-scale provider's value): the first
read calls its ``settle`` function, which waits for the result and `Deferred.set`\\ s it.
`InOrder` queues `InFlight` results (one `nnstat.background.transfer.HostCopy` each) and
completes them oldest first: those that have arrived (polled, no wait), or every one up to a
given handle, waiting for their copies.

Example:
    >>> import torch
    >>> from nnstat.background.transfer import HostBuffers, start_copy
    >>> queue, seen = InOrder(), []
    >>> handle = Deferred(lambda: queue.drain(complete, wait=True), "failed before")
    >>> def complete(entry):
    ...     (host,) = entry.copy.wait(); entry.handles[0].set({"x": host.item()})
    >>> queue.append(InFlight(start_copy([torch.tensor(2.0)], HostBuffers(pin=True)), 0, [handle]))
    >>> dict(handle)
    {'x': 2.0}
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from nnstat.background.transfer import HostCopy

__all__ = ["Deferred", "InFlight", "InOrder"]


class Deferred(Mapping[str, Any]):
    """A mapping filled in later: the first read calls `settle` (which waits for the values and
    `set`\\ s them); if it could not (the work failed, and raised before), the read raises
    ``RuntimeError(missing)``. ``dict(d)`` or ``d.copy()`` gives a plain dict.

    Args:
        settle: waits for the values and calls `set` (called on each read until they are set).
        missing: the message a read raises when `settle` left no values.

    Example:
        >>> d = Deferred(lambda: d.set({"a": 1.0}), "no values")
        >>> d.ready, d["a"], d.ready
        (False, 1.0, True)
    """

    def __init__(self, settle: Callable[[], None], missing: str) -> None:
        self._settle = settle
        self.missing = missing
        self._data: dict[str, Any] | None = None

    @property
    def ready(self) -> bool:
        """Whether the values are here (reading them waits for nothing)."""
        return self._data is not None

    def set(self, data: dict[str, Any]) -> None:
        """Fill in the values (called by `settle`, or when the result arrives)."""
        self._data = data

    def _resolve(self) -> dict[str, Any]:
        if self._data is None:
            self._settle()
            if self._data is None:
                raise RuntimeError(self.missing)
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._resolve()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._resolve())

    def __len__(self) -> int:
        return len(self._resolve())

    def copy(self) -> dict[str, Any]:
        """A plain dict of the values (``wandb.log(tracker.step())`` copies what it gets)."""
        return dict(self._resolve())


@dataclass(eq=False)
class InFlight:
    """Device results on their way to the host: their one copy, what their owner needs to
    finish them (`work`), their number (a step, an update) and the `Deferred` they fill in."""

    copy: HostCopy
    work: Any
    handles: list[Deferred] = field(default_factory=list)
    number: int = 0


class InOrder(deque[InFlight]):
    """`InFlight` results in a deque, completed oldest first (see the module docstring).

    Example:
        >>> queue = InOrder(); len(queue), bool(queue)
        (0, False)
    """

    def holds(self, handle: Deferred) -> bool:
        """Whether `handle` is filled in by a queued entry."""
        return any(h is handle for e in self for h in e.handles)

    def drain(
        self,
        complete: Callable[[InFlight], None],
        wait: bool,
        upto: Deferred | None = None,
        note: Callable[[InFlight], str] | None = None,
    ) -> None:
        """``complete(entry)`` for the entries whose copies have arrived, oldest first; with
        `wait` every entry (up to the one filling `upto` when given), waiting for its copy.

        Args:
            complete: finishes an entry (reads its copy, fills its handles, delivers it).
            wait: wait for copies still on their way (else stop at the first one).
            upto: stop after the entry that fills this handle.
            note: added to an error of ``complete`` (which entry failed).

        Raises:
            BaseException: what ``complete`` raised (the entry is dropped from the queue).
        """
        while self:
            entry = self[0]
            if not wait and not entry.copy.done():
                break
            self.popleft()
            try:
                complete(entry)
            except BaseException as e:
                if note is not None and hasattr(e, "add_note"):
                    e.add_note(note(entry))
                raise
            if any(h is upto for h in entry.handles):  # identity: == would read a mapping
                break
