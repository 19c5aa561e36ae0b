"""Everything a logging pass's rows depend on: all parameters and buffers of the watched model,
not only the watched modules' own parameters (a re-trained layer that is not watched, or a
BatchNorm's running statistics, change the rows of the layers after it).

Two fingerprints:

* :func:`model_fingerprint` (meta.json's ``model_sha256``): sha256 over every parameter and
  buffer of the model, taken at the first block of each pass and compared with the store's,
  like ``params_sha256`` (which stays the watched parameters' hash, so older stores resume);
* :class:`BlockGuard`: a per-block check. At the end of each ``run(...)`` block it keeps, per
  tensor, its identity (storage pointer, shape, dtype) and its ``_version`` counter (which
  in-place updates such as ``opt.step()`` or ``load_state_dict`` bump), per module its
  training mode, and per (device, dtype) group one :func:`checksum` of every bit of its
  tensors, computed on their device in a few kernels per group (updates that do not bump
  ``_version``: ``p.data[:, 1::2].mul_(2)``, one element, fused optimizers); at the start of
  the next block of the same pass anything that differs is a
  :class:`~nnstat.store.errors.ModelChangedError` naming the tensors, modules or group.
  Changes *inside* a block (a train-mode BatchNorm updating its running statistics in
  forward) are not changes between blocks. A block inside which no tensor's identity,
  version or mode changed keeps the checksums taken at its start as its end state: one pass
  over the weights per block, not two.

Example:
    >>> m = torch.nn.Linear(2, 2); guard = BlockGuard(); guard.record(m)
    >>> with torch.no_grad(): _ = m.weight.mul_(3)
    >>> guard.changed(m)
    ['weight']
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nnstat.store.errors import ModelChangedError
from nnstat.store.integrity import params_hash

Models = torch.nn.Module | list[torch.nn.Module]  # a model, or the roots enclosing it


def named(models: Models, what: str) -> list[tuple[str, Any]]:
    """``named_parameters`` / ``named_buffers`` / ``named_modules`` (``what``) of one model or
    of a list of them (names prefixed ``"i:"`` when there are several)."""
    if isinstance(models, torch.nn.Module):
        models = [models]
    return [
        (f"{i}:{n}" if len(models) > 1 else n, x)
        for i, m in enumerate(models)
        for n, x in getattr(m, what)()
    ]


def model_tensors(model: Models) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` (or of each of a list of models) as
    ``(name, tensor)``, parameters first (a DTensor gathered with ``full_tensor()``)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        DTensor = ()  # noqa: N806
    for name, t in [*named(model, "named_parameters"), *named(model, "named_buffers")]:
        t = t.detach()
        yield name, t.full_tensor() if isinstance(t, DTensor) else t


def _parents(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that hold ``module`` as a child (found through the garbage collector's
    referrers: a module does not know its parents)."""
    out: list[torch.nn.Module] = []
    for holder in gc.get_referrers(module):
        if not isinstance(holder, dict):
            continue
        for owner in gc.get_referrers(holder):  # the parent, or its instance dict
            if isinstance(owner, torch.nn.Module) and owner._modules is holder:
                out.append(owner)
            elif isinstance(owner, dict) and owner.get("_modules") is holder:
                out += [
                    m
                    for m in gc.get_referrers(owner)
                    if isinstance(m, torch.nn.Module) and m.__dict__ is owner
                ]
    return out


