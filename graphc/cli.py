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
    if argv[:1] == ["check"]:  # likewise
        return _report_errors(run_check_command, parse_check(argv[1:]))
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
    p = sub.add_parser("check", help="run a training script's N ranks in this process and "
                       "compare every step with eager PyTorch", usage=CHECK_USAGE)
    p.add_argument("script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)


# graphc check's options -> whether each takes a value
CHECK_OPTIONS = {"--nproc": True, "--steps": True, "--dtype": True, "--tolerance": True}
CHECK_USAGE = ("graphc check SCRIPT [SCRIPT_ARGS...] --nproc N [--steps K] "
               "[--dtype float64|float32|script] [--tolerance T] [-- SCRIPT_ARGS]")


def parse_check(argv: List[str]) -> argparse.Namespace:
    """`graphc check`'s options, which may stand before or after the script's."""
    from .tools.plan_cli import split_argv
    mine, script, theirs = split_argv(argv, CHECK_OPTIONS)
    p = argparse.ArgumentParser(prog="graphc check", usage=CHECK_USAGE,
                                description="Runs SCRIPT's ranks as threads of this process (every "
                                "rank's plan, in-memory transfers), every graph call also run eagerly "
                                "on the whole batch; prints the loss and parameter differences per step "
                                "and exits 1 on a difference.")
    p.add_argument("--nproc", type=int, required=True, help="ranks (the script's WORLD_SIZE)")
    p.add_argument("--steps", type=int, default=3, help="graph calls compared (default 3)")
    p.add_argument("--dtype", default="float64", choices=["float64", "float32", "script"],
                   help="the default dtype the script starts with (default float64; 'script': "
                        "leave it to the script)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="bound on |graphc - eager| / (1 + |eager|) (default 1e-10 in float64)")
    args = p.parse_args(mine)
    if script is None:
        p.error("missing SCRIPT: graphc check train.py --nproc 8")
    args.script, args.script_args = script, theirs
    return args


def run_check_command(args: argparse.Namespace) -> int:
    import time

    import torch

    from .testing import check_script
    dtype = None if args.dtype == "script" else getattr(torch, args.dtype)
    start = time.perf_counter()
    reports = check_script(args.script, args.script_args, args.nproc, args.steps, dtype, args.tolerance)
    ok = all(r.ok for r in reports)
    print(f"graphc check: {'OK' if ok else 'DIFFERS'}: {len(reports)} graph(s), {args.nproc} rank(s), "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
