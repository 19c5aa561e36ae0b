"""The capture engine: the one set of module hooks in nnstat.

A forward hook remembers each watched module's input and registers a tensor hook on its output;
the tensor hook receives the gradient w.r.t. that output during backward. At the end of the
backward pass (an autograd engine callback) every module's calls are turned into one
:class:`ModuleCapture` and handed to the consumers.
"""

from __future__ import annotations

import re
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from nnstat.capture.build import (
    LOSS_REDUCTIONS,
    BatchContext,
    Watched,
    build_capture,
    check_batch_args,
    create_graph_refusal,
    first_tensor,
    hook_target,
    path_edges,
    reshaped,
    warn_without_gradient,
)
from nnstat.capture.capture import ModuleCapture
from nnstat.capture.kinds import supported_modules
from nnstat.capture.layouts.ambiguous import SampleRows, add_check_guard
from nnstat.capture.layouts.broadcast import BroadcastOutput, add_guard
from nnstat.capture.layouts.foreign import ForeignUses
from nnstat.capture.layouts.hooks import (
    LayoutHooks,
    batch_coupled,
    enclosing,
    kind_of,
    sequence_first_layers,
)

__all__ = ["LOSS_REDUCTIONS", "CaptureConsumer", "CaptureEngine", "UnsupportedModuleError"]

#: the private grad_fn method Tensor.register_hook uses (a test sets a missing name to take the
#: public-API fallback every other torch would)
_REGISTER_HOOK_DICT = "_register_hook_dict"


class UnsupportedModuleError(ValueError):
    """A module selected explicitly for capture has no per-sample gradient rule.

    Example:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.GRU(2, 2))
        >>> CaptureEngine().watch(model, type_filter="GRU")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        nnstat.capture.engine.UnsupportedModuleError: cannot capture ... of: 1 (GRU): no ...
    """


class CaptureConsumer(Protocol):
    def on_capture(self, cap: ModuleCapture) -> None: ...


