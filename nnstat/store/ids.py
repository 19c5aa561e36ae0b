"""Ids of the rows of a gradient store: what a user's ``data_id`` becomes, content hashes, and
reading a shard's ids file (``rank{r}-{n:05d}.ids.json``).

Example:
    >>> ids = normalize_ids([3, "a"], 2)
    >>> ids
    [3, 'a']
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nnstat.store import files

DataId = int | str


def content_id(row: torch.Tensor) -> str:
    """Stable id of one sample's tensor: sha1 of its dtype, shape and bytes (40 hex chars).

    Example:
        >>> content_id(torch.zeros(2)) == content_id(torch.zeros(2))
        True
    """
    t = row.detach().to("cpu").contiguous()
    h = hashlib.sha1()
    h.update(str(t.dtype).encode())
    h.update(str(tuple(t.shape)).encode())
    # bfloat16 & co have no numpy view; raw bytes through uint8 work for every dtype.
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def content_ids(batch: torch.Tensor) -> list[str]:
    """One :func:`content_id` per row of ``batch`` (its dimension 0): content hashing asked
    for explicitly, whatever the dtype and shape (``data_id="hash"`` uses it).

    Example:
        >>> content_ids(torch.tensor([3, 4]))[0] == content_id(torch.tensor(3))
        True
    """
    if batch.dim() == 0:
        raise ValueError("content_ids needs a batch dimension, got a scalar tensor")
    return [content_id(row) for row in batch]


def _is_integer_tensor(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


def normalize_ids(data_id: Any, n: int | None = None) -> list[DataId]:
    """Turn a user's ``data_id`` into ids (ints or strings, types preserved); ``n`` checks the count.

    * a list/sequence of ints and strings: kept as they are (numpy integers become ``int``);
    * a **1-D integer** tensor or array (what a ``DataLoader`` collates dataset indices into):
      a list of int ids, so rows trace back to dataset indices;
    * any other tensor or array (floating point, bool, or more than one dimension): a batch
      whose rows are hashed, one :func:`content_id` each. To hash a 1-D integer tensor, ask for
      it: :func:`content_ids`, or ``run(data_id="hash")`` (the Run hashes the model's input).

    Example:
        >>> normalize_ids(torch.tensor([7, 3]))
        [7, 3]
        >>> normalize_ids(torch.tensor([[1.0], [2.0]]), 2)[0] != normalize_ids(torch.tensor([[2.0]]), 1)[0]
        True
    """
    if isinstance(data_id, torch.Tensor):
        if data_id.dim() == 0:
            raise ValueError("data_id tensor must have a batch dimension, got a scalar")
        if data_id.dim() == 1 and _is_integer_tensor(data_id):
            ids: list[DataId] = [int(x) for x in data_id.tolist()]
        else:
            ids = content_ids(data_id)
    elif isinstance(data_id, np.ndarray):
        if data_id.ndim == 0:
            raise ValueError("data_id array must have a batch dimension, got a scalar")
        if data_id.dtype.kind in "iu" and data_id.ndim == 1:
            ids = [int(x) for x in data_id]
        else:
            ids = [content_id(torch.from_numpy(np.ascontiguousarray(r))) for r in data_id]
    elif type(data_id) is list and all(type(x) is int for x in data_id):
        ids = list(data_id)  # the common case, one C-level pass (exact ints: bool is excluded)
    elif isinstance(data_id, Sequence) and not isinstance(data_id, str | bytes):
        ids = []
        for x in data_id:
            if isinstance(x, bool) or not isinstance(x, int | np.integer | str):
                raise TypeError(
                    f"data_id entries must be int or str, got {type(x).__name__} ({x!r})"
                )
            ids.append(x if isinstance(x, str) else int(x))
    else:
        raise TypeError(
            "data_id must be a list of ints/strings, a 1-D integer tensor of ids, a batch "
            f'tensor to hash, "hash" (in run(...)) or None; got {type(data_id).__name__}'
        )
    if n is not None and len(ids) != n:
        raise ids_count_error(len(ids), n)
    return ids


def ids_count_error(given: int, samples: int) -> ValueError:
    """The error for a ``data_id`` of ``given`` entries where the batch has ``samples`` rows
    (one message for every place that checks it).

    Args:
        given: entries of ``data_id``.
        samples: samples the batch (or the block's capture) holds.

    Returns:
        The ``ValueError`` to raise.

    Example:
        >>> str(ids_count_error(3, 4))
        'data_id has 3 entries but the batch has 4 samples: pass one id per sample'
    """
    return ValueError(
        f"data_id has {given} entries but the batch has {samples} samples: pass one id per sample"
    )


def read_ids(ids_path: Path) -> list[DataId]:
    """Ids of one shard, as written (ints and strings); anything else names the file."""
    ids = files.read_json(ids_path)
    if not isinstance(ids, list):
        raise ValueError(f"{ids_path}: expected a JSON list of ids, got {type(ids).__name__}")
    bad = [x for x in ids if isinstance(x, bool) or not isinstance(x, int | str)]
    if bad:
        raise ValueError(f"{ids_path}: ids must be ints or strings, got {bad[:3]!r}")
    return ids


def ids_digest(ids: Sequence[DataId]) -> str:
    """SHA-256 of a shard's ids in order (their compact JSON): what the commit log records for
    the shard, so a reordered, edited or swapped ids file is refused at open.

    Args:
        ids: the shard's ids, in row order.

    Returns:
        64 hex digits.

    Example:
        >>> ids_digest([0, 1]) == ids_digest([1, 0])
        False
    """
    return hashlib.sha256(json.dumps(list(ids), separators=(",", ":")).encode()).hexdigest()


def ids_set_digest(ids: Iterable[DataId]) -> str:
    """:func:`ids_digest` of a set of ids, whatever their order (ints first, then strings, each
    sorted): what meta.json records of the rows a statistics pass saw.

    Args:
        ids: the ids (repeats count once).

    Returns:
        64 hex digits.

    Example:
        >>> ids_set_digest([1, "a", 0]) == ids_set_digest(["a", 0, 1, 1])
        True
    """
    return ids_digest(sorted(set(ids), key=lambda i: (isinstance(i, str), i)))


def duplicate_ids(ids: list) -> list:
    """The entries of ``ids`` that repeat an earlier entry, in order."""
    seen: set = set()
    out = []
    for i in ids:
        if i in seen:
            out.append(i)
        seen.add(i)
    return out
