"""Errors of the gradient store that more than one module raises, and :func:`add_note`.

Example:
    >>> e = ValueError("refused"); add_note(e, "hint"); issubclass(ModelChangedError, ValueError)
    True
"""

from __future__ import annotations


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (Python 3.11+); on 3.10 the note joins the message."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{note}", *error.args[1:])
    else:
        error.args = (*error.args, note)


class ModelChangedError(ValueError):
    """The watched parameters differ from those the store's rows were computed with
    (``meta.json`` ``params_sha256``): adding rows would mix two models in one store."""


class StoreWriteError(RuntimeError):
    """The background writer failed; the original exception is the ``__cause__``."""


class StoreLockedError(RuntimeError):
    """Another writer (another process, or an unfinished pass of this one) holds the lock of the
    same rank of the same store."""
