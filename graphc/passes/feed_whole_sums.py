"""feed_whole_sums: every micro-batch reads the whole batch's value of the sums it combines
nonlinearly (a router's token counts), computed by a routing pre-pass.

Invariant: no node of a stage program carries META_WHOLE_SUM; each such sum was replaced by
`total / m`, with `total` a program input that the stage's Prologue computes once per step:
the program's own computation of the sum (through the parameters and the model's forward up
to it, with its exchanges), run without gradient on every micro-batch and summed. Every such
Prologue runs in the plan (`in_plan`: PrePass instructions before the schedule), and reads
what it needs of earlier stages from their pre-passes (Prologue.recv_from / send_to).
Requires: feed_whole_batch (a Prologue it may already have made), find_batch_dims
(META_WHOLE_SUM on the sums).

NOTE: Whole-batch sums
Transformers' router auxiliary loss (load_balancing_loss_func, Switch Transformer) is
E * sum_e f_e * P_e with two means over the whole batch: f_e, the share of tokens routed to
expert e (histc counts: no gradient), and P_e, the mean router probability (linear in the
tokens). Per micro-batch it would be another number. It becomes exact when each micro-batch
b computes E * sum_e f_e(whole) * P_e(b): graphc averages the micro-batches' losses, and P is
linear, so the mean over b is E * sum_e f_e(whole) * P_e(whole), and micro-batch b's gradient
is E * f_e(whole) * dP_e(b) / m, the whole batch's. In general (batch_rows:
whole_sums_or_couple): a product of batch sums, or a division by one, is exact per
micro-batch when at most one factor carries a gradient (a quotient's numerator) and every
sum without gradient is replaced by its mean over the m micro-batches, S(whole) / m. The
loss is a mean (the same for the batch twice over), so its micro-batch form at
(S(whole) / m, R(b), N / m) equals the whole form at (S(whole), m R(b), N), linear in R:
averaging over b gives the whole batch's value. With an attention mask the token count
(flat_mask.sum()) is such a sum too; `(x * mask).sum() / mask.sum()` is another.

The counts depend on the parameters and on the forward of every layer before the router, so
they are known before any backward only by a pre-pass: the Prologue runs the stage program,
cut to what the sums need, without gradient on each micro-batch's inputs (random ops replay
the micro-batch's draws, NOTE: Replica-equal randomness; an expert layer's exchanges run on
every rank of its group alike, as in the forward, and are listed as the pre-pass's
collectives, `0P1.ALL_TO_ALL`). Routing is deterministic given the parameters, which do not
change within a step, so the counts are the forward's. The cost is about one extra forward
per step, said at compile time and priced by the simulator (a PrePass costs a forward).

Through the pipeline. HF Mixtral and Qwen3-MoE concatenate every layer's router logits at
the last stage, so the last stage's sums read values received from earlier stages (the
hidden states its own routers need, an earlier layer's logits). The pre-pass therefore runs
through the pipeline, as plan instructions: stage s's PrePass of micro-batch b (`1P0`)
receives from the stages before it what its cut reads (`1RECV_P0`, the values the forward
receives, the same specs and peers), runs its cut, and sends on (`0SEND_P0`) what later
stages' cuts read. feed_whole_sums cuts the last stage first, so each stage's cut has as
outputs its own sums and then the values later cuts read; any stage, not only the last,
may have sums that depend on received values. The plan lists every local stage's PrePass of
every micro-batch, stages in order, before the schedule's first instruction on every rank,
whatever the schedule (1F1B, interleaved, zbv: between two chunks of one rank the values are
handed over in memory, as the forward's); the verifier pairs the SEND_P and RECV_P like the
step's transfers and proves the whole plan deadlock-free. After a stage's last PrePass its
sums are totalled (and summed over ranks where feed_whole_batch's counts are split), and
every micro-batch's forward reads the totals.

ZeRO stage 3. A PrePass is a compute like a forward, so insert_zero_sync gathers a stage's
sharded parameters before its first compute, the first PrePass, and releases them after its
last (one stage per rank; per compute with several chunks): the pre-pass reads the same
whole parameters as the step. Gathering unit by unit (enable_zero(unit_bytes=...), NOTE:
ZeRO units) would need the units' begin/end calls inside the cut program too; such a plan
keeps the whole-stage gathers instead, and says so (insert_zero_units warns).
"""
from __future__ import annotations