class CaptureEngine(LayoutHooks):
    """Watch modules and stream per-sample quantities to consumers.

    Hooks do nothing outside :meth:`batch`, never change outputs, gradients or
    ``requires_grad``, and are all removed by :meth:`unwatch`.

    Example:
        >>> import torch, nnstat
        >>> nn = torch.nn
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> engine = nnstat.CaptureEngine()
        >>> engine.watch(model)
        ['0', '2']
        >>> norms = {}
        >>> engine.add_consumer(lambda cap: norms.update({cap.name: cap.per_sample_sq_norm()}))
        >>> with engine.batch(loss_reduction="mean"):
        ...     model(torch.randn(16, 4)).pow(2).mean().backward()
        >>> norms["0"].shape
        torch.Size([16])
        >>> engine.unwatch()
    """

    def __init__(self) -> None:
        self._watched: dict[nn.Module, Watched] = {}
        self._handles: list[Any] = []
        self._consumers: list[Callable[[ModuleCapture], None]] = []
        self._forward_consumers: list[Callable[[str, nn.Module, Any, Any], None]] = []
        self._backward_consumers: list[Callable[[list[ModuleCapture]], None]] = []
        self._ctx: BatchContext | None = None
        self._contexts: dict[tuple, BatchContext] = {}
        self._pending: dict[nn.Module, list[tuple[torch.Tensor, torch.Tensor, BatchContext]]] = {}
        self._lock = threading.Lock()
        self._flush_queued = False
        self._roots: list[nn.Module] = []
        # (parent, key, child) on the way from each root to each watched module: a module
        # replaced after watch() (model.fc = nn.Linear(...)) is found at the next batch
        self._edges: dict[tuple[int, str], tuple[nn.Module, str, nn.Module, str]] = {}
        self._keep_input = False
        self.model_input: torch.Tensor | None = None
        # the latest call of a watched root inside the block: its first tensor sizes the batch
        # when a module's output has batch size 1 (see broadcast.py); kept unread until then
        self._root_call: tuple[tuple, dict] | None = None
        self._left_out: dict[str, str] = {}
        # nn.MultiheadAttention modules hooked for their own or their out_proj's rows
        self._attention: set[nn.Module] = set()
        # owner -> the other modules sharing its parameters (captured into the owner: tied.py)
        self._tied: dict[nn.Module, list[nn.Module]] = {}
        # calls recorded for the one check of parameters used outside their module (foreign.py)
        self._foreign: ForeignUses | None = None
        self._warned_rows = False
        self._batch_norms: list[tuple[str, nn.Module]] = []
        self.no_gradient_warned: set[str] = set()  # warned once each (build.py), the store too

    # ---------------------------------------------------------------- selection
    @property
    def watched(self) -> dict[str, nn.Module]:
        """Watched modules by name, in watch order (a module that shares its parameters with
        another one is watched under that one's name alone: see ``nnstat/capture/layouts/tied.py``).
        """
        return {w.name: w.module for w in self._watched.values() if w.tied_to is None}

    @property
    def left_out(self) -> dict[str, str]:
        """Watched modules whose per-sample gradients turned out undefined, with the reason.

        A module whose input is shared by the whole batch (``[1, T]`` position ids) is
        captured through an expansion of its output to the batch (docs/capture.md, "Inputs
        shared by the batch"); one whose batch-1 output the model uses otherwise is left out
        here, with one warning, and delivers no more captures until :meth:`unwatch`.

        Example:
            >>> engine = CaptureEngine(); _ = engine.watch(torch.nn.Linear(2, 2))
            >>> engine.left_out
            {}
        """
        return dict(self._left_out)

    def kinds(self) -> dict[str, str]:
        """Capture kind of each watched module by name."""
        return {w.name: w.kind for w in self._watched.values() if w.tied_to is None}

    def watch(
        self,
        model: nn.Module,
        name_filter: str | Iterable[str] | None = None,
        type_filter: type | str | Iterable[type | str] | None = None,
    ) -> list[str]:
        """Register hooks on the selected modules of ``model`` and return their names.

        ``name_filter``: regex (``re.search``) or list of regexes on module names;
        ``type_filter``: module classes or class names. Modules without parameters of their own
        are never selected. ``nn.MultiheadAttention`` is captured through the module itself:
        its ``in_proj`` (kind ``"attention"``) and the ``out_proj`` inside it (see
        ``nnstat/capture/kinds/attention.py``). Without filters, unsupported modules that own
        parameters are skipped with one warning; with a filter, selecting one raises
        :class:`UnsupportedModuleError`.

        Args:
            model: the network.
            name_filter: regex or regexes of module names to watch; ``None``: all.
            type_filter: module classes or class names to watch; ``None``: all supported.

        Returns:
            The names of the watched modules.

        Raises:
            UnsupportedModuleError: a filter selects a module the engine cannot capture (an
                unsupported kind, or a layer of a sequence-first transformer).
            ValueError: a module of that name is already watched.
            TypeError: ``model`` is not an ``nn.Module`` (e.g. the optimizer).
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"watch() expects the model (an nn.Module), got {type(model).__name__}")
        explicit = name_filter is not None or type_filter is not None
        names = _as_list(name_filter)
        types = _as_list(type_filter)
        mha = {n: m for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
        seq_first = sequence_first_layers(model)
        selected: list[Watched] = []
        unsupported: list[str] = []
        for name, module in model.named_modules():
            if not any(True for _ in module.parameters(recurse=False)):
                continue
            if names and not any(re.search(p, name) for p in names):
                continue
            if types and not any(_type_matches(module, t) for t in types):
                continue
            parent = next((m for p, m in mha.items() if enclosing(name, [p])), None)
            layer = enclosing(name, seq_first)
            kind, why = kind_of(module, parent, layer)
            if kind is None:
                unsupported.append(f"{name or '<root>'} ({type(module).__name__}): {why}")
                continue
            if module in self._watched:
                continue
            selected.append(Watched(name or "model", module, kind, via=parent))
        selected = self._select_ties(model, selected, unsupported)
        if unsupported:
            msg = "cannot capture per-sample gradients of: " + "; ".join(unsupported)
            msg += f" (the module types with a rule: {supported_modules()})"
            if explicit:
                raise UnsupportedModuleError(msg)
            warnings.warn(msg + " (skipped; they are not watched)", stacklevel=2)
        taken = {w.name for w in self._watched.values()}
        for w in selected:
            if w.name in taken:
                raise ValueError(f"a module named {w.name!r} is already watched")
            self._watched[w.module] = w
            if w.kind == "attention" or w.via is not None:
                # attention: one hook on the module gives the rows of in_proj and out_proj
                attn = w.via if w.via is not None else w.module
                if attn not in self._attention:
                    self._attention.add(attn)
                    hook = partial(self._on_attention, attn)
                    hook = attn.register_forward_hook(hook, with_kwargs=True, prepend=True)
                    self._handles.append(hook)
                continue
            # first of the module's hooks: a user's hook may change the output (o * 2), and the
            # capture needs the gradient of the module's own output
            hook = w.module.register_forward_hook(partial(self._on_forward, w), prepend=True)
            self._handles.append(hook)
        for w in selected:
            self._edges.update(path_edges(model, w.name))
        if selected and not any(model is r for r in self._roots):
            self._roots.append(model)
            self._handles.append(
                model.register_forward_pre_hook(self._on_model_input, with_kwargs=True)
            )
            self._handles.append(model.register_forward_hook(self._on_model_output))
            self._batch_norms += batch_coupled(model)
        if selected:
            self._foreign = ForeignUses()  # armed again: the new modules are not checked yet
        return [w.name for w in selected if w.tied_to is None]

    def unwatch(self) -> None:
        """Remove every hook and forget the watched modules and pending captures."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._watched.clear()
        self._attention.clear()
        self._tied.clear()
        self._foreign = None
        self._batch_norms = []
        self._roots.clear()
        self._edges.clear()
        self._left_out.clear()
        self._root_call = None
        with self._lock:
            self._pending.clear()

    # ---------------------------------------------------------------- consumers
    def add_consumer(self, consumer: CaptureConsumer | Callable[[ModuleCapture], None]) -> None:
        """Add an object with ``on_capture(cap)`` (or a plain callable).

        An object may also define ``on_forward(name, module, input, output)``: it is called by
        the same forward hook inside :meth:`batch` for every watched module call, also under
        ``torch.no_grad()`` (values as computed, not detached copies; it fires again when
        activation checkpointing recomputes a forward).
        An object may define ``on_backward(caps)`` instead of (or besides) ``on_capture``: it
        receives the list of all captures of one backward at once, in watch order, so it can
        batch its work over modules (e.g. one kernel over every module's
        :meth:`~nnstat.capture.capture.ModuleCapture.sq_norm_factors`).

        Args:
            consumer: the object or callable.

        Raises:
            TypeError: it has none of those methods and is not callable.
        """
        fn = getattr(consumer, "on_capture", consumer)
        on_forward = getattr(consumer, "on_forward", None)
        on_backward = getattr(consumer, "on_backward", None)
        if not any(callable(f) for f in (fn, on_forward, on_backward)):
            raise TypeError(
                "consumer must have on_capture(cap), on_backward(caps) or on_forward(...), or "
                f"be callable, got {consumer!r}"
            )
        if callable(fn):
            self._consumers.append(fn)
        if callable(on_forward):
            self._forward_consumers.append(on_forward)
        if callable(on_backward):
            self._backward_consumers.append(on_backward)

    def remove_consumer(self, consumer: Any) -> None:
        fn = getattr(consumer, "on_capture", consumer)
        on_forward = getattr(consumer, "on_forward", None)
        on_backward = getattr(consumer, "on_backward", None)
        self._consumers = [c for c in self._consumers if c != fn]
        self._forward_consumers = [c for c in self._forward_consumers if c != on_forward]
        self._backward_consumers = [c for c in self._backward_consumers if c != on_backward]

    # ------------------------------------------------------------------ batches
    @contextmanager
    def batch(
        self,
        batch_size: int | None = None,
        mask: torch.Tensor | None = None,
        loss_reduction: str = "sum",
        outputs_require_grad: bool = False,
        samples: int | str | None = None,
    ) -> Iterator[None]:
        """Capture forward/backward passes run inside this block.

        ``loss_reduction="mean"`` multiplies output gradients by ``batch_size`` (default: the
        module's batch dimension N) so they are gradients of each sample's own loss term.
        ``mask`` (``[N]`` or ``[N, *positions]``, nonzero = keep) zeroes excluded positions in
        modules whose output positions match its shape.
        ``outputs_require_grad=True`` (the store's ``param_grads=False`` pass, which freezes the
        watched parameters to skip the weight-gradient products): a watched module whose output
        would not require grad returns a copy that does, so its output gradient still reaches
        the hooks. Values never change.
        ``samples``: the block's number of samples, or ``"input"``: dim 0 of the first tensor
        passed to the watched model (the Run passes its ``data_id``'s length, else
        ``"input"``). Given it (or a ``mask``), a module whose input the batch shares (GPT-2's
        position ids ``[1, T]``) is captured with exact per-sample gradients through an
        expansion of its output, and one that cannot be is left out with one warning
        (:attr:`left_out`); without either, such a module's capture holds the batch's summed
        gradient as one sample.

        Args:
            batch_size: the loss's batch size for ``loss_reduction="mean"``; ``None``: each
                module's batch dimension.
            mask: ``[N]`` or ``[N, *positions]``, nonzero = keep.
            loss_reduction: ``"sum"`` or ``"mean"``, how the loss reduced the batch.
            outputs_require_grad: make watched outputs require grad (frozen parameters).
            samples: the number of samples, ``"input"`` or ``None``.

        Raises:
            ValueError: an invalid ``batch_size``, ``loss_reduction``, ``mask`` or
                ``samples``.
            RuntimeError: ``batch()`` blocks nested.
        """
        self._begin(batch_size, mask, loss_reduction, outputs_require_grad, samples)
        try:
            yield
        finally:
            self._ctx = None
            self._root_call = None
        # a backward that ran without the autograd callback (should not happen) still counts
        self.flush()

    def _begin(
        self,
        batch_size: int | None,
        mask: torch.Tensor | None,
        loss_reduction: str,
        outputs_require_grad: bool,
        samples: int | str | None = None,
    ) -> None:
        """Validate and open a batch (``batch()`` without its generator, for per-step callers
        that close it with ``_end()``)."""
        check_batch_args(batch_size, loss_reduction)
        if samples is not None and samples != "input":
            if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
                raise ValueError(f'samples must be a non-negative int or "input", got {samples!r}')
        if mask is None:  # immutable, so reused: this runs every training step
            key = (batch_size, loss_reduction, outputs_require_grad, samples)
            ctx = self._contexts.get(key)
            if ctx is None:
                ctx = self._contexts[key] = BatchContext(
                    batch_size, None, loss_reduction, outputs_require_grad, samples
                )
        else:
            if not isinstance(mask, torch.Tensor) or mask.dim() < 1:
                raise ValueError("mask must be a tensor of shape [N] or [N, *positions]")
            ctx = BatchContext(
                batch_size, mask.detach(), loss_reduction, outputs_require_grad, samples
            )
        if self._ctx is not None:
            raise RuntimeError("engine.batch(...) blocks cannot be nested")
        for parent, key, child, path in self._edges.values():
            if parent._modules.get(key) is not child:
                raise RuntimeError(
                    f"nnstat capture: watched module {path!r} was replaced or removed after "
                    "watch() (e.g. model.fc = nn.Linear(...)): the hooks are on the old module, "
                    "so the model's new one would not be captured. Call unwatch() and "
                    "watch(model) again after changing the model (nnstat.unwatch(); "
                    "nnstat.watch(model), or gns.unwatch(); gns.watch(model))."
                )
        self._ctx = ctx

    def _abort(self) -> None:
        """Close a batch whose block raised, dropping its pending captures."""
        self._ctx = None
        self._root_call = None
        with self._lock:
            self._pending = {}

    def _end(self) -> None:
        """Close the batch opened by ``_begin`` and hand over anything still pending."""
        self._ctx = None
        self._root_call = None
        self.flush()

    @contextmanager
    def recording_model_input(self) -> Iterator[None]:
        """Inside this block, `model_input` becomes the first tensor passed to the watched
        model's first call (positional arguments first, then keywords, inside lists, tuples,
        dicts and dataclasses), or stays ``None``. Used to hash a batch's samples
        (``data_id="hash"``).

        Example:
            >>> import torch
            >>> engine = CaptureEngine(); _ = engine.watch(torch.nn.Linear(2, 1))
            >>> with engine.batch(), engine.recording_model_input():
            ...     _ = engine._roots[0](torch.ones(3, 2))
            >>> tuple(engine.model_input.shape)
            (3, 2)
        """
        self.model_input, self._keep_input = None, True
        try:
            yield
        finally:
            self._keep_input = False

    # -------------------------------------------------------------------- hooks
    def _on_model_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self._ctx is not None:
            self._root_call = (args, kwargs)
            if self._foreign is not None:
                self._foreign.clear()
        if self._keep_input and self.model_input is None:
            t = first_tensor(args, kwargs)
            if t is not None:
                self.model_input = t.detach()

    def _on_forward(
        self, w: Watched, module: nn.Module, inputs: tuple, output: Any
    ) -> torch.Tensor | None:
        ctx = self._ctx
        if ctx is None:
            return None
        if self._forward_consumers:
            for fn in self._forward_consumers:
                fn(w.name, module, inputs[0] if inputs else None, output)
        if not isinstance(output, torch.Tensor) or not torch.is_grad_enabled():
            return None
        if not inputs or not isinstance(inputs[0], torch.Tensor):
            return None
        if self._left_out and w.name in self._left_out:
            return None
        x = inputs[0]
        guard = replaced = None
        if isinstance(output, BroadcastOutput):
            # a shared output from upstream went through this module row by row
            # (broadcast.py): its rows are per sample, so hook the plain expanded result; a
            # refused use later leaves this module out too
            guard = self._guard(w, output._nnstat_guards[0])
            replaced, output = add_guard(output, guard), output._nnstat_expanded
            if not output.requires_grad:
                return None
            if isinstance(x, BroadcastOutput):
                x = x._nnstat_expanded
        elif isinstance(x, BroadcastOutput):
            x = x._nnstat_orig  # the module computed with it unexpanded (a refused use)
        elif isinstance(output, SampleRows):
            # computed row by row from rows under check (ambiguous.py): refused with them
            guard = self._guard(w, output._nnstat_guards[0], checked=True)
            replaced = add_check_guard(output, guard)
        if not output.requires_grad:
            if not (ctx.outputs_require_grad and output.is_floating_point()):
                return None
            # nothing upstream needs a gradient (frozen parameters, input without grad): start
            # the graph here; a non-leaf copy keeps downstream in-place ops (ReLU(inplace)) legal
            replaced = output = output.detach().requires_grad_().clone()
        if guard is None and output.dim() and x.dim() and (x.shape[0] == 1 or not x.requires_grad):
            # an input the batch may share (position ids): see _shared
            shared = self._shared(w, x, output, ctx)
            if shared is not None:
                wrapped, x = shared
                if isinstance(wrapped, BroadcastOutput):
                    # the rest of the model reads the checked expansion; the hook sits on the
                    # plain expanded tensor, where autograd delivers each sample's gradient
                    replaced, output = wrapped, wrapped._nnstat_expanded
                else:
                    replaced = wrapped  # rows per sample, checked at their first uses
        x = x.detach()
        w.kind.keep_forward_stats(x, output)  # LayerNorm: autograd's own mean and 1/std of x
        # the input travels in the closure, so a recomputed forward (activation checkpointing)
        # pairs with its own backward and a forward whose output never gets a gradient is dropped
        hook = partial(self._on_output_grad, module, x, ctx)
        target = hook_target(output) if output._is_view() else output
        if self._foreign is not None:  # what the model reads and what is hooked: this call's
            self._foreign.call(module, (*inputs, x), (output, replaced, target))
        if target is not output:
            hook = partial(reshaped, hook, output.shape)
        fresh = type(target) is torch.Tensor and target._backward_hooks is None
        register = getattr(target.grad_fn, _REGISTER_HOOK_DICT, None) if fresh else None
        if register is not None:
            # what Tensor.register_hook does for a fresh non-leaf tensor, minus the removable
            # handle we never use (a third of the per-layer hook cost on small models); any
            # other tensor (subclasses, existing hooks, leaves), or a torch without this
            # private method, goes through the public API
            target._backward_hooks = OrderedDict(nnstat_capture=hook)
            register(target)
        else:
            target.register_hook(hook)
        return replaced

    def _on_output_grad(
        self, module: nn.Module, x: torch.Tensor, ctx: BatchContext, grad: torch.Tensor
    ) -> None:
        if torch.is_grad_enabled():  # a backward with create_graph=True
            raise RuntimeError(create_graph_refusal(self._watched[module].name))
        with self._lock:
            calls = self._pending.get(module)
            if calls is None:
                self._pending[module] = [(x, grad, ctx)]
            else:
                calls.append((x, grad, ctx))
            if not self._flush_queued:
                self._flush_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.flush)

    def flush(self) -> None:
        """Hand pending captures to the consumers (called automatically after each backward)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._flush_queued = False
        if not pending or not (self._consumers or self._backward_consumers):
            return
        if self._attention:
            self._attention_rows(pending)
        left_out = self._left_out
        caps = [
            build_capture(w, pending[module])
            for module, w in list(self._watched.items())
            if pending.get(module) and not (left_out and w.name in left_out)
        ]
        if self._tied:
            caps = self._merge_tied(caps)
        ctx = next(iter(pending.values()))[0][2]
        if caps and (ctx.samples is not None or ctx.mask is not None):
            caps = self._rows_not_samples(self._drop_unbroadcast(caps), ctx)
        # a module left out has had its own warning
        got = {c.name for c in caps} | left_out.keys()
        warn_without_gradient([n for n in self.watched if n not in got], self.no_gradient_warned)
        for cap in caps:
            for consumer in self._consumers:
                consumer(cap)
        for batch_consumer in self._backward_consumers:
            batch_consumer(caps)


def _as_list(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, (str, type)):
        return [x]
    return list(x)


def _type_matches(module: nn.Module, t: type | str) -> bool:
    if isinstance(t, str):
        return any(c.__name__ == t for c in type(module).__mro__)
    return isinstance(module, t)
