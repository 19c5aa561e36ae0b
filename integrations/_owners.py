"""Sinks call their Trackers' ``flush`` before they close, so no background step is lost.

A Tracker with background statistics delivers step t at the next ``step()`` or at
``flush()``/``close()``. A loop that ends by closing the sink (``wandb.finish()``,
``writer.close()``) instead of the Tracker would log the last step into a closed sink.
:meth:`nnstat.Tracker.add_sink` calls ``sink.attach(tracker.flush)``; the sink keeps weak
references (a sink never keeps a Tracker alive) and calls them first when it closes.

Example:
    >>> owners = FlushOwners()
    >>> class T:
    ...     def flush(self): print("flushed")
    >>> t = T(); owners.add(t.flush); owners.flush()
    flushed
"""

from __future__ import annotations

import sys
import traceback
import weakref
from collections.abc import Callable


class FlushOwners:
    """Weak references to the ``flush`` methods of the Trackers logging into one sink."""

    def __init__(self) -> None:
        self._refs: list[weakref.WeakMethod] = []

    def __len__(self) -> int:
        return len(self._refs)

    def add(self, flush: Callable[[], None]) -> None:
        """Remember a bound ``flush`` method (weakly)."""
        self._refs.append(weakref.WeakMethod(flush))

    def flush(self) -> None:
        """Call every live owner's ``flush``; one that raises does not stop the others, and
        the first error is raised after them (nothing is dropped)."""
        errors: list[BaseException] = []
        for ref in list(self._refs):
            method = ref()
            if method is not None:
                try:
                    method()
                except BaseException as e:  # raised below, once every owner has flushed
                    errors.append(e)
        for other in errors[1:]:
            if hasattr(errors[0], "add_note"):  # Python >= 3.11
                errors[0].add_note(
                    f"also: another Tracker's flush: {type(other).__name__}: {other}"
                )
            print("nnstat: another Tracker's flush also failed:", file=sys.stderr)
            traceback.print_exception(type(other), other, other.__traceback__, file=sys.stderr)
        if errors:
            raise errors[0]
