"""The `graphc` command line (also `python -m graphc`)."""
from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from .errors import GraphcError


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="graphc", description="graphc: a static-graph compiler "
                                     "for distributed training on PyTorch")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command")
    _add_commands(sub)
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plan"]:  # its options may follow the script's, so it splits argv itself
        from .tools import plan_cli
        return _report_errors(plan_cli.run_plan_command, plan_cli.parse(argv[1:]))
    args = parser.parse_args(argv)
    if args.version:
        from . import __version__
        print(__version__)
        return 0
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return _report_errors(args.func, args)


def _report_errors(func, args) -> int:
    try:
        return func(args) or 0
    except GraphcError as e:
        print(f"graphc: error: {e}", file=sys.stderr)
        return 1


def _add_commands(sub) -> None:
    """Subcommands register here."""
    from .tools import plan_cli
    plan_cli.add_parser(sub)


if __name__ == "__main__":
    sys.exit(main())
