"""Everything a logging pass's rows depend on: all parameters and buffers of the watched model,
not only the watched modules' own parameters (a re-trained layer that is not watched, or a
BatchNorm's running statistics, change the rows of the layers after it).

Two fingerprints:

* :func:`model_fingerprint` (meta.json's ``model_sha256``): sha256 over every parameter and
  buffer of the model, taken at the first block of each pass and compared with the store's,
  like ``params_sha256`` (which stays the watched parameters' hash, so older stores resume);
* :class:`BlockGuard`: a cheap per-block check. At the end of each ``run(...)`` block it keeps,
  per tensor, its identity (storage pointer, shape, dtype), its ``_version`` counter (which
  in-place updates such as ``opt.step()`` or ``load_state_dict`` bump) and a few strided
  sampled values (updates that do not bump it: ``p.data.mul_()``, fused optimizers); at the
  start of the next block of the same pass anything that differs is a
  :class:`~nnstat.store.errors.ModelChangedError` naming the tensors. Changes *inside* a block
  (a train-mode BatchNorm updating its running statistics in forward) are not changes between
  blocks.

Example:
    >>> m = torch.nn.Linear(2, 2); guard = BlockGuard(); guard.record(m)
    >>> with torch.no_grad(): _ = m.weight.mul_(3)
    >>> guard.changed(m)
    ['weight']
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nnstat.store.errors import ModelChangedError
from nnstat.store.integrity import params_hash

SAMPLES = 4  # strided values kept per tensor at each block boundary
_SAMPLED = "(sampled values of the parameters or buffers)"


def model_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` as ``(name, tensor)``, parameters first
    (a DTensor gathered with ``full_tensor()``)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        DTensor = ()  # noqa: N806
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        t = t.detach()
        yield name, t.full_tensor() if isinstance(t, DTensor) else t


def model_fingerprint(model: torch.nn.Module | None) -> str | None:
    """``meta["model_sha256"]``: :func:`~nnstat.store.integrity.params_hash` of
    :func:`model_tensors` (same on every rank: see ``params_fingerprint``)."""
    if model is None:
        return None
    from nnstat.run.params import combine_rank_digests

    with torch.no_grad():
        return combine_rank_digests(params_hash(model_tensors(model)))


def _state(model: torch.nn.Module) -> tuple[list[tuple], dict[tuple, torch.Tensor]]:
    """Per tensor its identity and version; the strided samples concatenated per (device,
    dtype), left on the device (copies: the cat owns them)."""
    ids = []
    groups: dict[tuple, list[torch.Tensor]] = {}  # samples by (device, dtype): one cat each
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        local = getattr(t, "to_local", None)  # a DTensor (FSDP2): this rank's shard
        t = local() if callable(local) else t
        ids.append((name, t.data_ptr(), tuple(t.shape), t.dtype, t._version))
        n = t.numel()
        if n:
            step = max(1, n // SAMPLES)
            if t.is_contiguous():  # one strided view, no copy
                sample = torch.as_strided(t, (-(-n // step),), (step,), t.storage_offset())
            else:
                sample = t.reshape(-1)[::step]
            groups.setdefault((t.device, t.dtype), []).append(sample)
    return ids, {key: torch.cat(group) for key, group in groups.items()}


def _same_bits(a: dict[tuple, torch.Tensor], b: dict[tuple, torch.Tensor]) -> bool | torch.Tensor:
    """Whether two sample sets hold the same bits (NaN == NaN): a bool when the shapes tell, else
    a 0-d bool tensor on the device, not read here (recording and comparing the samples read
    nothing: the caller reads the flag, with the block's other flags, in one host read)."""
    if a.keys() != b.keys() or any(a[k].shape != b[k].shape for k in a):
        return False
    if not a:
        return True
    device = next(iter(a.values())).device  # groups on other devices join it (no host copy)
    flags = [(a[k].view(torch.uint8) == b[k].view(torch.uint8)).all().to(device) for k in a]
    return torch.stack(flags).all()


class BlockGuard:
    """The model's state at the end of the last block of a pass; see the module docstring."""

    def __init__(self) -> None:
        self._state: tuple[list[tuple], dict[tuple, torch.Tensor]] | None = None

    def reset(self) -> None:
        self._state = None

    def record(self, model: torch.nn.Module | None) -> None:
        if model is not None:
            with torch.no_grad():
                self._state = _state(model)

    def _compare(self, model: torch.nn.Module | None) -> tuple[list[str], bool | torch.Tensor]:
        """The tensors whose identity or version differ from the last :meth:`record`, and
        whether the sampled values are the same (a device flag, not read)."""
        if self._state is None or model is None:
            return [], True
        with torch.no_grad():
            ids, values = _state(model)
        old_ids, old_values = self._state
        out = [a[0] for a, b in zip(ids, old_ids, strict=False) if a != b]
        if len(ids) != len(old_ids):
            out.append(f"({len(old_ids)} -> {len(ids)} tensors)")
        return out, True if out else _same_bits(values, old_values)

    def changed(self, model: torch.nn.Module | None) -> list[str]:
        """Names of the tensors that differ from the last :meth:`record` (all of them when only
        the sampled values tell)."""
        out, same = self._compare(model)
        return out if out or bool(same) else [_SAMPLED]

    def check(self, model: torch.nn.Module | None) -> None:
        """Raise :class:`ModelChangedError` when the model changed since the last block (one
        host read: :meth:`begin` then :meth:`confirm`)."""
        self.confirm(self.begin(model))

    def begin(self, model: torch.nn.Module | None) -> bool | torch.Tensor:
        """At a block's start: raise at once when a tensor was replaced or updated in place
        (identity, version); return whether the sampled values are unchanged, as a device flag
        the block reads with its other flags at its end (:meth:`confirm`)."""
        out, same = self._compare(model)
        self._refuse(out)
        return same

    def confirm(self, same: bool | list[bool] | torch.Tensor) -> None:
        """Raise when :meth:`begin`'s flag (or its value, read by the caller) says the sampled
        values changed; a tensor flag is read here."""
        if isinstance(same, torch.Tensor):
            same = bool(same)
        elif isinstance(same, list):
            same = all(same)
        self._refuse([] if same else [_SAMPLED])

    def _refuse(self, changed: list[str]) -> None:
        if changed:
            self._state = None
            raise ModelChangedError(
                f"the model changed between two run(...) blocks of one logging pass "
                f"({', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}): an optimizer "
                "step or another update while logging, so the pass's rows would come from "
                "several models. Log with fixed weights (after training, or each checkpoint "
                "into its own project, or with overwrite=True), and finalize() the pass before "
                "changing the model"
            )
