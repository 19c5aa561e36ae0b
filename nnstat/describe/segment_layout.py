"""The flat layout of `nnstat.describe.torch_segments`: tensors grouped by (device, dtype), each
group laid out in rows of ``B`` elements (each tensor from a new row, its last row padded), and the
index tensors of that layout, built once per list of tensors and cached.

Example:
    >>> import torch
    >>> lay = layout_of([torch.ones(5), torch.ones(3, dtype=torch.float64)], None)
    >>> [(g.dtype, g.numels) for g in lay.groups]
    [(torch.float32, [5]), (torch.float64, [3])]
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from nnstat.describe import triton_rows
from nnstat.describe.binning import sample_runs
from nnstat.describe.moments import Workspace
from nnstat.describe.partials import work_dtype

__all__ = ["Group", "Layout", "layout_of", "reorder", "on_device", "MAX_BLOCK", "MAX_GROUP"]

#: Elements per group at most (more of one dtype: several groups, each a whole number of
#: tensors). The flat buffer holds one group: at most 512 MiB for float32 data (twice that on
#: CPU, where it also holds the powers, see `_norm_kernels`).
MAX_GROUP = 1 << 27
#: Row length of the flat layout (shorter rows when the tensors are small, see `_block`).
MAX_BLOCK = 4096
_MIN_BLOCK = 128
_LAYOUT_CACHE: OrderedDict[tuple, Layout] = OrderedDict()
_CACHE_SIZE = 16
_CACHE_LOCK = threading.Lock()


def _block(numels: Sequence[int]) -> int:
    """Row length: `MAX_BLOCK`, halved while padding would exceed a quarter of the data."""
    total = sum(numels)
    b = MAX_BLOCK
    while b > _MIN_BLOCK and sum(-(-n // b) * b for n in numels) > 1.25 * total:
        b //= 2
    return b


def on_device(values: Sequence[float] | Sequence[int], dtype: torch.dtype, dev: torch.device):
    # non_blocking: a pageable host-to-device copy then does not wait for the queued kernels
    return torch.tensor(values, dtype=dtype).to(dev, non_blocking=True)


@dataclass
class Group:
    """One (device, dtype) group of a list: its tensors' positions and, built on first use,
    the flat layout (rows of `block`, each tensor from a new row, its last row padded)."""

    device: torch.device
    dtype: torch.dtype
    positions: list[int]
    numels: list[int]
    work: torch.dtype = field(init=False)
    n: torch.Tensor = field(init=False)  # float64 [m] element counts
    eps_row: torch.Tensor = field(init=False)  # float64 [1, m]: the work dtype's epsilon
    _rows: dict | None = None
    _samples: dict = field(default_factory=dict)
    _table: triton_rows.RowTable | None = None

    def __post_init__(self) -> None:
        self.work = work_dtype(self.dtype)
        self.n = on_device([float(k) for k in self.numels], torch.float64, self.device)
        eps = torch.finfo(self.work).eps
        self.eps_row = torch.full((1, len(self.numels)), eps, dtype=torch.float64)
        self.eps_row = self.eps_row.to(self.device, non_blocking=True)

    def rows(self) -> dict:
        """The flat layout's index tensors (cached)."""
        if self._rows is None:
            # per-tensor sizes in Python (no tensor is read), index vectors built by torch
            b = _block(self.numels)
            counts = [-(-k // b) for k in self.numels]
            starts = [0]
            for c in counts[:-1]:
                starts.append(starts[-1] + c * b)
            pads = [c * b - k for c, k in zip(counts, self.numels, strict=True)]
            seg = torch.arange(len(self.numels))
            pad_seg = torch.repeat_interleave(seg, torch.tensor(pads), output_size=sum(pads))
            first = torch.tensor(starts)
            ends = [s + k for s, k in zip(starts, self.numels, strict=True)]
            pad_idx = _ranges(torch.tensor(ends), torch.tensor(pads), sum(pads))
            row_seg = torch.repeat_interleave(seg, torch.tensor(counts), output_size=sum(counts))
            dev = self.device
            zeros = torch.zeros(b, dtype=self.work, device=dev)
            self._rows = {
                "block": b,
                "count": sum(counts),
                "starts": starts,
                "pads": [zeros[:p] for p in pads],
                "lengths": on_device(counts, torch.int64, dev),
                "row_seg": row_seg.to(dev, non_blocking=True),
                "pad_idx": pad_idx.to(dev, non_blocking=True),
                "pad_src": first[pad_seg].to(dev, non_blocking=True),
                "pad_seg": pad_seg.to(dev, non_blocking=True),
                "tiled": {},
            }
        return self._rows

    def triton(self) -> bool:
        """Whether this group is reduced by the fused row kernels (`triton_rows`: CUDA with
        Triton, float dtypes) instead of the flat copy and torch's kernels."""
        return self.dtype in triton_rows.FLOAT_DTYPES and triton_rows.available(self.device)

    def table(self) -> triton_rows.RowTable:
        """The rows' tensors and starts for the Triton row kernels (cached)."""
        if self._table is None:
            self._table = triton_rows.RowTable.build(self.numels, self.rows()["block"], self.device)
        return self._table

    def lengths(self, k: int) -> torch.Tensor:
        """Rows per tensor repeated `k` times: one segment_reduce adds `k` kinds of partials."""
        r = self.rows()
        if k not in r["tiled"]:
            r["tiled"][k] = r["lengths"].repeat(k)
        return r["tiled"][k]

    def samples(self, max_elements: int | None) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
        """Flat positions of the histogram samples in the flat buffer, their tensor, and which
        tensors were subsampled (`binning.sample_runs`' positions, cached)."""
        if max_elements not in self._samples:
            r = self.rows()
            run_starts, run_seg, sampled = [], [], []
            length = []
            for i, (k, s) in enumerate(zip(self.numels, r["starts"], strict=True)):
                runs, run_length, was = sample_runs(k, max_elements)
                run_starts += [s + start for start in runs]
                run_seg += [i] * len(runs)
                length += [run_length] * len(runs)
                sampled.append(was)
            lengths = torch.tensor(length, dtype=torch.int64)
            total = sum(length)
            seg = torch.repeat_interleave(torch.tensor(run_seg), lengths, output_size=total)
            idx = _ranges(torch.tensor(run_starts, dtype=torch.int64), lengths, total)
            dev = self.device
            self._samples[max_elements] = (
                idx.to(dev, non_blocking=True),
                seg.to(dev, non_blocking=True),
                sampled,
            )
        return self._samples[max_elements]


def _ranges(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lengths)])`` (`total` elements) without
    a Python loop over elements (host int64 tensors; layouts are built once)."""
    offsets = lengths.cumsum(0) - lengths
    base = torch.repeat_interleave(starts - offsets, lengths, output_size=total)
    return base + torch.arange(total)


@dataclass
class Layout:
    """Groups of a list of tensors and where each tensor's row lands in the result."""

    groups: list[Group]
    order: torch.Tensor | None  # caller position -> row of the grouped table (None: identity)
    empty_rows: dict[tuple[float, ...], torch.Tensor] = field(default_factory=dict)


