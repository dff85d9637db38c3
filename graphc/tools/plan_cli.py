"""`graphc plan SCRIPT [SCRIPT_ARGS...] --nproc N --out DIR [--simulate [HOW] [--routing DIR]] [--ranks R]`.

Runs SCRIPT in this process (runpy, sys.argv = [SCRIPT, *SCRIPT_ARGS]) in plan mode (see
graphc/modes.py): every Graph it compiles is compiled for N ranks and written to DIR, and
its first training step ends the script. graphc's own options may stand before or after
the script's; a script option spelled like one of them goes after `--`.
"""
from __future__ import annotations

import argparse
import gc
import os
import runpy
import sys
from typing import List, Tuple

from ..errors import GraphcError

# graphc plan's options -> whether each takes a value (for splitting them from the script's)
OPTIONS = {"--nproc": True, "--out": True, "--simulate": None, "--no-chart": False,
           "--ranks": True, "--auto": False, "--routing": True}
# --auto's own options: graphc's only when --auto is given (a script may take a --device too)
AUTO_OPTIONS = {"--device": True, "--memory": True, "--budget-s": True}
USAGE = ("graphc plan SCRIPT [SCRIPT_ARGS...] --nproc N --out DIR "
         "[--simulate [measure|h100|h200|a100] [--routing DIR]] [--ranks 0,7,-1|all] [--no-chart] "
         "[--auto [--device h100] [--memory GIB] [--budget-s S]] [-- SCRIPT_ARGS]")


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="compile a training script's graphs for N ranks; write plans",
                       description=__doc__.split("\n\n")[1] if __doc__ else None,
                       usage=USAGE)
    p.add_argument("script", help="the training script, as you would run it under torchrun")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=run_plan_command)


def split_argv(argv: List[str], options=None) -> Tuple[List[str], str, List[str]]:
    """(graphc options, script, script args) from what follows `graphc plan` (or another
    command running a script: `options` maps its options to whether each takes a value,
    None for an optional value; default OPTIONS)."""
    if options is None:
        options = dict(OPTIONS, **(AUTO_OPTIONS if "--auto" in argv else {}))
    mine, script, theirs = [], None, []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--" and script is not None:
            theirs += argv[i + 1:]
            break
        name = tok.split("=", 1)[0]
        if name in options:
            mine.append(tok)
            takes = options[name]
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if "=" not in tok and nxt is not None and (takes or (takes is None and not nxt.startswith("-")
                                                                  and not nxt.endswith(".py"))):
                mine.append(nxt)
                i += 1
        elif script is None and not tok.startswith("-"):
            script = tok
        elif script is None:
            mine.append(tok)          # e.g. -h, reported by the parser
        else:
            theirs.append(tok)
        i += 1
    return mine, script, theirs


def parse(argv: List[str]) -> argparse.Namespace:
    mine, script, theirs = split_argv(argv)
    p = argparse.ArgumentParser(prog="graphc plan", usage=USAGE)
    p.add_argument("--nproc", type=int, required=True, help="number of ranks to compile for")
    p.add_argument("--out", required=True, help="folder for rank<r>.json/.txt, stage<s>.py, charts")
    p.add_argument("--simulate", nargs="?", const="measure", default=None,
                   help="predict the step: 'measure' (time the stages on this machine, default) "
                        "or a device preset (h100, h200, a100, cpu)")
    p.add_argument("--routing", default=None, metavar="DIR",
                   help="with --simulate: price the expert-parallel exchanges by the routing a real "
                        "step recorded (GRAPHC_ROUTING_OUT=DIR) and print tokens per expert per step")
    p.add_argument("--no-chart", action="store_true", help="skip the PNG/SVG charts")
    p.add_argument("--ranks", default=None,
                   help="whose rank<r>.json/.txt to write: a list like 0,7,-1 (negative: from "
                        "the end) or 'all'; default all below 64 ranks, else the first and last "
                        "rank of each stage (stages.txt summarises every stage)")
    p.add_argument("--auto", action="store_true",
                   help="search the layout (stages, tensor, data parallelism, ZeRO, schedule, "
                        "micro-batches, checkpointing) that the simulator finds fastest and that "
                        "fits; writes DIR/layout.json and DIR/auto.md (NOTE: Layout search)")
    p.add_argument("--device", default="h100", help="--auto: the device preset (h100, h200, a100, cpu)")
    p.add_argument("--memory", type=float, default=None,
                   help="--auto: GiB per rank a layout must fit (default: the device's memory)")
    p.add_argument("--budget-s", type=float, default=60.0,
                   help="--auto: seconds for compiling and simulating candidates (default 60)")
    args = p.parse_args(mine)
    if script is None:
        p.error("missing SCRIPT: graphc plan train.py --nproc 4 --out plans")
    args.script, args.script_args = script, theirs
    return args


