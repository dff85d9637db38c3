"""write_all(): the files `graphc plan` writes for one compiled graph.

  rank<r>.json / rank<r>.txt   the plans of the chosen ranks (plan.to_json(), str(plan)):
                               all below ALL_RANKS_BELOW ranks, else the first and last
                               rank of each stage, or `--ranks 0,7,-1`
  stages.txt                   every stage in a few lines (summary.py)
  stage<s>.py                  each stage's fx program as Python, with its interface
  passes.txt                   the compilation history: every pass's output and time
  schedule.png / .svg          the schedule with unit costs (forward 1, backward 2)
  simulation.txt, simulated.png / .svg, simulated_trace.json   with --simulate (the table
                               adds each rank's model-state bytes: NOTE: Model-state bytes)

Charts and the simulated trace fold ranks with identical timelines into one row; the charts
are drawn in forked children while the rest is written (NOTE: Charts drawn aside, aside.py).
Without matplotlib (the `plan` extra) the charts are skipped, said once per run.
"""
from __future__ import annotations

import functools
import json
import os
from typing import List, Optional, Tuple

from ..errors import GraphcError
from ..history import history_text
from ..runtime.trace import timeline_to_chrome
from .aside import Aside
from .chart import FORMATS, INSTALL_HINT, charts_available, draw_timeline
from .cost_model import CostModel
from .costs import DEVICES, device_costs, measure_costs
from .routing import read_routing, routed_plans, routing_table
from .rows import fold_ranks, ranges, row_label
from .simulate import fit_report, model_inputs, simulate
from .summary import stage_summary

ALL_RANKS_BELOW = 64    # worlds this small get every rank's plan file by default
STEADY_STEPS = 4


def write_all(graph, compiled, folder: str, mode, routing: Optional[str] = None) -> List[str]:
    """routing: a folder of recorded routing (NOTE: Routing log) that --simulate prices the
    expert exchanges by (graphc/tools/routing.py)."""
    os.makedirs(folder, exist_ok=True)
    name = type(graph).__name__
    chosen, why = select_ranks(getattr(mode, "ranks", None), compiled)
    written = write_plans([compiled.plans[r] for r in chosen], folder)
    written.append(_write(os.path.join(folder, "stages.txt"), stage_summary(name, compiled, chosen)))
    written += write_programs(compiled, folder)
    written.append(_write(os.path.join(folder, "passes.txt"), history_text(compiled.history)))
    # the values the plan was compiled under, as every call checks them (NOTE: Guards)
    written.append(_write(os.path.join(folder, "guards.txt"), compiled.guards.text()))
    if mode.chart and not charts_available():
        mode.chart = False          # said once, for every graph the script compiles
        print(f"graphc plan: matplotlib is not installed, so no schedule charts are drawn "
              f"(plans and tables are written). For charts: {INSTALL_HINT}", flush=True)
    aside = Aside()         # the charts are drawn in children meanwhile (NOTE: Charts drawn aside)
    if mode.chart:
        written += write_schedule_chart(compiled, folder, name, aside)
    if mode.simulate:
        written += write_simulation(graph, compiled, folder, mode.simulate, mode.chart, routing, aside)
    aside.wait()
    print(f"graphc plan: {name}: {len(compiled.plans)} rank(s), {len(compiled.stages)} stage(s), "
          f"{compiled.num_microbatches} micro-batch(es); plans verified; wrote {len(written)} "
          f"files to {folder}", flush=True)
    if why:
        print(f"graphc plan: {name}: {why}", flush=True)
    staged = {r for s in compiled.stages for r in s.ranks}
    idle = [r for r in range(len(compiled.plans)) if r not in staged]
    if idle:
        print(f"graphc plan: {name}: rank(s) {ranges(idle)} of --nproc {len(compiled.plans)} hold no "
              "stage (no placement names them): they only call the graph", flush=True)
    return written


