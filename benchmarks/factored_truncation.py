"""Where factored rows lose LDS: a dense store's training rows truncated module by module.

The transformer task of `influence_quality.py` (`_lm_task.py`, same flags, same training and the
same retraining protocol, so its LDS match that script's): the scored model is logged once as a
dense rank-``--rank`` store; its training rows are then truncated offline to rank ``c`` per
module, either as the store's factored rows are (the best rank-``c`` approximation of each
``r_out × r_in`` block, ``nnstat.store.factored``) or in the K-FAC metric (the best rank-``c``
approximation of ``S^{-1/2} G A^{-1/2}``, ``S`` and ``A`` the module's K-FAC factors in the logged
space with the damping split between them, mapped back: the same number of factor pairs). The
queries stay exact and the preconditioners (identity, K-FAC from the statistics, EK-FAC) are fitted
on the dense store, so every difference from the dense row is the truncation's. Modules the store
keeps dense under ``factors=c`` (``worth_factoring``) stay dense here too.

Per-module counts (what ``factors={module: c}`` stores): ``--alloc`` takes hand-made mappings
(``'*=1,tok=6,pos=6,head=6'``), ``--budgets`` bytes per row that an energy-greedy allocation
fills (one pair per module, then the pair with the most mean kept energy per added column;
energy measured on the first ``--energy-rows`` rows, the logger's first block, and on all), and
``--keep`` the fewest pairs keeping a mean energy per module. Every row prints its bytes per
row and, besides each LDS (mean ± s.e. over the queries), its paired difference to the dense
rows (mean ± s.e. over the queries of the per-query difference: the same retrainings and
queries, so far less noisy than either LDS). ``--task mlp|cnn`` runs the digits tasks
(L-BFGS, as ``influence_quality.py --train lbfgs``).

    .venv/bin/python benchmarks/factored_truncation.py --factors 2,4 --per-module
    .venv/bin/python benchmarks/factored_truncation.py --lm-d 128 --lm-mlp 256 --factors 4 \
        --alloc '*=1,tok=6,pos=6,head=6' --budgets 10944
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import influence_quality as iq
import numpy as np
import torch
from _lm_task import add_arguments

from nnstat.influence import as_source, run_lds_protocol
from nnstat.influence.lds import lds_per_query
from nnstat.influence.precondition import KronFactor, Preconditioner, fit_from_rows
from nnstat.influence.row_layout import ModuleSpec
from nnstat.influence.sources import TensorSource
from nnstat.store.factored import factored_width, worth_factoring


def rank_c(g: torch.Tensor, c: int) -> torch.Tensor:
    """Best rank-``c`` approximation of each ``[r_out, r_in]`` matrix of ``g`` (Eckart-Young)."""
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    return (u[..., :c] * s[..., None, :c]) @ vh[..., :c, :]


def whitened_rank_c(g: torch.Tensor, c: int, factor: KronFactor, damping: float) -> torch.Tensor:
    """Best rank-``c`` approximation of ``g`` in the K-FAC metric: ``S`` and ``A`` (eigenvalues
    ``s``, ``a``: ``factor.eig`` is their outer product) damped by ``√λ·π`` and ``√λ/π``,
    ``π = √(mean s / mean a)`` (Martens & Grosse's split of one damping between two factors)."""
    eig = factor.eig.double()
    u, sv, vh = torch.linalg.svd(eig)  # rank one
    s, a = (u[:, 0] * sv[0].sqrt()).abs(), (vh[0] * sv[0].sqrt()).abs()
    q_out = torch.eye(len(s), dtype=g.dtype) if factor.q_out is None else factor.q_out.to(g)
    q_in = torch.eye(len(a), dtype=g.dtype) if factor.q_in is None else factor.q_in.to(g)
    pi = (s.mean() / a.mean()).sqrt()
    ds = (s + damping**0.5 * pi).sqrt()[:, None]
    da = (a + damping**0.5 / pi).sqrt()[None, :]
    w = rank_c(q_out.T @ g @ q_in / ds / da, c) * ds * da
    return q_out @ w @ q_in.T


def truncate(
    rows: torch.Tensor,
    layout: list[ModuleSpec],
    c: int | Mapping[str, int | None],
    only: set[str] | None = None,
    kfac: Preconditioner | None = None,
) -> torch.Tensor:
    """``rows`` with the factored modules (of ``only``, when given) truncated to rank ``c`` (one
    count, or one per module name: ``None`` or a missing name keeps the module dense): plainly,
    or in the K-FAC metric of ``kfac`` when given."""
    out = rows.clone()
    dampings = None if kfac is None else kfac.module_dampings(None)
    for m in layout:
        cm = c.get(m.name) if isinstance(c, Mapping) else c
        if not m.kronecker or not worth_factoring(cm, m.r_out, m.r_in):
            continue
        if only is not None and m.name not in only:
            continue
        assert cm is not None
        cols = slice(m.offset, m.offset + m.width)
        g = rows[:, cols].reshape(-1, m.r_out, m.r_in)
        if kfac is None:
            out[:, cols] = rank_c(g, cm).reshape(len(rows), -1)
        else:
            factor = kfac.factors[m.name]
            assert isinstance(factor, KronFactor)
            t = whitened_rank_c(g, cm, factor, dampings[m.name])
            out[:, cols] = t.reshape(len(rows), -1)
    return out


def stored_columns(layout: list[ModuleSpec], c: int | Mapping[str, int | None] | None) -> int:
    """Columns of one stored row under ``c`` (as :func:`truncate` takes it): factored width
    where :func:`worth_factoring`, the dense width elsewhere."""
    total = 0
    for m in layout:
        cm = c.get(m.name) if isinstance(c, Mapping) else c
        if m.kronecker and worth_factoring(cm, m.r_out, m.r_in):
            total += factored_width(int(cm), m.r_out, m.r_in)  # type: ignore[arg-type]
        else:
            total += m.width
    return total


def energy_curves(rows: torch.Tensor, layout: list[ModuleSpec]) -> dict[str, np.ndarray]:
    """Per Kronecker module, the mean over ``rows`` of the fraction of ``‖G‖²_F`` the best
    rank-``c`` approximation keeps, for ``c = 0 .. min(r_out, r_in)``."""
    out = {}
    for m in layout:
        if not m.kronecker:
            continue
        g = rows[:, m.offset : m.stop].reshape(-1, m.r_out, m.r_in)
        sq = torch.linalg.svdvals(g).square()
        total = sq.sum(1, keepdim=True)
        frac = torch.where(total > 0, sq / torch.where(total > 0, total, 1.0), 0.0)
        kept = torch.cat([torch.zeros(len(g), 1, dtype=frac.dtype), frac.cumsum(1)], 1)
        kept[(total == 0).squeeze(1)] = 1.0
        out[m.name] = kept.mean(0).numpy()
    return out


def greedy_allocation(
    layout: list[ModuleSpec], curves: Mapping[str, np.ndarray], budget: int
) -> dict[str, int | None]:
    """Factor pairs per module within ``budget`` stored columns: from one pair each, add the
    pair (or switch to the dense row) with the most mean kept energy per added column."""
    alloc: dict[str, int | None] = {m.name: 1 for m in layout if m.name in curves}
    specs = {m.name: m for m in layout}
    while True:
        used = stored_columns(layout, alloc)
        best, best_gain = None, 0.0
        for name, cm in alloc.items():
            m = specs[name]
            if cm is None:
                continue
            nxt: int | None = cm + 1
            if not worth_factoring(nxt, m.r_out, m.r_in):
                nxt = None  # one more pair costs at least the dense row: store it dense
            trial = {**alloc, name: nxt}
            cost = stored_columns(layout, trial) - used
            gain = (1.0 if nxt is None else curves[name][nxt]) - curves[name][cm]
            if used + cost <= budget and cost > 0 and gain / cost > best_gain:
                best, best_gain = (name, nxt), gain / cost
        if best is None:
            return alloc
        alloc[best[0]] = best[1]


def threshold_allocation(
    layout: list[ModuleSpec], curves: Mapping[str, np.ndarray], keep: float
) -> dict[str, int | None]:
    """The fewest factor pairs per module keeping a mean ``keep`` of its energy (dense where
    that many pairs are no narrower than the dense row)."""
    out: dict[str, int | None] = {}
    for m in layout:
        if m.name not in curves:
            continue
        cm = int(np.argmax(curves[m.name] >= keep - 1e-12)) or 1
        out[m.name] = cm if worth_factoring(cm, m.r_out, m.r_in) else None
    return out


def parse_allocation(spec: str, layout: list[ModuleSpec]) -> dict[str, int | None]:
    """``name=c,...`` (``*``: every other Kronecker module; ``c`` or ``dense``) as a mapping."""
    pairs = dict(p.split("=") for p in spec.split(","))
    names = {m.name for m in layout if m.kronecker}
    unknown = set(pairs) - names - {"*"}
    if unknown:
        raise ValueError(f"--alloc {spec!r}: no module {sorted(unknown)}; modules: {sorted(names)}")
    out: dict[str, int | None] = {}
    for name in names:
        v = pairs.get(name, pairs.get("*", "dense"))
        out[name] = None if v == "dense" else int(v)
    return out


def refit(
    pres: Mapping[str, Preconditioner], rows: torch.Tensor, layout: list[ModuleSpec]
) -> dict[str, Preconditioner]:
    """``pres`` as a store of ``rows`` fits them: identity and K-FAC (from the statistics) as
    they are; ``raw`` and EK-FAC's eigenvalue corrections (where the statistics do not hold
    them, e.g. a projected module) refitted on ``rows``, as ``Preconditioner.fit`` does on a
    factored store's (densified) rows."""
    source = TensorSource(rows.float(), layout=layout)
    out = {k: p for k, p in pres.items() if k in ("identity", "kfac")}
    if "raw" in pres:
        out["raw"] = Preconditioner("raw", layout, fit_from_rows(source, layout, {}, 4096))
    ekfac = pres["ekfac"]
    factors = {n: f for n, f in ekfac.factors.items() if ekfac.origin.get(n) == "statistics"}
    todo = {n: pres["kfac"].factors[n] for n, o in ekfac.origin.items() if o == "statistics+rows"}
    dense = [m for m in layout if not m.kronecker]
    factors.update(fit_from_rows(source, dense, todo, 4096))  # type: ignore[arg-type]
    out["ekfac"] = Preconditioner("ekfac", layout, factors)
    out["ekfac"].origin = dict(ekfac.origin)
    return {k: out[k] for k in pres}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", choices=["lm", "mlp", "cnn"], default="lm")
    ap.add_argument("--rank", type=int, default=64, help="projection rank of the dense store")
    ap.add_argument("--factors", default="2,4", help="ranks c to truncate to")
    ap.add_argument("--per-module", action="store_true", help="also one module at a time")
    ap.add_argument(
        "--alloc", nargs="*", default=[], help="per-module counts, e.g. '*=2,head=8' ('dense')"
    )
    ap.add_argument(
        "--budgets", default="", help="bytes per row: energy-greedy allocations within each"
    )
    ap.add_argument("--keep", default="", help="energies: the fewest pairs keeping each")
    ap.add_argument("--energy-rows", type=int, default=32, help="rows the energy is measured on")
    ap.add_argument("--no-kfac-metric", action="store_true", help="skip the K-FAC-metric rows")
    ap.add_argument("--raw", action="store_true", help="also raw (refitted per row set)")
    ap.add_argument("--m", type=int, default=50, help="LDS subsets")
    ap.add_argument("--n-query", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=24, help="mlp: hidden width")
    ap.add_argument("--threads", type=int, default=1)
    add_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for key, value in {**iq.TASK_DEFAULTS["*"], **iq.TASK_DEFAULTS.get(args.task, {})}.items():
        setattr(args, key, value)
    task = iq.make_task(args.task, args)
    torch.manual_seed(0)  # as influence_quality.bench_setting
    train_fn = iq.trainer(task, "adam+lbfgs" if args.task == "lm" else "lbfgs", args)
    n = len(task.train[0])
    model = train_fn(torch.arange(n))

    def query_losses(m):
        return task.loss(m(task.query[0]), task.query[1], reduction="none")

    t = time.perf_counter()
    proto = run_lds_protocol(train_fn, n, query_losses, m=args.m, seed=1)
    print(f"{task.describe}; LDS protocol {time.perf_counter() - t:.0f} s (m = {args.m})")
    with tempfile.TemporaryDirectory() as d:
        log, loader = iq.nnstat_logs(
            model, task.train, task.query, Path(d), "dense", args.rank, "random", task.loss
        )
        source = as_source(loader)
        ids, blocks = [], []
        for block_ids, rows in source.iter_blocks(4096):
            ids += list(block_ids)
            blocks.append(rows)
        order = torch.as_tensor(np.argsort([int(i) for i in ids]))
        train_rows = torch.cat(blocks)[order].double()
        layout = list(source.layout)
        kinds = ("identity", "raw", "kfac", "ekfac") if args.raw else ("identity", "kfac", "ekfac")
        pres = {k: Preconditioner.fit(source, k) for k in kinds}
    names = [m.name for m in layout if m.kronecker]
    print("modules (r_out x r_in):", ", ".join(f"{m.name} {m.r_out}x{m.r_in}" for m in layout))
    Alloc = int | dict[str, int | None] | None
    variants: list[tuple[str, Alloc, set[str] | None, bool]] = [("dense", None, None, False)]
    for c in (int(v) for v in args.factors.split(",") if v):
        variants.append((f"c = {c}", c, None, False))
        if not args.no_kfac_metric:
            variants.append((f"c = {c}, K-FAC metric", c, None, True))
        if args.per_module:
            variants += [(f"c = {c}, {nm} only", c, {nm}, False) for nm in names]
    for spec in args.alloc:
        variants.append((spec, parse_allocation(spec, layout), None, False))
    first = train_rows[: args.energy_rows]  # the first block the logger would see
    curves = {"first": energy_curves(first, layout), "all": energy_curves(train_rows, layout)}
    for budget in (int(v) for v in args.budgets.split(",") if v):
        for which, curve in curves.items():
            alloc = greedy_allocation(layout, curve, budget // 4)
            variants.append((f"energy-greedy ≤ {budget:,} B ({which} rows)", alloc, None, False))
    for keep in (float(v) for v in args.keep.split(",") if v):
        alloc = threshold_allocation(layout, curves["first"], keep)
        variants.append((f"energy ≥ {keep} per module (first rows)", alloc, None, False))

    dense_cols = stored_columns(layout, None)
    base = {}
    heads = [
        {"identity": "identity", "raw": "raw", "kfac": "K-FAC", "ekfac": "EK-FAC"}[k] for k in pres
    ]
    print(
        "\n| training rows | factors per module | bytes per row | vs dense | "
        + " | ".join(heads + [f"Δ {h}" for h in heads])
        + " |\n| --- | --- |"
        + " ---: |" * (2 + 2 * len(heads))
    )
    for label, c, only, whiten in variants:
        rows = train_rows
        if c is not None:
            rows = truncate(train_rows, layout, c, only, pres["kfac"] if whiten else None)
        cols = stored_columns(layout, c if only is None else {nm: c for nm in only})
        if isinstance(c, dict):
            per = " ".join(f"{nm} {'dense' if c.get(nm) is None else c[nm]}" for nm in names)
        else:
            per = "dense" if c is None else f"all {c}"
        cells, deltas = [], []
        fitted = pres if c is None else refit(pres, rows, layout)
        for k, p in fitted.items():
            q = p.apply(log.rows, damping=None).double()
            scores = (q @ rows.T).float()
            lds, sem, _ = iq.lds_summary(scores, proto)
            per_q = lds_per_query(scores, proto.subset_masks, proto.subset_losses)
            cells.append(f"{lds:.3f} ± {sem:.3f}")
            if c is None:
                base[k] = per_q
            d = per_q - base[k]
            d = d[~np.isnan(d)]
            deltas.append(f"{d.mean():+.4f} ± {d.std(ddof=1) / np.sqrt(len(d)):.4f}")
        print(
            f"| {label} | {per} | {cols * 4:,} | {dense_cols / cols:.2f}× fewer | "
            + " | ".join(cells + deltas)
            + " |",
            flush=True,
        )


if __name__ == "__main__":
    main()
