"""The watched parameters of a :class:`~nnstat.run.Run`: their fingerprint (meta.json's
``params_sha256``), the checks that a pass is computed with the store's weights, and freezing
them for a ``param_grads=False`` pass.

Example:
    >>> import torch
    >>> combine_rank_digests("abc")  # one process: its own digest
    'abc'
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from nnstat.store.errors import ModelChangedError
from nnstat.store.files import META_FILE, read_json
from nnstat.store.integrity import params_hash
from nnstat.store.logger import check_same_params


def watched_parameters(engine: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """``("{module}.{param}", full tensor)`` of every watched module's own parameters, in watch
    order (registration order within a module). A DTensor (FSDP2) is gathered with
    ``full_tensor()``, a collective: every rank hashes the same whole weights. FSDP1 flat
    parameters are hashed as each rank holds them (outside forward: its shard);
    :func:`params_fingerprint` combines the ranks' hashes."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        DTensor = ()  # noqa: N806
    for name, module in engine.watched.items():
        for pname, p in module.named_parameters(recurse=False):
            t = p.detach()
            yield f"{name}.{pname}", t.full_tensor() if isinstance(t, DTensor) else t


def params_fingerprint(engine: Any) -> str:
    """``meta["params_sha256"]``: :func:`nnstat.store.integrity.params_hash` of
    :func:`watched_parameters` (the weights the rows of a pass are computed with).

    Under ``torch.distributed`` every rank returns the same value (a collective: call it on
    every rank): the ranks' hashes are exchanged, and when they differ (FSDP1, where each rank
    holds its shard) the fingerprint is the hash of all of them in rank order. Without this the
    ranks would write one shared ``meta.json`` with whichever rank's shard came first and
    refuse each other's passes."""
    with torch.no_grad():
        local = params_hash(watched_parameters(engine))
    return combine_rank_digests(local)


def combine_rank_digests(local: str) -> str:
    """One digest for all ranks: ``local`` when every rank has it (replicated weights: DDP,
    FSDP2's gathered tensors, one process), else sha256 of the ranks' digests in rank order."""
    from nnstat.distributed import rank_world

    _, world = rank_world()
    if world == 1:
        return local
    import torch.distributed as dist

    digests: list[Any] = [None] * world
    dist.all_gather_object(digests, local)
    if all(d == local for d in digests):
        return local
    return hashlib.sha256(("sharded:" + ",".join(map(str, digests))).encode()).hexdigest()


def freeze_params(engine: Any) -> Callable[[], None]:
    """Turn off ``requires_grad`` of watched modules' parameters; return the restore function."""
    saved: list[tuple[torch.nn.Parameter, bool]] = []
    seen: set[int] = set()
    for module in engine.watched.values():
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                saved.append((p, p.requires_grad))
    for p, _ in saved:
        p.requires_grad_(False)

    def restore() -> None:
        for p, flag in saved:
            p.requires_grad_(flag)

    return restore


def check_store_weights(
    path: Path, current: str, warned_once: set[str], model_sha256: str | None = None
) -> None:
    """At the first block of a logging pass: refuse (:class:`ModelChangedError`) when the
    store at ``path`` holds rows of other weights than ``current`` (its meta.json's
    ``params_sha256``, and ``model_sha256``: every parameter and buffer); warn once (``"unchecked weights"`` in ``warned_once``) when its
    meta.json predates the fingerprint."""
    meta_path = Path(path) / META_FILE
    if not meta_path.exists():
        return
    old = read_json(meta_path)
    old = old if isinstance(old, dict) else {}
    check_same_params(old, {"params_sha256": current, "model_sha256": model_sha256}, path)
    if old.get("params_sha256") is None and "unchecked weights" not in warned_once:
        warned_once.add("unchecked weights")
        warnings.warn(
            f"{meta_path} has no params_sha256 (written before nnstat recorded the "
            "weights): this pass cannot check that the stored rows were computed with "
            "the same weights as its own",
            stacklevel=5,
        )


def weights_changed_error(pass_names: list[str], index: int) -> ModelChangedError:
    """The error for pass ``index`` of one ``schedule()`` whose weights differ from its first
    pass's (an optimizer step inside the loop)."""
    return ModelChangedError(
        f"the watched parameters changed between pass {pass_names[0]!r} and pass "
        f"{pass_names[index]!r} of one schedule() (an optimizer step inside the loop?): "
        "the statistics of one pass would describe other weights than the next. Keep "
        "the model fixed for the whole schedule; after training, log into a new "
        "project or with overwrite=True."
    )