def select_ranks(spec: Optional[str], compiled) -> Tuple[List[int], str]:
    """The ranks whose plan files to write, and a note when that is not every rank.

    spec: None (every rank below ALL_RANKS_BELOW ranks, else the first and last rank of
    each stage), "all", or a comma list of ranks, negative ones counted from the end
    ("0,7,-1").
    """
    world = len(compiled.plans)
    if spec is None and world < ALL_RANKS_BELOW:
        return list(range(world)), ""
    if spec is not None and spec.strip() == "all":
        return list(range(world)), ""
    if spec is None:
        chosen = sorted({r for s in compiled.stages for r in (s.ranks[0], s.ranks[-1])})
        return chosen, (f"plans written for {len(chosen)} of {world} ranks (the first and last "
                        f"of each stage; a stage's ranks differ only in peers and groups, see "
                        f"stages.txt); --ranks all or --ranks 0,7,-1 chooses others")
    chosen = parse_ranks(spec, world)
    return chosen, f"plans written for rank(s) {ranges(chosen)} of {world} (--ranks {spec})"


def parse_ranks(spec: str, world: int) -> List[int]:
    """"0,7,-1" -> [0, 7, world - 1]; a GraphcError names a token that is not a rank."""
    chosen = sorted({_rank(tok, world) for tok in spec.split(",") if tok.strip()})
    if not chosen:
        raise GraphcError(f"graphc plan --ranks {spec!r} names no rank. Fix: e.g. --ranks 0,7,-1")
    return chosen


def _rank(token: str, world: int) -> int:
    try:
        r = int(token)
    except ValueError:
        r = None
    if r is None or not -world <= r < world:
        raise GraphcError(f"graphc plan --ranks: {token.strip()!r} is not a rank of a world of "
                          f"{world} (0..{world - 1}, or -1..-{world} from the end). Fix: e.g. "
                          f"--ranks 0,7,-1, or --ranks all")
    return r % world


def _write(path: str, text: str) -> str:
    with open(path, "w") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    return path


def write_plans(plans, folder: str) -> List[str]:
    out = []
    for plan in plans:
        base = os.path.join(folder, f"rank{plan.rank}")
        out.append(_write(base + ".json", plan_json_text(plan)))
        out.append(_write(base + ".txt", str(plan)))
    return out


def plan_json_text(plan) -> str:
    """plan.to_json() as JSON, a line per stage and per instruction. json.dumps(indent=...)
    encodes in Python, about ten times slower than its compact C encoder, which writes
    each line here: at 8192 ranks, 64 plans of a few thousand instructions and stages of
    256 ranks each took seconds."""
    d = plan.to_json()
    lists = {key: d.pop(key) for key in ("stages", "instructions")}
    text = json.dumps(d, indent=1)[:-2]          # the other fields, without the closing brace
    for key, items in lists.items():
        text += f',\n "{key}": [\n  ' + ",\n  ".join(json.dumps(x) for x in items) + "\n ]"
    return text + "\n}"


def write_programs(compiled, folder: str) -> List[str]:
    out = []
    for prog in compiled.programs:
        ranks = list(compiled.stages[prog.stage].ranks)
        head = (f"# graphc stage {prog.stage} on ranks {ranks}: the program one micro-batch runs.\n"
                f"# Readable, not standalone: `self` is the user's model (its sub-modules and\n"
                f"# parameters keep their names). Interface below; sends and receives are in\n"
                f"# the rank<r>.txt plans.\n")
        body = "\n".join("# " + line if i == 0 else line for i, line in enumerate(str(prog).splitlines()))
        out.append(_write(os.path.join(folder, f"stage{prog.stage}.py"), head + body))
    return out


def rank_notes(compiled):
    """rank -> what it runs ("stage 1", "stages 0, 4", "idle"), for chart rows."""
    held = {r: [] for r in range(len(compiled.plans))}
    for s in compiled.stages:
        for r in s.ranks:
            held[r].append(s.stage_id)
    return {r: ("stage " if len(ids) == 1 else "stages ") + ", ".join(map(str, ids)) if ids else "idle"
            for r, ids in held.items()}


def write_schedule_chart(compiled, folder: str, name: str, aside: Optional[Aside] = None) -> List[str]:
    """schedule.png / .svg: the step simulated with unit costs and drawn, here or `aside`."""
    path = os.path.join(folder, "schedule")
    (aside or Aside(forking=False)).run("the schedule chart", _draw_schedule, compiled, path, name)
    return chart_files(path)


