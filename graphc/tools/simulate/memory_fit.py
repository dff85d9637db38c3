"""Will it fit: each rank's predicted peak (NOTE: Peak memory model) against a device's memory,
and, when it does not, what to change, each change with the bytes it saves at the peak.

The savings are read off the peak's parts: ZeRO's next stage shards what it names over the
data-parallel ranks (stage 1 the optimizer state, 2 also the gradients, 3 also the
parameters: each to 1/d), twice the micro-batches halves each micro-batch's activations,
twice the pipeline stages (or tensor parallel 2) halves the model state on a rank.
Checkpointing keeps only a micro-batch's stage inputs until its backward recomputes it.
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple, Union

from ...plan.instructions import AllReduce, ReduceScatter
from ...plan.plan import ExecutionPlan
from .model_state import zero_stage
from .peak import MemoryPeak

MODEL_STATE = ("parameters", "optimizer", "gradients", "gradient buffers")


def fit_report(peaks: Dict[int, MemoryPeak], capacity: int, device: str,
               plans: Union[ExecutionPlan, Sequence[ExecutionPlan]]) -> str:
    """Whether every rank's predicted peak fits `capacity` bytes: the highest rank, the
    instruction holding its peak, its parts; when it does not fit, the ranks over, by how
    much, and what to change (`plans`: every rank's, or one plan standing for all)."""
    if not peaks:
        return ""
    worst = max(peaks.values(), key=lambda m: m.peak)
    plan = _plan_of(plans, worst.rank)
    parts = ", ".join(f"{k} {_size(v)}" for k, v in sorted(worst.parts.items(), key=lambda kv: -kv[1]))
    head = (f"memory on {device} ({_size(capacity)}): highest rank {worst.rank}, peak "
            f"{_size(worst.peak)} at {worst.at} ({parts})")
    if worst.fits(capacity):
        return f"{head}: fits, {_size(capacity - worst.peak)} free"
    over = [r for r, m in sorted(peaks.items()) if not m.fits(capacity)]
    short = worst.peak - capacity
    lines = [f"{head}: DOES NOT FIT on ranks {over[:8]}{' ...' if len(over) > 8 else ''}, "
             f"{_size(short)} over ({short / capacity:.0%} of the device); what to change:"]
    for saving, text in changes(worst, plan):
        enough = " (enough alone)" if saving >= short else ""
        lines.append(f"  - {text}: saves ~{_size(saving)} at the peak{enough}")
    return "\n".join(lines)


def changes(peak: MemoryPeak, plan: ExecutionPlan) -> List[Tuple[int, str]]:
    """(bytes saved at the peak, the change) for each change that applies, most saved first."""
    parts = peak.parts
    act = parts.get("activations", 0)
    out: List[Tuple[int, str]] = []
    if act and plan.training and plan.checkpointing != "always":
        out.append((act // 2, "activation checkpointing: module.config.set_activation_checkpointing(True) "
                              "or graph.config.set_activation_checkpointing(\"always\") keeps only each "
                              "micro-batch's stage inputs until its backward (up to the activations' "
                              "bytes, about half shown)"))
    if act:
        m = plan.num_microbatches
        out.append((act // 2, f"more micro-batches: config.set_gradient_accumulation_steps({2 * m}) halves "
                              "each micro-batch's activations (or more data-parallel ranks)"))
    out.extend(_zero_change(parts, plan))
    state = sum(parts.get(k, 0) for k in MODEL_STATE)
    if state:
        out.append((state // 2, "more pipeline stages (twice as many) or tensor parallelism (2 ranks a "
                                "layer) halve the parameters and their state on a rank"))
    return sorted(out, key=lambda sc: -sc[0])


def _zero_change(parts: Dict[str, int], plan: ExecutionPlan) -> List[Tuple[int, str]]:
    """The next ZeRO stage over this rank's data-parallel ranks, or why there is none."""
    stage = zero_stage(plan) if plan.training else 0
    if not plan.training or stage == 3:
        return []
    d = max((len(i.ranks) for i in plan.instructions if type(i) in (AllReduce, ReduceScatter)), default=1)
    if d == 1:
        state = parts.get("optimizer", 0) + parts.get("gradients", 0)
        return [(state // 2, "ZeRO shards the model state over data-parallel ranks and this stage has "
                             "none: give it several ranks, then config.enable_zero(True, stage=2) "
                             "(with 2 ranks)")]
    sharded = {1: ("optimizer",), 2: ("optimizer", "gradients", "gradient buffers"),
               3: ("optimizer", "gradients", "gradient buffers", "parameters")}[stage + 1]
    done = {0: (), 1: ("optimizer",), 2: ("optimizer", "gradients", "gradient buffers")}[stage]
    saving = sum(parts.get(k, 0) for k in sharded if k not in done) * (d - 1) // d
    return [(saving, f"config.enable_zero(True, stage={stage + 1}) shards the "
                     f"{', '.join(k for k in sharded if k not in done)} over the {d} data-parallel ranks")]


def _plan_of(plans, rank: int) -> ExecutionPlan:
    if isinstance(plans, ExecutionPlan):
        return plans
    return next((p for p in plans if p.rank == rank), plans[0])


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2 ** 30 else f"{nbytes / 2**20:.2f} MiB"
