"""`ModuleCapture`: what one watched module saw during one backward pass."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from nnstat.capture.kinds import Kind, kind_named
from nnstat.capture.matrix import rows_mm, scaled
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
        kind: str | Kind,
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
        self.kind = kind = kind_named(kind)  # the layer kind: its products are computed there
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
            bias = kind.has_bias(module)
        self._bias = bias and kind.dense
        self.num_samples = int(b.shape[0])
        # an int, or a 0-d tensor (a mask's count) read only when num_positions is asked for
        self._positions: int | torch.Tensor = num_positions
        self.d_in, self.d_out = kind.dims(module) if dims is None else dims

    @classmethod
    def _plain(
        cls,
        name: str,
        module: nn.Module,
        kind: Kind,
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
        return self.kind.outer

    @property
    def forward(self) -> torch.Tensor:
        """``[N, T, d_in(+1)]`` float32 inputs in matrix form (embedding: one-hot, materialised)."""
        return self.kind.forward(self)

    @property
    def backward(self) -> torch.Tensor:
        """``[N, T, d_out]`` float32 gradients of each sample's own loss w.r.t. the output."""
        return self._b

    @property
    def indices(self) -> torch.Tensor:
        """Embedding only: ``[N, T]`` indices, ``-1`` where the position has no gradient.

        Raises:
            AttributeError: the module is not an embedding.
        """
        if not self.kind.tokens:
            raise AttributeError(f"{self.name}: indices exist only for embedding, not {self.kind}")
        return self._a

    # ------------------------------------------------------------ per-sample gradients
    def per_sample_grad(self) -> torch.Tensor:
        """Per-sample gradient in matrix form.

        ``[N, d_out, d_in(+1)]`` for outer-product kinds (bias = last column; embedding:
        ``[N, D, V]``; HF Conv1D: the transpose of its ``(nx, nf)`` weight), ``[N, D(+D)]`` for
        layernorm (weight then bias). Use :meth:`per_sample_grads_by_param` for parameter shapes.

        Returns:
            float32 ``[N, ...]``: each sample's gradient of its own loss (see the class).
        """
        return self.kind.per_sample_grad(self)

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
        return self.kind.batch_grad(self)

    def per_sample_grads_by_param(self) -> dict[str, torch.Tensor]:
        """``{"weight": [N, *weight.shape], "bias": [N, *bias.shape]}`` (bias when present)."""
        return self.kind.grads_by_param(self.module, self.per_sample_grad())

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
        return scaled(self.kind.sq_norm(self, self._b_raw), self._scale * self._scale)

    def sq_norm_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
        """``(tensors, values, c)`` with ``Σ_i ‖G_i‖² = c · (Σ_k ‖tensors[k]‖²_F + Σ values)``.

        The batch's summed per-sample squared norms without the ``[N]`` per-sample values:
        one-position rows give :meth:`sq_norm_factors`'s factors; positions over a sequence give
        the two Grams' dot or the per-sample matrices, whichever takes fewer multiply-adds (see
        :meth:`~nnstat.capture.kinds.Kind.sq_norm_parts`). ``c`` is the mean-loss factor
        squared, left to the caller (a float on the host, not a kernel). :func:`sq_norm_sums`
        does this for many captures, the one-position ones in fewer kernels.

        Returns:
            The tensors (norms to take), the 0-d values (to add) and the factor ``c``.

        Example:
            >>> import torch, nnstat
            >>> m = torch.nn.Linear(3, 2); e = nnstat.CaptureEngine(); _ = e.watch(m); caps = []
            >>> e.add_consumer(caps.append)
            >>> with e.batch(): m(torch.randn(4, 5, 3)).sum().backward()
            >>> ts, vs, c = caps[0].sq_norm_parts()
            >>> total = c * (sum(t.square().sum() for t in ts) + sum(vs))
            >>> bool(torch.isclose(total, caps[0].per_sample_sq_norm().sum()))
            True
        """
        factors = self.sq_norm_factors()
        if factors is not None:
            return factors[0], [], factors[1]
        tensors, values = self.kind.sq_norm_parts(self, self._b_raw)
        return tensors, values, self._scale * self._scale

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
        return self.kind.dense

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

        Args:
            p_in: ``[r_in, d_in(+1)]`` input-side projection (layernorm: ``[r, D]``).
            p_out: ``[r_out, d_out]`` output-side projection; ``None`` for layernorm only.
            out: float32 ``[N, r_out * r_in]`` buffer (or column slice) to write into.

        Returns:
            The ``[N, r_out * r_in]`` projected rows (``out`` when given).

        Raises:
            ValueError: a projection of the wrong shape, ``p_out`` missing for an
                outer-product kind or given for layernorm, or ``out`` of the wrong shape; the
                message names the module.

        Example:
            >>> import torch, nnstat
            >>> m = torch.nn.Linear(3, 2); e = nnstat.CaptureEngine(); _ = e.watch(m); caps = []
            >>> e.add_consumer(caps.append)
            >>> with e.batch(): m(torch.randn(4, 3)).sum().backward()
            >>> p_in, p_out = torch.randn(2, 4), torch.randn(2, 2)
            >>> ref = torch.einsum("ro,nod,sd->nrs", p_out, caps[0].per_sample_grad(), p_in)
            >>> torch.allclose(caps[0].project(p_in, p_out), ref.reshape(4, -1), atol=1e-5)
            True
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

        Args:
            p_in: ``[r_in, d_in(+1)]`` input-side projection.
            p_out: ``[r_out, d_out]`` output-side projection.

        Returns:
            ``(bp, ap)``, or ``None`` for several positions per sample or a non-dense kind.

        Raises:
            ValueError: a projection of the wrong shape (the message names the module).
        """
        if not self._is_plain_row():
            return None
        bp, ap = self._projected_factors(p_in, p_out)
        return bp.reshape(self.num_samples, -1), ap.reshape(self.num_samples, -1)

    def projected_factors(
        self, p_in: torch.Tensor, p_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(b P_outᵀ, [a, 1] P_inᵀ)`` per position, ``[N, T, r_out]`` and ``[N, T, r_in]``:
        ``project(p_in, p_out)[n]`` is ``vec(Σ_t outer(bp[n, t], ap[n, t]))`` (the gradient
        store factors it: :mod:`nnstat.store.factored`). Kronecker kinds only."""
        if not self.is_kronecker:
            raise ValueError(f"{self.name} ({self.kind}) has no Kronecker structure to factor")
        return self._projected_factors(p_in, p_out)

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
        ap = self.kind.projected_rows(self, p_in)
        # the mean-loss factor on the projected [N, T, r_out] rows, not on [N, T, d_out]: exact
        # for a power-of-two batch size, one rounding either way otherwise
        return scaled(rows_mm(self._b_raw, p_out.T), self._scale), ap

    # ------------------------------------------------------------ sums for statistics
    def forward_gram(self, proj: torch.Tensor | None = None) -> torch.Tensor:
        """``Σ_{n,t} a aᵀ`` over unmasked positions, ``[d_in(+1), d_in(+1)]``; with ``proj``
        (``P`` ``[r, d_in(+1)]``) that of the projected inputs, ``Σ (P a)(P a)ᵀ`` ``[r, r]``.

        Raises:
            ValueError: ``proj`` of the wrong shape (the message names the module).
        """
        if proj is not None:
            ap = self._projected_forward(proj)
            return ap.T @ ap
        return self.kind.forward_gram(self)

    def backward_gram(self, proj: torch.Tensor | None = None) -> torch.Tensor:
        """``Σ_{n,t} b bᵀ``, ``[d_out, d_out]``; with ``proj`` (``P`` ``[r, d_out]``)
        ``Σ (P b)(P b)ᵀ`` ``[r, r]`` without the ``d_out × d_out`` matrix.

        Raises:
            ValueError: ``proj`` of the wrong shape (the message names the module).
        """
        b = self._b_raw.reshape(-1, self._b_raw.shape[-1])
        if proj is not None:
            _check_proj(self.name, "projection", proj, self.d_out)
            b = b @ proj.to(b).T
        # the mean-loss factor squared on the [d, d] result, not on b's [N, T, d]
        return scaled(b.T @ b, self._scale * self._scale)

    def forward_sq_sum(self) -> torch.Tensor:
        """``Σ_{n,t} a²`` per input dimension (the diagonal of :meth:`forward_gram`)."""
        return self.kind.forward_sq_sum(self)

    def backward_sq_sum(self) -> torch.Tensor:
        """``Σ_{n,t} b²`` per output dimension (the diagonal of :meth:`backward_gram`)."""
        return scaled(self._b_raw.square().sum((0, 1)), self._scale * self._scale)

    def _projected_forward(self, proj: torch.Tensor) -> torch.Tensor:
        """``P [a, 1]`` ``[N·T, r]`` of every position (masked rows zero)."""
        _check_proj(self.name, "projection", proj, self.d_in)
        return self.kind.projected_forward(self, proj.to(self._b_raw))

    def forward_sum(self) -> torch.Tensor:
        """``Σ_{n,t} a`` over unmasked positions."""
        return self.kind.forward_sum(self)

    def backward_sum(self) -> torch.Tensor:
        """``Σ_{n,t} b``."""
        return scaled(self._b_raw.sum((0, 1)), self._scale)

    def __repr__(self) -> str:
        return (
            f"ModuleCapture(name={self.name!r}, kind={self.kind!r}, N={self.num_samples}, "
            f"positions={self.num_positions}, d_in={self.d_in}, d_out={self.d_out})"
        )


def _check_out(name: str, out: torch.Tensor, n: int, width: int) -> None:
    if out.shape != (n, width) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(
            f"{name}: out must be a float32 [{n}, {width}] tensor with contiguous rows, got "
            f"{out.dtype} {tuple(out.shape)} strides {out.stride()}"
        )


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
