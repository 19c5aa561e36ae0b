"""Which modules have well-defined per-sample gradients: a one-batch probe for the per-sample
noise scale and the logging passes (inputs broadcast over the batch, tied weights)."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from torch import nn

__all__ = ["ModuleProbe", "shared_parameter_modules"]


def _names_regex(names: Sequence[str]) -> str:
    import re

    return "^(?:" + "|".join(re.escape(n) for n in names) + ")$"


def shared_parameter_modules(model: nn.Module) -> set[str]:
    """Names of modules owning a parameter that another module also owns (tied weights).

    Example:
        >>> m = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
        >>> m[1].weight = m[0].weight
        >>> sorted(shared_parameter_modules(m))
        ['0', '1']
    """
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    return {n for users in owners.values() if len(users) > 1 for n in users}


class ModuleProbe:
    """Watch every supported module for one forward/backward and record the batch dimension
    each saw, to leave out modules whose per-sample gradients are undefined: inputs broadcast
    over the batch that the engine could not expand (GPT-2's position embedding, fed ``[1, T]``,
    is expanded and kept) or, with ``unshared=True``, tied weights (one gradient from two
    modules).

    Example:
        >>> import torch
        >>> model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 1))
        >>> probe = ModuleProbe(model)
        >>> with probe:
        ...     model(torch.randn(4, 2)).sum().backward()
        >>> probe.regex()
        '^(?:0|1)$'
    """

    def __init__(self, model: nn.Module, name_filter: Any = None, unshared: bool = False) -> None:
        from nnstat.capture.engine import CaptureEngine

        self.engine = CaptureEngine()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # unsupported modules are reported by the real watch
            names = self.engine.watch(model, name_filter=name_filter)
        self.excluded: dict[str, str] = {}
        if unshared:
            tied = shared_parameter_modules(model) & set(names)
            self.excluded.update({n: "its parameters are shared with another module" for n in tied})
        self.names = names
        # a module without gradient is what the probe finds out (it is not kept): no warning
        self.engine.no_gradient_warned.update(names)
        self.seen: dict[str, int] = {}
        self.engine.add_consumer(self._record)
        self._ctx: Any = None

    def _record(self, cap: Any) -> None:
        self.seen[cap.name] = int(cap.backward.shape[0])

    def __enter__(self) -> ModuleProbe:
        # samples="input": a module fed an input the batch shares (position ids [1, T]) is
        # captured per sample through an expansion of its output, so it is kept
        self._ctx = self.engine.batch(loss_reduction="sum", samples="input")
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        ctx, self._ctx = self._ctx, None
        try:
            if ctx is not None:
                ctx.__exit__(*exc)
        finally:
            for name, why in self.engine.left_out.items():
                self.excluded.setdefault(name, why)
            self.engine.unwatch()

    def keep(self) -> list[str]:
        """Modules with well-defined per-sample gradients, in watch order."""
        if not self.seen:
            raise RuntimeError("the probe captured nothing: run a forward and backward inside it")
        sizes = list(self.seen.values())
        batch = max(set(sizes), key=lambda n: (sizes.count(n), n))
        for name, n in self.seen.items():
            if n != batch:
                self.excluded.setdefault(
                    name, f"it sees a batch of {n}, not {batch} (input broadcast over the batch)"
                )
        keep = [n for n in self.names if n in self.seen and n not in self.excluded]
        if not keep:
            raise ValueError(f"no module has per-sample gradients: {self.excluded}")
        return keep

    def regex(self) -> str:
        """A ``name_filter`` selecting exactly :meth:`keep`."""
        return _names_regex(self.keep())
