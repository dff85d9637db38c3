"""The `graphc` command line (also `python -m graphc`)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="graphc", description="graphc: a static-graph compiler "
                                     "for distributed training on PyTorch")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    _add_commands(sub)
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__
        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return args.func(args) or 0


def _add_commands(sub) -> None:
    """Subcommands register here."""


if __name__ == "__main__":
    sys.exit(main())
