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
import math
import sys
from pathlib import Path

import pandas as pd

from nnstat.store.files import META_FILE

from .precondition import PRECONDITIONERS
from .score import MODES, compute_influence_all, compute_self_influence

OUT_SUFFIXES = (".parquet", ".csv")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _damping(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="nnstat influence",
        description="Score a query gradient store against a training gradient store.",
    )
    p.add_argument("store", help="training gradient store directory")
    p.add_argument("--query", help="query gradient store directory (same projection)")
    p.add_argument(
        "--top-k", type=_positive_int, default=None, help="keep only k helpful + k harmful"
    )
    p.add_argument("--out", default=None, help="output file (.parquet or .csv)")
    p.add_argument("--mode", choices=MODES, default=None, help="default: dot (not with --self)")
    p.add_argument(
        "--preconditioner",
        choices=PRECONDITIONERS,
        default=None,
        help="default: ekfac when the store holds K-FAC statistics, else raw",
    )
    p.add_argument(
        "--damping", type=_damping, default=None, help=">= 0 (default: 0.1 x mean eigenvalue)"
    )
    p.add_argument(
        "--batch-size", type=_positive_int, default=None, help="rows per block (default: ~16 MB)"
    )
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
    else:  # main() accepts only OUT_SUFFIXES
        frame.to_csv(path, index=False)
    print(f"wrote {len(frame)} rows to {path}", file=sys.stderr)


def usage_error(parser: argparse.ArgumentParser, message: str) -> int:
    """Print argparse's own error format (usage, then ``prog: error: message``) and return 2.

    Returned instead of raised (``parser.error`` exits) so callers of a command's ``main()`` get
    the exit status like for every other outcome; the viewer's command uses it too.
    """
    parser.print_usage(sys.stderr)
    print(f"{parser.prog}: error: {message}", file=sys.stderr)
    return 2


def stores_below(folder: Path, limit: int = 5) -> str:
    """The hint for a folder that is not a store but holds some (a ``root_dir`` given for its
    project): ``"; stores in it: a, b"``, else ``""``.

    Example:
        >>> stores_below(Path("/no/such/folder"))
        ''
    """
    found = sorted(m.parent for m in folder.glob(f"*/{META_FILE}"))
    found += sorted(m.parent for m in folder.glob(f"*/*/{META_FILE}"))
    if not found:
        return ""
    more = f", ... ({len(found)} in all)" if len(found) > limit else ""
    return "; stores in it: " + ", ".join(str(f) for f in found[:limit]) + more


def main(argv: list[str] | None = None) -> int:
    """Run the ``nnstat influence`` command; returns the exit status.

    Example:
        >>> main(["/no/such/store", "--query", "/no/such/query"])  # doctest: +SKIP
    """
    parser = _parser()
    args = parser.parse_args(argv)
    for label, path in (("STORE", args.store), ("--query", args.query)):
        if path is None:
            continue
        if not Path(path).is_dir():
            return usage_error(parser, f"{label}: no gradient store at {path}")
        # checked here, before any work, so a typo costs no scoring time
        if not (Path(path) / META_FILE).is_file():
            message = f"{label}: {path} is not a gradient store (no {META_FILE})"
            return usage_error(parser, message + stores_below(Path(path)))
    if args.out is not None and Path(args.out).suffix not in OUT_SUFFIXES:
        return usage_error(parser, f"--out must end in .parquet or .csv, got {args.out!r}")
    if args.out is not None and not Path(args.out).parent.is_dir():
        # before any work: found only after scoring, it cost the whole run
        return usage_error(parser, f"--out: directory {Path(args.out).parent} does not exist")
    if args.self_influence:
        # self-influence is g_iᵀ M g_i: a --mode would be ignored, so it is refused
        for flag, given in (
            ("--query", args.query),
            ("--top-k", args.top_k),
            ("--mode", args.mode),
        ):
            if given is not None:
                return usage_error(parser, f"--self takes no {flag}")
    elif args.query is None:
        return usage_error(parser, "--query is required (or --self)")
    try:
        _score(args)
    except (OSError, ValueError) as e:
        # a damaged or mismatched store: the message names the file and the fix, which a
        # traceback through the scoring code would bury
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


def _score(args: argparse.Namespace) -> None:
    """Score and write the table the parsed, checked ``args`` ask for."""
    if args.self_influence:
        res = compute_self_influence(
            args.store,
            preconditioner=args.preconditioner,
            damping=args.damping,
            batch_size=args.batch_size,
        )
        _write(res.to_frame(), args.out)
        return
    res = compute_influence_all(
        args.query,
        args.store,
        mode=args.mode or "dot",
        preconditioner=args.preconditioner,
        damping=args.damping,
        top_k=args.top_k,
        batch_size=args.batch_size,
    )
    _write(res.to_frame(), args.out)


if __name__ == "__main__":
    sys.exit(main())
