"""One ``run(...)`` block's projected rows, assembled as the capture engine delivers modules.

On the CPU a logging pass writes each module's projected rows straight into that module's
columns of one of the writer's reused row buffers (no per-batch allocation); an eval pass or a
block with two backward passes keeps one fresh tensor per module instead (two passes add up,
like the gradients they project). On an accelerator (:func:`on_accelerator`) the rows stay
there: every module projects into its columns of one staging buffer on the device, laid out
like the stored row, followed by a few words for the block's flags (the weights guard's and the
rows' NaN/Inf flags, written there at its end), and the whole buffer leaves the device in ONE
copy at the block's end (the store's writer queues it, non-blocking, into pinned memory; its
thread reads the flags once the copy has landed): nothing is read back inside the step.
:class:`BatchRows` holds that per-block state for :class:`nnstat.run.Run`;
:func:`module_blocks`, :func:`refuse_left_out` and :func:`input_ids` are the checks and ids of
a block's rows before they are stored.

Example:
    >>> rows = BatchRows()
    >>> rows.open
    False
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch

from nnstat.capture.build import warn_without_gradient
from nnstat.capture.capture import modules_by_size
from nnstat.store import outer
from nnstat.store.factored import EnergyTally, factor_rows
from nnstat.store.ids import content_ids, ids_count_error
from nnstat.store.projection import (
    ModuleProjection,
    project_capture,
    projected_factors,
    row_factors,
)


def on_accelerator(device: torch.device) -> bool:
    """Whether rows captured on ``device`` are staged there (one copy per block) rather than
    written into the host row buffer module by module. Tests force it to run the accelerator
    branch on the CPU.

    Example:
        >>> on_accelerator(torch.device("cpu"))
        False
    """
    return device.type != "cpu"


class Block(NamedTuple):
    """A closed block's rows: ``rows`` (module → ``[N, width]``, views of ``buffer`` or
    ``staged`` when those exist), ``buffer`` (the writer's host row buffer, or ``None``),
    ``factors`` (outer products the writer forms, or ``None``), ``staged`` (the device
    staging buffer ``[N, row_width]``, or ``None``) and ``flat`` (the flat device buffer
    ``staged`` is the start of, followed by ``N`` + the ``flags`` of :meth:`BatchRows.begin`
    words for the block's flags; ``None`` without ``staged``)."""

    rows: dict[str, torch.Tensor]
    buffer: torch.Tensor | None = None
    factors: list[outer.OuterFactors] | None = None
    staged: torch.Tensor | None = None
    flat: torch.Tensor | None = None


class BatchRows:
    """Per-block row assembly: module → rows and the shared row buffer.

    Example:
        >>> rows = BatchRows()
        >>> rows.begin({})
        >>> rows.end()
        Block(rows={}, buffer=None, factors=None, staged=None, flat=None)
    """

    def __init__(self) -> None:
        self.columns: dict[str, slice] = {}
        self._projections: Mapping[str, ModuleProjection] = {}
        self._rows: dict[str, torch.Tensor] | None = None
        self._buffer: torch.Tensor | None = None
        self._stage: torch.Tensor | None = None  # the device staging buffer of the block
        self._flat: torch.Tensor | None = None  # _stage's flat buffer, with the flags' words
        self._flags = 0  # words after the rows and their N row flags (the guard's flags)
        # modules whose rows are outer products left for the writer to form (see store.outer)
        self._outer: list[outer.OuterFactors] = []
        self._all_outer = True
        self._factor = True  # factored modules stored as factors (begin's factor)
        self._sizes: dict[str, int] = {}  # module -> samples it saw in this block
        self._summed_warned = False  # the warning for a block of several backward passes
        # captured energy of factored modules over the pass (the Run records it in meta.json)
        self.energy = EnergyTally()

    @property
    def open(self) -> bool:
        """True between :meth:`begin` and :meth:`end`."""
        return self._rows is not None

    def begin(
        self, projections: Mapping[str, ModuleProjection], flags: int = 0, factor: bool = True
    ) -> None:
        """Start a block under ``projections``; a device staging buffer keeps ``N + flags``
        words after the rows (the rows' NaN/Inf flags and ``flags`` more). ``factor=False``
        (queries: few, kept exact) makes dense rows also of the modules a store keeps as
        factors."""
        self._projections = projections
        self._factor = factor
        self._rows, self._buffer, self._stage, self._flat = {}, None, None, None
        self._flags = flags
        self._outer, self._all_outer = [], True
        self._sizes = {}

    def end(self) -> Block:
        """Close the block (see :class:`Block`).

        Factors come back only when every module's rows in the buffer are outer products not
        yet formed; otherwise the block's rows are all in place (formed here if need be). In a
        staging buffer the columns of modules without rows are zeroed here, on the device.
        """
        rows, self._rows = self._rows or {}, None
        buffer, self._buffer = self._buffer, None
        stage, self._stage = self._stage, None
        flat, self._flat = self._flat, None
        factors, self._outer = self._outer, []
        if factors and not self._all_outer:
            assert buffer is not None
            outer.fill(buffer, factors)
            factors = []
        if stage is not None:
            for name in self._projections:
                if name not in rows:  # took no part in the loss: stored as zeros
                    stage[:, self.columns[name]].zero_()
        return Block(rows, buffer, factors or None, stage, flat)

    def add(self, cap: Any, writer: Any | None) -> None:
        """Project one module's capture; in place into ``writer``'s row buffer when given, into
        the block's device staging buffer on an accelerator."""
        assert self._rows is not None
        proj = self._projections[cap.name]
        prev = self._rows.get(cap.name)
        if prev is not None and cap.num_samples and not self._summed_warned:
            self._summed_warned = True
            warnings.warn(
                f"nnstat: a run(...) block ran a second backward pass (module {cap.name!r}): "
                "each stored row is the sum over the block's passes of the gradients of the "
                "sample at its position. That is right when every pass is over the same "
                "samples (two views, two loss terms); for passes over different samples, give "
                "each its own run(...) block. Warned once per run",
                stacklevel=2,
            )
        factored = None
        if proj.factors and cap.num_samples and self._factor:
            factored = self._factored(cap, proj, prev)
        if cap.num_samples and (self._stage is not None or on_accelerator(cap.device)):
            self._check_size(cap.name, cap.num_samples)
            self._add_staged(cap, proj, prev, factored)
            return
        if cap.num_samples == 0:  # an empty batch (a filtered last batch): nothing to project
            if prev is None:
                buf = self._row_buffer(writer, 0) if writer is not None else None
                empty = torch.zeros(0, self._width(proj))
                self._rows[cap.name] = empty if buf is None else buf[:, self.columns[cap.name]]
            return
        self._check_size(cap.name, cap.num_samples)
        if prev is None and writer is not None:
            buf = self._row_buffer(writer, cap.num_samples)
            out = buf[:, self.columns[cap.name]]
            # dtype and device read without building the rows (a tied capture's are GBs)
            here = cap.device == buf.device
            factors = None
            if cap.dtype == torch.float32 and here and len(buf) and factored is None:
                factors = row_factors(cap, proj)
            if factored is not None:
                self._all_outer = False
                out.copy_(factored)
            elif factors is not None:
                self._outer.append(outer.OuterFactors(self.columns[cap.name], *factors))
            elif here:
                self._all_outer = False
                project_capture(cap, proj, out=out)
            else:  # an accelerator: one transfer of the projected rows
                self._all_outer = False
                out.copy_(project_capture(cap, proj))
            self._rows[cap.name] = out
            return
        if self._outer:  # a second backward adds to the rows: form the pending ones first
            assert self._buffer is not None
            outer.fill(self._buffer, self._outer)
            self._outer, self._all_outer = [], False
        rows = project_capture(cap, proj).float() if factored is None else factored
        self._rows[cap.name] = rows if prev is None else prev.add_(rows)

    def _factored(self, cap: Any, proj: ModuleProjection, prev: Any) -> torch.Tensor:
        """The factored rows of a module stored as factors (:mod:`nnstat.store.factored`),
        computed on the capture's device; their energy is tallied."""
        if prev is not None:
            raise ValueError(
                f"module {cap.name!r} is stored as factors (factors={proj.factors}), and a "
                "second backward in one run(...) block would add two factored gradients, which "
                "is not a sum of their factors: call backward once per block, or log dense "
                "rows (factors=None)"
            )
        assert proj.factors is not None
        rows, energy = factor_rows(*projected_factors(cap, proj), proj.factors)
        self.energy.add(cap.name, energy)
        return rows

    def _add_staged(
        self,
        cap: Any,
        proj: ModuleProjection,
        prev: torch.Tensor | None,
        factored: torch.Tensor | None = None,
    ) -> None:
        """Project into this module's columns of the device staging buffer (a second backward
        adds to them); no host transfer. ``factored``: the module's rows, already made."""
        if self._stage is None:
            self._layout()
            width = sum(self._width(p) for p in self._projections.values())
            n = cap.num_samples
            # the flags' words after the rows: they leave the device in the rows' one copy
            self._flat = torch.empty(
                n * width + n + self._flags, dtype=torch.float32, device=cap.device
            )
            self._stage = self._flat[: n * width].view(n, width)
        out = self._stage[:, self.columns[cap.name]]
        same = cap.device == out.device
        if factored is not None:
            out.copy_(factored)
        elif prev is not None:
            out.add_(project_capture(cap, proj).to(out.device))
        elif same:
            project_capture(cap, proj, out=out)
        else:  # a model split over devices: a device-to-device copy, nothing read back
            out.copy_(project_capture(cap, proj))
        self._rows[cap.name] = out

    def _width(self, p: ModuleProjection) -> int:
        return p.width if self._factor else p.dense_width

    def _layout(self) -> None:
        offset = 0
        for name, p in self._projections.items():
            self.columns[name] = slice(offset, offset + self._width(p))
            offset += self._width(p)

    def _check_size(self, name: str, n: int) -> None:
        """Every module of a block must see its N samples: name the ones that did not."""
        first = next(iter(self._sizes.values()), n)
        self._sizes.setdefault(name, n)
        if n == first:
            return
        sizes = list(self._sizes.items())
        if self._sizes[name] != n:  # the same module, in a second backward of the block
            sizes.append((name, n))
        seen = modules_by_size(sizes)
        raise ValueError(
            f"watched modules saw different batch sizes in one run(...) block ({seen}). Each "
            "module's dim 0 must be the block's samples. Layouts that break it: samples "
            "flattened with their positions ([B*T, d]: apply the module to [B, T, d]); "
            "sequence-first tensors ([T, B, d], e.g. nn.TransformerEncoderLayer with "
            "batch_first=False: use batch_first=True); a float table shared by the batch "
            "([T, d] without a batch dimension: pass it as table[None], which nnstat expands "
            "to the batch). Or watch with a name_filter that excludes the module"
        )

    def _row_buffer(self, writer: Any, n: int) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = writer.row_buffer(n)
            self._layout()
        return self._buffer


def module_blocks(
    batch: Mapping[str, torch.Tensor],
    projections: Mapping[str, ModuleProjection],
    warned: set[str],
    factored: bool = True,
) -> list[torch.Tensor]:
    """One ``[N, width]`` block per module in layout order; zeros for modules without gradient.

    A watched module that took no part in the loss has a zero gradient: stored as zeros, with a
    one-time warning naming it (``warned``: the engine's, which gave it already when a backward
    of the block left the module out; ``factored=False``: a query block's dense widths).
    Nothing captured at all is an error (no backward in the block).
    """
    if not batch:
        raise RuntimeError(
            "nothing was captured inside run(...): call loss.backward() inside the block "
            "(and make sure the loss depends on a watched module)"
        )
    n = next(iter(batch.values())).shape[0]
    warn_without_gradient([m for m in projections if m not in batch], warned, stacklevel=4)
    return [
        batch[m] if m in batch else torch.zeros(n, p.width if factored else p.dense_width)
        for m, p in projections.items()
    ]


def refuse_left_out(
    left_out: Mapping[str, str],
    projections: Mapping[str, ModuleProjection],
    ids: list | None,
    batch: Mapping[str, torch.Tensor],
) -> None:
    """A module of the store's layout that the engine left out (``left_out``: module -> why)
    would be stored as zeros (and be missing from the statistics): refuse the block instead,
    saying how to include or exclude the module."""
    left = {m: why for m, why in left_out.items() if m in projections}
    if not left:
        return
    n = next(iter(batch.values())).shape[0] if batch else None
    if ids is not None and n is not None and n != len(ids):
        # the expansion was sized by data_id: that is the error to fix first
        raise ids_count_error(len(ids), n)
    reasons = "; ".join(f"{m!r}: {why}" for m, why in left.items())
    raise ValueError(
        f"nnstat: watched modules were left out of capture in this run(...) block, so its "
        f"rows are not stored ({reasons}). Remove the cause (an input the batch shares: give it "
        "the batch dimension, GPT-2 and similar: position_ids=torch.arange(T).expand(B, T); a "
        "parameter used outside its module: use it through a module, head = nn.Linear(d, "
        "vocab, bias=False); head.weight = emb.weight), or nnstat.unwatch() and watch the "
        "model again with a name_filter that excludes them (in a new project, or with "
        "overwrite=True)"
    )


def input_ids(x: torch.Tensor | None, batch: Mapping[str, torch.Tensor], model: str) -> list:
    """``data_id="hash"``: content ids of the rows of the model's first input tensor ``x``
    (``model``: the watched model's class name, for the error when it was not called)."""
    if x is None:
        raise RuntimeError(
            'data_id="hash" hashes the first tensor passed to the watched model, but '
            f"{model}.forward was not called inside this run(...) block, or was called with "
            "no tensor (in lists, tuples, dicts or dataclasses) among its arguments; pass the "
            "ids (data_id=[...]) instead"
        )
    n = next(iter(batch.values())).shape[0] if batch else None
    if x.dim() == 0 or (n is not None and x.shape[0] != n):
        raise ValueError(
            f'data_id="hash": the model\'s first input has shape {tuple(x.shape)}, which '
            f"is not a batch of the {n} samples captured; pass the ids (data_id=[...]) or "
            "the tensor to hash (data_id=tensor) instead"
        )
    ids = content_ids(x)
    if len(set(ids)) < len(ids):
        raise ValueError(
            f'data_id="hash": {len(ids) - len(set(ids))} of the {len(ids)} rows of the model\'s '
            f"first input (shape {tuple(x.shape)}, {x.dtype}) repeat an earlier row, so their "
            "hashes do too; when that tensor is not what tells the samples apart (a mask, "
            "padding, a constant), pass the ids (data_id=[...]) or the tensor to hash "
            "(data_id=tensor) instead"
        )
    return ids
