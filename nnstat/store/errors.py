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
    (``meta.json`` ``params_sha256``): adding rows would mix two models in one store.

    Example:
        >>> import tempfile, torch, nnstat
        >>> model = torch.nn.Linear(2, 1)
        >>> run = nnstat.init(project="p", root_dir=tempfile.mkdtemp())
        >>> _ = nnstat.setup({"statistic": "none"}), nnstat.watch(model)
        >>> with run(data_id=[0]):
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> nnstat.finalize()
        >>> with torch.no_grad():
        ...     _ = model.weight.add_(1.0)  # a training step
        >>> with run(data_id=[1]):  # doctest: +ELLIPSIS
        ...     model(torch.ones(1, 2)).sum().backward()
        Traceback (most recent call last):
        nnstat.store.errors.ModelChangedError: cannot add to the gradient store ...
    """


class StoreWriteError(RuntimeError):
    """The background writer failed; the original exception is the ``__cause__``.

    Example:
        >>> import shutil, tempfile, torch
        >>> from nnstat.store.writer import StoreWriter
        >>> d = tempfile.mkdtemp()
        >>> w = StoreWriter(d, row_width=1, shard_rows=1)
        >>> shutil.rmtree(d)  # the store's folder is gone before the shard is written
        >>> try:
        ...     w.put([0], torch.ones(1, 1))
        ...     w.close()
        ... except StoreWriteError as e:
        ...     print(type(e.__cause__).__name__)
        FileNotFoundError
    """


class StoreLockedError(RuntimeError):
    """Another writer (another process, or an unfinished pass of this one) holds the lock of the
    same rank of the same store.

    Example:
        >>> import tempfile
        >>> from nnstat.store.writer import StoreWriter
        >>> d = tempfile.mkdtemp()
        >>> first = StoreWriter(d, row_width=1)
        >>> StoreWriter(d, row_width=1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        nnstat.store.errors.StoreLockedError: ...rank0.lock: an earlier logging pass of this ...
        >>> first.close()  # releases the lock
        0
        >>> StoreWriter(d, row_width=1).close()
        0
    """