def enclosing(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``[model]``, or when it is a submodule of others (``watch(model.head)``), the outermost
    modules holding it: their parameters, buffers and training modes feed its rows (a
    backbone computes its input, the layers after it its output gradients), so a parent
    changed between blocks or before a resume is a changed model. Found once per pass (a scan
    of the garbage collector's objects: ~0.1 s in a small process, more in a large one).

    Example:
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        >>> enclosing(net[1])[0] is net
        True
    """
    roots, seen, todo = [], {id(model)}, [model]
    while todo:
        m = todo.pop()
        parents = [p for p in _parents(m) if id(p) not in seen]
        if not parents and m is not model:
            roots.append(m)
        for p in parents:
            seen.add(id(p))
            todo.append(p)
    return roots or [model]


def model_fingerprint(model: Models | None) -> str | None:
    """``meta["model_sha256"]``: :func:`~nnstat.store.integrity.params_hash` of
    :func:`model_tensors` (same on every rank: see ``params_fingerprint``)."""
    if model is None:
        return None
    from nnstat.run.params import combine_rank_digests

    with torch.no_grad():
        return combine_rank_digests(params_hash(model_tensors(model)))


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as a flat integer tensor (a view when ``t`` is contiguous): 32-bit words for
    4/8/16-byte dtypes, 16/8-bit ones for 2/1-byte dtypes (bool, float16, bfloat16, float8)."""
    size = t.element_size()
    word = torch.int32 if size % 4 == 0 else (torch.int16 if size == 2 else torch.uint8)
    return t.reshape(-1).view(word)


#: columns of the grid :func:`checksum` reduces (the words are padded with zeros to a multiple)
COLUMNS = 4096


def checksum_weights(rows: int, device: torch.device | None = None) -> torch.Tensor:
    """:func:`checksum`'s weights for grids of up to ``rows`` rows: ``2j + 1`` for each of the
    :data:`COLUMNS` columns, then ``2 * COLUMNS * i`` for each row ``i`` (int32, modulo 2**32).

    Example:
        >>> checksum_weights(2)[[0, 1, COLUMNS, COLUMNS + 1]].tolist()
        [1, 3, 0, 8192]
    """
    cols = torch.arange(1, 2 * COLUMNS, 2, dtype=torch.int64, device=device)
    starts = torch.arange(rows, dtype=torch.int64, device=device) * (2 * COLUMNS)
    # int64 -> int32 keeps the low 32 bits: the weights modulo 2**32
    return torch.cat([cols, starts]).to(torch.int32)


def checksum(words: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """One 0-d int32 checksum of a flat int32 tensor, left on its device: the sum of
    ``word_i * (2i + 1)`` modulo 2**32 (``weights``: :func:`checksum_weights` of at least the
    grid's rows, made here when not given).

    Computed without a product per word: the words, zero-padded to a ``[rows, COLUMNS]`` grid
    (a view when ``words.numel()`` is a multiple of :data:`COLUMNS`), are reduced along each
    axis, row sums ``r_i`` and column sums ``c_j``, and ``sum_ij w_ij (2(i C + j) + 1) =
    sum_j (2j + 1) c_j + sum_i 2 C i r_i``: two reads of the words, no write of their size
    (a product then a sum read them twice and wrote them once).

    Every single changed word is caught (an odd weight times a nonzero difference is nonzero
    modulo 2**32), and so is an exchange of two words unless their difference times
    ``2 (j - i)`` is a multiple of 2**32 (e.g. two float32 values that differ only in their
    sign bit, exchanged: the one case a write could plausibly make); several changes are missed
    only when their weighted differences cancel modulo 2**32.

    Example:
        >>> a = torch.tensor([1.0, 2.0, 3.0]).view(torch.int32)
        >>> bool(checksum(a) == checksum(a.flip(0)))
        False
    """
    n = words.numel()
    if n % COLUMNS or not n:
        words = torch.cat([words, words.new_zeros(-n % COLUMNS or COLUMNS)])
    grid = words.view(-1, COLUMNS)
    rows = grid.shape[0]
    if weights is None:
        weights = checksum_weights(rows, words.device)
    sums = torch.cat([grid.sum(0, dtype=torch.int32), grid.sum(1, dtype=torch.int32)])
    return (sums * weights[: COLUMNS + rows]).sum(dtype=torch.int32)


class Weights:
    """:func:`checksum`'s weights and a buffer for the words of a group, per device, kept (the
    buffer 4 bytes per word of the largest group, the weights one per :data:`COLUMNS` of them),
    so that a block boundary allocates nothing (on CPU, fresh memory made the check ~10x
    slower) and launches no kernel to make the weights; also the few zero words that pad a
    group to whole 32-bit words and to a multiple of :data:`COLUMNS` of them."""

    def __init__(self) -> None:
        self._weights: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pads: dict[tuple, torch.Tensor] = {}

    def __call__(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights for ``n`` words and the words buffer on ``device`` (at least ``n``)."""
        w = self._weights.get(device)
        if w is None or w[1].numel() < n:
            w = (
                checksum_weights(-(-n // COLUMNS), device),
                torch.empty(n, dtype=torch.int32, device=device),
            )
            self._weights[device] = w
        return w

    def pad(self, words: list[torch.Tensor]) -> list[torch.Tensor]:
        """``words`` plus zeros up to a multiple of :data:`COLUMNS` 32-bit words (whole words
        first: 1/2-byte words are padded to a multiple of 4 bytes)."""
        size = words[0].element_size()
        extra = (-sum(w.numel() for w in words) * size) % (4 * COLUMNS) // size
        if not extra:
            return words
        key = (words[0].device, words[0].dtype, extra)
        if key not in self._pads:
            self._pads[key] = torch.zeros(extra, dtype=words[0].dtype, device=words[0].device)
        return [*words, self._pads[key]]


def _state(
    model: Models, weights: Weights, sums: bool = True
) -> tuple[list[tuple], dict[tuple, torch.Tensor]]:
    """Per tensor its identity and version, per module its training mode (``m.train()`` /
    ``m.eval()`` change what a forward computes); per (device, dtype) one :func:`checksum` of
    every bit of its tensors concatenated, left on the device (not read here): a cat and two
    reductions of the words per group, and three small kernels (``sums=False``: the identities
    alone, no kernel)."""
    ids: list[tuple] = [
        (f"{n or 'model'} (training mode)", m.training) for n, m in named(model, "named_modules")
    ]
    groups: dict[tuple, list[torch.Tensor]] = {}  # words by (device, dtype): one cat each
    for name, t in [*named(model, "named_parameters"), *named(model, "named_buffers")]:
        local = getattr(t, "to_local", None)  # a DTensor (FSDP2): this rank's shard
        t = local() if callable(local) else t
        ids.append((name, t.data_ptr(), tuple(t.shape), t.dtype, t._version))
        if t.numel() and sums:
            groups.setdefault((t.device, t.dtype), []).append(_words(t.detach()))
    sums = {}
    for key, group in groups.items():
        group = weights.pad(group)
        n = sum(g.numel() * g.element_size() for g in group) // 4
        w, buf = weights(n, group[0].device)
        if len(group) == 1 and group[0].dtype == torch.int32:
            words = group[0]  # one tensor of 32-bit words, a whole grid: read where it is
        else:  # into the kept buffer (as its own word type; 1/2-byte words are always copied)
            words = torch.cat(group, out=buf[:n].view(group[0].dtype)).view(torch.int32)
        sums[key] = checksum(words, w)
    return ids, sums


def _same_bits(a: dict[tuple, torch.Tensor], b: dict[tuple, torch.Tensor]) -> bool | torch.Tensor:
    """Whether two checksum sets are equal: a bool when the groups tell, else a ``[groups]``
    bool tensor on the device, not read here (recording and comparing the checksums read
    nothing: the caller reads the flags, with the block's other flags, in one host read)."""
    if a.keys() != b.keys():
        return False
    if not a:
        return True
    device = next(iter(a.values())).device  # groups on other devices join it (no host copy)
    if len(a) == 1:
        (k,) = a
        return a[k] == b[k]
    return torch.stack([a[k].to(device) for k in a]) == torch.stack([b[k].to(device) for k in a])


class BlockGuard:
    """The model's state at the end of the last block of a pass; see the module docstring."""

    def __init__(self) -> None:
        self._state: tuple[list[tuple], dict[tuple, torch.Tensor]] | None = None
        self._groups: list[tuple] = []  # the (device, dtype) groups of the last begin()
        self._weights = Weights()
        # the state begin() computed: the block's end state too when nothing was updated
        self._begun: tuple[list[tuple], dict[tuple, torch.Tensor]] | None = None

    def reset(self) -> None:
        self._state = self._begun = None

    def record(self, model: Models | None) -> None:
        """Keep ``model``'s state at a block's end. When no tensor was replaced or updated in
        place inside the block (identities, versions and training modes as :meth:`begin`
        found them), :meth:`begin`'s checksums are kept: no kernel, no second pass over the
        weights (a bits-only change inside the block, e.g. through ``.data``, then reads as a
        change at the next :meth:`begin`: refused, as the block's rows came from two models)."""
        if model is None:
            return
        begun, self._begun = self._begun, None
        with torch.no_grad():
            if begun is not None and _state(model, self._weights, sums=False)[0] == begun[0]:
                self._state = begun
                return
            self._state = _state(model, self._weights)

    def _compare(self, model: Models | None) -> tuple[list[str], bool | torch.Tensor]:
        """The tensors whose identity or version differ from the last :meth:`record`, and
        whether each group's checksum is the same (a device flag, not read)."""
        if self._state is None or model is None:
            return [], True
        with torch.no_grad():
            ids, values = _state(model, self._weights)
        self._begun = (ids, values)
        old_ids, old_values = self._state
        out = [a[0] for a, b in zip(ids, old_ids, strict=False) if a != b]
        if len(ids) != len(old_ids):
            out.append(f"({len(old_ids)} -> {len(ids)} tensors or modules)")
        self._groups = list(values)
        return out, True if out else _same_bits(values, old_values)

    def changed(self, model: Models | None) -> list[str]:
        """Names of the tensors or modules that differ from the last :meth:`record` (a
        (device, dtype) group when only its checksum tells)."""
        out, same = self._compare(model)
        return out or self._values_changed(same)

    def check(self, model: Models | None) -> None:
        """Raise :class:`ModelChangedError` when the model changed since the last block (one
        host read: :meth:`begin` then :meth:`confirm`)."""
        self.confirm(self.begin(model))

    def begin(self, model: Models | None) -> bool | torch.Tensor:
        """At a block's start: raise at once when a tensor was replaced or updated in place
        (identity, version, training mode); return whether each group's checksum is unchanged,
        as a device flag
        the block reads with its other flags at its end (:meth:`confirm`)."""
        out, same = self._compare(model)
        self._refuse(out)
        return same

    def confirm(self, same: bool | list[bool] | torch.Tensor) -> None:
        """Raise when :meth:`begin`'s flag (or its value, read by the caller) says a group's
        checksum changed; a tensor flag is read here."""
        self._refuse(self._values_changed(same))

    def _values_changed(self, same: bool | list[bool] | torch.Tensor) -> list[str]:
        if isinstance(same, torch.Tensor):
            same = same.reshape(-1).tolist()
        return values_changed(same, self._groups)

    def deferred(self) -> Callable[[list[bool]], None]:
        """:meth:`confirm` for values read later, elsewhere (the store's writer thread reads
        :meth:`begin`'s flag from the block's host copy): a function of the flag's values that
        raises :class:`ModelChangedError` when a group's checksum changed. It keeps this
        block's groups; the guard's state is left as it is."""
        groups = list(self._groups)

        def confirm(same: list[bool]) -> None:
            changed = values_changed(same, groups)
            if changed:
                raise changed_error(changed)

        return confirm

    def _refuse(self, changed: list[str]) -> None:
        if changed:
            self._state = None
            raise changed_error(changed)


def values_changed(same: bool | list[bool], groups: list[tuple]) -> list[str]:
    """The (device, dtype) ``groups`` whose checksum flag in ``same`` is False, as names for
    :func:`changed_error` (``same``: one flag per group, or one bool for all)."""
    if isinstance(same, bool):
        same = [same] * max(1, len(groups))
    if all(same):
        return []
    if len(same) != len(groups):  # the groups themselves differ
        return ["(the values of the parameters or buffers)"]
    return [
        f"(the values of the {dtype} parameters or buffers on {device}: checksum)"
        for (device, dtype), ok in zip(groups, same, strict=True)
        if not ok
    ]


def changed_error(changed: list[str]) -> ModelChangedError:
    """The refusal of a model that changed between two blocks (``changed``: what differs)."""
    return ModelChangedError(
        f"the model changed between two run(...) blocks of one logging pass "
        f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}): an optimizer "
        "step or another update while logging, so the pass's rows would come from "
        "several models. Log with fixed weights (after training, or each checkpoint "
        "into its own project, or with overwrite=True), and finalize() the pass before "
        "changing the model"
    )
