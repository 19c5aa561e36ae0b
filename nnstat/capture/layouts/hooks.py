"""The engine's hooks for model layouts beyond "one row per sample in dim 0".

:class:`LayoutHooks` is a part of :class:`~nnstat.capture.engine.CaptureEngine`:

* inputs the batch shares (GPT-2's ``[1, T]`` and nanoGPT's ``[T]`` position ids, a
  ``[T, T]`` relative-position table): expanded to the batch (broadcast.py) or, when ``T``
  equals the batch size, checked at their first uses (ambiguous.py);
* ``nn.MultiheadAttention``: one hook on the module gives the rows of ``in_proj`` and of the
  ``out_proj`` inside it (kinds/attention.py);
* parameters shared by several modules (tied embeddings): captured once, under one module
  (tied.py);
* modules left out of capture, with the reason and the fix (:attr:`left_out`).

Example:
    >>> import torch
    >>> from nnstat.capture import CaptureEngine
    >>> engine = CaptureEngine()
    >>> engine.watch(torch.nn.MultiheadAttention(4, 2))
    ['model', 'out_proj']
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from nnstat.capture.build import BatchContext, Watched, first_tensor
from nnstat.capture.capture import ModuleCapture
from nnstat.capture.kinds import detect_kind, unsupported_reason
from nnstat.capture.kinds.attention import attention_call, attention_rows
from nnstat.capture.kinds.attention import unsupported_reason as attention_unsupported
from nnstat.capture.layouts.ambiguous import FIX as AMBIGUOUS_FIX
from nnstat.capture.layouts.ambiguous import check_rows
from nnstat.capture.layouts.broadcast import BroadcastGuard, expand
from nnstat.capture.layouts.foreign import ForeignUses, graph_roots
from nnstat.capture.layouts.tied import merge, owner_index, tie_groups, unsupported_tie

__all__ = ["LayoutHooks", "batch_coupled", "enclosing", "sequence_first_layers"]


class LayoutHooks:
    """The layout part of the capture engine (see the module docstring); not used alone.

    Example:
        >>> from nnstat.capture import CaptureEngine
        >>> issubclass(CaptureEngine, LayoutHooks)
        True
    """

    _watched: dict[nn.Module, Watched]
    _ctx: BatchContext | None
    _left_out: dict[str, str]
    _attention: set[nn.Module]
    _root_call: tuple[tuple, dict] | None
    _forward_consumers: list
    _tied: dict[nn.Module, list[nn.Module]]
    _foreign: ForeignUses | None
    _warned_rows: bool  # _rows_not_samples warned (once per engine)
    _batch_norms: list[tuple[str, nn.Module]]  # batch_coupled() of the roots, until warned
    _on_output_grad: Callable[..., None]  # CaptureEngine's: records one call's rows

    def _select_ties(
        self, model: nn.Module, selected: list[Watched], unsupported: list[str]
    ) -> list[Watched]:
        """``selected`` with every tie group it touches completed (tied.py): the group's
        other modules are added as aliases of its owner, the owner is added when missing, and
        a group that cannot be merged is reported in ``unsupported`` instead."""
        groups = tie_groups(model)
        if not groups:
            return selected
        order = {m: i for i, (_, m) in enumerate(model.named_modules())}
        by_module = {w.module: w for w in selected}
        out = list(selected)
        for group in groups:
            chosen = [by_module[m] for _, m in group if m in by_module]
            if not chosen:
                continue
            reason = unsupported_tie(group)
            if reason is not None:
                for w in chosen:
                    unsupported.append(f"{w.name} ({type(w.module).__name__}): {reason}")
                    out.remove(w)
                continue
            k = owner_index([m for _, m in group])
            owner = group[k][1]
            for i, (name, m) in enumerate(group):
                w = by_module.get(m) or self._watched.get(m)
                if w is None:
                    w = Watched(name or "model", m, detect_kind(m))
                    out.append(w)
                w.tied_to = None if i == k else owner
            self._tied[owner] = [m for i, (_, m) in enumerate(group) if i != k]
        return sorted(out, key=lambda w: order.get(w.module, len(order)))

    def _merge_tied(self, caps: list[ModuleCapture]) -> list[ModuleCapture]:
        """Each tie group's captures merged into one capture of its owner (tied.py), in the
        owner's place (watch order); a group with a member left out is left out."""
        owner_of = {m: o for o, aliases in self._tied.items() for m in (o, *aliases)}
        parts: dict[nn.Module, list[ModuleCapture]] = {}
        for cap in caps:
            owner = owner_of.get(cap.module)
            if owner is not None:
                parts.setdefault(owner, []).append(cap)
        merged: dict[nn.Module, ModuleCapture] = {}
        for owner, group in parts.items():
            members = [self._watched[m] for m in (owner, *self._tied[owner])]
            gone = [w.name for w in members if w.name in self._left_out]
            if gone:
                for w in members:
                    why = f"it shares its parameters with {_names(gone)}, which is left out"
                    self._leave_out(w.name, why)
                continue
            w = self._watched[owner]
            merged[owner] = merge(w.name, w.module, w.kind, w.dims, group)
        out = []
        for cap in caps:
            owner = owner_of.get(cap.module)
            if owner is None:
                out.append(cap)
            elif owner in merged:
                out.append(merged.pop(owner))  # first capture of the group
        order = {m: i for i, m in enumerate(self._watched)}
        return sorted(out, key=lambda c: order[owner_of.get(c.module, c.module)])

    def _on_attention(
        self, attn: nn.Module, module: nn.Module, args: tuple, kwargs: dict, output: Any
    ) -> Any:
        """Forward hook of an ``nn.MultiheadAttention``: keep its inputs for attention.py."""
        ctx = self._ctx
        if ctx is None:
            return None
        out = output[0] if isinstance(output, tuple) else output
        w = self._watched.get(attn)
        if w is not None and self._forward_consumers:
            query = args[0] if args else kwargs.get("query")
            for fn in self._forward_consumers:
                fn(w.name, attn, query, out)
        if self._foreign is not None:
            self._foreign.call(attn, [*args, *kwargs.values()], output)
        if not isinstance(out, torch.Tensor) or not torch.is_grad_enabled():
            return None
        names = [
            v.name
            for v in (w, self._watched.get(attn.out_proj))
            if v is not None and v.name not in self._left_out
        ]
        if not names:
            return None
        replaced = None
        if not out.requires_grad:
            if not (ctx.outputs_require_grad and out.is_floating_point()):
                return None
            # frozen parameters and an input without gradient (the store's param_grads=False
            # pass): start the graph here, as _on_forward does for other modules
            out = out.detach().requires_grad_().clone()
            replaced = (out, *output[1:]) if isinstance(output, tuple) else out
        if attn.training and attn.dropout > 0:
            for n in names:
                self._leave_out(
                    n,
                    f"nn.MultiheadAttention drops attention weights at random in training mode "
                    f"(dropout={attn.dropout}), which nnstat cannot replay to compute per-sample "
                    "gradients",
                    fix="construct it with dropout=0.0, or capture in model.eval()",
                )
            return None
        weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
        if isinstance(weights, torch.Tensor) and weights.requires_grad:
            weights.register_hook(partial(self._attention_weights_used, names))
        call = attention_call(attn, args, kwargs)
        out.register_hook(partial(self._on_output_grad, attn, call, ctx))
        return replaced

    def _on_model_output(self, model: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook of a watched model, inside a block: warn once about a BatchNorm that
        used batch statistics, and once, at the end of the first forward that builds a graph,
        leave out the modules whose parameters the forward also uses outside them
        (foreign.py)."""
        if self._ctx is None:
            return
        if self._batch_norms:
            self._warn_batch_statistics()
        check = self._foreign
        if check is None or not torch.is_grad_enabled():
            return
        roots = graph_roots(output)
        if not roots or torch.compiler.is_compiling():
            return
        self._foreign = None
        owners: dict[int, list[nn.Module]] = {}
        names: dict[int, list[tuple[Watched, str]]] = {}
        for w in self._watched.values():
            for pname, p in w.module.named_parameters(recurse=False):
                owners.setdefault(id(p), []).append(w.via if w.via is not None else w.module)
                names.setdefault(id(p), []).append((w, pname))
        found = check.users(roots, {k: tuple(v) for k, v in owners.items()})
        check.clear()
        for pid, users in found.items():
            where = sorted(
                (
                    "in the model's forward outside every watched module"
                    if m is None
                    else f"inside {self._watched[m].name!r}" if m in self._watched else "elsewhere"
                )
                for m in users
            )
            for w, pname in names[pid]:
                self._leave_out(
                    w.name,
                    f"its parameter {pname!r} also gets gradient outside the module's own "
                    f"forward ({', '.join(where)}), e.g. an output layer tied by hand, "
                    "F.linear(h, emb.weight) or h @ emb.weight.T: a capture holds only the share "
                    "through the module's output, so its per-sample gradients would be wrong",
                    fix="use the parameter through a module there (head = nn.Linear(d, vocab, "
                    "bias=False); head.weight = emb.weight: nnstat captures such a tie whole)",
                )

    def _warn_batch_statistics(self) -> None:
        """Warn once when a BatchNorm of the watched model normalized with the batch's own
        statistics in this block (training mode, or no running statistics)."""
        coupled = [
            (n, m)
            for n, m in self._batch_norms
            if m.training or getattr(m, "running_mean", 0) is None
        ]
        if not coupled:
            return
        self._batch_norms = []
        warnings.warn(
            f"nnstat: the BatchNorm layers {_names([n for n, _ in coupled])} "
            f"({type(coupled[0][1]).__name__}) "
            "normalize with the batch's own statistics (training mode), so every sample's "
            "output depends on the other samples: the captured per-sample gradients of the "
            "watched modules that feed them (rows, norms, the per-sample noise scale, "
            "statistics) are each sample's share of the batch loss's gradient, not the "
            "gradient of its own loss. "
            "Capture in model.eval() (running statistics: a logging pass), or use GroupNorm "
            "or LayerNorm (per sample) (warned once)",
            stacklevel=3,
        )

    def _attention_weights_used(self, names: list[str], grad: torch.Tensor) -> None:
        for n in names:
            self._leave_out(
                n,
                "its attention weights (nn.MultiheadAttention's second output) take part in "
                "the loss, and nnstat derives the attention's per-sample gradients from its "
                "first output alone",
                fix="call it with need_weights=False, or detach the weights you use",
            )

    def _attention_rows(self, pending: dict) -> None:
        """Turn each attention module's pending calls into rows of in_proj and out_proj."""
        for attn in self._attention & pending.keys():
            calls = pending.pop(attn)
            rows = [(attention_rows(attn, call, g), ctx) for call, g, ctx in calls]
            if attn in self._watched:
                pending[attn] = [(a, b, ctx) for ((a, b), _), ctx in rows]
            if attn.out_proj in self._watched:
                pending[attn.out_proj] = [(o, dy, ctx) for (_, (o, dy)), ctx in rows]

    def _shared(
        self, w: Watched, x: torch.Tensor, output: torch.Tensor, ctx: BatchContext
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(what the model reads instead of output, the input as rows per sample)`` for a
        module whose input (without gradient) the batch may share, else None.

        * ``[1, ...]`` (GPT-2's ``[1, T]`` position ids): the output is expanded to the batch;
        * integer input whose dim 0 is not the batch size (nanoGPT's
          ``pos(torch.arange(T))``, a ``[T, T]`` relative-position table): the output gets a
          leading batch dimension (float data of another size stays an error of the block);
        * integer input with dim 0 equal to the batch size but not the model's input (labels
          ``[B]``, or ``[T]`` ids with ``T == B``): captured as rows per sample, and the output
          is checked at its first uses (ambiguous.py).

        Nothing happens when the block's number of samples is unknown (then flush() compares
        modules), 1, or the model is being compiled.
        """
        n = x.shape[0]
        if n != 1 and x.is_floating_point():
            return None  # float data: rows per sample (a [1, ...] float input may be shared)
        if ctx.samples is None and ctx.mask is None:
            return None  # the caller did not say how many samples the block holds
        batch, source = self._block_batch(ctx)
        if batch is None or batch <= 1 or torch.compiler.is_compiling():
            return None
        if n == 1 and output.shape[0] == 1:
            guard = BroadcastGuard(w.name, batch, source, self._leave_out)
            return expand(output, guard), x.expand(batch, *x.shape[1:])
        shape = tuple(x.shape)
        if n != batch and output.shape[0] == n:
            layout = (
                f"its input {shape} has no batch dimension (dim 0 is {n}, not the block's "
                f"{batch} samples: an input shared by the whole batch, e.g. position ids "
                "torch.arange(T); or samples flattened to [B*T, ...] or laid out "
                "sequence-first [T, B, ...], which nnstat cannot split into samples)"
            )
            guard = BroadcastGuard(w.name, batch, source, self._leave_out, layout)
            return expand(output, guard, slot=False), x.unsqueeze(0).expand(batch, *shape)
        if n == batch and not self._is_model_input(x):
            layout = f"its input {shape} has dim 0 equal to {n}"
            refuse = partial(self._leave_out, fix=AMBIGUOUS_FIX)
            return check_rows(output, BroadcastGuard(w.name, batch, source, refuse, layout)), x
        return None

    def _guard(self, w: Watched, upstream: BroadcastGuard, checked: bool = False) -> BroadcastGuard:
        """A guard for ``w``, which computed row by row on an upstream module's expansion
        (broadcast.py) or, ``checked``, on its rows under check (ambiguous.py)."""
        if checked:
            layout = f"it computes row by row on the output of {upstream.name!r}; {upstream.layout}"
            refuse = partial(self._leave_out, fix=AMBIGUOUS_FIX)
            return BroadcastGuard(w.name, upstream.batch, upstream.source, refuse, layout)
        layout = f"its input comes from {upstream.name!r}, which is shared by the batch"
        return BroadcastGuard(w.name, upstream.batch, upstream.source, self._leave_out, layout)

    def _is_model_input(self, x: torch.Tensor) -> bool:
        """True when ``x`` is the watched model's first input tensor (or a same-shape view)."""
        if self._root_call is None:
            return False
        t = first_tensor(*self._root_call)
        return t is x or (t is not None and t.data_ptr() == x.data_ptr() and t.shape == x.shape)

    def _block_batch(self, ctx: BatchContext) -> tuple[int | None, str]:
        """The block's number of samples and where it came from."""
        if isinstance(ctx.samples, int):
            return ctx.samples, "the block's samples"
        if ctx.samples is None and ctx.mask is not None:
            return int(ctx.mask.shape[0]), "the mask's first dimension"
        if self._root_call is not None:
            t = first_tensor(*self._root_call)
            if t is not None and t.dim():
                return int(t.shape[0]), f"dim 0 of the model's first input {tuple(t.shape)}"
        return None, ""

    def _leave_out(self, name: str, why: str, fix: str | None = None) -> None:
        """Stop capturing ``name`` (its per-sample gradients are undefined), warning once.
        ``fix``: how to include it (default: give the shared input the batch dimension)."""
        if name in self._left_out:
            return
        self._left_out[name] = why
        if fix is None:
            fix = (
                "give that input the batch dimension (GPT-2 and similar: "
                "position_ids=torch.arange(T).expand(B, T))"
            )
        warnings.warn(
            f"nnstat: not capturing {name!r}: {why}. It is left out (CaptureEngine.left_out); "
            f"the model computes exactly as without nnstat. To include it, {fix}, or watch "
            "with a name_filter that excludes it to silence this warning.",
            stacklevel=3,
        )

    def _drop_unbroadcast(self, caps: list[ModuleCapture]) -> list[ModuleCapture]:
        """Leave out modules that saw a batch of 1 where others saw more: an input shared by
        the batch that could not be expanded (the batch size was unknown when it ran, or the
        model is being compiled), whose gradient is the batch's sum, not a sample's."""
        n = max(c.num_samples for c in caps)
        if n <= 1 or all(c.num_samples == n for c in caps):
            return caps
        others = [c.name for c in caps if c.num_samples == n]
        for c in caps:
            if c.num_samples == 1:
                self._leave_out(
                    c.name,
                    f"it saw a batch of 1 while {_names(others)} saw {n} (an input shared by "
                    "the whole batch, e.g. position ids of shape [1, T]) and the batch size "
                    "was not known when it ran (the watched model's first input tensor has no "
                    "batch dimension, or the model was not called), or the model is "
                    "compiled; its gradient is the batch's sum, not a sample's",
                )
        return [c for c in caps if c.num_samples != 1]

    def _rows_not_samples(
        self, caps: list[ModuleCapture], ctx: BatchContext
    ) -> list[ModuleCapture]:
        """Warn once when every module saw ``n`` rows but the block holds another number of
        samples: a model that flattens its samples (``x.view(-1, d)``, ``[B*T, d]``) or works
        sequence-first (``[T, B, d]``) inside gives rows that are positions, not samples, and
        every module agrees, so no other check sees it. Only a warning: a model whose first
        input is not batch-major has the same shapes with correct rows."""
        sizes = {c.num_samples for c in caps}
        batch, source = self._block_batch(ctx)
        n = next(iter(sizes)) if len(sizes) == 1 else None
        if n is None or batch is None or n in (0, 1, batch) or self._warned_rows:
            return caps
        self._warned_rows = True
        warnings.warn(
            f"nnstat: the watched modules ({_names([c.name for c in caps])}) each saw {n} rows "
            f"in dim 0 where the block holds {batch} samples ({source}), so their per-sample "
            "gradients, norms and rows are per row, not per sample: the model flattens its "
            "samples ([B*T, ...], x.view(-1, d)) or runs sequence-first ([T, B, ...]) inside. "
            "Keep the batch in dim 0 of every watched module's input (apply layers to "
            "[B, T, d]; torch's transformer layers and attention: batch_first=True). If the "
            "rows are the samples (the model's first input is not batch-major), give their "
            "number instead: NoiseScale.batch(batch_size=n), run(data_id=[...]) (warned once)",
            stacklevel=3,
        )
        return caps


def _names(names: list[str], limit: int = 4) -> str:
    """``'a', 'b' and 3 more`` for messages."""
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def enclosing(name: str, holders: Iterable[str]) -> str | None:
    """The first of ``holders`` (module names) that holds module ``name``; the root (``""``)
    holds every other module, and is returned as ``"model"``, the engine's name for it.

    Example:
        >>> enclosing("enc.linear1", ["dec", "enc"]), enclosing("linear1", [""])
        ('enc', 'model')
    """
    for h in holders:
        if name.startswith(h + ".") if h else name != "":
            return h or "model"
    return None


def batch_coupled(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The BatchNorm layers of ``model`` by name (``SyncBatchNorm`` and the lazy ones too):
    in training mode each normalizes with statistics of the whole batch.

    Example:
        >>> [n for n, _ in batch_coupled(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))]
        ['1']
    """
    norms = nn.modules.batchnorm._BatchNorm
    return [(n or "model", m) for n, m in model.named_modules() if isinstance(m, norms)]


def sequence_first_layers(model: nn.Module) -> dict[str, nn.Module]:
    """torch's transformer layers built with ``batch_first=False`` (the default), by name:
    their Linears and LayerNorms see ``[T, B, E]`` tensors, whose dim 0 is not the batch.

    Example:
        >>> list(sequence_first_layers(nn.Sequential(nn.TransformerEncoderLayer(4, 2))))
        ['0']
    """
    kinds = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    return {
        n: m
        for n, m in model.named_modules()
        if isinstance(m, kinds) and not getattr(m.self_attn, "batch_first", True)
    }


def kind_of(
    module: nn.Module, attn: nn.Module | None, seq_first: str | None = None
) -> tuple[str | None, str]:
    """``(capture kind or None, why not)``; ``attn``: the ``nn.MultiheadAttention`` that holds
    ``module`` (its ``out_proj`` is captured through it, anything else inside it is not);
    ``seq_first``: the name of the sequence-first transformer layer that holds it."""
    reparam = reparametrized(module)
    if reparam is not None:
        return None, reparam
    if seq_first is not None and attn is None and not isinstance(module, nn.MultiheadAttention):
        return None, (
            f"it is inside the transformer layer {seq_first!r}, built with batch_first=False: "
            "its tensors are sequence-first ([T, B, E]) and nnstat needs the batch in dim 0 "
            "(its attention is captured either way); build the layer with batch_first=True"
        )
    if attn is None:
        kind = detect_kind(module)
        return kind, "" if kind is not None else unsupported_reason(module)
    reason = attention_unsupported(attn)
    if reason is not None:
        return None, f"it is inside an nn.MultiheadAttention whose {reason}"
    if module is not attn.out_proj:
        return None, "it is inside nn.MultiheadAttention, which never calls its forward"
    return "linear", ""


def reparametrized(module: nn.Module) -> str | None:
    """Why ``module`` cannot be captured when its weight is computed from other parameters
    (``torch.nn.utils.parametrize``: ``parametrizations.weight_norm``, ``spectral_norm``,
    ``orthogonal``; the older hook-based ``weight_norm`` / ``spectral_norm``), else ``None``.

    A capture gives per-sample gradients of the weight the layer computes with, not of the
    parameters that train (``original0``/``original1``, ``weight_g``/``weight_v``): their norms
    differ once training moves away from the initialisation, and the noise scale, which reads
    those parameters' ``.grad``, would mix the two spaces.

    Example:
        >>> layer = torch.nn.utils.parametrizations.weight_norm(nn.Linear(2, 2))
        >>> "remove_parametrizations" in reparametrized(layer)
        True
        >>> reparametrized(nn.Linear(2, 2)) is None
        True
    """
    from torch.nn.utils import parametrize
    from torch.nn.utils.spectral_norm import SpectralNorm
    from torch.nn.utils.weight_norm import WeightNorm

    if isinstance(module, parametrize.ParametrizationList):
        return (
            "it holds the parameters of a parametrized tensor (torch.nn.utils.parametrize) of "
            "the module above it, which is left out with it"
        )
    names = list(getattr(module, "parametrizations", {}) or {})
    old = [
        h.name
        for h in module._forward_pre_hooks.values()
        if isinstance(h, (WeightNorm, SpectralNorm))
    ]
    if not (parametrize.is_parametrized(module) or old):
        return None
    fix = (
        f"torch.nn.utils.parametrize.remove_parametrizations(module, {names[0]!r})"
        if names
        else f"torch.nn.utils.remove_weight_norm / remove_spectral_norm(module, {old[0]!r})"
    )
    return (
        f"its {(names or old)!r} is computed from other parameters (weight_norm, spectral_norm "
        "or another parametrization), so per-sample gradients of the layer's weight are not "
        f"those of the parameters that train; capture it after {fix} (e.g. for a logging pass "
        "on the trained model), or leave it out (name_filter)"
    )