def layout_of(tensors: Sequence[torch.Tensor], ws: Workspace | None) -> Layout:
    key = tuple((t.device, t.dtype, t.numel()) for t in tensors)
    cache = ws.layouts if ws is not None else _LAYOUT_CACHE
    with _CACHE_LOCK:  # the module cache may be shared by threads
        lay = cache.get(key)
        if lay is not None:
            cache.move_to_end(key)
            return lay
    by: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, (dev, dtype, numel) in enumerate(key):
        if numel:  # empty tensors get their row in `_reorder`
            by.setdefault((dev, dtype), []).append(i)
    groups = []
    for (dev, dtype), pos in by.items():
        # groups of at most MAX_GROUP elements (whole tensors): bounds the flat buffer
        part, size = [], 0
        for i in pos:
            if part and size + key[i][2] > MAX_GROUP:
                groups.append(Group(dev, dtype, part, [key[j][2] for j in part]))
                part, size = [], 0
            part.append(i)
            size += key[i][2]
        groups.append(Group(dev, dtype, part, [key[j][2] for j in part]))
    grouped = [i for g in groups for i in g.positions]
    order = None
    if grouped != list(range(len(key))):
        row = {p: r for r, p in enumerate(grouped)}
        order = on_device(
            [row.get(i, len(grouped)) for i in range(len(key))], torch.int64, key[0][0]
        )
    lay = Layout(groups, order)
    with _CACHE_LOCK:
        cache[key] = lay
        while len(cache) > _CACHE_SIZE:
            cache.popitem(last=False)
    return lay


def reorder(rows: torch.Tensor, lay: Layout, empty: list[float]) -> torch.Tensor:
    """Grouped rows back in the caller's order; empty tensors get the row `empty`."""
    if lay.order is None:
        return rows
    key = tuple(empty)
    if key not in lay.empty_rows:  # cached: no host-to-device copy per call
        lay.empty_rows[key] = on_device([empty], torch.float64, rows.device)
    rows = torch.cat([rows, lay.empty_rows[key]])
    return rows.index_select(0, lay.order.to(rows.device))
