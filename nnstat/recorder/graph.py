"""Dependency graph between registered tensors, from autograd plus manual edges.

The graph is the computation graph with every unregistered operation contracted away: an edge
``a -> b`` means that ``b`` was computed from ``a`` without passing through another registered
tensor. Its identity is a sha256 of canonical JSON, so the same graph from two processes (or two
trials) has the same hash; Python's per-process ``hash()`` is never used.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence

import torch

ROLES: tuple[str, ...] = ("input", "target", "output", "loss", "intermediate", "parameter")


def autograd_edges(named: Sequence[tuple[str, torch.Tensor]]) -> set[tuple[str, str]]:
    """Edges ``(parent, child)`` between the named tensors found by walking ``grad_fn``.

    Tensors without autograd history (created under ``torch.no_grad()`` or not requiring grad)
    contribute no edges; connect them with manual edges. The walk visits each autograd node
    once, so its cost is linear in the size of the graph.

    Example:
        >>> w = torch.ones(2, requires_grad=True)
        >>> h = w * 2
        >>> y = h.sum()
        >>> sorted(autograd_edges([("w", w), ("h", h), ("y", y)]))
        [('h', 'y'), ('w', 'h')]
    """
    # keyed by (node, output_nr): outputs of one multi-output op (split, chunk) share a node
    by_node: dict[tuple[object, int], str] = {}
    by_leaf: dict[int, str] = {}
    for name, t in named:
        if t.grad_fn is not None:
            by_node[(t.grad_fn, t.output_nr)] = name
        elif t.requires_grad:
            by_leaf[id(t)] = name

    def own_name(node: object, nr: int) -> str | None:
        name = by_node.get((node, nr))
        if name is not None:
            return name
        variable = getattr(node, "variable", None)
        return by_leaf.get(id(variable)) if variable is not None else None

    memo: dict[object, frozenset[str]] = {}

    def ancestors(root: object) -> frozenset[str]:
        # iterative post-order: deep graphs (long RNN unrolls) exceed Python's recursion limit
        stack: list[tuple[object, bool]] = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in memo:
                continue
            parents = [(p, nr) for p, nr in getattr(node, "next_functions", ()) if p is not None]
            if not expanded:
                stack.append((node, True))
                stack.extend(
                    (p, False) for p, nr in parents if p not in memo and own_name(p, nr) is None
                )
                continue
            found: set[str] = set()
            for p, nr in parents:
                name = own_name(p, nr)
                if name is not None:
                    found.add(name)
                else:
                    found |= memo.get(p, frozenset())
            memo[node] = frozenset(found)
        return memo[root]

    edges: set[tuple[str, str]] = set()
    for (node, _), child in by_node.items():
        for parent in ancestors(node):
            if parent != child:
                edges.add((parent, child))
    return edges


def graph_document(
    nodes: Iterable[tuple[str, str]], edges: Iterable[tuple[str, str]]
) -> dict[str, object]:
    """Canonical JSON-ready description: sorted ``nodes`` ``[name, role]`` and ``edges``.

    Example:
        >>> graph_document([("b", "loss"), ("a", "input")], [("a", "b")])["nodes"]
        [['a', 'input'], ['b', 'loss']]
    """
    node_list = sorted({(str(n), str(r)) for n, r in nodes})
    names = {n for n, _ in node_list}
    edge_list = sorted({(str(a), str(b)) for a, b in edges})
    missing = sorted({x for e in edge_list for x in e} - names)
    if missing:
        raise ValueError(f"graph edges name unregistered tensors: {missing}")
    return {"nodes": [list(n) for n in node_list], "edges": [list(e) for e in edge_list]}


def graph_hash(document: dict[str, object]) -> str:
    """sha256 of the canonical JSON of a graph document; identical graphs share it.

    Example:
        >>> d = graph_document([("a", "input")], [])
        >>> graph_hash(d) == graph_hash(graph_document([("a", "input")], []))
        True
    """
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
