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

from nnstat.projection import ForwardFactors, ModuleProjection, project_capture


class BatchRows:
    """Per-block row assembly: module → rows, the shared row buffer and its finiteness.

    ``factors`` is the :class:`~nnstat.projection.ForwardFactors` consumer the run registered
    on its engine: rows built from its input halves are certified finite without a pass over
    the row buffer.

    Example:
        >>> rows = BatchRows()
        >>> rows.begin({}, forward_factors=False)
        >>> rows.end()
        ({}, None)
    """

    def __init__(self, factors: ForwardFactors | None = None) -> None:
        self.factors = factors if factors is not None else ForwardFactors()
        self.columns: dict[str, slice] = {}
        self.all_finite = True
        self._projections: Mapping[str, ModuleProjection] = {}
        self._rows: dict[str, torch.Tensor] | None = None
        self._buffer: torch.Tensor | None = None

    @property
    def open(self) -> bool:
        """True between :meth:`begin` and :meth:`end`."""
        return self._rows is not None

    def begin(self, projections: Mapping[str, ModuleProjection], forward_factors: bool) -> None:
        """Start a block under ``projections`` (``forward_factors``: let the forward hook help)."""
        self._projections = projections
        self._rows, self._buffer, self.all_finite = {}, None, True
        if forward_factors:
            self.factors.start(projections)

    def end(self) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Close the block: ``(module → rows, the row buffer or None)``."""
        self.factors.stop()
        rows, self._rows = self._rows or {}, None
        buffer, self._buffer = self._buffer, None
        return rows, buffer

    def add(self, cap: Any, writer: Any | None) -> None:
        """Project one module's capture; in place into ``writer``'s row buffer when given."""
        assert self._rows is not None
        proj = self._projections[cap.name]
        prev = self._rows.get(cap.name)
        if prev is None and writer is not None:
            out = self._row_buffer(writer, cap.num_samples)[:, self.columns[cap.name]]
            finite = self.factors.rows(cap, proj, out)
            if finite is not None:
                self.all_finite &= finite
            elif cap.backward.device == out.device:
                self.all_finite = False
                project_capture(cap, proj, out=out)
            else:  # an accelerator: one transfer of the projected rows
                self.all_finite = False
                out.copy_(project_capture(cap, proj))
            self._rows[cap.name] = out
            return
        self.all_finite = False  # a sum of backward passes: checked on the rows
        rows = project_capture(cap, proj).float()
        self._rows[cap.name] = rows if prev is None else prev.add_(rows)

    def _row_buffer(self, writer: Any, n: int) -> torch.Tensor:
        if self._buffer is None:
            self._buffer = writer.row_buffer(n)
            offset = 0
            for name, p in self._projections.items():
                self.columns[name] = slice(offset, offset + p.width)
                offset += p.width
        elif self._buffer.shape[0] != n:
            raise ValueError(
                f"watched modules saw different batch sizes in one run(...) block "
                f"({self._buffer.shape[0]} and {n})"
            )
        return self._buffer
