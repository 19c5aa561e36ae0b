"""``nnstat influence STORE --query QUERY_STORE --top-k 10 --out scores.parquet``.

Scores every query row of ``QUERY_STORE`` against the training store ``STORE`` and writes a long
table (``.parquet`` or ``.csv``): with ``--top-k`` the k most helpful and most harmful training
ids per query (``test_id, kind, rank, train_id, score``), otherwise every pair
(``test_id, train_id, score``). ``--self`` writes the self-influence of ``STORE``'s rows instead.

Example:
    >>> main(["--help"])  # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from .precondition import PRECONDITIONERS
from .score import MODES, compute_influence_all, compute_self_influence


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nnstat influence",
        description="Score a query gradient store against a training gradient store.",
    )
    p.add_argument("store", help="training gradient store directory")
    p.add_argument("--query", help="query gradient store directory (same projection)")
    p.add_argument("--top-k", type=int, default=None, help="keep only k helpful + k harmful")
    p.add_argument("--out", default=None, help="output file (.parquet or .csv)")
    p.add_argument("--mode", choices=MODES, default="dot")
    p.add_argument("--preconditioner", choices=PRECONDITIONERS, default=None)
    p.add_argument("--damping", type=float, default=None, help="default: 0.1 x mean eigenvalue")
    p.add_argument("--batch-size", type=int, default=None, help="rows per block (default: ~16 MB)")
    p.add_argument(
        "--self",
        dest="self_influence",
        action="store_true",
        help="self-influence of the rows of STORE (no --query)",
    )
    return p


def _write(frame: pd.DataFrame, out: str | None) -> None:
    if out is None:
        print(frame.to_string(index=False))
        return
    path = Path(out)
    # ids may be ints or strings: keep them as text so one column has one type on disk
    for col in ("test_id", "train_id", "id"):
        if col in frame and frame[col].map(type).nunique() > 1:
            frame[col] = frame[col].astype(str)
    if path.suffix == ".parquet":
        frame.to_parquet(path, index=False)
    elif path.suffix == ".csv":
        frame.to_csv(path, index=False)
    else:
        raise SystemExit(f"nnstat influence: --out must end in .parquet or .csv, got {out!r}")
    print(f"wrote {len(frame)} rows to {path}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the ``nnstat influence`` command; returns the exit status.

    Example:
        >>> main(["/no/such/store", "--query", "/no/such/query"])  # doctest: +SKIP
    """
    args = _parser().parse_args(argv)
    for path in (args.store, args.query):
        if path is not None and not Path(path).is_dir():
            print(f"nnstat influence: no gradient store at {path}", file=sys.stderr)
            return 2
    if args.self_influence:
        if args.query is not None:
            print("nnstat influence: --self takes no --query", file=sys.stderr)
            return 2
        res = compute_self_influence(
            args.store,
            preconditioner=args.preconditioner,
            damping=args.damping,
            batch_size=args.batch_size,
        )
        _write(res.to_frame(), args.out)
        return 0
    if args.query is None:
        print("nnstat influence: --query is required (or --self)", file=sys.stderr)
        return 2
    res = compute_influence_all(
        args.query,
        args.store,
        mode=args.mode,
        preconditioner=args.preconditioner,
        damping=args.damping,
        top_k=args.top_k,
        batch_size=args.batch_size,
    )
    _write(res.to_frame(), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
