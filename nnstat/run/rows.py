"""One ``run(...)`` block's projected rows, assembled as the capture engine delivers modules.

A logging pass writes each module's projected rows straight into that module's columns of one
of the writer's reused row buffers (no per-batch allocation); an eval pass or a block with two
backward passes keeps one fresh tensor per module instead (two passes add up, like the
gradients they project). :class:`BatchRows` holds that per-block state for
:class:`nnstat.run.Run`.

Example:
    >>> rows = BatchRows()
    >>> rows.open
    False
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nnstat.capture.capture import modules_by_size
from nnstat.store import outer
from nnstat.store.projection import ModuleProjection, project_capture, row_factors


class BatchRows:
    """Per-block row assembly: module → rows and the shared row buffer.

    Example:
        >>> rows = BatchRows()
        >>> rows.begin({})
        >>> rows.end()
        ({}, None, None)
    """

    def __init__(self) -> None:
        self.columns: dict[str, slice] = {}
        self._projections: Mapping[str, ModuleProjection] = {}
        self._rows: dict[str, torch.Tensor] | None = None
        self._buffer: torch.Tensor | None = None
        # modules whose rows are outer products left for the writer to form (see store.outer)
        self._outer: list[outer.OuterFactors] = []
        self._all_outer = True
        self._sizes: dict[str, int] = {}  # module -> samples it saw in this block

    @property
    def open(self) -> bool:
        """True between :meth:`begin` and :meth:`end`."""
        return self._rows is not None

    def begin(self, projections: Mapping[str, ModuleProjection]) -> None:
        """Start a block under ``projections``."""
        self._projections = projections
        self._rows, self._buffer = {}, None
        self._outer, self._all_outer = [], True
        self._sizes = {}

    def end(
        self,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, list[outer.OuterFactors] | None]:
        """Close the block: ``(module → rows, the row buffer or None, factors or None)``.

        Factors come back only when every module's rows in the buffer are outer products not
        yet formed; otherwise the block's rows are all in place (formed here if need be).
        """
        rows, self._rows = self._rows or {}, None
        buffer, self._buffer = self._buffer, None
        factors, self._outer = self._outer, []
        if factors and not self._all_outer:
            assert buffer is not None
            outer.fill(buffer, factors)
            factors = []
        return rows, buffer, factors or None

    def add(self, cap: Any, writer: Any | None) -> None:
        """Project one module's capture; in place into ``writer``'s row buffer when given."""
        assert self._rows is not None
        proj = self._projections[cap.name]
        prev = self._rows.get(cap.name)
        if cap.num_samples == 0:  # an empty batch (a filtered last batch): nothing to project
            if prev is None:
                buf = self._row_buffer(writer, 0) if writer is not None else None
                empty = torch.zeros(0, proj.width)
                self._rows[cap.name] = empty if buf is None else buf[:, self.columns[cap.name]]
            return
        self._check_size(cap.name, cap.num_samples)
        if prev is None and writer is not None:
            buf = self._row_buffer(writer, cap.num_samples)
            out = buf[:, self.columns[cap.name]]
            b = cap.backward
            factors = None
            if b.dtype == torch.float32 and b.device == buf.device and len(buf):
                factors = row_factors(cap, proj)
            if factors is not None:
                self._outer.append(outer.OuterFactors(self.columns[cap.name], *factors))
            elif b.device == buf.device:
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
        rows = project_capture(cap, proj).float()
        self._rows[cap.name] = rows if prev is None else prev.add_(rows)

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
            "module's dim 0 must be the block's samples: a module applied to flattened inputs "
            "([B*T, d]) or to a tensor without the batch dimension has no per-sample gradient; "
            "watch with a name_filter that excludes it, or call it on [B, ...] inputs"
        )

    def _row_buffer(self, writer: Any, n: int) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = writer.row_buffer(n)
            offset = 0
            for name, p in self._projections.items():
                self.columns[name] = slice(offset, offset + p.width)
                offset += p.width
        return self._buffer
