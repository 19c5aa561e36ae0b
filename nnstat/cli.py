"""The `nnstat` console script: `nnstat demo`, `nnstat influence ...`, `nnstat view ...`.

Each sub-command lives with its feature; this module only dispatches, importing lazily.
"""

from __future__ import annotations

import importlib
import sys

# sub-command -> (module, function taking argv, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("nnstat.demo", "main", "train a small network on digits with nnstat watching"),
    "influence": ("nnstat.influence.cli", "main", "score a query log against a gradient store"),
    "view": (
        "nnstat.viewer.server",
        "main",
        "browse Tracker runs, recorder trials, gradient stores and reports in a local page",
    ),
}


def _usage() -> str:
    lines = ["usage: nnstat <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `nnstat` console script.

    Example:
        >>> main(["--help"])  # doctest: +SKIP
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    # usage errors in argparse's format: usage on stderr, then one line saying what is wrong
    if not argv:
        print(f"{_usage()}\nnnstat: error: a command is required", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        choices = ", ".join(COMMANDS)
        print(
            f"{_usage()}\nnnstat: error: unknown command {command!r} (choose from {choices})",
            file=sys.stderr,
        )
        return 2
    module, func, _ = COMMANDS[command]
    result = getattr(importlib.import_module(module), func)(rest)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
