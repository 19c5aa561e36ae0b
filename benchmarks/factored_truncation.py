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

    .venv/bin/python benchmarks/factored_truncation.py --factors 2,4 --per-module
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import influence_quality as iq
import numpy as np
import torch
from _lm_task import add_arguments

from nnstat.influence import as_source, run_lds_protocol
from nnstat.influence.precondition import KronFactor, Preconditioner
from nnstat.influence.row_layout import ModuleSpec
from nnstat.store.factored import worth_factoring


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
    c: int,
    only: set[str] | None = None,
    kfac: Preconditioner | None = None,
) -> torch.Tensor:
    """``rows`` with the factored modules (of ``only``, when given) truncated to rank ``c``:
    plainly, or in the K-FAC metric of ``kfac`` when given."""
    out = rows.clone()
    dampings = None if kfac is None else kfac.module_dampings(None)
    for m in layout:
        if not m.kronecker or not worth_factoring(c, m.r_out, m.r_in):
            continue
        if only is not None and m.name not in only:
            continue
        cols = slice(m.offset, m.offset + m.width)
        g = rows[:, cols].reshape(-1, m.r_out, m.r_in)
        if kfac is None:
            out[:, cols] = rank_c(g, c).reshape(len(rows), -1)
        else:
            factor = kfac.factors[m.name]
            assert isinstance(factor, KronFactor)
            t = whitened_rank_c(g, c, factor, dampings[m.name])
            out[:, cols] = t.reshape(len(rows), -1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=64, help="projection rank of the dense store")
    ap.add_argument("--factors", default="2,4", help="ranks c to truncate to")
    ap.add_argument("--per-module", action="store_true", help="also one module at a time")
    ap.add_argument("--m", type=int, default=50, help="LDS subsets")
    ap.add_argument("--n-query", type=int, default=40)
    ap.add_argument("--threads", type=int, default=1)
    add_arguments(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for key, value in {**iq.TASK_DEFAULTS["*"], **iq.TASK_DEFAULTS["lm"]}.items():
        setattr(args, key, value)
    task = iq.make_task("lm", args)
    torch.manual_seed(0)  # as influence_quality.bench_setting
    train_fn = iq.trainer(task, "adam+lbfgs", args)
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
        pres = {k: Preconditioner.fit(source, k) for k in ("identity", "kfac", "ekfac")}
    queries = {k: p.apply(log.rows, damping=None).double() for k, p in pres.items()}
    names = [m.name for m in layout if m.kronecker]
    variants: list[tuple[str, int | None, set[str] | None, bool]] = [("dense", None, None, False)]
    for c in (int(v) for v in args.factors.split(",")):
        variants += [(f"c = {c}", c, None, False), (f"c = {c}, K-FAC metric", c, None, True)]
        if args.per_module:
            variants += [(f"c = {c}, {nm} only", c, {nm}, False) for nm in names]
    print("\n| training rows | identity | K-FAC | EK-FAC |\n| --- | ---: | ---: | ---: |")
    for label, c, only, whiten in variants:
        rows = train_rows
        if c is not None:
            rows = truncate(train_rows, layout, c, only, pres["kfac"] if whiten else None)
        cells = []
        for q in queries.values():
            lds, sem, _ = iq.lds_summary((q @ rows.T).float(), proto)
            cells.append(f"{lds:.3f} ± {sem:.3f}")
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
