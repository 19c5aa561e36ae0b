"""Build NetDicts from a model: weights, gradients, optimizer states, updates, `compute_stats`.

Re-exported by `nnstat.netdict` (and `nnstat`); kept apart so each module stays small.

Example:
    >>> import torch, nnstat
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
    >>> list(nnstat.get_optimizer_state(model, opt, "momentum_buffer"))
    ['weight', 'bias']
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from nnstat.distributed import clean_name, fsdp1_grad, fsdp1_shards, fsdp1_whole
from nnstat.netdict.netdict import NetDict, select_names

__all__ = [
    "UnknownStateKeyError",
    "get_weight",
    "get_grad",
    "get_optimizer_state",
    "get_update",
    "compute_stats",
    "optimizer_state_keys",
    "layer_state_keys",
]


class UnknownStateKeyError(KeyError):
    """An optimizer-state key that no parameter's state holds; the message lists those that exist.

    Args:
        key: the key asked for.
        existing: the keys the optimizer's states hold.
        optimizer: the optimizer's class name, for the message.

    Example:
        >>> str(UnknownStateKeyError("exp_avg_sg", ["exp_avg", "exp_avg_sq"]))[:40]
        "unknown optimizer state key 'exp_avg_sg'"
    """

    def __init__(self, key: str, existing: Sequence[str], optimizer: str = "optimizer") -> None:
        self.key = key
        self.existing = list(existing)
        close = difflib.get_close_matches(key, self.existing, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        if self.existing:
            msg = f"unknown optimizer state key {key!r}; {optimizer} state holds {self.existing}{hint}"
        else:
            msg = (
                f"unknown optimizer state key {key!r}: the {optimizer} state is empty (call "
                "optimizer.step() at least once first; some settings keep no state at all, "
                "e.g. SGD without momentum)"
            )
        super().__init__(msg)
        self.message = msg

    def __str__(self) -> str:  # KeyError would quote the whole message
        return self.message


def _params(
    model: nn.Module, include: str | None, exclude: str | None
) -> list[tuple[str, nn.Parameter]]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected an nn.Module, got {type(model).__name__}")
    # FSDP1 wrappers add a prefix: keys are the unwrapped model's names
    named = [(clean_name(n), p) for n, p in model.named_parameters()]
    if not named:
        raise ValueError(f"{type(model).__name__} has no parameters")
    keep = set(select_names([n for n, _ in named], include, exclude))
    if not keep:
        raise ValueError(
            f"no parameter matches include={include!r} exclude={exclude!r}; "
            f"parameters are {[n for n, _ in named][:10]}"
        )
    return [(n, p) for n, p in named if n in keep]


def _take(t: torch.Tensor, device: str | torch.device | None, copy: bool) -> torch.Tensor:
    t = t.detach()
    if device is not None:
        moved = t.to(device)
        return moved.clone() if copy and moved is t else moved
    return t.clone() if copy else t


def _take_all(
    tensors: dict[str, torch.Tensor], device: str | torch.device | None, copy: bool
) -> dict[str, torch.Tensor]:
    """:func:`_take` of each tensor, the copies made in one ``_foreach_copy_`` per (device,
    dtype) group: a clone per tensor launched a kernel per parameter (148 for GPT-2 small) on
    every ``get_weight(model).describe_layers()``. Each copy keeps its own storage (saving one
    entry saves only it); tensor subclasses (DTensor) are cloned one by one."""
    out = {n: _take(t, device, False) for n, t in tensors.items()}
    if not copy:
        return out
    groups: dict[tuple[torch.device, torch.dtype], list[str]] = {}
    for n, t in out.items():
        if t.device != tensors[n].device:
            continue  # moved to `device`: already a copy
        if type(t) is not torch.Tensor:
            out[n] = t.clone()
        else:
            groups.setdefault((t.device, t.dtype), []).append(n)
    for names in groups.values():
        src = [out[n] for n in names]
        dst = [torch.empty_like(t) for t in src]
        torch._foreach_copy_(dst, src)
        out.update(zip(names, dst, strict=True))
    return out


def get_weight(
    model: nn.Module,
    include: str | None = None,
    exclude: str | None = None,
    device: str | torch.device | None = None,
    copy: bool = True,
) -> NetDict:
    """The model's parameters as a NetDict (a detached copy unless ``copy=False``).

    The copy is the default so that ``W1 - W0`` around ``optimizer.step()`` is the real update
    (in-place optimizers would otherwise change ``W0`` too). Tensors stay on the model's device
    unless `device` is given.

    Args:
        model: the network.
        include: regex (``re.search``) of parameter names to keep; ``None``: all.
        exclude: regex of parameter names to leave out.
        device: device to put the tensors on; ``None``: where they are.
        copy: detached copies (``False``: the parameters' own detached storage).

    Returns:
        A :class:`NetDict` parameter name → weight tensor.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: the model has no parameters, or none matches ``include``/``exclude``.

    Example:
        >>> W = get_weight(torch.nn.Linear(2, 1), include="bias")
        >>> list(W)
        ['bias']
    """
    shards = fsdp1_shards(model)
    whole = {n: fsdp1_whole(p, p, shards) for n, p in _params(model, include, exclude)}
    return NetDict(_take_all(whole, device, copy))


def get_grad(
    model: nn.Module,
    include: str | None = None,
    exclude: str | None = None,
    device: str | torch.device | None = None,
    copy: bool = True,
    missing: str = "warn",
) -> NetDict:
    """The gradients (``p.grad``) as a NetDict.

    Parameters with ``requires_grad=False`` are skipped silently. Trainable parameters whose
    ``.grad`` is None are skipped with one warning naming them (``missing="warn"``), silently
    (``"ignore"``) or raise (``"raise"``). If no parameter has a gradient, a ValueError is raised.

    Args:
        model: the network, after ``loss.backward()``.
        include: regex (``re.search``) of parameter names to keep; ``None``: all.
        exclude: regex of parameter names to leave out.
        device: device to put the tensors on; ``None``: where they are.
        copy: detached copies (``False``: the ``.grad`` tensors themselves, detached).
        missing: trainable parameters without ``.grad``: ``"warn"``, ``"ignore"`` or
            ``"raise"``.

    Returns:
        A :class:`NetDict` parameter name → gradient.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: the model has no parameters, or none matches ``include``/``exclude``.
            Also: no parameter has a gradient yet, ``missing="raise"`` with one missing, or
            an unknown ``missing``.

    Example:
        >>> m = torch.nn.Linear(2, 1); m(torch.ones(1, 2)).sum().backward()
        >>> get_grad(m)["bias"].tolist()
        [1.0]
    """
    if missing not in ("warn", "ignore", "raise"):
        raise ValueError(f"missing must be 'warn', 'ignore' or 'raise', got {missing!r}")
    params = _params(model, include, exclude)
    shards = fsdp1_shards(model)
    out, absent = {}, []
    for n, p in params:
        g = fsdp1_grad(p, shards)
        if g is not None:
            out[n] = g
        elif p.requires_grad:
            absent.append(n)
    if not out:
        first = absent[0] if absent else params[0][0]
        raise ValueError(
            f"no parameter has a gradient yet (e.g. {first!r} has .grad None); "
            "call loss.backward() before get_grad"
        )
    if absent:
        msg = f"{len(absent)} parameter(s) have no gradient and are left out: {absent[:5]}"
        if missing == "raise":
            raise ValueError(msg)
        if missing == "warn":
            warnings.warn(msg, stacklevel=2)
    return NetDict(_take_all(out, device, copy))


def optimizer_state_keys(optimizer: torch.optim.Optimizer) -> list[str]:
    """Keys of per-parameter tensor states that exist in `optimizer` (e.g. ``exp_avg``).

    Example:
        >>> optimizer_state_keys(torch.optim.Adam(torch.nn.Linear(1, 1).parameters()))
        []
    """
    keys: dict[str, None] = {}
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                keys[k] = None
    return list(keys)


def layer_state_keys(optimizer: Any, params: Sequence[torch.Tensor]) -> list[str]:
    """Keys of the per-parameter states of ``params`` worth a layer statistic: tensors with one
    or more dimensions and at most the parameter's elements, whatever their shape (Adafactor's
    factored ``row_var`` ``[m, 1]`` and ``col_var`` ``[1, n]``); not scalar counters (Adam's
    ``step``), even where a 0-d parameter makes a scalar the parameter's shape, nor a state of
    the whole model kept under one parameter (L-BFGS's flat direction ``d``). A key some
    parameter holds so counts for every parameter holding it (a 0-d parameter's ``exp_avg``).

    Args:
        optimizer: the optimizer (anything whose ``.state`` maps parameters to state dicts).
        params: the parameters to look at.

    Returns:
        The keys, in the order first met.

    Example:
        >>> m = torch.nn.Linear(3, 2); opt = torch.optim.Adafactor(m.parameters())
        >>> m(torch.ones(1, 3)).sum().backward(); opt.step()
        >>> layer_state_keys(opt, list(m.parameters()))
        ['row_var', 'col_var', 'variance']
    """
    keys: dict[str, None] = {}
    for p in params:
        for k, v in optimizer.state.get(p, {}).items():
            if isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() <= p.numel():
                keys[k] = None
    return list(keys)


def get_optimizer_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    key: str,
    include: str | None = None,
    exclude: str | None = None,
    device: str | torch.device | None = None,
    copy: bool = True,
) -> NetDict:
    """One optimizer state (``"exp_avg"``, ``"exp_avg_sq"``, ``"momentum_buffer"``, ...).

    Parameters without that state (no step yet, frozen) are left out. An unknown key raises
    `UnknownStateKeyError` listing the keys that exist.

    Args:
        model: the network the optimizer trains.
        optimizer: the optimizer holding the state.
        key: the state's name in ``optimizer.state[p]``.
        include: regex (``re.search``) of parameter names to keep; ``None``: all.
        exclude: regex of parameter names to leave out.
        device: device to put the tensors on; ``None``: where they are.
        copy: detached copies (``False``: the state tensors themselves).

    Returns:
        A :class:`NetDict` parameter name → state tensor.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``optimizer`` not an optimizer.
        UnknownStateKeyError: no parameter's state holds ``key`` (a ``KeyError``).
        ValueError: no parameter matches ``include``/``exclude``.

    Example:
        >>> m = torch.nn.Linear(2, 1); opt = torch.optim.Adam(m.parameters())
        >>> m(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> get_optimizer_state(m, opt, "exp_avg_sq")["bias"].shape
        torch.Size([1])
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    existing = optimizer_state_keys(optimizer)
    if key not in existing:
        raise UnknownStateKeyError(key, existing, type(optimizer).__name__)
    out = {}
    shards = fsdp1_shards(model)
    for n, p in _params(model, include, exclude):
        v = optimizer.state.get(p, {}).get(key)
        if v is None and id(p) in shards and p.numel() == 0:
            v = p.detach()  # FSDP1: this rank holds no slice of the parameter (nor of its state)
        if isinstance(v, torch.Tensor):
            out[n] = fsdp1_whole(v, p, shards)
    return NetDict(_take_all(out, device, copy))


def get_update(W0: NetDict, W1: NetDict, lr: float = 1.0) -> NetDict:
    """The step from `W0` to `W1` divided by `lr`: ``(W1 - W0) / lr``.

    With ``lr=1`` this is the raw update; with the optimizer's learning rate it is the update
    direction (``-grad`` for plain SGD).

    Args:
        W0: weights before the step (e.g. ``get_weight(model)`` before ``optimizer.step()``).
        W1: weights after it, with the same keys.
        lr: divisor of the difference.

    Returns:
        A :class:`NetDict` of ``(W1 - W0) / lr``.

    Raises:
        ValueError: ``lr`` is zero, or the two NetDicts have different layers.

    Example:
        >>> a = NetDict({"w": torch.tensor([1.0])}); b = NetDict({"w": torch.tensor([0.5])})
        >>> get_update(a, b, lr=0.5)["w"].tolist()
        [-1.0]
    """
    if not lr:
        raise ValueError("lr must be non-zero")
    diff = W1 - W0
    return diff if lr == 1.0 else diff / lr


def compute_stats(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    state_keys: Sequence[str] | str = (),
    include: str | None = None,
    exclude: str | None = None,
    stats: Sequence[str] | str | None = None,
    layerwise: bool = True,
) -> dict[str, float]:
    """Weight, gradient and optimizer-state statistics in one flat dict.

    Keys are ``"weight/<layer>/<stat>"``, ``"grad/<layer>/<stat>"``, ``"<state_key>/<layer>/<stat>"``.
    State keys are validated before anything is computed. Parameters without ``.grad`` are left
    out of ``grad/`` with one warning (all of ``grad/`` when nothing has a gradient yet).

    Args:
        model: the network.
        optimizer: its optimizer; needed for ``state_keys``.
        state_keys: optimizer states to describe (``"exp_avg"``, ...).
        include: regex (``re.search``) of parameter names to keep; ``None``: all.
        exclude: regex of parameter names to leave out.
        stats: statistic names (see `nnstat.describe`); ``None``: all of them.
        layerwise: one row per layer (``False``: one per group for the whole network).

    Returns:
        A flat dict metric key → float.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: the model has no parameters, or none matches ``include``/``exclude``.
        UnknownStateKeyError: a state key no parameter's state holds.
        ValueError: ``state_keys`` without an optimizer, or an unknown statistic.

    Example:
        >>> m = torch.nn.Linear(2, 1); opt = torch.optim.Adam(m.parameters())
        >>> m(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> s = compute_stats(m, opt, ["exp_avg"], stats=["l2"])
        >>> sorted(s)[:2]
        ['exp_avg/bias/l2', 'exp_avg/weight/l2']
    """
    keys = (state_keys,) if isinstance(state_keys, str) else tuple(state_keys)
    if keys:
        if optimizer is None:
            raise ValueError(f"state_keys {list(keys)} need an optimizer")
        existing = optimizer_state_keys(optimizer)
        for k in keys:
            if k not in existing:
                raise UnknownStateKeyError(k, existing, type(optimizer).__name__)
    out = get_weight(model, include, exclude, copy=False).describe_layers(
        stats=stats, prefix="weight/", layerwise=layerwise
    )
    named = _params(model, include, exclude)
    shards = fsdp1_shards(model)
    with_grad = [n for n, p in named if fsdp1_grad(p, shards) is not None]
    if len(with_grad) < len(named):
        absent = [n for n, p in named if fsdp1_grad(p, shards) is None and p.requires_grad]
        if absent:
            warnings.warn(
                f"{len(absent)} parameter(s) have no gradient and are left out of grad/: "
                f"{absent[:5]}",
                stacklevel=2,
            )
    if with_grad:
        G = get_grad(model, include, exclude, copy=False, missing="ignore")
        out.update(G.describe_layers(stats=stats, prefix="grad/", layerwise=layerwise))
    for k in keys:
        S = get_optimizer_state(model, optimizer, k, include, exclude, copy=False)
        if len(S):
            out.update(S.describe_layers(stats=stats, prefix=f"{k}/", layerwise=layerwise))
    return out
