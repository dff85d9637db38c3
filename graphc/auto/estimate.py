"""The search's estimates on paper: a layout's step and memory from one one-rank compile.

NOTE: Auto estimate
With F the forward seconds of one micro-batch on one stage (the one-rank forward over data
x micro-batches x stages, and over tensor degree where the layers have pairs), u = 3F (4F
checkpointed: the recompute, once per micro-batch, as the simulator charges it, NOTE:
Recompute cost) a stage's forward and backward, and W the busiest rank's work per
micro-batch (chunks x u on even stages; stages cut by layers put the ends, the forward
outside the layer list, a language model's head, on the last stage: W counts its chunks'
share of the layers plus the ends, whose share `ends_share` takes from the Linear weights'
elements): GPipe and 1F1B take m W + (p - 1) W, interleaved 1F1B m W + (p - 1) u, ZB-V
m W + (p - 1) u / 2; data parallelism adds half a ring all-reduce of the rank's gradients
(the other half overlaps the backward), tensor parallelism four ring all-reduces per layer
and micro-batch of one activation (the saved bytes of a layer over 8); a ring over a group
that spans more ranks than a node holds (data: dp x tp consecutive ranks) runs at the
network's bandwidth. On CPU presets F adds the host time of the stage's share of the model's ops (not cut by data or tensor
degree, nor by micro-batches: each op is dispatched whatever its size), u the runtime's
time per compute instruction and per transfer, each collective its host time per member;
where a node's ranks share C cores the step is at least the world's summed work over C
(NOTE: Shared cores in graphc/tools/shared_cores.py), a hand-off per wait included (every
member of a collective but the last to join, and about one receive a micro-batch on a
pipeline's rank): on 8 local-world ranks of a small model, the layout that does the least
work and waits least wins, not the one with the shortest path. The activations of a micro-batch
on a stage are the one-rank bytes over data x micro-batches x stages, and under tensor degree t
x (TP_UNSPLIT + (1 - TP_UNSPLIT) / t): what lies outside the Megatron pairs stays whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from .layout import Layout, layer_list

# the share of a transformer layer's activations that tensor parallelism leaves whole (norms,
# residuals, dropout masks outside the pairs): 10 of the 34 sbh bytes per layer of Korthikanti
# et al., "Reducing Activation Recomputation in Large Transformer Models" (2022), without
# sequence parallelism; graphc's memory model found 0.66 of tp1's bytes per layer at tp2 on
# Llama-3-8B (this gives 0.65)
TP_UNSPLIT = 10 / 34


@dataclass
class ModelFacts:
    """What the estimates read, from one compile on one rank."""

    forward_s: float            # the whole batch's forward on the device, one rank
    activation_bytes: int       # its saved activations
    param_bytes: int
    states: int                 # optimizer state tensors per parameter
    layers: int
    tp_degrees: Tuple[int, ...]   # tensor degrees whose Megatron pairs divide every layer
    rows: int                   # the batch's rows
    link_bytes_per_s: float
    latency_s: float
    # host time (CPU presets; 0 on accelerators, NOTE: Auto estimate): of the whole model's
    # ops of one micro-batch's forward, per compute instruction, per collective member, per
    # transfer, and the cores a node's ranks share (0: a device each)
    forward_host_s: float = 0.0
    instruction_s: float = 0.0
    collective_s: float = 0.0
    p2p_s: float = 0.0
    cores: float = 0.0
    node_ranks: int = 0         # ranks a node holds (the preset's gpus_per_node)
    handoff_s: float = 0.0      # per wait where ranks share cores (NOTE: Shared cores)
    net_bytes_per_s: float = 0.0    # between nodes (0: the link above everywhere)
    net_latency_s: float = 0.0
    ends_share: float = 0.0     # of the forward outside the layer list (NOTE: Auto estimate)


def ends_share(root) -> float:
    """The share of a forward's matmul FLOPs outside the layer list (a language model's head),
    by Linear weights: each costs 2 x rows x its elements (NOTE: Auto estimate)."""
    import torch.nn as nn
    name, layers = layer_list(root)
    inside = {id(m) for layer in layers for m in layer.modules()}
    linear = [m for m in root.modules() if isinstance(m, nn.Linear)]
    total = sum(m.weight.numel() for m in linear)
    ends = sum(m.weight.numel() for m in linear if id(m) not in inside)
    return ends / total if total and layers else 0.0


def estimate(lay: Layout, f: ModelFacts) -> Tuple[float, int]:
    """(step seconds, bytes per rank) on paper (See NOTE: Auto estimate)."""
    tp_split = lay.tp if lay.tp in f.tp_degrees else 1
    m, p = lay.microbatches, lay.pp
    whole = f.forward_s / (lay.dp * m * tp_split)        # one micro-batch's forward, all stages
    F = whole / lay.stages + f.forward_host_s / lay.stages
    # the busiest rank: its chunks' share of the layers, and the ends (the head, on the last stage)
    F_rank = whole * ((1 - f.ends_share) * lay.chunks / lay.stages + f.ends_share) \
        + f.forward_host_s * lay.chunks / lay.stages if p > 1 else lay.chunks * F
    computes = 3 if lay.schedule == "zbv" else 2          # F, B (ZB-V: F, I, W) per micro-batch
    times = 4 if lay.checkpointing == "always" else 3
    u = times * F + computes * f.instruction_s
    waits = 0.0   # a rank's waits per step where ranks share cores (NOTE: Shared cores)
    if p > 1:     # a send and a receive each way per stage boundary and micro-batch
        u += 4 * f.p2p_s
        waits += m * lay.chunks    # about one a micro-batch: a gradient not yet sent back
    W = times * F_rank + lay.chunks * (u - times * F)
    bubble = {"interleaved_1f1b": (p - 1) * u, "zbv": (p - 1) * u / 2}.get(lay.schedule, (p - 1) * W)
    step = m * W + (bubble if p > 1 else 0)
    if p > 1:
        step += 2 * (m + p - 1) * lay.chunks * f.latency_s
    collectives = []      # seconds of a rank's collectives, host time included
    grads = f.param_bytes / (p * tp_split)
    if lay.dp > 1:   # a data group spans dp x tp consecutive ranks (Layout.ranks)
        bandwidth, latency = _group_link(f, lay.dp * tp_split)
        ring = 2 * (lay.dp - 1) / lay.dp * grads / bandwidth + 2 * (lay.dp - 1) * latency
        calls = 1 if lay.zero == 0 else 2 + (2 * f.layers / p * m if lay.zero == 3 else 0)
        collectives.append(ring / 2 * (1.5 if lay.zero == 3 else 1.0) + calls * f.collective_s)
        waits += calls * (lay.dp - 1) / lay.dp      # every member but the last to join waits
    if tp_split > 1:
        msg = f.activation_bytes / max(f.layers, 1) / (lay.dp * m) / 8
        bandwidth, latency = _group_link(f, tp_split)
        one = 2 * (tp_split - 1) / tp_split * msg / bandwidth + 2 * (tp_split - 1) * latency
        collectives.append(4 * (f.layers / p) * m * (one + f.collective_s))
        waits += 4 * (f.layers / p) * m * (tp_split - 1) / tp_split
    for seconds in collectives:
        step += seconds
    if f.cores:   # a node's ranks share its cores: at least their summed work (NOTE: Shared cores)
        ranks = min(lay.world, f.node_ranks) if f.node_ranks else lay.world
        work = m * lay.chunks * u       # an average rank's: the ranks' sum over them
        step = max(step, ranks * (work + sum(collectives) + waits * f.handoff_s) / f.cores)
    return step, memory_estimate(lay, f)


def _group_link(f: ModelFacts, span: int) -> Tuple[float, float]:
    """(bandwidth, latency) of a ring over a group whose ranks span `span` consecutive ranks:
    the network's once it leaves a node, as the simulator's collectives (CostModel.collective)."""
    if f.net_bytes_per_s and f.node_ranks and span > f.node_ranks:
        return f.net_bytes_per_s, f.net_latency_s
    return f.link_bytes_per_s, f.latency_s


def memory_estimate(lay: Layout, f: ModelFacts) -> int:
    tp_split = lay.tp if lay.tp in f.tp_degrees else 1
    whole = f.param_bytes / (lay.pp * tp_split)
    d = lay.dp
    params = whole / d if lay.zero == 3 else whole
    grads = whole / d if lay.zero >= 2 else whole
    optim = f.states * (whole / d if lay.zero >= 1 else whole)
    # tensor parallelism splits the activations inside the Megatron pairs only (NOTE: Auto estimate)
    tp_share = TP_UNSPLIT + (1 - TP_UNSPLIT) / tp_split if tp_split > 1 else 1.0
    per_mb = f.activation_bytes * tp_share / (lay.dp * lay.microbatches * lay.stages)
    if lay.pp == 1:
        inflight = 1                                  # accumulation: one micro-batch at a time
    else:
        inflight = lay.microbatches if lay.schedule == "gpipe" else min(lay.pp, lay.microbatches)
    held = per_mb * lay.chunks * inflight
    if lay.checkpointing == "always":
        held = per_mb * lay.chunks + inflight * per_mb / max(f.layers / lay.stages, 1) / 4
    transient = whole if lay.zero == 3 else 0         # a stage gathered whole at stage 3
    return int(params + grads + optim + held + transient)
