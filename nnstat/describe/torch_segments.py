"""The statistics of many tensors on an accelerator in O(dtype groups) kernels, not O(tensors).

`segment_table` is the one tensor-statistics core of the device paths (`summarize` and
``NetDict.describe`` on accelerators, the Tracker's staged step, the recorder's reductions). It
groups the tensors by (device, dtype) and launches a fixed number of kernels per group:

- Norm statistics only (``l2``, ``rms``, ``abs_max``, ``l1``, ...): the multi-tensor norm kernels
  (``torch._foreach_norm``) read the tensors where they are, no copy.
- Anything else: the group is copied ONCE into a reusable flat buffer (`Workspace.flat`) laid out
  in rows of ``B`` elements, each tensor starting on a new row (its last row padded). Every
  per-element reduction is then one row-wise kernel over the whole group, and one
  ``segment_reduce`` per kind of partial adds the rows of each tensor up (in float64). The
  moments take two passes: the first gives each tensor's mean ``c`` (float32 for float32 data),
  minimum and maximum; the second reduces ``d = (x - c) * s`` in place, with ``s`` a power of
  two bringing ``max |x - c|`` near 1 (so ``d^4`` neither overflows nor underflows and the
  scaling is exact). ``sum d`` is kept and the power sums are shifted to the exact mean in
  float64 (`nnstat.distributed.shift_power_sums`), so data whose spread is a few ulps of its
  mean (a LayerNorm weight near 1) keeps its variance, skew and kurtosis.
- Histograms (`HistSpec`): the samples of every tensor of a group (`binning.sample_runs`'
  positions, from a cached index) are gathered from the flat buffer and counted by one
  scatter/bincount (`binning.bin_flat`).

On CUDA with Triton (`nnstat.describe.triton_rows`) float groups skip the flat copy: fused row
kernels read each row where it lies and form a pass' partials in one read (norms: one read per
group; moments: two, not ~13 passes), in float64; the rows and partials are the same.

The layout of a list (row ownership, pad positions, sample indices) is built once and cached
(per `Workspace`, else in a small module cache), so a step does no per-tensor host work beyond
making views. Nothing is read back to the host: the result is a device table whose last column
is a finiteness probe (non-finite exactly when a tensor holds NaN/Inf or a float32 sum
overflowed); `nnstat.describe.summary.repair_table` recomputes those rows on the host after the
one transfer, as before. Memory: one flat buffer of the largest group's size in its work dtype
(float32, float64 for float64 data), reused across calls; the histogram samples and their
indices (at most ``hist_max_elements`` per tensor).

Example:
    >>> import torch
    >>> table = segment_table([torch.tensor([1.0, 2.0, 3.0, 6.0])], ("mean", "var", "max"))[0]
    >>> table[0, :3].tolist()
    [3.0, 3.5, 6.0]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nnstat.describe import partials as pr
from nnstat.describe import triton_rows
from nnstat.describe.binning import bin_flat, hist_ranges
from nnstat.describe.moments import Workspace
from nnstat.describe.segment_layout import Group, Layout, layout_of, reorder
from nnstat.describe.segment_rows import centre_scale, moment_rows, norm_rows

__all__ = [
    "segment_table",
    "segment_tables",
    "segment_partials",
    "HistSpec",
]


@dataclass(frozen=True)
class HistSpec:
    """Histograms to count in the same pass: `bins` per tensor over its own finite range, from
    at most `max_elements` elements (None: all; see `nnstat.describe.histogram`)."""

    bins: int
    max_elements: int | None


def segment_table(
    tensors: Sequence[torch.Tensor],
    stats: tuple[str, ...],
    workspace: Workspace | None = None,
    hist: HistSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, list[bool]]:
    """``(table, hist, sampled)`` of `tensors`, on their device, with no host synchronisation.

    `table` is ``[n, len(stats) + 1]`` float64, `stats` validated names of
    `nnstat.describe.STAT_NAMES` (columns in that order), the last column the finiteness probe
    (the l2 norm: NaN/Inf when a tensor holds NaN/Inf or a float32 sum overflowed; statistics
    of such rows and of empty tensors are to be recomputed on the host, `repair_table`).
    With `hist`: ``[n, 2 + bins]`` float64 rows ``[lo, hi, counts...]`` (the range
    `binning.hist_ranges` takes from each tensor's min and max, and the counts of its sample
    over it) and, per tensor, whether its histogram was subsampled; else ``(table, None, [])``.
    Tensors may be on several devices; the tables land on the first tensor's device.

    Example:
        >>> x = torch.tensor([0.0, 1.0, 1.0])
        >>> t, h, was = segment_table([x], ("max", "sparsity"), None, HistSpec(2, None))
        >>> t[:, :2].tolist(), h.tolist(), was
        ([[1.0, 0.3333333333333333]], [[0.0, 1.0, 1.0, 2.0]], [False])
    """
    return segment_tables([tensors], stats, workspace, hist)[0]


def segment_tables(
    lists: Sequence[Sequence[torch.Tensor]],
    stats: tuple[str, ...],
    workspace: Workspace | None = None,
    hist: HistSpec | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor | None, list[bool]]]:
    """`segment_table` of several lists (a Tracker step's groups) at once: each list is copied
    and reduced on its own (the flat buffer is reused), and the statistics of all of them are
    derived from their partials by one set of small kernels.

    Example:
        >>> [t[:, 0].tolist() for t, _, _ in segment_tables([[torch.ones(2)], [torch.zeros(3)]], ("numel",))]
        [[2.0], [3.0]]
    """
    lists = [list(ts) for ts in lists]
    k = len(stats)
    red = _segment_rows(lists, stats, workspace, hist)
    if red is None:
        return [(torch.zeros((0, k + 1), dtype=torch.float64), None, []) for _ in lists]
    table = pr.probe_table(red.rows, red.eps, stats)  # one set of small kernels for every list
    dev = table.device
    out = []
    per_list = zip(table.split(red.sizes), red.layouts, red.hists, red.sampled, strict=True)
    for part, lay, h_list, was in per_list:
        if lay is None:
            out.append((torch.zeros((0, k + 1), dtype=torch.float64), None, []))
            continue
        h = None
        if hist is not None:
            h_rows = torch.cat(h_list) if h_list else _nan(0, 2 + hist.bins, dev)
            # an empty tensor's histogram: no counts over the nominal range [0, 1]
            h = reorder(h_rows, lay, [0.0, 1.0] + [0.0] * hist.bins)
        out.append((reorder(part, lay, _empty_row(stats)), h, was))
    return out


def segment_partials(
    tensors: Sequence[torch.Tensor], stats: tuple[str, ...], workspace: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial rows ``[n, WIDTH]`` (`nnstat.describe.partials`, the columns `stats` need) of
    non-empty-list `tensors` on their device and each one's epsilon ``[n]``: the torch-segment
    backend of `nnstat.describe.core.partial_table`. No host read.

    Example:
        >>> rows, eps = segment_partials([torch.tensor([1.0, 2.0, 3.0, 6.0])], ("var",))
        >>> pr.finish(rows, ("var",), eps).tolist()
        [[3.5]]
    """
    red = _segment_rows([list(tensors)], stats, workspace, None)
    assert red is not None and red.layouts[0] is not None
    both = torch.cat([red.rows, red.eps[:, None]], dim=1)
    both = reorder(both, red.layouts[0], _EMPTY_PARTIAL)
    return both[:, :-1], both[:, -1]


#: An empty tensor's partial row and epsilon (`reorder`'s filler in `segment_partials`).
_EMPTY_PARTIAL = pr.exact_row(torch.zeros(0)).tolist() + [1.0]


@dataclass
class _Reduced:
    """`_segment_rows`' result: the partial rows and epsilons of every non-empty tensor of the
    lists (grouped order, on the first tensor's device) and, per list, their number, its layout
    (None: an empty list), its groups' histogram rows and which tensors were subsampled."""

    rows: torch.Tensor
    eps: torch.Tensor
    sizes: list[int]
    layouts: list[Layout | None]
    hists: list[list[torch.Tensor]]
    sampled: list[list[bool]]


def _segment_rows(
    lists: list[list[torch.Tensor]],
    stats: tuple[str, ...],
    workspace: Workspace | None,
    hist: HistSpec | None,
) -> _Reduced | None:
    """The partials of every list of `lists` as `_Reduced` (None: every list is empty)."""
    live = [ts for ts in lists if ts]
    if not live:
        return None
    dev = live[0][0].device
    norm_path = (
        hist is None
        and not set(stats) - pr.NORM_STATS
        and (_norm_kernels(dev) or triton_rows.available(dev))
    )
    if norm_path:
        needs = frozenset(s for s in ("abs_max", "l1") if s in stats or _derived(s, stats))
    else:
        needs = _needs(stats, hist is not None)
    ws = workspace or Workspace()
    layouts = [layout_of(ts, workspace) if ts else None for ts in lists]
    parts, hists, sizes, sampled = [], [], [], []
    with torch.no_grad():
        for ts, lay in zip(lists, layouts, strict=True):
            was = [False] * len(ts)
            h_list = []
            m = 0
            for g in lay.groups if lay is not None else []:
                m += len(g.positions)
                if norm_path:
                    parts.append(_partials(g, ts, _triton_norm_partials, _norm_partials, needs))
                    continue
                p, h = _partials(g, ts, _triton_moment_partials, _moment_partials, needs, ws, hist)
                parts.append(p.to(dev))
                if h is not None:
                    h_list.append(h.to(dev))
                    for i, w in zip(g.positions, g.samples(hist.max_elements)[2], strict=True):
                        was[i] = w
            sizes.append(m)
            hists.append(h_list)
            sampled.append(was if hist is not None else [])
        if not parts:  # only empty tensors: their rows are filled in by `reorder`
            rows, eps = _nan(0, pr.WIDTH, dev), _nan(0, 1, dev)[:, 0]
        elif norm_path:
            rows = norm_rows(torch.cat(parts, dim=1), needs)
            eps = rows[:, pr.N]  # unused: the norm statistics have no constant rule
        else:
            rows, eps = moment_rows(torch.cat(parts, dim=1), needs)
    return _Reduced(rows, eps, sizes, layouts, hists, sampled)


def _partials(g: Group, ts: Sequence[torch.Tensor], triton: Any, plain: Any, *args: Any) -> Any:
    """A group's partials by the fused kernels where they serve it, else (also when they fail on
    first use: `triton_rows.fall_back` warns once) by torch's."""
    if g.triton():
        try:  # the kernels read the tensors where they are: no views to make
            return triton(g, [ts[i] for i in g.positions], *args)
        except Exception as error:  # noqa: BLE001 (re-raised unless the kernels never ran)
            if not triton_rows.fall_back(error):
                raise
    return plain(g, [ts[i].detach().reshape(-1) for i in g.positions], *args)


def _nan(rows: int, cols: int, dev: torch.device) -> torch.Tensor:
    return torch.full((rows, cols), math.nan, dtype=torch.float64, device=dev)


def _derived(stat: str, stats: tuple[str, ...]) -> bool:
    return stat == "l1" and "abs_mean" in stats


def _needs(stats: tuple[str, ...], hist: bool) -> frozenset[str]:
    """Which partials the moment path computes for `stats`."""
    s = set(stats)
    need = set()
    if s & {"var", "std", "skew", "kurtosis"}:
        need.add("pass_b")
    if "skew" in s:
        need.add("s3")
    if "kurtosis" in s:
        need.add("s4")
    if s & {"min", "max", "abs_max"} or "pass_b" in need or hist:
        need.add("minmax")
    if s & {"l1", "abs_mean"}:
        need.add("l1")
    if "sparsity" in s:
        need.add("nnz")
    if "pass_b" not in need:
        need.add("sq")  # l2 (the probe) from sums of squares; with the moments, from m2
    return frozenset(need)


def _norm_partials(g: Group, views: list[torch.Tensor], needs: frozenset[str]) -> torch.Tensor:
    """``[2 + len(needs), m]`` float64: counts, l2 (and abs_max, l1) of each tensor of a group,
    from the multi-tensor norm kernels (one launch per kind for the whole group)."""
    if not g.dtype.is_floating_point:
        flat = torch.cat(views).to(torch.float32)
        views = list(flat.split(g.numels))
    # float64 accumulation and result, read in the tensors' own dtype (no copy on accelerators)
    ords = [2.0] + [math.inf if s == "abs_max" else 1.0 for s in ("abs_max", "l1") if s in needs]
    rows = torch.stack(
        [torch.stack(torch._foreach_norm(views, o, dtype=torch.float64)) for o in ords]
    )
    return torch.cat([g.n.unsqueeze(0), rows])


def _norm_kernels(device: torch.device) -> bool:
    """Whether sums of powers come from norm kernels: on accelerators, whose reductions are
    trees (float32 sums of d^2 and d^4 within ~2e-7 of float64), norm statistics from the
    multi-tensor kernels and power sums from row-wise 2- and 4-norms (fewest passes, no second
    buffer). On CPU torch's norm kernels accumulate sequentially (~1e-6 off on a few thousand
    elements, ~1e-5 on 20k; asked for float64, the multi-tensor one copies every tensor first,
    10x slower): there the flat pass forms the powers and adds them with pairwise `sum`."""
    return device.type != "cpu"


def _norm_rows(x2: torch.Tensor, p: int) -> torch.Tensor:
    """Row sums of ``|x|^p`` from the row-wise p-norm (one read, no power written)."""
    return torch.linalg.vector_norm(x2, p, dim=1).pow_(p)


def _segment(g: Group, partials: torch.Tensor, reduce: str) -> torch.Tensor:
    """``[k, R]`` row partials reduced per tensor to ``[k, m]`` float64 (one kernel)."""
    k = partials.shape[0]
    out = torch.segment_reduce(
        partials.to(torch.float64).reshape(-1), reduce, lengths=g.lengths(k), unsafe=True
    )
    return out.view(k, len(g.numels))


def _extrema(
    g: Group, lo_rows: torch.Tensor, hi_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tensor's min and max from its rows' (one segment reduction for both)."""
    mm = _segment(g, torch.stack([lo_rows, hi_rows.neg()]), "min")
    return mm[0], mm[1].neg()


def _hist_rows(
    g: Group,
    samples: torch.Tensor,
    seg: torch.Tensor,
    lo: torch.Tensor,
    hi: torch.Tensor,
    hist: HistSpec,
) -> torch.Tensor:
    """``[m, 2 + bins]`` rows ``[lo, hi, counts...]`` of the group's histogram samples (their
    tensor in `seg`) over each tensor's range."""
    rlo, rhi = hist_ranges(lo, hi)
    counts = bin_flat(samples, seg, rlo, rhi, hist.bins, len(g.numels))
    return torch.cat([torch.stack([rlo, rhi], dim=1), counts], dim=1)


def _moment_partials(
    g: Group,
    views: list[torch.Tensor],
    needs: frozenset[str],
    ws: Workspace,
    hist: HistSpec | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Partials ``[K, m]`` float64 of one group (rows in `_columns`' order) and its histogram
    rows ``[m, 2 + bins]`` (or None), from one copy into the flat buffer."""
    r = g.rows()
    b, n_rows = r["block"], r["count"]
    size = n_rows * b
    # accelerators: power sums by norm kernels reading d where it is; on CPU the powers are
    # formed in a second half of the buffer and added up by `sum` (see `_norm_kernels`)
    fewer = _norm_kernels(g.device)
    buf = ws.flat(size if fewer else 2 * size, g.work, g.device)
    x, x2 = buf[:size], buf[:size].view(n_rows, b)
    t2 = None if fewer else buf[size:].view(n_rows, b)
    inputs = [t for v, pad in zip(views, r["pads"], strict=True) for t in (v, pad) if t.numel()]
    torch.cat(inputs, out=x)  # pads are zeros: neutral for sums, norms and non-zero counts
    a_rows = [x2.sum(1)]
    if "sq" in needs:
        sq = _norm_rows(x2, 2) if t2 is None else torch.mul(x2, x2, out=t2).sum(1)
        a_rows.append(sq)
    if "l1" in needs:
        a_rows.append(torch.linalg.vector_norm(x2, 1, dim=1))
    if "nnz" in needs:
        a_rows.append(torch.linalg.vector_norm(x2, 0, dim=1))
    out = [g.n.unsqueeze(0), _segment(g, torch.stack(a_rows), "sum")]
    lo = hi = None
    has_pads = r["pad_idx"].numel() > 0
    if "minmax" in needs:
        if has_pads:  # pads take their tensor's first element: neutral for min and max
            x.index_copy_(0, r["pad_idx"], x.index_select(0, r["pad_src"]))
        if g.device.type == "cpu":  # CPU's row-wise aminmax is ~3x slower than amin + amax
            lo_r, hi_r = x2.amin(1), x2.amax(1)
        else:
            lo_r, hi_r = torch.aminmax(x2, dim=1)
        lo, hi = _extrema(g, lo_r, hi_r)
        out.append(torch.stack([lo, hi]))
    h = None
    if hist is not None:
        assert lo is not None and hi is not None
        idx, seg, _ = g.samples(hist.max_elements)
        h = _hist_rows(g, x.index_select(0, idx), seg, lo, hi, hist)
    if "pass_b" in needs:
        assert lo is not None and hi is not None
        c64, scale = centre_scale(out[1][0], g.n, lo, hi, g.work)
        c = c64.to(g.work)
        if has_pads:  # pads take their centre: zero deviation
            x.index_copy_(0, r["pad_idx"], c.index_select(0, r["pad_seg"]))
        per_row = (
            torch.stack([(c64 * scale).neg_(), scale]).to(g.work).index_select(1, r["row_seg"])
        )
        # d = (x - c) * s in place: x * s and c * s are exact (s is a power of two)
        torch.addcmul(per_row[0].unsqueeze(1), x2, per_row[1].unsqueeze(1), out=x2)
        # powers formed in the buffer's two halves and added up by `sum` (torch's CPU 2- and
        # 4-norm kernels were up to ~1e-6 off; sums are pairwise on CPU, trees on GPUs)
        if t2 is None:  # 5 passes over d instead of 9: 2- and 4-norms, then d^3 in place
            b_rows = [x2.sum(1), _norm_rows(x2, 2)]
            s4 = _norm_rows(x2, 4) if "s4" in needs else None
            if "s3" in needs:
                b_rows.append(x2.pow_(3).sum(1))  # d is not needed any more
            if s4 is not None:
                b_rows.append(s4)
        else:
            d2 = torch.mul(x2, x2, out=t2)
            b_rows = [x2.sum(1), d2.sum(1)]
            if "s3" in needs:
                b_rows.append(torch.mul(d2, x2, out=x2).sum(1))  # d is not needed any more
            if "s4" in needs:
                b_rows.append(d2.square_().sum(1))
        sums = _segment(g, torch.stack(b_rows), "sum")
        out += [torch.stack([c64, scale]), sums]
    return torch.cat([*out, g.eps_row]), h


def _triton_norm_partials(
    g: Group, views: list[torch.Tensor], needs: frozenset[str]
) -> torch.Tensor:
    """`_norm_partials` from ONE read of the group (`triton_rows.pass_a`), not one per norm."""
    a = triton_rows.pass_a(g.table(), triton_rows.bind(views), moments=False)
    keep = [1] + ([2] if "l1" in needs else [])  # sums of squares (and of |x|)
    sums = _segment(g, torch.stack([a[i] for i in keep]), "sum")
    rows = [g.n, sums[0].sqrt()]
    if "abs_max" in needs:
        rows.append(_segment(g, a[5:6], "max")[0])
    if "l1" in needs:
        rows.append(sums[1])
    return torch.stack(rows)


def _triton_moment_partials(
    g: Group,
    views: list[torch.Tensor],
    needs: frozenset[str],
    ws: Workspace,
    hist: HistSpec | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_moment_partials` (same rows) from two reads of the group where it lies (the fused
    row kernels of `triton_rows`): no flat copy, no pad fix-ups, no power written."""
    tab, bound = g.table(), triton_rows.bind(views)  # addresses copied once for every pass
    a = triton_rows.pass_a(tab, bound)
    # rows picked by views and stacked: a list index would copy the index to the device (a sync)
    sel = [0] + [i for i, k in ((1, "sq"), (2, "l1"), (3, "nnz")) if k in needs]
    out = [g.n.unsqueeze(0), _segment(g, torch.stack([a[i] for i in sel]), "sum")]
    lo = hi = None
    if "minmax" in needs:
        lo, hi = _extrema(g, a[4], a[5])
        out.append(torch.stack([lo, hi]))
    h = None
    if hist is not None:
        assert lo is not None and hi is not None
        idx, seg, _ = g.samples(hist.max_elements)
        h = _hist_rows(g, triton_rows.gather(tab, bound, idx, g.work), seg, lo, hi, hist)
    if "pass_b" in needs:
        assert lo is not None and hi is not None
        c64, scale = centre_scale(out[1][0], g.n, lo, hi, g.work)
        neg_cs = (c64 * scale).neg_().to(g.work)
        b = triton_rows.pass_b(tab, bound, neg_cs, scale.to(g.work))
        keep = [0, 1] + [i for i, k in ((2, "s3"), (3, "s4")) if k in needs]
        out += [torch.stack([c64, scale]), _segment(g, torch.stack([b[i] for i in keep]), "sum")]
    return torch.cat([*out, g.eps_row]), h


def _empty_row(stats: tuple[str, ...]) -> list[float]:
    """An empty tensor's statistics (as the CPU path gives them): zero count and norms, NaN
    for the rest; its probe is finite (nothing to repair)."""
    zero = {"numel", "l1", "l2", "nonfinite"}
    return [0.0 if s in zero else math.nan for s in stats] + [0.0]