import logging
import operator
from collections import defaultdict
from typing import Dict, List, Sequence, Tuple

import torch.fx as fx

from ..errors import GraphcError
from ..meta import META_TENSOR, META_WHOLE_SUM, TensorMeta
from ..plan.instructions import TensorSpec
from ..plan.program import Prologue, StageProgram
from .feed_whole_batch import add_step_input

_log = logging.getLogger("graphc")

# producer stage -> consumer stage -> the producer's outputs the consumer's pre-pass reads
_Wanted = Dict[int, Dict[int, List[str]]]


def feed_whole_sums(programs: Sequence[StageProgram], num_microbatches: int) -> List[StageProgram]:
    if num_microbatches == 1:
        return list(programs)
    wanted: _Wanted = defaultdict(dict)
    # the last stage first: a stage's cut reads what earlier stages' cuts must then send it
    for prog in sorted(programs, key=lambda p: p.stage, reverse=True):
        sums = [n for n in prog.module.graph.nodes if n.meta.get(META_WHOLE_SUM)]
        sent = wanted.get(prog.stage, {})
        if sums or sent:
            _pre_pass(prog, sums, sent, num_microbatches, wanted)
    return list(programs)


def _pre_pass(prog: StageProgram, sums: List[fx.Node], sent: Dict[int, List[str]], m: int,
              wanted: _Wanted) -> None:
    names = [f"graphc_whole_{n.name}" for n in sums]
    sent_names = list(dict.fromkeys(name for b in sorted(sent) for name in sent[b]))
    cut, received = _cut_program(prog, sums, sent_names)
    recv_from = _received_specs(prog, sums, received)
    for a, specs in recv_from.items():
        wanted[a][prog.stage] = [t.name for t in specs]
    send_to = {b: [t for t in prog.send_to[b] if t.name in names_b] for b, names_b in sent.items()}
    prog.prologue = _with_prologue(prog, cut, names, sent_names, recv_from, send_to)
    for node, name in zip(sums, names):
        _read_whole(prog, node, name, m)
    prog.module.graph.lint()
    prog.module.recompile()
    if sums:
        _log.warning("stage %d: sums over the batch without gradient combined nonlinearly (%s, nodes "
                     "%s; e.g. a router's auxiliary loss) under %d-step accumulation: a pre-pass runs what "
                     "they need of the model's forward (for a router, the model up to it, through the "
                     "pipeline's earlier stages) without gradient on every micro-batch before the step, "
                     "for the whole batch's sums (See NOTE: Whole-batch sums); for a router it costs "
                     "about one extra forward per step", prog.stage, _where(sums[0]),
                     ", ".join(n.name for n in sums), m)


def _cut_program(prog: StageProgram, sums: List[fx.Node], sent: List[str]) -> Tuple[fx.Graph, List[str]]:
    """The program's graph with `sums` and then the outputs named `sent` as its outputs,
    without what they do not need; and the values received from other stages it reads."""
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    graph.graph_copy(prog.module.graph, env)
    output = next(n for n in prog.module.graph.nodes if n.op == "output")
    by_name = dict(zip(prog.outputs, output.args[0]))
    graph.output(tuple(graph.call_method("detach", (env[n],)) for n in sums + [by_name[s] for s in sent]))
    graph = fx.GraphModule(prog.module, graph).graph   # an owner: fx asks modules' purity
    graph.eliminate_dead_code(is_impure_node=_writes_a_value)
    received = []
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        if not ph.users:
            graph.erase_node(ph)
        elif ph.target not in prog.user_inputs:
            received.append(ph.target)
    return graph, received


def _received_specs(prog: StageProgram, sums: List[fx.Node], received: List[str]) -> Dict[int, List[TensorSpec]]:
    """Producer stage -> the values of `received` it sends, in the order the step sends them."""
    out: Dict[int, List[TensorSpec]] = {}
    for a, specs in sorted(prog.recv_from.items()):
        mine = [t for t in specs if t.name in received]
        if mine:
            out[a] = mine
    found = {t.name for specs in out.values() for t in specs}
    missing = [name for name in received if name not in found]
    if missing:   # a per-step value of the stage itself (a loss's whole count): not per micro-batch
        raise _not_per_microbatch(prog, sums, missing[0])
    return out


