"""`Kind`: what one kind of layer contributes to a capture, and the registry of kinds.

Every supported kind is reduced to the same shape of data so that per-sample gradients,
projections, squared norms and K-FAC factors share one code path:

* ``A``: ``[N, T, d_in]`` float32 "forward" rows (conv: unfolded patches; the bias's column of
  ones stays implicit until someone asks for it, see ``ModuleCapture``), and ``B``:
  ``[N, T, d_out]`` float32 "backward" rows, so that the per-sample weight gradient (in
  ``[d_out, d_in]`` layout) is ``G_i = Σ_t b_t a_tᵀ``.

A kind is a subclass of :class:`Kind` in its own module of this package (``linear.py``,
``conv.py``, ...): it says which modules it captures, how their inputs and output gradients
become rows, the matrix form's sides, and how the parameters map to it. The base class holds
the dense outer-product case (a linear layer's), which the capture's per-sample gradients,
Grams and sums use; a kind whose rows are something else (an embedding's token indices, a
LayerNorm's elementwise gradient) overrides those. Defining the subclass registers it
(``__init_subclass__``), in import order, which is the order :func:`detect_kind` tries them.

A kind is also its name: ``Kind`` subclasses ``str``, so ``cap.kind == "linear"``, a kind in
a store's ``meta.json`` and a kind as a dictionary key keep meaning the name.
"""

from __future__ import annotations

from typing import ClassVar, Protocol

import torch
from torch import nn

from nnstat.capture.matrix import (
    gram_is_cheaper,
    gram_sq_norm_sum,
    gram_sq_norms,
    rows_mm,
    scaled,
)


class Rows(Protocol):
    """What a kind reads of a capture (:class:`~nnstat.capture.capture.ModuleCapture` holds
    it): the forward rows ``_a`` (no ones column), the output gradients ``_b_raw`` unscaled and
    ``_b`` times the mean-loss factor ``_scale``, and the implicit bias column."""

    module: nn.Module
    d_in: int
    d_out: int
    _bias: bool  # the matrix form ends with the bias's ones column
    _scale: float
    _keep: torch.Tensor | None  # [N, T] 0/1 of unmasked rows (None: all kept)

    @property
    def _a(self) -> torch.Tensor: ...

    @property
    def _b_raw(self) -> torch.Tensor: ...

    @property
    def _b(self) -> torch.Tensor: ...

    def _ones(self) -> torch.Tensor: ...

    def _a_full(self) -> torch.Tensor: ...


#: every registered kind by name, in registration (= detection) order
REGISTRY: dict[str, Kind] = {}