def run_plan_command(args: argparse.Namespace) -> int:
    """`graphc plan`, from parse()'s namespace (cli.main sends `plan` argv here directly)."""
    auto = None
    if args.auto:
        from ..auto.search import plan_mode_search
        auto = plan_mode_search(args.device, args.memory, args.budget_s)
    return run_plan(args.script, args.script_args, args.nproc, args.out, args.simulate,
                    not args.no_chart, args.ranks, auto, args.routing)


def run_plan(script: str, script_args: List[str], nproc: int, out: str,
             simulate: str = None, chart: bool = True, ranks: str = None, auto=None,
             routing: str = None) -> int:
    """Runs `script` in plan mode; returns 0 once at least one graph's plans are written.
    routing: a folder of recorded routing for --simulate (NOTE: Routing log)."""
    from .costs import DEVICES
    from ..modes import PlanModeExit, plan_mode
    from .dump import parse_ranks, write_all
    if not os.path.isfile(script):
        raise GraphcError(f"graphc plan: script {script!r} not found")
    if simulate not in (None, "measure", *DEVICES):
        raise GraphcError(f"graphc plan --simulate {simulate!r}: choose 'measure' or one of "
                          f"{sorted(DEVICES)}")
    if routing is not None and simulate is None:
        raise GraphcError("graphc plan --routing prices the simulated expert exchanges: add --simulate")
    if ranks is not None and ranks.strip() != "all":
        parse_ranks(ranks, nproc)       # a wrong --ranks fails before the script runs
    saved_argv, saved_path, saved_env = sys.argv[:], sys.path[:], dict(os.environ)
    sys.argv = [script] + list(script_args)
    # the script sees rank 0 of a torchrun world of N (without MASTER_ADDR: no process group)
    for k, v in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", nproc), ("LOCAL_WORLD_SIZE", nproc)):
        os.environ.setdefault(k, str(v))
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    # NOTE: Frozen heap in graphc plan
    # A world's plans, timelines and tables are millions of small objects that live until the
    # command ends, and the cyclic collector walks every one of them at each full collection:
    # at 8192 ranks that was 2 CPU s of the command's 11 (the same as with the collector off).
    # So the heap is frozen (gc.freeze: the collector no longer visits it) twice, where what
    # exists will outlive the command: torch's and graphc's modules before the script runs,
    # and each compiled graph before its files are written; unfrozen when the command ends, so
    # a caller in this process (a test) gets its garbage collected again.
    gc.freeze()

    def write(graph, compiled, folder, mode):
        gc.freeze()
        return write_all(graph, compiled, folder, mode, routing=routing)
    try:
        with plan_mode(nproc, out, simulate, chart, ranks, write=write, auto=auto) as mode:
            try:
                runpy.run_path(script, run_name="__main__")
            except PlanModeExit as stop:
                print(stop, flush=True)
            except SystemExit as e:
                if e.code not in (None, 0):
                    raise
    finally:
        gc.unfreeze()
        sys.argv, sys.path = saved_argv, saved_path
        os.environ.clear()
        os.environ.update(saved_env)
    if not mode.written:
        raise GraphcError(f"graphc plan: {script} finished without compiling a graphc.Graph. "
                          "Fix: make sure the script calls graph(...) or graph.compile(...) "
                          "(and that its arguments reach that point).")
    return 0