def _writes_a_value(node: fx.Node) -> bool:
    """Kept though unused: an in-place write into a value the sums may read (not a buffer,
    whose update belongs to the forward), and fx's own impure nodes (grad modes, autocast)."""
    if node.op == "call_method" and node.target.endswith("_") and not node.target.endswith("__"):
        base = node.args[0] if node.args else None
        return not (isinstance(base, fx.Node) and base.op == "get_attr")
    return node.is_impure()


def _with_prologue(prog: StageProgram, cut: fx.Graph, names: List[str], sent: List[str],
                   recv_from: Dict[int, List[TensorSpec]], send_to: Dict[int, List[TensorSpec]]) -> Prologue:
    """One Prologue, run by the plan's pre-pass, computing the stage's earlier per-step values
    (feed_whole_batch) and the whole sums (summed over micro-batches, never over ranks: the
    program's own collectives after the sum still run), then the values it sends on."""
    graph, placeholders = fx.Graph(), {}
    outputs: list = []
    for part in ([prog.prologue.module.graph] if prog.prologue is not None else []) + [cut]:
        outputs += list(_copy_into(graph, part, placeholders))
    graph.output(tuple(outputs))
    module = fx.GraphModule(prog.module, graph, class_name=f"Stage{prog.stage}Prologue")
    inputs = [n.target for n in graph.nodes if n.op == "placeholder"]
    old = prog.prologue
    return Prologue(module, inputs, (list(old.outputs) if old else []) + names,
                    (list(old.groups) if old else []) + [()] * len(names),
                    in_plan=True, sent=sent, recv_from=recv_from, send_to=send_to)


def _copy_into(graph: fx.Graph, part: fx.Graph, placeholders: Dict[str, fx.Node]):
    """part's nodes into graph, its inputs shared by name; returns part's outputs there."""
    env: Dict[fx.Node, fx.Node] = {}
    for node in part.nodes:
        if node.op == "placeholder":
            if node.target not in placeholders:
                placeholders[node.target] = graph.placeholder(node.target)
            env[node] = placeholders[node.target]
        elif node.op == "output":
            return fx.node.map_arg(node.args[0], lambda a: env[a])
        else:
            env[node] = graph.node_copy(node, lambda a: env[a])
    return ()


def _read_whole(prog: StageProgram, node: fx.Node, name: str, m: int) -> None:
    """node's value replaced by the whole batch's mean over micro-batches: total / m."""
    meta = node.meta[META_TENSOR]
    total = add_step_input(prog, name, TensorMeta(meta.shape, meta.dtype, False))
    with prog.module.graph.inserting_before(node):
        mean = prog.module.graph.call_function(operator.truediv, (total, m))
    mean.meta = {k: v for k, v in node.meta.items() if k != META_WHOLE_SUM}
    # a sum made in place (`zeros.scatter_add_(0, ids, w)`, the masked router counts): the
    # tensor written is the sum, and its write would add this micro-batch's part once more
    writes = [u for u in node.users if _writes_into(u, node)]
    node.replace_all_uses_with(mean, delete_user_cb=lambda user: user not in writes)
    for write in writes:
        write.replace_all_uses_with(mean)
        prog.module.graph.erase_node(write)
    del node.meta[META_WHOLE_SUM]


def _writes_into(user: fx.Node, node: fx.Node) -> bool:
    """Is `user` an in-place method writing into `node` (`node.scatter_add_(...)`)?"""
    name = user.target if user.op == "call_method" else ""
    return name.endswith("_") and not name.endswith("__") and bool(user.args) and user.args[0] is node


def _where(node: fx.Node) -> str:
    trace = node.meta.get("stack_trace", "").strip().splitlines()
    return f"{trace[-2].strip()}: {trace[-1].strip()}" if len(trace) >= 2 else f"node '{node.name}'"


def _not_per_microbatch(prog: StageProgram, sums: List[fx.Node], value: str) -> GraphcError:
    return GraphcError(
        f"stage {prog.stage} combines sums over the batch nonlinearly ({_where(sums[0])}, node "
        f"'{sums[0].name}'), so under gradient accumulation a pre-pass computes the whole batch's "
        "sums before the step (See NOTE: Whole-batch sums). Here they depend on "
        f"'{value}', itself a value of the whole batch computed once per step (a loss's count of "
        "targets), which the pre-pass does not have per micro-batch. Fix: compute that value "
        "outside build() and pass it as an input, or use "
        "self.config.set_gradient_accumulation_steps(1).")
