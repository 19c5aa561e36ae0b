"""NetDict: an ordered mapping layer name → tensor, with whole-network arithmetic and statistics.

Layer keys are parameter names exactly as ``model.named_parameters()`` gives them, in that order.
Statistics are computed on the tensors' device (`nnstat.describe.summarize`) with one host transfer.

Example:
    >>> import torch, nnstat
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    >>> W = nnstat.get_weight(model)
    >>> list(W)
    ['0.weight', '0.bias', '1.weight', '1.bias']
    >>> sorted(W.describe_layers(include="^1", stats=["l2"]))
    ['1.bias/l2', '1.weight/l2']
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from nnstat.describe import Description, summarize, validate_stats
from nnstat.describe.sharded import norms_sharded, summarize_sharded
from nnstat.distributed import any_dtensor

__all__ = ["NetDict", "SameParams", "select_names"]


def select_names(
    names: Sequence[str], include: str | None = None, exclude: str | None = None
) -> list[str]:
    """Names matching `include` and not `exclude` (regexes found anywhere, like ``re.search``).

    Example:
        >>> select_names(["h.0.ln_1.weight", "h.0.attn.in_proj_weight"], include="ln")
        ['h.0.ln_1.weight']
    """
    inc = re.compile(include) if include else None
    exc = re.compile(exclude) if exclude else None
    return [
        n for n in names if (inc is None or inc.search(n)) and (exc is None or not exc.search(n))
    ]


class SameParams:
    """Refuses a model whose parameters are no longer the tensors ``owner`` took from it.

    A module replaced after ``owner`` took the parameters (``model.fc = nn.Linear(...)``)
    leaves it reading the old, detached tensors: every number about them would describe a
    layer the model no longer has. In-place changes (``.to(dtype)``, ``.half()``, a moved
    device, ``load_state_dict``) keep the same tensors and pass. `check` runs every logged
    step: it follows each parameter's path of ``_modules``/``_parameters`` entries (one dict
    lookup each: about 10 us for GPT-2's 148 tensors on a CPU core, against 130 us for a
    ``named_parameters()`` walk), and walks the model by name only when one of them changed.

    Args:
        model: the model the parameters were taken from.
        names: their names, as ``owner`` took them (after ``clean``).
        params: the parameters, in the order of ``names``.
        owner: who holds them, for the message (``"Tracker"``).
        fix: what to call after changing the model, for the message.
        clean: the map from ``named_parameters()`` names to ``names`` (wrapper prefixes).

    Example:
        >>> m = torch.nn.Sequential(torch.nn.Linear(2, 1))
        >>> same = SameParams(m, ["0.weight"], [m[0].weight], "T", "watch again")
        >>> same.check()
        >>> m[0] = torch.nn.Linear(2, 1)
        >>> try:
        ...     same.check()
        ... except ValueError as e:
        ...     print(str(e)[:69])
        T: 1 parameter(s) it took from the model are no longer the model's: [
    """

    def __init__(
        self,
        model: torch.nn.Module,
        names: Sequence[str],
        params: Sequence[torch.Tensor],
        owner: str,
        fix: str,
        clean: Callable[[str], str] = str,
    ) -> None:
        self.model, self.names, self.params = model, list(names), list(params)
        self.owner, self.fix, self.clean = owner, fix, clean
        self._edges = self._paths()

    def _paths(self) -> list[tuple[dict, str, Any]]:
        """``(dict, key, value)``: each step from the model down to each parameter."""
        raw = {self.clean(n): n for n, _ in self.model.named_parameters()}
        edges: dict[tuple[int, str], tuple[dict, str, Any]] = {}
        for name in self.names:
            *path, leaf = raw[name].split(".")
            module = self.model
            for key in path:
                child = module._modules[key]
                edges[(id(module._modules), key)] = (module._modules, key, child)
                module = child
            edges[(id(module._parameters), leaf)] = (
                module._parameters,
                leaf,
                module._parameters[leaf],
            )
        return list(edges.values())

    def check(self) -> None:
        """Raise if a parameter taken is gone or its name now holds another tensor.

        Raises:
            ValueError: naming the parameters and the fix.
        """
        if all(d.get(k) is v for d, k, v in self._edges):
            return
        now = {self.clean(n): p for n, p in self.model.named_parameters()}
        changed = [n for n, p in zip(self.names, self.params, strict=True) if now.get(n) is not p]
        if changed:
            shown = f"{changed[:5]}{' ...' if len(changed) > 5 else ''}"
            raise ValueError(
                f"{self.owner}: {len(changed)} parameter(s) it took from the model are no longer "
                f"the model's: {shown} (a module or parameter was replaced, or removed, "
                f"afterwards), so its numbers would describe tensors the model no longer uses. "
                f"{self.fix}"
            )
        self._edges = self._paths()  # the same tensors under new containers


class NetDict(Mapping[str, torch.Tensor]):
    """Ordered mapping layer name → tensor with element-wise arithmetic and statistics.

    Binary operators accept another NetDict with exactly the same keys, or a scalar.

    Args:
        data: layer name → tensor; ``None``: empty.

    Raises:
        TypeError: a key that is not a string or a value that is not a tensor.
        ValueError: (operators) another NetDict with different layers.

    Example:
        >>> import torch
        >>> a = NetDict({"w": torch.tensor([3.0, 4.0])})
        >>> float((a * 2 - a).norm(2))
        5.0
    """

    __slots__ = ("_data",)

    def __init__(self, data: Mapping[str, torch.Tensor] | None = None) -> None:
        self._data: dict[str, torch.Tensor] = {}
        for k, v in (data or {}).items():
            self[k] = v

    # -- mapping --------------------------------------------------------------------------
    def __getitem__(self, key: str) -> torch.Tensor:
        return self._data[key]

    def __setitem__(self, key: str, value: torch.Tensor) -> None:
        if not isinstance(key, str):
            raise TypeError(f"NetDict keys are layer names (str), got {type(key).__name__}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(
                f"NetDict value for {key!r} must be a torch.Tensor, got {type(value).__name__}"
            )
        self._data[key] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __repr__(self) -> str:
        body = ", ".join(f"{k}: {tuple(v.shape)}" for k, v in self._data.items())
        return f"NetDict({{{body}}})"

    # -- arithmetic -----------------------------------------------------------------------
    def _binary(self, other: Any, op: Callable[[Any, Any], torch.Tensor], name: str) -> NetDict:
        if isinstance(other, NetDict):
            if list(self._data) != list(other._data):
                only_a = [k for k in self._data if k not in other._data]
                only_b = [k for k in other._data if k not in self._data]
                detail = (
                    f"only in left: {only_a[:5]}, only in right: {only_b[:5]}"
                    if only_a or only_b
                    else "same keys in a different order"
                )
                raise ValueError(f"cannot {name} NetDicts with different layers ({detail})")
            out = {}
            for k, a in self._data.items():
                b = other._data[k]
                if a.shape != b.shape:
                    raise ValueError(
                        f"cannot {name} NetDicts: layer {k!r} has shapes "
                        f"{tuple(a.shape)} and {tuple(b.shape)}"
                    )
                out[k] = op(a, b)
            return NetDict(out)
        if isinstance(other, numbers.Number) or (
            isinstance(other, torch.Tensor) and other.dim() == 0
        ):
            return NetDict({k: op(a, other) for k, a in self._data.items()})
        return NotImplemented

    def __add__(self, other: Any) -> NetDict:
        return self._binary(other, torch.add, "add")

    def __sub__(self, other: Any) -> NetDict:
        return self._binary(other, torch.sub, "subtract")

    def __mul__(self, other: Any) -> NetDict:
        return self._binary(other, torch.mul, "multiply")

    def __truediv__(self, other: Any) -> NetDict:
        return self._binary(other, torch.div, "divide")

    def __radd__(self, other: Any) -> NetDict:
        return self._binary(other, lambda a, b: b + a, "add")

    def __rsub__(self, other: Any) -> NetDict:
        return self._binary(other, lambda a, b: b - a, "subtract")

    def __rmul__(self, other: Any) -> NetDict:
        return self._binary(other, lambda a, b: b * a, "multiply")

    def __rtruediv__(self, other: Any) -> NetDict:
        return self._binary(other, lambda a, b: b / a, "divide")

    def __pow__(self, exponent: Any) -> NetDict:
        return self.pow(exponent)

    def __neg__(self) -> NetDict:
        return self.apply(torch.neg)

    def __abs__(self) -> NetDict:
        return self.apply(torch.abs)

    def abs(self) -> NetDict:
        """Element-wise absolute value."""
        return self.apply(torch.abs)

    def neg(self) -> NetDict:
        """Element-wise negation."""
        return self.apply(torch.neg)

    def sqrt(self) -> NetDict:
        """Element-wise square root."""
        return self.apply(torch.sqrt)

    def pow(self, exponent: Any) -> NetDict:
        """Element-wise power (scalar exponent or a NetDict of exponents)."""
        return self._binary(exponent, torch.pow, "raise to a power")

    def apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> NetDict:
        """A NetDict of ``fn(tensor)`` for every layer.

        Example:
            >>> NetDict({"w": torch.tensor([-1.0])}).apply(torch.exp)["w"].tolist()
            [0.3678794503211975]
        """
        return NetDict({k: fn(v) for k, v in self._data.items()})

    def clone(self) -> NetDict:
        """Deep copy of every tensor (detached)."""
        return self.apply(lambda t: t.detach().clone())

    def to(self, *args: Any, **kwargs: Any) -> NetDict:
        """``tensor.to(*args, **kwargs)`` for every layer (device and/or dtype)."""
        return self.apply(lambda t: t.to(*args, **kwargs))

    def filter(self, include: str | None = None, exclude: str | None = None) -> NetDict:
        """Layers whose name matches `include` and not `exclude` (``re.search`` anywhere)."""
        return NetDict({k: self._data[k] for k in select_names(list(self._data), include, exclude)})

    # -- reductions -----------------------------------------------------------------------
    def numel(self) -> int:
        """Total number of elements over all layers."""
        return sum(t.numel() for t in self._data.values())

    def layer_norms(self, p: float = 2) -> dict[str, float]:
        """The p-norm of each layer (one host transfer).

        Example:
            >>> NetDict({"a": torch.tensor([3.0, 4.0])}).layer_norms()
            {'a': 5.0}
        """
        if not self._data:
            return {}
        if any_dtensor(list(self._data.values())):
            # sharded layers: norms of the local shards reduced across ranks, never gathered
            return dict(zip(self._data, norms_sharded(list(self._data.values()), p), strict=True))
        tensors = [t.detach().reshape(-1) for t in self._data.values()]
        # complex layers keep their dtype: ``_foreach_norm`` takes the modulus, ``.float()`` would
        # drop the imaginary part
        tensors = [t if t.is_floating_point() or t.is_complex() else t.float() for t in tensors]
        norms = torch._foreach_norm(tensors, p)
        values = torch.stack([n.to(tensors[0].device, torch.float64) for n in norms]).tolist()
        return dict(zip(self._data, values, strict=True))

    def norm(self, p: float = 2) -> float:
        """The p-norm of the whole network, as if all layers were one flat vector.

        Args:
            p: the norm's order (``inf``, ``-inf`` and ``0`` included).

        Returns:
            The norm.

        Raises:
            ValueError: an empty NetDict.

        Example:
            >>> NetDict({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])}).norm(2)
            5.0
        """
        if not self._data:
            raise ValueError("norm of an empty NetDict")
        norms = list(self.layer_norms(p).values())
        if p == math.inf:
            return max(norms)
        if p == -math.inf:
            return min(norms)
        if p == 0:
            return float(sum(norms))
        return float(sum(n**p for n in norms) ** (1.0 / p))

    def _selected(
        self, include: str | None, exclude: str | None
    ) -> tuple[list[str], list[torch.Tensor]]:
        if not self._data:
            raise ValueError("cannot describe an empty NetDict (no layers)")
        names = select_names(list(self._data), include, exclude)
        if not names:
            raise ValueError(
                f"no layer matches include={include!r} exclude={exclude!r}; "
                f"layers are {list(self._data)[:10]}"
            )
        return names, [self._data[n] for n in names]

    def describe(
        self,
        layerwise: bool = False,
        include: str | None = None,
        exclude: str | None = None,
        stats: Sequence[str] | str | None = None,
        display: bool = False,
    ) -> Description:
        """Statistics of the whole network (over all its elements) or of each layer.

        `stats` defaults to every name in `nnstat.describe.STAT_NAMES`. NaN/Inf are counted in
        ``nonfinite``; the other statistics (except ``numel``) describe the finite elements.

        Args:
            layerwise: one row per layer (``False``: one for the whole network).
            include: regex (``re.search``) of layer names to describe; ``None``: all.
            exclude: regex of layer names to leave out.
            stats: statistic names; ``None``: all of them.
            display: also print the table.

        Returns:
            A `Description`: ``{stat: value}``, or ``{layer: {stat: value}}`` when layerwise.

        Raises:
            ValueError: an empty NetDict, no layer matching ``include``/``exclude``, or an
                unknown statistic.

        Example:
            >>> d = NetDict({"a": torch.tensor([1.0, 3.0])}).describe(stats=["mean", "max"])
            >>> dict(d)
            {'mean': 2.0, 'max': 3.0}
        """
        stats = validate_stats(stats)
        names, tensors = self._selected(include, exclude)
        if layerwise:
            table = summarize(tensors, stats).tolist()
            out = Description(
                {n: dict(zip(stats, row, strict=True)) for n, row in zip(names, table, strict=True)}
            )
        elif any_dtensor(tensors):
            row = summarize_sharded(tensors, stats, combine=True)
            row = row[0].tolist()
            out = Description(zip(stats, row, strict=True))
        else:
            dev = tensors[0].device
            flat = torch.cat([t.detach().reshape(-1).to(dev) for t in tensors])
            out = Description(zip(stats, summarize([flat], stats)[0].tolist(), strict=True))
        if display:
            print(out)
        return out

    def describe_layers(
        self,
        include: str | None = None,
        exclude: str | None = None,
        stats: Sequence[str] | str | None = None,
        prefix: str = "",
        layerwise: bool = True,
        display: bool = False,
    ) -> dict[str, float]:
        """A flat ``{"<prefix><layer>/<stat>": float}`` dict, ready for ``wandb.log``.

        With ``layerwise=False`` the keys are ``"<prefix><stat>"`` for the whole network.

        Args:
            include: regex of layer names to describe; ``None``: all.
            exclude: regex of layer names to leave out.
            stats: statistic names; ``None``: all of them.
            prefix: prepended to every key (e.g. ``"weight/"``).
            layerwise: per layer (``False``: the whole network).
            display: also print the table.

        Returns:
            The flat metrics dict.

        Raises:
            ValueError: an empty NetDict, no layer matching ``include``/``exclude``, or an
                unknown statistic.

        Example:
            >>> NetDict({"fc.weight": torch.ones(2)}).describe_layers(stats=["l1"], prefix="w/")
            {'w/fc.weight/l1': 2.0}
        """
        desc = self.describe(layerwise, include, exclude, stats, display)
        if layerwise:
            return {f"{prefix}{n}/{s}": v for n, row in desc.items() for s, v in row.items()}
        return {f"{prefix}{s}": v for s, v in desc.items()}

    # -- persistence ----------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Save as safetensors (``.safetensors``) or a plain tensor dict for ``torch.load``.

        Args:
            path: the file; its suffix picks the format.

        Example:
            >>> import tempfile, os
            >>> p = os.path.join(tempfile.mkdtemp(), "w.safetensors")
            >>> NetDict({"a": torch.zeros(2)}).save(p); list(NetDict.load(p))
            ['a']
        """
        path = Path(path)
        data = {k: v.detach().cpu().contiguous() for k, v in self._data.items()}
        if path.suffix == ".safetensors":
            from safetensors.torch import save_file

            save_file(data, str(path), metadata={"nnstat.order": "\n".join(data)})
        else:
            torch.save(data, path)

    @classmethod
    def load(cls, path: str | Path, device: str | torch.device = "cpu") -> NetDict:
        """Load a NetDict saved by `save` (never unpickles arbitrary objects).

        Args:
            path: a file written by `save`.
            device: device to load the tensors onto.

        Returns:
            The NetDict, in the saved layer order.

        Raises:
            ValueError: the file does not hold a dict of tensors, or is damaged.
        """
        path = Path(path)
        if path.suffix == ".safetensors":
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(path), framework="pt", device=str(device)) as f:
                    order = (f.metadata() or {}).get("nnstat.order")
                    keys = order.split("\n") if order else list(f.keys())
                    return cls({k: f.get_tensor(k) for k in keys})
            except SafetensorError as e:
                raise ValueError(
                    f"{path}: not a readable safetensors file ({e}); it is damaged or was cut "
                    "short: save the NetDict again"
                ) from e
        data = torch.load(path, map_location=device, weights_only=True)
        if not isinstance(data, Mapping):
            raise ValueError(f"{path} does not hold a dict of tensors")
        return cls(data)
