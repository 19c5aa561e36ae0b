"""`ModuleCapture`: what one watched module saw during one backward pass."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from nnstat.capture import rules
from nnstat.capture.norms import sq_norm_factors


class ModuleCapture:
    """Forward rows, output gradients and per-sample gradients of one module for one backward.

    Built by :class:`~nnstat.capture.engine.CaptureEngine`; consumers receive it in
    ``on_capture(cap)``. All tensors are float32 regardless of autocast. ``backward`` holds the
    gradient of **each sample's own loss** (already multiplied by the batch size when the loss
    was a mean), and masked positions are zero in both streams.

    Example:
        >>> import torch, nnstat
        >>> model = torch.nn.Linear(3, 2)
        >>> engine = nnstat.CaptureEngine(); _ = engine.watch(model)
        >>> caps = []
        >>> engine.add_consumer(caps.append)
        >>> with engine.batch():
        ...     model(torch.randn(5, 3)).sum().backward()
        >>> caps[0].per_sample_grad().shape
        torch.Size([5, 2, 4])
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        kind: str,
        a: torch.Tensor,
        b: torch.Tensor,
        num_positions: int | torch.Tensor,
        keep: torch.Tensor | None = None,
        dims: tuple[int, int] | None = None,
        bias: bool | None = None,
        scale: float = 1.0,
    ) -> None:
        self.name = name
        self.module = module
        self.kind = kind
        # embedding: [N, T] long indices (-1 = no gradient); else [N, T, d_in] WITHOUT the bias's
        # ones column: it is implicit (= keep) so no [N, T, d_in + 1] copy is made unless asked
        self._a3: torch.Tensor | None = a
        self._x2: torch.Tensor | None = None  # [N, d] one-position inputs (viewed 3-D lazily)
        # `backward` is b * scale (the mean-loss rescaling), multiplied only when first needed:
        # squared norms apply scale^2 to [N] values instead of scaling [N, T, d_out]
        self._b3: torch.Tensor | None = b
        self._g2: torch.Tensor | None = None
        self._scale = float(scale)
        self._b_scaled: torch.Tensor | None = None
        self._keep = keep  # [N, T] float 0/1 of unmasked rows, None = all kept
        # dims/bias may come precomputed (the engine does it once at watch time: this object is
        # built per module per backward, so attribute probing here is a fixed per-step cost)
        if bias is None:
            bias = rules.has_bias(module)
        self._bias = bias and kind in rules.BIAS_KINDS
        self.num_samples = int(b.shape[0])
        # an int, or a 0-d tensor (a mask's count) read only when num_positions is asked for
        self._positions: int | torch.Tensor = num_positions
        self.d_in, self.d_out = rules.dims(kind, module) if dims is None else dims

    @classmethod
    def _plain(
        cls,
        name: str,
        module: nn.Module,
        kind: str,
        a: torch.Tensor,
        b: torch.Tensor,
        n: int,
        num_positions: int,
        dims: tuple[int, int],
        bias: bool,
        scale: float,
    ) -> ModuleCapture:
        """The engine's per-step constructor: arguments already validated and converted
        (``bias`` already restricted to the kinds with a ones column), no mask."""
        self = cls.__new__(cls)
        self.name, self.module, self.kind = name, module, kind
        # [N, d] one-position rows stay 2-D until a method needs [N, 1, d] (the noise scale's
        # per-step path never does: two views fewer per module per step)
        if a.dim() == 2:
            self._a3, self._b3, self._x2, self._g2 = None, None, a, b
        else:
            self._a3, self._b3, self._x2, self._g2 = a, b, None, None
        self._scale, self._keep = scale, None
        self._b_scaled = None
        self._bias, self.num_samples, self._positions = bias, n, num_positions
        self.d_in, self.d_out = dims
        return self

    @property
    def device(self) -> torch.device:
        """The device of the capture's tensors, read without building any of them."""
        return (self._g2 if self._g2 is not None else self._b3).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the output-gradient rows (float32), read without building them."""
        return (self._g2 if self._g2 is not None else self._b3).dtype

    @property
    def num_positions(self) -> int:
        """Positions that were not masked out (the K-FAC ``A`` factor divides by their count).

        With a mask this reads the device once, at the first call (logging never asks);
        :attr:`position_count` is the same number left on the device."""
        n = self._positions
        if isinstance(n, torch.Tensor):
            n = self._positions = int(n)
        return n

    @property
    def position_count(self) -> int | torch.Tensor:
        """:attr:`num_positions` without a host read: an int, or a 0-d tensor on the device."""
        return self._positions

    @property
    def _a(self) -> torch.Tensor:
        a = self._a3
        if a is None:
            a = self._a3 = self._x2.unsqueeze(1)
        return a

    @property
    def _b_raw(self) -> torch.Tensor:
        b = self._b3
        if b is None:
            b = self._b3 = self._g2.unsqueeze(1)
        return b

    @property
    def _b(self) -> torch.Tensor:
        b = self._b_scaled
        if b is None:
            b = self._b_raw
            b = self._b_scaled = b if self._scale == 1.0 else b * self._scale
        return b

    def _ones(self) -> torch.Tensor:
        """The implicit bias column ``[N, T]``: 1 on kept rows, 0 on masked ones."""
        if self._keep is not None:
            return self._keep
        return self._b_raw.new_ones(self._b_raw.shape[0], self._b_raw.shape[1])

    def _a_full(self) -> torch.Tensor:
        if not self._bias:
            return self._a
        return torch.cat([self._a, self._ones().unsqueeze(-1)], dim=-1)

    # ------------------------------------------------------------------ streams
    @property
    def is_kronecker(self) -> bool:
        """True when the gradient is a sum of outer products ``b aᵀ`` (all kinds but layernorm)."""
        return self.kind in rules.OUTER_KINDS

    @property
    def forward(self) -> torch.Tensor:
        """``[N, T, d_in(+1)]`` float32 inputs in matrix form (embedding: one-hot, materialised)."""
        if self.kind == "embedding":
            return one_hot_rows(self._a, self.d_in)
        return self._a_full()

    @property
    def backward(self) -> torch.Tensor:
        """``[N, T, d_out]`` float32 gradients of each sample's own loss w.r.t. the output."""
        return self._b

    @property
    def indices(self) -> torch.Tensor:
        """Embedding only: ``[N, T]`` indices, ``-1`` where the position has no gradient."""
        if self.kind != "embedding":
            raise AttributeError(f"{self.name}: indices exist only for embedding, not {self.kind}")
        return self._a

    # ------------------------------------------------------------ per-sample gradients
    def per_sample_grad(self) -> torch.Tensor:
        """Per-sample gradient in matrix form.

        ``[N, d_out, d_in(+1)]`` for outer-product kinds (bias = last column; embedding:
        ``[N, D, V]``; HF Conv1D: the transpose of its ``(nx, nf)`` weight), ``[N, D(+D)]`` for
        layernorm (weight then bias). Use :meth:`per_sample_grads_by_param` for parameter shapes.
        """
        if self.kind == "layernorm":  # the mean-loss factor on the sums, not on b [N, T, D]
            return scaled(self._grad_of(self._b_raw), self._scale)
        return self._grad_of(self._b)

    def _grad_of(self, b: torch.Tensor) -> torch.Tensor:
        """:meth:`per_sample_grad` with `b` as the output gradients (scaled or not)."""
        a = self._a
        if self.kind == "layernorm":
            w = (b * a).sum(1)
            return torch.cat([w, b.sum(1)], dim=1) if rules.has_bias(self.module) else w
        if self.kind == "embedding":
            out = b.new_zeros(a.shape[0], self.d_in, self.d_out)
            return scatter_rows(out, a, b).transpose(1, 2)
        bt = b.transpose(1, 2)
        if not self._bias:
            return torch.bmm(bt, a)
        if b.shape[1] < self.d_out:  # appending the ones column to A is the smaller copy
            return torch.bmm(bt, self._a_full())
        # masked rows have b = 0, so the bias gradient is the plain sum over positions
        return torch.cat([torch.bmm(bt, a), b.sum(1).unsqueeze(-1)], dim=-1)

    def batch_grad(self) -> torch.Tensor:
        """``Σ_i G_i`` in :meth:`per_sample_grad`'s matrix form: the batch's gradient of the
        module (of the summed per-sample losses) in one product over all positions, without
        per-sample matrices and without a host read (no boolean-mask selection).

        Example:
            >>> import torch, nnstat
            >>> m = torch.nn.Linear(2, 1); e = nnstat.CaptureEngine(); _ = e.watch(m); out = []
            >>> e.add_consumer(lambda c: out.append(c.batch_grad()))
            >>> with e.batch(): m(torch.ones(3, 2)).sum().backward()
            >>> out[0].tolist()  # weight [1, 2], then the bias column
            [[3.0, 3.0, 3.0]]
        """
        if self.kind == "layernorm":
            return self.per_sample_grad().sum(0)
        b = self._b_raw.reshape(-1, self._b_raw.shape[-1])
        if self.kind == "embedding":  # every position as one sample of a batch of one
            g = b.new_zeros(1, self.d_in, self.d_out)
            g = scatter_rows(g, self._a.reshape(1, -1), b.unsqueeze(0))[0].T
        else:
            a = self._a.reshape(-1, self._a.shape[-1])
            g = b.T @ a
            if self._bias:  # masked rows have b = 0: the bias column is the plain sum
                g = torch.cat([g, b.sum(0).unsqueeze(-1)], dim=1)
        return scaled(g, self._scale)

    def per_sample_grads_by_param(self) -> dict[str, torch.Tensor]:
        """``{"weight": [N, *weight.shape], "bias": [N, *bias.shape]}`` (bias when present)."""
        return rules.grads_by_param(self.kind, self.module, self.per_sample_grad())

    def per_sample_sq_norm(self) -> torch.Tensor:
        """``[N]`` squared Frobenius norm of each sample's gradient (weight and bias together).

        Uses ``‖Σ_t b_t a_tᵀ‖² = Σ_{t,s} (a_t·a_s)(b_t·b_s)`` when that is cheaper than
        materialising ``G_i``.
        """
        if self._is_plain_row():
            # row norms are one vectorised reduction each (3x faster than square().sum() on
            # [512, 2048]); the rest is in place on [N]
            na = torch.linalg.vector_norm(self._a, dim=(1, 2))
            nb = torch.linalg.vector_norm(self._b_raw, dim=(1, 2))
            if self._scale != 1.0:
                nb.mul_(self._scale)
            if self._bias:  # (|a|^2 + 1) |b|^2 = |b|^2 + |a|^2 |b|^2 (the bias's implicit 1)
                nb2 = nb.square_()
                return torch.addcmul(nb2, na.square_(), nb2)
            return na.mul_(nb).square_()
        # unscaled output gradients; the mean-loss factor squared multiplies the [N] result
        return scaled(self._sq_norm_of(self._b_raw), self._scale * self._scale)

    def _sq_norm_of(self, b: torch.Tensor) -> torch.Tensor:
        a, t = self._a, b.shape[1]
        if self.kind == "layernorm":
            return self._grad_of(b).square().sum(1)
        if self.kind == "embedding":
            if t * t > self.d_in:
                return self._grad_of(b).square().sum((1, 2))
            same = (a.unsqueeze(2) == a.unsqueeze(1)) & (a >= 0).unsqueeze(2)
            return (same * torch.bmm(b, b.transpose(1, 2))).sum((1, 2))
        if t * (self.d_in + self.d_out) < self.d_in * self.d_out:
            return gram_sq_norms(a, b, self._bias)
        return self._grad_of(b).square().sum((1, 2))

    def sq_norm_factors(self) -> tuple[list[torch.Tensor], float] | None:
        """``(tensors, c)`` with ``Σ_i ‖G_i‖² = c · Σ_k ‖tensors[k]‖²_F``, or None.

        For one-position outer products (an MLP's layers) ``‖G_i‖² = ‖a_i‖² ‖b_i‖² (+ ‖b_i‖²``
        for the bias), so the per-sample products ``‖a_i‖ ‖b_i‖`` (and ``‖b_i‖``) carry the
        batch's summed per-sample squared norms: one ``torch._foreach_norm`` over many modules'
        factors then replaces half a dozen kernels per module (the noise-scale tracker's
        per-step path).
        None for other captures (use :meth:`per_sample_sq_norm`). :func:`sq_norm_factors`
        does this for many captures with fewer kernels.

        Example:
            >>> import torch, nnstat
            >>> m = torch.nn.Linear(3, 2); e = nnstat.CaptureEngine(); _ = e.watch(m); caps = []
            >>> e.add_consumer(caps.append)
            >>> with e.batch(): m(torch.randn(4, 3)).sum().backward()
            >>> ts, c = caps[0].sq_norm_factors()
            >>> bool(torch.isclose(c * sum(t.square().sum() for t in ts),
            ...                    caps[0].per_sample_sq_norm().sum()))
            True
        """
        return sq_norm_factors([self])[0]

    def _is_plain_row(self) -> bool:
        """One position per sample and an outer-product gradient ``b aᵀ`` (dense inputs)."""
        if self._g2 is None and self._b3.shape[1] != 1:
            return False
        return self.kind in _ROW_KINDS

    def project(
        self,
        p_in: torch.Tensor,
        p_out: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Projected per-sample gradients without materialising ``G_i``.

        Outer-product kinds: ``[N, r_out * r_in]`` = ``vec(P_out @ G_i @ P_inᵀ)`` row-major, with
        ``p_in`` ``[r_in, d_in(+1)]`` and ``p_out`` ``[r_out, d_out]``. Layernorm: ``p_in`` of
        shape ``[r, D]`` alone, returns ``[N, r]``. ``out`` (optional, float32, may be a column
        slice of a wider row buffer) receives the result and is returned: a caller that reuses
        its buffers never allocates the ``[N, r_out * r_in]`` result.
        """
        if not self.is_kronecker:
            if p_out is not None:
                raise ValueError(
                    f"{self.name} ({self.kind}) has no Kronecker structure: pass p_in only"
                )
            g = self.per_sample_grad()
            _check_proj(self.name, "p_in", p_in, g.shape[1])
            p_t = p_in.to(g).T
            if out is None or not _writable_into(out, g, p_t):
                return _into(g @ p_t, out)
            # straight into the (strided) columns: a copy kernel fewer per module per batch,
            # the same GEMM (BLAS writes rows at any leading dimension)
            _check_out(self.name, out, g.shape[0], p_t.shape[1])
            return torch.mm(g, p_t, out=out)
        bp, ap = self._projected_factors(p_in, p_out)
        n, r_out, r_in = self.num_samples, bp.shape[-1], ap.shape[-1]
        if out is None:
            return torch.bmm(bp.transpose(1, 2), ap).reshape(n, -1)
        _check_out(self.name, out, n, r_out * r_in)
        if bp.shape[1] == 1:  # one position: the outer product, written in place (no bmm temp)
            torch.mul(bp.reshape(n, r_out, 1), ap.reshape(n, 1, r_in), out=out.view(n, r_out, r_in))
            return out
        bt = bp.transpose(1, 2)
        if not _writable_into(out, bt, ap):
            return _into(torch.bmm(bt, ap).reshape(n, -1), out)
        # [N, r_out, r_in] written in place (batch stride = the row buffer's width): no temp
        # and no copy kernel per module per batch, the same batched GEMM
        torch.bmm(bt, ap, out=out.view(n, r_out, r_in))
        return out

    def row_factors(
        self, p_in: torch.Tensor, p_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(P_out b_i, P_in a_i)`` as ``[N, r_out]``, ``[N, r_in]`` when each projected row is
        their outer product (one position per sample), else ``None``.

        ``project(p_in, p_out)[i]`` equals ``vec(outer(bp[i], ap[i]))`` bit for bit: a caller
        may form the rows later (the gradient store does, in its writer thread).
        """
        if not self._is_plain_row():
            return None
        bp, ap = self._projected_factors(p_in, p_out)
        return bp.reshape(self.num_samples, -1), ap.reshape(self.num_samples, -1)

    def _checked_projections(
        self, p_in: torch.Tensor, p_out: torch.Tensor | None, like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both projection matrices, checked against this module's sides and cast to `like`'s
        dtype and device."""
        if p_out is None:
            raise ValueError(f"{self.name} ({self.kind}) needs both p_in and p_out")
        _check_proj(self.name, "p_in", p_in, self.d_in)
        _check_proj(self.name, "p_out", p_out, self.d_out)
        return p_in.to(like), p_out.to(like)

    def _projected_factors(
        self, p_in: torch.Tensor, p_out: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``b @ p_outᵀ`` ``[N, T, r_out]`` and ``[a, 1] @ p_inᵀ`` ``[N, T, r_in]``."""
        p_in, p_out = self._checked_projections(p_in, p_out, self._b_raw)
        if self.kind == "embedding":
            ap = token_rows(self._a, p_in)
        elif self._bias:
            # [a, 1] @ p_inᵀ without building [a, 1]; masked rows have b = 0 and drop out
            ap = torch.addmm(p_in[:, -1], self._a.reshape(-1, self._a.shape[-1]), p_in[:, :-1].T)
            ap = ap.reshape(*self._a.shape[:2], -1)
        else:
            ap = _rows_mm(self._a, p_in.T)
        # the mean-loss factor on the projected [N, T, r_out] rows, not on [N, T, d_out]: exact
        # for a power-of-two batch size, one rounding either way otherwise
        return scaled(_rows_mm(self._b_raw, p_out.T), self._scale), ap

    # ------------------------------------------------------------ sums for statistics
    def forward_gram(self, proj: torch.Tensor | None = None) -> torch.Tensor:
        """``Σ_{n,t} a aᵀ`` over unmasked positions, ``[d_in(+1), d_in(+1)]``; with ``proj``
        (``P`` ``[r, d_in(+1)]``) that of the projected inputs, ``Σ (P a)(P a)ᵀ`` ``[r, r]``."""
        if proj is not None:
            ap = self._projected_forward(proj)
            return ap.T @ ap
        if self.kind == "embedding":
            return torch.diag(self._token_counts())
        a = self._a.reshape(-1, self._a.shape[-1])
        gram = a.T @ a
        if not self._bias:
            return gram
        k = self._ones().reshape(-1)
        col = k @ a
        corner = (k * k).sum().reshape(1, 1)
        return torch.cat([torch.cat([gram, col[:, None]], 1), torch.cat([col[None], corner], 1)])

    def backward_gram(self, proj: torch.Tensor | None = None) -> torch.Tensor:
        """``Σ_{n,t} b bᵀ``, ``[d_out, d_out]``; with ``proj`` (``P`` ``[r, d_out]``)
        ``Σ (P b)(P b)ᵀ`` ``[r, r]`` without the ``d_out × d_out`` matrix."""
        b = self._b_raw.reshape(-1, self._b_raw.shape[-1])
        if proj is not None:
            _check_proj(self.name, "projection", proj, self.d_out)
            b = b @ proj.to(b).T
        # the mean-loss factor squared on the [d, d] result, not on b's [N, T, d]
        return scaled(b.T @ b, self._scale * self._scale)

    def forward_sq_sum(self) -> torch.Tensor:
        """``Σ_{n,t} a²`` per input dimension (the diagonal of :meth:`forward_gram`)."""
        if self.kind == "embedding":
            return self.forward_sum()  # one-hot: a² = a
        total = self._a.square().sum((0, 1))
        if not self._bias:
            return total
        return torch.cat([total, self._ones().square().sum().reshape(1)])

    def backward_sq_sum(self) -> torch.Tensor:
        """``Σ_{n,t} b²`` per output dimension (the diagonal of :meth:`backward_gram`)."""
        return scaled(self._b_raw.square().sum((0, 1)), self._scale * self._scale)

    def _projected_forward(self, proj: torch.Tensor) -> torch.Tensor:
        """``P [a, 1]`` ``[N·T, r]`` of every position (masked rows zero)."""
        _check_proj(self.name, "projection", proj, self.d_in)
        proj = proj.to(self._b_raw)
        if self.kind == "embedding":
            return token_rows(self._a.reshape(-1), proj)
        a = self._a.reshape(-1, self._a.shape[-1])
        if not self._bias:
            return a @ proj.T
        k = self._ones().reshape(-1, 1)
        return torch.addmm(k * proj[:, -1], a, proj[:, :-1].T)

    def forward_sum(self) -> torch.Tensor:
        """``Σ_{n,t} a`` over unmasked positions."""
        if self.kind == "embedding":
            return self._token_counts()
        total = self._a.sum((0, 1))
        if not self._bias:
            return total
        return torch.cat([total, self._ones().sum().reshape(1)])

    def _token_counts(self) -> torch.Tensor:
        """Embedding: ``[V]`` float32 count of each index over positions with a gradient.

        A scatter-add of 0/1 weights: no boolean-mask selection and no ``bincount`` (both read
        the device back: the selection's size, bincount's maximum on CUDA). Counts up to 2^24
        per batch are exact in float32, in any order of the additions.
        """
        idx = self._a.reshape(-1)
        valid = idx >= 0
        counts = torch.zeros(self.d_in, device=idx.device)
        return counts.index_add_(0, idx.clamp(min=0), valid.float())

    def backward_sum(self) -> torch.Tensor:
        """``Σ_{n,t} b``."""
        return scaled(self._b_raw.sum((0, 1)), self._scale)

    def __repr__(self) -> str:
        return (
            f"ModuleCapture(name={self.name!r}, kind={self.kind!r}, N={self.num_samples}, "
            f"positions={self.num_positions}, d_in={self.d_in}, d_out={self.d_out})"
        )


_ROW_KINDS = (*rules.ROW_KINDS, "conv")


def _check_out(name: str, out: torch.Tensor, n: int, width: int) -> None:
    if out.shape != (n, width) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(
            f"{name}: out must be a float32 [{n}, {width}] tensor with contiguous rows, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )


def one_hot_rows(idx: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., width]`` float32 one-hot rows of indices ``idx`` (``-1``: a zero row): an
    embedding's forward rows in matrix form.

    Example:
        >>> one_hot_rows(torch.tensor([2, -1]), 3)
        tensor([[0., 0., 1.],
                [0., 0., 0.]])
    """
    return F.one_hot(idx.clamp(min=0), width).float() * (idx >= 0).unsqueeze(-1)


def token_rows(idx: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``one_hot_rows(idx, V) @ p.T`` (``p`` ``[r, V]``) as a lookup: the rows of the one-hot
    matrix are never built (``[N, T, V]``: GBs for a GPT-2 vocabulary). The values are the
    product's, bit for bit: each output is one ``p`` entry times 1 plus exact zeros.

    Example:
        >>> p = torch.randn(2, 3)
        >>> bool(torch.equal(token_rows(torch.tensor([2, -1]), p),
        ...                  one_hot_rows(torch.tensor([2, -1]), 3) @ p.T))
        True
    """
    return F.embedding(idx.clamp(min=0), p.T) * (idx >= 0).unsqueeze(-1)


def gram_sq_norms(a: torch.Tensor, b: torch.Tensor, bias: bool = False) -> torch.Tensor:
    """``[N]`` squared norms of ``G_i = Σ_t b_t [a_t, 1]ᵀ`` (ones column when `bias`: adds the
    sum of ``b``'s Gram) as one batched dot of the two ``[N, T, T]`` Grams.

    Example:
        >>> a, b = torch.randn(2, 3, 4), torch.randn(2, 3, 5)
        >>> g = torch.cat([b.transpose(1, 2) @ a, b.sum(1).unsqueeze(-1)], -1)
        >>> bool(torch.allclose(gram_sq_norms(a, b, bias=True), g.square().sum((1, 2))))
        True
    """
    n = a.shape[0]
    gram_a = torch.bmm(a, a.transpose(1, 2)).view(n, 1, -1)
    gram_b = torch.bmm(b, b.transpose(1, 2)).view(n, -1, 1)
    sq = torch.bmm(gram_a, gram_b).view(n)
    return sq.add_(gram_b.view(n, -1).sum(1)) if bias else sq


def scatter_rows(
    out: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor, alpha: float = 1.0
) -> torch.Tensor:
    """``out[i, idx[i, t]] += alpha * rows[i, t]`` in place (any strides) for ``out`` ``[N, R,
    C]``, ``idx`` ``[N, T]`` (``-1``: adds zeros, not a boolean selection, a host sync on a GPU).

    Example:
        >>> out = torch.zeros(1, 3, 2)
        >>> scatter_rows(out, torch.tensor([[2, -1, 2]]), torch.ones(1, 3, 2))[0].tolist()
        [[0.0, 0.0], [0.0, 0.0], [2.0, 2.0]]
    """
    n, t = idx.shape
    src = torch.where((idx >= 0).unsqueeze(-1), rows if alpha == 1.0 else rows * alpha, 0.0)
    sample = torch.arange(n, device=idx.device).unsqueeze(1).expand(n, t)
    return out.index_put_(
        (sample.reshape(-1), idx.clamp(min=0).reshape(-1)), src.reshape(n * t, -1), True
    )


def scaled(rows: torch.Tensor, scale: float) -> torch.Tensor:
    """``rows * scale``, in place on `rows` (a fresh product) unless ``scale == 1``."""
    return rows if scale == 1.0 else rows.mul_(scale)


def _rows_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w`` for ``[N, T, d]`` rows: the one GEMM ``matmul`` folds them into, viewed back
    (``matmul`` adds an ``_unsafe_view`` op per call, a dispatch per module per batch)."""
    if x.dim() != 3 or not x.is_contiguous():
        return x @ w  # matmul decides how to fold (or batch) rows it cannot view
    n, t, d = x.shape
    return torch.mm(x.view(n * t, d), w).view(n, t, w.shape[1])


def _writable_into(out: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """Whether an ``out=`` product may write ``out`` directly (same dtype and device; no
    autograd graph, which ``out=`` refuses)."""
    for x in inputs:
        if x.dtype != out.dtype or x.device != out.device:
            return False
        if x.requires_grad and torch.is_grad_enabled():
            return False
    return True


def _into(rows: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return rows
    _check_out("project", out, rows.shape[0], rows.shape[1])
    out.copy_(rows)
    return out


def _check_proj(name: str, label: str, p: torch.Tensor, d: int) -> None:
    if p.dim() != 2 or p.shape[1] != d:
        raise ValueError(f"{name}: {label} must have shape [r, {d}], got {tuple(p.shape)}")


def modules_by_size(sizes: Iterable[tuple[str, int]]) -> str:
    """``"3: 'b'; 4: 'a', 'c'"``: modules grouped by the batch size each saw, for the errors
    that refuse a block whose modules disagree.

    Example:
        >>> modules_by_size([("a", 4), ("b", 3), ("c", 4)])
        "3: 'b'; 4: 'a', 'c'"
    """
    groups: dict[int, list[str]] = {}
    for name, n in sizes:
        groups.setdefault(n, []).append(name)
    return "; ".join(f"{n}: {', '.join(map(repr, ms))}" for n, ms in sorted(groups.items()))