class Kind(str):
    """One kind of layer; its instance is its name (see the module docstring).

    Example:
        >>> from nnstat.capture.kinds import detect_kind
        >>> k = detect_kind(torch.nn.Linear(3, 2))
        >>> k == "linear", k.dims(torch.nn.Linear(3, 2)), k.outer
        (True, (4, 2), True)
    """

    name: ClassVar[str]
    #: module classes this kind captures (:meth:`matches` may refine the test)
    modules: ClassVar[tuple[type, ...]] = ()
    #: the module's weight and bias attributes (the names of the parameters it captures)
    params: ClassVar[tuple[str, str]] = ("weight", "bias")
    #: the gradient is a sum of outer products ``b aᵀ`` (K-FAC applies)
    outer: ClassVar[bool] = True
    #: forward rows are dense ``[N, T, d_in]`` and the matrix form ends with the bias column
    dense: ClassVar[bool] = True
    #: forward rows are token indices ``[N, T]`` (``-1``: no gradient), one-hot in matrix form
    tokens: ClassVar[bool] = False
    #: rows are already ``[N, ..., d]`` matrices (no unfolding): the engine's fast path
    plain: ClassVar[bool] = False
    #: a tie may join this kind; its matrix form is the weight (False) or its transpose (True)
    tie_transposed: ClassVar[bool | None] = None
    #: how messages name the modules it captures (default: the ``modules`` classes)
    label: ClassVar[str] = ""

    def __new__(cls) -> Kind:
        return super().__new__(cls, cls.name)

    def __reduce__(self) -> tuple:
        # one instance per kind: a copy or an unpickled kind is the registered one
        return (kind_named, (str(self),))

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            if cls.name in REGISTRY:
                raise ValueError(f"a layer kind named {cls.name!r} is already registered")
            REGISTRY[cls.name] = cls()

    # ------------------------------------------------------------------ the module
    def matches(self, module: nn.Module) -> bool:
        """Whether this kind is the one for ``module`` (supported or not)."""
        return isinstance(module, self.modules)

    def unsupported(self, module: nn.Module) -> str | None:
        """Why a matching ``module`` cannot be captured, or None when it can."""
        return None

    def has_bias(self, module: nn.Module) -> bool:
        """Whether ``module`` has a bias parameter."""
        return isinstance(getattr(module, self.params[1], None), torch.Tensor)

    def dims(self, module: nn.Module) -> tuple[int, int]:
        """``(d_in(+1), d_out)`` of the matrix form."""
        raise NotImplementedError

    def logged_dims(self, module: nn.Module) -> tuple[int, int | None]:
        """``(d_in, d_out)`` of the gradient as a store logs it (``d_out`` None: flat)."""
        return self.dims(module)

    def forward_rows(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Matrix-form forward rows ``[N, T, d_in]`` of one module call (no bias column)."""
        if x.dim() < 2:
            raise ValueError(
                f"{type(module).__name__}: expected input [N, ..., d_in], got {tuple(x.shape)}"
            )
        return x.detach().float().reshape(x.shape[0], -1, x.shape[-1])

    def keep_forward_stats(self, x: torch.Tensor, output: torch.Tensor) -> None:
        """Called by the engine with each call's (detached) input ``x`` and output: keep what
        the call's autograd node already computed from ``x`` beside it, for
        :meth:`forward_rows` (no kernel). Nothing for most kinds."""

    def backward_rows(self, module: nn.Module, g: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """Matrix-form output gradients ``[N, T, d_out]`` and the positional shape."""
        g = g.detach().float()
        return g.reshape(g.shape[0], -1, g.shape[-1]), tuple(g.shape[1:-1])

    def masked_rows(self, a: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Forward rows with the positions where ``keep`` (``[N, T]`` 0/1) is 0 masked out."""
        return a * keep.unsqueeze(-1)

    def grads_by_param(self, module: nn.Module, g: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a matrix-form per-sample gradient into ``{param_name: [N, *param.shape]}``."""
        bias = self.has_bias(module)
        out = {self.params[0]: self.weight_of(module, g[..., :-1] if bias else g)}
        if bias:
            out[self.params[1]] = g[..., -1]
        return out

    def matrix_from_params(
        self, module: nn.Module, params: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Inverse of :meth:`grads_by_param`: ``{param_name: [N, *param.shape]}`` to the matrix
        form ``[N, d_out, d_in(+1)]`` (bias = last column)."""
        w = self.weight_matrix(module, params[self.params[0]])
        if not self.has_bias(module):
            return w
        return torch.cat([w, params[self.params[1]].unsqueeze(-1)], dim=-1)

    def weight_of(self, module: nn.Module, w: torch.Tensor) -> torch.Tensor:
        """The matrix form's weight part ``[N, d_out, d_in]`` in the parameter's shape."""
        return w

    def weight_matrix(self, module: nn.Module, w: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`weight_of`."""
        return w

    # ------------------------------------------------------------ a capture's products
    # ``c`` is the capture (see Rows); these are the dense outer-product kinds' products
    def forward(self, c: Rows) -> torch.Tensor:
        """``[N, T, d_in(+1)]`` forward rows in matrix form."""
        return c._a_full()

    def per_sample_grad(self, c: Rows) -> torch.Tensor:
        """``[N, ...]`` per-sample gradients in matrix form."""
        return self.grad(c, c._b)

    def grad(self, c: Rows, b: torch.Tensor) -> torch.Tensor:
        """:meth:`per_sample_grad` with `b` as the output gradients (scaled or not)."""
        a = c._a
        bt = b.transpose(1, 2)
        if not c._bias:
            return torch.bmm(bt, a)
        if b.shape[1] < c.d_out:  # appending the ones column to A is the smaller copy
            return torch.bmm(bt, c._a_full())
        # masked rows have b = 0, so the bias gradient is the plain sum over positions
        return torch.cat([torch.bmm(bt, a), b.sum(1).unsqueeze(-1)], dim=-1)

    def batch_grad(self, c: Rows) -> torch.Tensor:
        """``Σ_i G_i`` in one product over all positions."""
        b = c._b_raw.reshape(-1, c._b_raw.shape[-1])
        a = c._a.reshape(-1, c._a.shape[-1])
        g = b.T @ a
        if c._bias:  # masked rows have b = 0: the bias column is the plain sum
            g = torch.cat([g, b.sum(0).unsqueeze(-1)], dim=1)
        return scaled(g, c._scale)

    def sq_norm(self, c: Rows, b: torch.Tensor) -> torch.Tensor:
        """``[N]`` squared norms of the per-sample gradients with `b` as output gradients."""
        if gram_is_cheaper(b.shape[1], c.d_in, c.d_out):
            return gram_sq_norms(c._a, b, c._bias)
        return self.grad(c, b).square().sum((1, 2))

    def sq_norm_parts(
        self, c: Rows, b: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(tensors, values)`` with ``Σ_i ‖G_i‖² = Σ_k ‖tensors[k]‖²_F + Σ values`` (`b` as
        output gradients): :meth:`sq_norm` summed over the samples without its ``[N]`` values,
        for a caller that takes many modules' Frobenius norms in one foreach kernel (the noise
        scale's per-step sum). The Grams give 0-d values (:func:`gram_sq_norm_sum`); otherwise
        the weight part ``bᵀ a`` and the bias column's position sums ``Σ_t b_t`` are the
        tensors (masked rows have ``b = 0``): no ones column, no squares, no sums here.
        """
        if type(self).sq_norm is not Kind.sq_norm:  # a kind with its own per-sample rule
            return [], [self.sq_norm(c, b).sum()]
        if gram_is_cheaper(b.shape[1], c.d_in, c.d_out):
            return [], gram_sq_norm_sum(c._a, b, c._bias)
        g = torch.bmm(b.transpose(1, 2), c._a)
        return ([g, b.sum(1)] if c._bias else [g]), []

    def projected_rows(self, c: Rows, p_in: torch.Tensor) -> torch.Tensor:
        """``[a, 1] @ p_inᵀ`` ``[N, T, r_in]`` (``p_in`` checked and cast)."""
        if not c._bias:
            return rows_mm(c._a, p_in.T)
        # [a, 1] @ p_inᵀ without building [a, 1]; masked rows have b = 0 and drop out
        ap = torch.addmm(p_in[:, -1], c._a.reshape(-1, c._a.shape[-1]), p_in[:, :-1].T)
        return ap.reshape(*c._a.shape[:2], -1)

    def projected_forward(self, c: Rows, proj: torch.Tensor) -> torch.Tensor:
        """``P [a, 1]`` ``[N·T, r]`` of every position (masked rows zero)."""
        a = c._a.reshape(-1, c._a.shape[-1])
        if not c._bias:
            return a @ proj.T
        k = c._ones().reshape(-1, 1)
        return torch.addmm(k * proj[:, -1], a, proj[:, :-1].T)

    def forward_gram(self, c: Rows) -> torch.Tensor:
        """``Σ_{n,t} a aᵀ`` ``[d_in(+1), d_in(+1)]`` over unmasked positions."""
        a = c._a.reshape(-1, c._a.shape[-1])
        gram = a.T @ a
        if not c._bias:
            return gram
        k = c._ones().reshape(-1)
        col = k @ a
        corner = (k * k).sum().reshape(1, 1)
        return torch.cat([torch.cat([gram, col[:, None]], 1), torch.cat([col[None], corner], 1)])

    def forward_sq_sum(self, c: Rows) -> torch.Tensor:
        """``Σ_{n,t} a²`` per input dimension."""
        total = c._a.square().sum((0, 1))
        if not c._bias:
            return total
        return torch.cat([total, c._ones().square().sum().reshape(1)])

    def forward_sum(self, c: Rows) -> torch.Tensor:
        """``Σ_{n,t} a`` over unmasked positions."""
        total = c._a.sum((0, 1))
        if not c._bias:
            return total
        return torch.cat([total, c._ones().sum().reshape(1)])


def kind_named(name: str) -> Kind:
    """The registered kind called ``name``.

    Args:
        name: a kind's name (a store's ``meta.json`` ``kind``), or a kind.

    Returns:
        The one registered instance of that kind.

    Raises:
        ValueError: no kind has that name (the message lists the registered ones).

    Example:
        >>> import copy
        >>> kind_named("linear").outer, copy.deepcopy(kind_named("conv")) is kind_named("conv")
        (True, True)
    """
    kind = REGISTRY.get(name)
    if kind is None:
        raise ValueError(f"unknown capture kind {name!r}; registered kinds: {list(REGISTRY)}")
    return kind
