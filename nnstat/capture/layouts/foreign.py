"""Watched parameters that also get gradient outside their module's forward.

A capture is the gradient of a module's parameters *through the module's output*:
``G_i = Σ_t b_t a_tᵀ``. When the model also uses a parameter by hand (an output layer tied to
the token embedding as ``logits = F.linear(h, self.emb.weight)`` or ``h @ self.emb.weight.T``,
an auxiliary term on a router's weight), that other share of the gradient never reaches the
module's hooks, and every per-sample gradient, norm, row and statistic of the module would
silently miss it.

The check walks the autograd graph of the watched model's output once (the first forward
inside a capture block after ``watch``): the graph is cut into *regions*, one per module call
(from the call's outputs down to its inputs) and one for everything else. A watched parameter
whose ``AccumulateGrad`` node is reached from a region other than its own module's calls is
used elsewhere; the engine leaves such modules out with the reason and the fix. Ties through
modules (``head.weight = emb.weight``, captured whole by tied.py) are the calls of the tie
group's modules, so they pass.

Example:
    >>> import torch
    >>> from torch import nn
    >>> emb, body = nn.Embedding(5, 3), nn.Linear(3, 3)
    >>> check = ForeignUses()
    >>> ids = torch.tensor([[1, 2]])
    >>> e = emb(ids); check.call(emb, (ids,), e)
    >>> h = body(e); check.call(body, (e,), h)
    >>> logits = torch.nn.functional.linear(h, emb.weight)  # the tie by hand
    >>> found = check.users([logits.grad_fn], {id(emb.weight): (emb,), id(body.weight): (body,)})
    >>> found == {id(emb.weight): {None}}  # used outside every watched call
    True
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ForeignUses", "graph_roots"]


def graph_roots(value: Any) -> list[Any]:
    """The autograd nodes (``grad_fn``) of the tensors in a module's output (tuples, lists,
    dicts and dataclasses such as transformers' ``ModelOutput`` searched)."""
    nodes, todo = [], [value]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            if x.grad_fn is not None:
                nodes.append(x.grad_fn)
        elif isinstance(x, Mapping):
            todo.extend(x.values())
        elif isinstance(x, list | tuple):
            todo.extend(x)
        elif is_dataclass(x) and not isinstance(x, type):
            todo.extend(getattr(x, f.name) for f in fields(x))
    return nodes


@dataclass(eq=False)
class _Region:
    """A module call (``owner``; None: outside every call) between its outputs and the nodes
    of its inputs (``stops``), where the walk returns to ``parent``, the region holding the
    call."""

    owner: nn.Module | None
    stops: frozenset
    parent: _Region | None


class ForeignUses:
    """Record watched module calls of one forward, then find who uses each parameter.

    ``call(module, inputs, output)`` from the forward hooks, ``users(outputs, owners)`` once
    the model's forward returned (see the module docstring).
    """

    def __init__(self) -> None:
        # output node of a call -> (module, the nodes of the call's input tensors)
        self.calls: dict[Any, tuple[nn.Module, frozenset]] = {}

    def clear(self) -> None:
        """Forget the recorded calls (a new forward of the model starts)."""
        self.calls.clear()

    def call(self, module: nn.Module, inputs: Iterable[Any], output: Any) -> None:
        """Record one call of a watched module (``module``: the hooked one, for
        ``nn.MultiheadAttention``'s ``out_proj`` the attention module)."""
        outs = graph_roots(output)
        if not outs:
            return
        stops = frozenset(graph_roots(list(inputs)))
        for node in outs:
            self.calls.setdefault(node, (module, stops))

    def users(
        self, outputs: list[Any], owners: Mapping[int, tuple[nn.Module, ...]]
    ) -> dict[int, set[nn.Module | None]]:
        """For each parameter of ``owners`` (``id(param)`` -> the hooked modules whose calls
        may use it) that is used elsewhere: the other users (a module, or None for the
        model's forward outside every watched call).

        Args:
            outputs: the model output's autograd nodes (:func:`graph_roots`).
            owners: the watched parameters by ``id`` and the modules that own them.

        Returns:
            ``{id(param): {foreign users}}``, only parameters with one.
        """
        top = _Region(None, frozenset(), None)
        entered: dict[tuple[Any, _Region], _Region] = {}
        seen: set[tuple[Any, _Region]] = set()
        found: dict[int, set[nn.Module | None]] = {}
        todo = [(node, top) for node in outputs]
        while todo:
            node, region = todo.pop()
            call = self.calls.get(node)
            if call is not None and region.owner is not call[0]:
                key = (node, region)  # a call's output: its own region starts here
                if key not in entered:
                    entered[key] = _Region(call[0], call[1], region)
                region = entered[key]
            if (node, region) in seen:
                continue
            seen.add((node, region))
            var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf's gradient
            if var is not None and id(var) in owners and region.owner not in owners[id(var)]:
                found.setdefault(id(var), set()).add(region.owner)
            for nxt, _ in node.next_functions:
                if nxt is None:
                    continue
                if nxt in region.stops:  # the call's input: upstream belongs to its caller
                    assert region.parent is not None
                    todo.append((nxt, region.parent))
                else:
                    todo.append((nxt, region))
        return found
