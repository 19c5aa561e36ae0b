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

from typing import NamedTuple

import torch
from torch import nn

from nnstat.capture.capture import ModuleCapture
from nnstat.capture.kinds import Kind, detect_kind
from nnstat.capture.matrix import one_hot_rows, scaled, scatter_rows, token_rows

__all__ = ["merge", "owner_index", "tie_groups", "unsupported_tie"]


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
        kind = detect_kind(m)
        if kind is None or kind.tie_transposed is None:
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
        kind = detect_kind(m)
        if kind is None or not kind.tokens:
            return i
    return 0


def merge(
    name: str, module: nn.Module, kind: Kind, dims: tuple[int, int], parts: list[ModuleCapture]
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
    if kind.tokens and all(c.kind.tokens for c in parts):
        a = torch.cat([c.indices for c in parts], 1)
        b = torch.cat([c.backward for c in parts], 1)
    else:
        flip = kind.tie_transposed
        a_parts: list[Scaled] = []
        b_parts: list[Scaled] = []
        for c in parts:
            # an embedding's one-hot rows stay indices (Tokens); the output gradient stays
            # unscaled (its mean-loss factor is applied to its projection, or when joined)
            a = Scaled(Tokens(c.indices, c.d_in) if c.kind.tokens else c.forward, 1.0)
            b = Scaled(c._b_raw, c._scale)
            if c.kind.tie_transposed != flip:
                a, b = b, a
            a_parts.append(a)
            b_parts.append(b)
        positions = sum(c.num_positions for c in parts)
        return TiedCapture(name, module, kind, a_parts, b_parts, positions, dims)
    positions = sum(c.num_positions for c in parts)
    return ModuleCapture(name, module, kind, a, b, positions, None, dims, False)


class Tokens(NamedTuple):
    """One-hot rows ``[N, T, width]`` kept as their indices ``idx`` ``[N, T]`` (``-1``: a zero
    row): an embedding's token side in a merged capture."""

    idx: torch.Tensor
    width: int


Side = torch.Tensor | Tokens


class Scaled(NamedTuple):
    """A part's rows and the factor its values carry (an output gradient's mean-loss
    rescaling, 1 for inputs), applied to its projection (small) rather than to the rows."""

    rows: Side
    scale: float


class TiedCapture(ModuleCapture):
    """A merged capture whose sides are concatenations of the modules' rows over positions,
    built only when asked for: its projection projects each module's rows and concatenates
    those, so an embedding's one-hot rows (``[N, T, V]``, plus the ``[N, 2T, V]``
    concatenation: GBs per batch for GPT-2 on an accelerator) are never built to be logged.
    The rows are the same, bit for bit: a one-hot row times ``P`` is a lookup of ``P``.
    Everything else (statistics, per-sample gradients) reads the concatenated matrices.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        kind: str,
        a_parts: list[Scaled],
        b_parts: list[Scaled],
        num_positions: int | torch.Tensor,
        dims: tuple[int, int],
    ) -> None:
        dense = next(p.rows for p in (*b_parts, *a_parts) if isinstance(p.rows, torch.Tensor))
        super().__init__(name, module, kind, dense, dense, num_positions, None, dims, False)
        self._a3 = self._b3 = None  # built from the parts on first use
        self._a_parts, self._b_parts = a_parts, b_parts
        self._dense = dense  # dtype and device of the rows
        self._length = sum(_length(p.rows) for p in a_parts)  # positions of the concatenation

    @property
    def device(self) -> torch.device:
        return self._dense.device

    @property
    def dtype(self) -> torch.dtype:
        return self._dense.dtype

    @property
    def _a(self) -> torch.Tensor:
        if self._a3 is None:
            self._a3 = _joined(self._a_parts)
        return self._a3

    @property
    def _b_raw(self) -> torch.Tensor:
        if self._b3 is None:
            self._b3 = _joined(self._b_parts)
        return self._b3

    def _is_plain_row(self) -> bool:
        if self._length != 1:
            return False
        _ = self._a, self._b_raw  # one row: the matrices are small (norms.py reads them)
        return super()._is_plain_row()

    def _projected_factors(
        self, p_in: torch.Tensor, p_out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        p_in, p_out = self._checked_projections(p_in, p_out, self._dense)
        return _projected(self._b_parts, p_out), _projected(self._a_parts, p_in)

    def per_sample_grad(self) -> torch.Tensor:
        """``[N, d_out, d_in]``: the sum over the modules of ``b_partᵀ a_part``, each from its
        own rows (a GEMM; a token side is a scatter of the other side's rows), so neither the
        one-hot ``[N, T, V]`` rows nor the ``[N, 2T, ·]`` concatenations are built; a part's
        scale rides on the GEMM's ``alpha`` or on the scattered rows."""
        out = self._dense.new_zeros(self.num_samples, self.d_out, self.d_in)
        return _add_products(out, self._a_parts, self._b_parts)

    def batch_grad(self) -> torch.Tensor:
        """``Σ_i G_i`` ``[d_out, d_in]``, module by module like :meth:`per_sample_grad`, with
        every position as one sample of a batch of one."""
        out = self._dense.new_zeros(1, self.d_out, self.d_in)
        a, b = (
            [Scaled(_one_sample(q.rows), q.scale) for q in side]
            for side in (self._a_parts, self._b_parts)
        )
        return _add_products(out, a, b)[0]

    def per_sample_sq_norm(self) -> torch.Tensor:
        """``[N]``: from the two sides' Grams over every position when that takes fewer
        multiply-adds than forming ``G_i`` (a wide head over few positions), else from
        :meth:`per_sample_grad`."""
        if self._length == 1:
            return super().per_sample_sq_norm()  # one row: the plain rows' norms
        if _gram_work(self._a_parts) + _gram_work(self._b_parts) < self._matrix_work():
            return self.gram_sq_norm()
        return self.matrix_sq_norm()

    def sq_norm_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
        """:meth:`per_sample_sq_norm` summed over the samples: the side Grams' dot (0-d), or the
        per-sample matrices for the caller's foreach norm (the parts carry their scales)."""
        if self._length == 1:
            return super().sq_norm_parts()
        if _gram_work(self._a_parts) + _gram_work(self._b_parts) < self._matrix_work():
            return [], self.gram_sq_norm_sum(), 1.0
        return [self.per_sample_grad()], [], 1.0

    def gram_sq_norm_sum(self) -> list[torch.Tensor]:
        """0-d values adding to ``Σ_i`` of :meth:`gram_sq_norm`: block by block, each pair of
        parts' Gram blocks of the two sides dotted over every sample (an off-diagonal pair
        once, weighted twice for its mirror; the parts' scales as weights on the 0-d dot), so
        neither ``[N, P, P]`` Gram is assembled."""
        a, b = self._a_parts, self._b_parts
        values = []
        for k in range(len(a)):
            for m in range(k, len(a)):
                ga, gb = _gram_block(a[k].rows, a[m].rows), _gram_block(b[k].rows, b[m].rows)
                if ga.is_contiguous() and gb.is_contiguous():
                    dot = torch.dot(ga.view(-1), gb.view(-1))
                else:
                    dot = torch.mul(ga, gb).sum()
                w = a[k].scale * a[m].scale * b[k].scale * b[m].scale * (1 if m == k else 2)
                values.append(dot if w == 1.0 else dot * w)
        return values

    def matrix_sq_norm(self) -> torch.Tensor:
        """``[N]`` squared norms of :meth:`per_sample_grad`'s matrices."""
        g = self.per_sample_grad()
        return torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).square_()

    def gram_sq_norm(self) -> torch.Tensor:
        """``[N]`` ``Σ_{t,s} (a_t·a_s)(b_t·b_s)`` over the positions of every part, each
        side's Gram assembled block by block: a GEMM between dense parts, a gather between a
        dense part and token indices, an equality test between two token parts."""
        n = self.num_samples
        ga = _side_gram(self._a_parts, n, self._dense).view(n, 1, -1)
        gb = _side_gram(self._b_parts, n, self._dense).view(n, -1, 1)
        return torch.bmm(ga, gb).view(n)

    def _matrix_work(self) -> int:
        n, d = self.num_samples, self.d_out * self.d_in
        dense = sum(
            _length(a)
            for (a, _), (b, _) in zip(self._a_parts, self._b_parts, strict=True)
            if not isinstance(a, Tokens) and not isinstance(b, Tokens)
        )
        # the GEMMs, plus the [N, d_out, d_in] matrices written, scattered into and read
        return 2 * n * dense * d + 4 * n * d


def _add_products(out: torch.Tensor, a_parts: list[Scaled], b_parts: list[Scaled]) -> torch.Tensor:
    """``out[i] += Σ_parts scale · b_partᵀ a_part`` per sample ``i`` (``out`` ``[N, d_out,
    d_in]``): a batched GEMM between dense parts, a scatter of the dense side's rows at the
    indices of a token side (rows of ``G`` for output-side tokens, columns for input-side)."""
    for (a, sa), (b, sb) in zip(a_parts, b_parts, strict=True):
        if isinstance(b, Tokens):  # G[i, tok] += a_t
            scatter_rows(out, b.idx, a, sa * sb)
        elif isinstance(a, Tokens):  # G[i, :, tok] += b_t
            scatter_rows(out.transpose(1, 2), a.idx, b, sa * sb)
        else:
            out.baddbmm_(b.transpose(1, 2), a, alpha=sa * sb)
    return out


def _one_sample(part: Side) -> Side:
    """A part's rows of every sample as the positions of one sample (``[1, N*T, ...]``)."""
    if isinstance(part, Tokens):
        return Tokens(part.idx.reshape(1, -1), part.width)
    return part.reshape(1, -1, part.shape[-1])


def _gram_work(parts: list[Scaled]) -> int:
    """Multiply-adds of :func:`_side_gram`'s GEMMs (blocks between dense parts)."""
    dense = [q.rows for q in parts if isinstance(q.rows, torch.Tensor)]
    total = sum(x.shape[1] for x in dense)
    return 2 * sum(x.shape[0] * x.shape[1] * x.shape[2] for x in dense) * total


def _side_gram(parts: list[Scaled], n: int, like: torch.Tensor) -> torch.Tensor:
    """``[N, P, P]`` Gram ``x_t·x_s`` of one side's rows over all ``P`` positions (each part
    times its scale), block by block, without the one-hot rows of a token part."""
    spans, at = [], 0
    for q in parts:
        spans.append((at, at + _length(q.rows)))
        at += _length(q.rows)
    out = like.new_empty(n, at, at)
    for k, (p, sp) in enumerate(parts):
        for m in range(k, len(parts)):
            q, sq = parts[m]
            block = _gram_block(p, q)
            if sp * sq != 1.0:
                block = block * (sp * sq)
            (k0, k1), (m0, m1) = spans[k], spans[m]
            out[:, k0:k1, m0:m1] = block
            if m != k:
                out[:, m0:m1, k0:k1] = block.transpose(1, 2)
    return out


def _gram_block(p: Side, q: Side) -> torch.Tensor:
    """``[N, T_p, T_q]`` dot products of the rows of two parts (one-hot rows as indices)."""
    if isinstance(p, Tokens) and isinstance(q, Tokens):
        same = p.idx.unsqueeze(2) == q.idx.unsqueeze(1)
        return (same & (p.idx >= 0).unsqueeze(2)).float()
    if isinstance(p, Tokens):
        return _gram_block(q, p).transpose(1, 2)
    if isinstance(q, Tokens):  # x_t · onehot(idx_s) = x_t[idx_s], 0 where idx_s = -1
        n, t = p.shape[:2]
        idx = q.idx.clamp(min=0).unsqueeze(1).expand(n, t, q.idx.shape[1])
        return torch.gather(p, 2, idx) * (q.idx >= 0).unsqueeze(1)
    return torch.bmm(p, q.transpose(1, 2))


def _length(part: Side) -> int:
    return part.idx.shape[1] if isinstance(part, Tokens) else part.shape[1]


def _joined(parts: list[Scaled]) -> torch.Tensor:
    """The parts' rows concatenated over positions, each times its scale."""
    rows = [
        one_hot_rows(p.idx, p.width) if isinstance(p, Tokens) else (p if s == 1.0 else p * s)
        for p, s in parts
    ]
    return rows[0] if len(rows) == 1 else torch.cat(rows, 1)


def _projected(parts: list[Scaled], p: torch.Tensor) -> torch.Tensor:
    """``_joined(parts) @ p.T`` ``[N, T, r]``: a side without tokens and of one scale in one
    GEMM over its concatenated rows (as :class:`ModuleCapture` does), else each part's rows
    (GEMM or lookup) concatenated; scales multiply the projected rows."""
    if not any(isinstance(q.rows, Tokens) for q in parts) and len({q.scale for q in parts}) == 1:
        x = _joined([Scaled(q.rows, 1.0) for q in parts])
        n, t, d = x.shape
        return scaled(torch.mm(x.reshape(n * t, d), p.T).view(n, t, -1), parts[0].scale)
    out = []
    for q, s in parts:
        if isinstance(q, Tokens):
            out.append(scaled(token_rows(q.idx, p), s))
        else:
            n, t, d = q.shape
            out.append(scaled(torch.mm(q.reshape(n * t, d), p.T).view(n, t, -1), s))
    return out[0] if len(out) == 1 else torch.cat(out, 1)
