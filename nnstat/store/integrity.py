"""Integrity hashes of a gradient store, and the differences between two metas.

meta.json records ``projection_sha256`` and ``statistics_sha256`` (:func:`tensors_hash` of
``projections.safetensors`` / ``statistics.safetensors``) and ``params_sha256`` (:func:`params_hash`
of the watched weights), so that files which do not belong together are refused.

Example:
    >>> tensors_hash({"w": torch.ones(2)}) == tensors_hash({"w": torch.ones(2)})
    True
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch


def tensors_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over sorted names, dtypes, shapes and bytes of ``tensors``."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        hash_tensor(h, name, tensors[name])
    return h.hexdigest()


def hash_tensor(h: Any, name: str, tensor: torch.Tensor) -> None:
    """Feed one named tensor to ``h`` as `tensors_hash` does (callers go in sorted name order;
    a reader can then hash a file one tensor at a time)."""
    t = tensor.detach().to("cpu").contiguous()
    h.update(name.encode())
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # the buffer itself, no copy


def params_hash(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over ``(name, tensor)`` pairs **in the given order** (unlike :func:`tensors_hash`,
    which sorts): each pair adds its name, then ``f"{dtype}{tuple(shape)}"``, then the raw
    bytes of the whole tensor (on the CPU, contiguous). The Run passes the watched parameters
    as ``"{module}.{param}"`` in watch order (``nnstat.run.params.params_fingerprint``).

    Example:
        >>> a = [("w", torch.ones(2))]
        >>> params_hash(a) == params_hash([("w", torch.ones(2))]) != params_hash([("w", torch.zeros(2))])
        True
    """
    h = hashlib.sha256()
    for name, tensor in named:
        hash_tensor(h, name, tensor)
    return h.hexdigest()


def diff_dicts(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Human-readable differences between two JSON-like values (``key: old -> new``).

    Example:
        >>> diff_dicts({"a": 1, "b": {"c": 2}}, {"a": 1, "b": {"c": 3}})
        ['b.c: 2 -> 3']
    """
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for k in sorted(set(old) | set(new), key=str):
            key = f"{prefix}.{k}" if prefix else str(k)
            if k not in old:
                out.append(f"{key}: (absent) -> {new[k]!r}")
            elif k not in new:
                out.append(f"{key}: {old[k]!r} -> (absent)")
            else:
                out += diff_dicts(old[k], new[k], key)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        out = []
        for i, (a, b) in enumerate(zip(old, new, strict=True)):
            out += diff_dicts(a, b, f"{prefix}[{i}]")
        return out
    return [] if old == new else [f"{prefix or '<root>'}: {old!r} -> {new!r}"]