def chart_files(path: str) -> List[str]:
    """The files draw_timeline writes for `path`."""
    return [f"{path}.{fmt}" for fmt in FORMATS]


def _draw_schedule(compiled, path: str, name: str) -> List[str]:
    plan = compiled.plans[0]
    result = simulate(compiled.plans, CostModel.uniform(len(compiled.stages)))
    title = (f"{name}: schedule {plan.schedule}, {len(compiled.stages)} stage(s), "
             f"{compiled.num_microbatches} micro-batch(es), {len(compiled.plans)} rank(s)\n"
             f"unit costs (forward 1, backward 2, communication free): "
             f"bubble {result.bubble_fraction:.1%}")
    return draw_timeline(result.timeline, path, title, time_unit="cost units", scale=1.0,
                         notes=rank_notes(compiled))


def costs_for(graph, compiled, how: str) -> CostModel:
    """`how`: "measure" (time the stages here) or a device preset name (see costs.DEVICES)."""
    if how == "measure":
        return measure_costs(compiled, optimizer=getattr(graph, "_optimizer", None), transport="auto")
    return device_costs(compiled, how)


def write_simulation(graph, compiled, folder: str, how: str, chart: bool = True,
                     routing: Optional[str] = None, aside: Optional[Aside] = None) -> List[str]:
    """simulation.txt (printed too), simulated.png / .svg (drawn here or `aside`) and
    simulated_trace.json: the step simulated on `how`'s costs."""
    if how == "measure" and aside is not None:
        aside.wait()        # timing the stages here wants the cores a chart would take
    costs = costs_for(graph, compiled, how)
    # every rank's parameters from the stage programs: the table adds model-state bytes
    model = model_inputs(compiled, getattr(graph, "_optimizer", None))
    cores = os.cpu_count() if how == "measure" else None
    plans, routed = compiled.plans, ""
    if routing is not None:   # expert exchanges priced by a real step's loads (NOTE: Routing log)
        recorded = read_routing(routing)
        plans = routed_plans(compiled.plans, recorded)
        balanced = simulate(compiled.plans, costs, steps=STEADY_STEPS, cores=cores)
        routed = (f"\n{routing_table(compiled.plans, recorded, routing)}\nsteady-state step: "
                  f"{balanced.step_time * 1e3:.3f} ms with balanced expert exchanges (the plan's "
                  f"estimate), the table's with the recorded routing")
    # several steps: the table reports the steady state (a rank starts its next step early)
    result = simulate(plans, costs, steps=STEADY_STEPS, cores=cores, model=model)
    name = type(graph).__name__
    table = f"# {name}: simulated step, costs {costs.source}\n{result.table()}{routed}"
    if how in DEVICES:          # will it fit: each rank's predicted peak against the device
        peaks = {r.rank: r.memory for r in result.ranks if r.memory is not None}
        table += "\n" + fit_report(peaks, int(DEVICES[how].memory_gib * 2 ** 30), how, compiled.plans)
    print(table, flush=True)
    title = (f"{name}: {result.steps} simulated steps ({costs.source})\nsteady-state step "
             f"{result.step_time * 1e3:.3f} ms, first step {result.first_step_time * 1e3:.3f} ms, "
             f"mean bubble {result.bubble_fraction:.1%}")
    out = [_write(os.path.join(folder, "simulation.txt"), table)]
    notes = rank_notes(compiled)
    if chart:
        path = os.path.join(folder, "simulated")
        draw = functools.partial(draw_timeline, result.timeline, path, title, notes=notes)
        (aside or Aside(forking=False)).run("the simulated chart", draw)
        out += chart_files(path)
    rows = [(ranks, row_label(ranks, notes)) for ranks in fold_ranks(result.timeline)]
    trace = timeline_to_chrome(result.timeline, process_prefix="simulated", rows=rows)
    out.append(_write(os.path.join(folder, "simulated_trace.json"), json.dumps(trace)))
    return out
