"""Parameters shared by several modules (tied input/output embeddings, GPT-2 style).

GPT-2's ``lm_head.weight`` *is* ``wte.weight``: one parameter, used by two modules. Its
per-sample gradient is the sum of both modules' contributions, and it must be logged once:
two rows under two names would store two halves of one gradient, and every inner product
between samples (influence) would miss the cross terms.

So a tie group (modules that own the same parameters) is captured as **one** module, its
*owner*: the first module of the group in ``named_modules()`` order that is not an embedding
(GPT-2's ``lm_head``), else the first. The others are hooked as *aliases*; they are not in
``watch()``'s names, ``engine.watched`` or a store's layout, and each backward their rows are
merged into the owner's capture:

* both are sums of outer products over positions, ``G = Σ_t b_t a_tᵀ`` in the owner's matrix
  form, so the merged capture concatenates the positions of every module;
* a module whose matrix form is the transpose of the owner's (an ``nn.Embedding``,
  ``[D, V]``, tied to an ``nn.Linear(D, V)``, ``[V, D]``) contributes its rows with the roles
  swapped: the embedding's output gradients become input rows and its one-hot tokens become
  output-gradient rows (``Σ_t e_t bᵀ = (Σ_t b e_tᵀ)ᵀ``).

The merged capture is an ordinary capture of the owner: its per-sample gradients are those of
the shared parameter, and K-FAC treats the uses of the parameter as positions of one layer
(K-FAC expand). Supported ties: modules of kinds linear, HF Conv1D and embedding whose
parameters are all shared (no bias of their own); other ties are refused with the reason.

Example:
    >>> from torch import nn
    >>> emb, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    >>> head.weight = emb.weight
    >>> model = nn.Sequential(emb, head)
    >>> [[n for n, _ in g] for g in tie_groups(model)]
    [['0', '1']]
    >>> owner_index([m for _, m in tie_groups(model)[0]])
    1
"""

from __future__ import annotations

import torch
from torch import nn

from nnstat.capture import rules
from nnstat.capture.capture import ModuleCapture

__all__ = ["merge", "owner_index", "tie_groups", "unsupported_tie"]

#: kinds a tie may join; their matrix form is the weight (False) or its transpose (True)
_TRANSPOSED = {"linear": False, "conv1d_hf": True, "embedding": True}


def tie_groups(model: nn.Module) -> list[list[tuple[str, nn.Module]]]:
    """Groups of two or more modules of ``model`` that own a common parameter, each in
    ``named_modules()`` order (modules sharing with a module of a group join that group)."""
    owners: dict[int, list[int]] = {}
    modules = [
        (n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))
    ]
    for i, (_, m) in enumerate(modules):
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(i)
    parent = list(range(len(modules)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for users in owners.values():
        for j in users[1:]:
            parent[root(j)] = root(users[0])
    groups: dict[int, list[int]] = {}
    for i in range(len(modules)):
        groups.setdefault(root(i), []).append(i)
    return [[modules[i] for i in g] for g in groups.values() if len(g) > 1]


def unsupported_tie(group: list[tuple[str, nn.Module]]) -> str | None:
    """Why the modules of ``group`` cannot be captured as one, or None when they can."""
    names = ", ".join(repr(n) for n, _ in group)
    for _, m in group:
        kind = rules.detect_kind(m)
        if kind not in _TRANSPOSED:
            return (
                f"the modules {names} share a parameter and {type(m).__name__} (kind {kind}) "
                "has no rule to merge a shared parameter's rows; untie it or exclude the group "
                "with a name_filter"
            )
    first = {id(p) for p in group[0][1].parameters(recurse=False)}
    for _, m in group[1:]:
        if {id(p) for p in m.parameters(recurse=False)} != first:
            return (
                f"the modules {names} share a parameter but not all of their parameters (e.g. "
                "an output bias of their own), which the merged capture of a shared weight "
                "cannot hold; share every parameter or exclude the group with a name_filter"
            )
    return None


def owner_index(modules: list[nn.Module]) -> int:
    """Index of the module a tie group is logged under: the first one that is not an
    embedding (its matrix form is the weight itself), else the first."""
    for i, m in enumerate(modules):
        if rules.detect_kind(m) != "embedding":
            return i
    return 0


def merge(
    name: str, module: nn.Module, kind: str, dims: tuple[int, int], parts: list[ModuleCapture]
) -> ModuleCapture:
    """One capture of the shared parameter under the owner (``name``, ``module``, ``kind``,
    ``dims``) from the captures of the group's modules in this backward (see the module
    docstring). Every part must have the same samples.

    Example:
        >>> import torch
        >>> from nnstat.capture import CaptureEngine
        >>> emb, head = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
        >>> head.weight = emb.weight
        >>> model = nn.Sequential(emb, head)
        >>> e = CaptureEngine(); e.watch(model)
        ['1']
        >>> caps = []; e.add_consumer(caps.append)
        >>> with e.batch(): model(torch.tensor([[1, 2], [3, 3]])).sum().backward()
        >>> g = caps[0].per_sample_grads_by_param()["weight"]
        >>> bool(torch.allclose(g.sum(0), emb.weight.grad))
        True
    """
    n = parts[0].num_samples
    if any(c.num_samples != n for c in parts):
        sizes = ", ".join(f"{c.name!r}: {c.num_samples}" for c in parts)
        raise ValueError(
            f"{name}: the modules that share its parameter saw different batch sizes ({sizes})"
        )
    if all(c.kind == "embedding" for c in parts) and kind == "embedding":
        a = torch.cat([c.indices for c in parts], 1)
        b = torch.cat([c.backward for c in parts], 1)
    else:
        flip = _TRANSPOSED[kind]
        a_parts, b_parts = [], []
        for c in parts:
            a, b = c.forward, c.backward  # one-hot rows for an embedding; b scaled
            if _TRANSPOSED[c.kind] != flip:
                a, b = b, a
            a_parts.append(a)
            b_parts.append(b)
        a, b = torch.cat(a_parts, 1), torch.cat(b_parts, 1)
    positions = sum(c.num_positions for c in parts)
    return ModuleCapture(name, module, kind, a, b, positions, None, dims, False)
