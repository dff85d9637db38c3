"""Accelerator presets and the communication model the simulator charges: links inside a
node and between nodes, ring and tree collectives.

Numbers per GPU and per direction, from the vendors' datasheets:

| preset | dense bf16/fp16 | fp32 | HBM | NVLink (in a node of 8) | network (between nodes) |
|---|---|---|---|---|---|
| h100 | 989 TFLOP/s | 67 TFLOP/s | 3,350 GB/s | 450 GB/s (NVLink 4: 900 GB/s both ways) | 50 GB/s (DGX H100: a 400 Gb/s ConnectX-7 NDR port per GPU) |
| h200 | 989 TFLOP/s | 67 TFLOP/s | 4,800 GB/s | 450 GB/s (NVLink 4) | 50 GB/s (DGX H200: as DGX H100) |
| a100 | 312 TFLOP/s | 19.5 TFLOP/s | 2,039 GB/s | 300 GB/s (NVLink 3: 600 GB/s both ways) | 25 GB/s (DGX A100: a 200 Gb/s ConnectX-6 HDR port per GPU) |

| cpu | 0.1 TFLOP/s | 0.1 TFLOP/s | 20 GB/s | 0.65 GB/s (ranks of one host: the local world's memory, shared memory or gloo over loopback) | 1.25 GB/s (10 GbE) |

The cpu row models CPU ranks on one host, as graphc's local world runs them (8 ranks of a
tiny model on this 2-core build machine: what benchmarks/auto_quality.py measures). Its
FLOP rates (an AVX2 core's FMA peak is about 0.1 TFLOP/s in float32; measured 0.03 float32,
0.012 float64 on a loaded 2-core build machine), the latency (30 us per step between ranks
of a host, 50 us between hosts), the network and 16 GiB a rank are assumptions. What
decides a small model's step on CPU ranks is host time, not FLOPs, and that is measured
(`PYTHONPATH=. python benchmarks/cpu_calibration.py`, three runs of the least of 5 rounds,
float64, one torch thread; 2026-11-28 at load average 6.9-8.1 on the 2 cores; the local
world's numbers in the process's CPU time, which other processes' load does not stretch):
op_us 8.1 per op a forward dispatches as device_costs counts them (its backward twice; the
runs gave 8.0-9.5), instruction_us 61 per compute instruction of the runtime (a wall-time
difference of two graph calls, 0-127 between the runs: the middle one), collective_us 13
per member of a collective beside its wait (9.9-16.4), link_gbps 2.7 (the local world's
all-reduce copies and sums in memory), p2p_us 1.7 per side of a transfer whose data is
there (sent before its receiver asks; 1.6-2.2), and handoff_us 125 per wait (an 8-rank
barrier's, per wait: 118-135 us of CPU; a 2-rank ping-pong, each message waited for,
122-129 per message; the same wait took 204-264 us of wall time at that load): in a local
world only a rank that must wait hands the core over, and that switch, not the transfer,
is the cost (NOTE: Shared cores). The previous preset charged every transfer and every collective
member a hand-off (p2p_us = collective_us = 279, and its ping-pong had moved a 4 MiB
tensor), which ranked the pipeline of 8, whose ranks run ahead and rarely wait, last of
the GPT's layouts. cores_per_node 1: the ranks of a local world run one at a time (NOTE:
Local world), so the step is at least their summed work and waits (NOTE: Shared cores);
for ranks that are processes on C cores pass cores_per_node=C to device_costs. The search
weighs these against each other, so their ratios matter more than their scale.

The fp32 column is the SXM parts' plain fp32 rate: PyTorch's default for float32 matmuls
(torch.backends.cuda.matmul.allow_tf32 is False), so a float32 program runs there and a
program under autocast (enable_amp) runs its matmuls and convolutions at the bf16 rate
(graphc/tools/costs.py counts each op's FLOPs at the rate of its operands' dtype).

Latencies are assumptions, not measurements: 5 us per transfer or collective step over
NVLink and 10 us across the network, the order of NCCL's own tuning model (a base
latency of several microseconds per collective plus about 1-3 us per NVLink hop and more
per network hop, nccl src/graph/tuning.cc). Ranks are numbered node by node (torchrun's
order), so ranks r and q share a node when r // 8 == q // 8.

Collectives (NOTE: Collective costs): a group inside one node runs at NVLink's bandwidth
and latency; a group that spans nodes at the network's (its slowest link; NCCL's
hierarchical algorithms that use NVLink for the in-node part are not modelled). For a
global buffer of B bytes over n ranks:
  * ring: each rank sends moved_bytes(kind, B, n) (graphc/sbp/cost.py: 2(n-1)/n B for an
    all-reduce, (n-1)/n B for an all-gather or reduce-scatter) in 2(n-1) (all-reduce) or
    n-1 steps, each costing one latency: sent / bandwidth + steps x latency;
  * tree (all-reduce only, NCCL's double binary tree): a reduce up and a broadcast down,
    each ceil(log2 n) latencies deep and moving the whole buffer once:
    2 (ceil(log2 n) x latency + B / bandwidth).
An all-reduce takes the faster of the two, as NCCL picks per size: the tree for small,
latency-bound buffers, the ring for large ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Sequence, Tuple


@dataclass(frozen=True)
class DevicePreset:
    """Peak rates of one accelerator and its links (per direction)."""

    name: str
    tflops: float               # dense bf16/fp16 tensor-core TFLOP/s (low precision: amp)
    hbm_gbps: float             # memory bandwidth, GB/s
    link_gbps: float            # NVLink bandwidth between two GPUs of a node, GB/s
    latency_us: float           # NVLink latency per transfer or collective step, microseconds
    efficiency: float = 0.5     # fraction of peak FLOP/s a real kernel mix reaches
    gpus_per_node: int = 8
    net_gbps: float = 50.0      # network bandwidth per GPU between nodes, GB/s
    net_latency_us: float = 10.0
    fp32_tflops: float = 67.0   # float32 TFLOP/s (no TF32): every other dtype's ops
    memory_gib: float = 80.0    # device memory, GiB (what a rank's peak must fit in)
    # host costs of CPU ranks (0 on accelerators, whose host work overlaps their kernels):
    op_us: float = 0.0          # per op a forward dispatches (its backward: twice)
    instruction_us: float = 0.0     # the runtime's time per compute instruction
    collective_us: float = 0.0      # per member of a collective call, whatever its bytes
    p2p_us: float = 0.0             # per send and per receive whose data is there
    handoff_us: float = 0.0         # per wait, where ranks share cores (NOTE: Shared cores)
    cores_per_node: float = 0.0     # cores a node's ranks share (0: a device each; NOTE: Shared cores)


DEVICES: Dict[str, DevicePreset] = {
    "h100": DevicePreset("h100", tflops=989, hbm_gbps=3350, link_gbps=450, latency_us=5,
                         net_gbps=50, memory_gib=80),
    "h200": DevicePreset("h200", tflops=989, hbm_gbps=4800, link_gbps=450, latency_us=5,
                         net_gbps=50, memory_gib=141),
    "a100": DevicePreset("a100", tflops=312, hbm_gbps=2039, link_gbps=300, latency_us=5,
                         net_gbps=25, fp32_tflops=19.5, memory_gib=80),
    # CPU ranks of one host (See the cpu row above: assumed rates, measured host costs)
    "cpu": DevicePreset("cpu", tflops=0.1, hbm_gbps=20, link_gbps=2.7, latency_us=30, gpus_per_node=64,
                        net_gbps=1.25, net_latency_us=50, fp32_tflops=0.1, memory_gib=16,
                        op_us=8.1, instruction_us=61, collective_us=13, p2p_us=1.7, handoff_us=125,
                        cores_per_node=1),
}


@dataclass(frozen=True)
class Network:
    """Links between nodes of `ranks_per_node` ranks (inside a node: the CostModel's link)."""

    ranks_per_node: int
    bandwidth: float            # bytes per second
    latency: float              # seconds per transfer or collective step

    def crosses(self, ranks: Sequence[int]) -> bool:
        """Whether `ranks` (a transfer's two ends, or a group) span more than one node."""
        node = ranks[0] // self.ranks_per_node
        return any(r // self.ranks_per_node != node for r in ranks)

    @staticmethod
    def of(preset: DevicePreset) -> "Network":
        return Network(preset.gpus_per_node, preset.net_gbps * 1e9, preset.net_latency_us * 1e-6)


def ring_steps(kind: str, n: int) -> int:
    """Latencies one collective pays; a context-parallel ring step (`send_recv`: each rank
    sends its block to the next, NOTE: Context parallel) pays one."""
    if kind == "send_recv":
        return 1
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def collective_seconds(kind: str, sent: int, whole: int, n: int, link: Tuple[float, float]) -> float:
    """Seconds of one collective (see NOTE: Collective costs in the module docstring).

    Args:
        kind: all_reduce, all_gather, reduce_scatter, all_to_all or send_recv.
        sent: bytes each rank sends in the ring algorithm.
        whole: the global buffer's bytes (for the tree all-reduce).
        n: the group's size.
        link: (bandwidth in bytes/s, latency in s) of the group's slowest link.
    """
    if n < 2:
        return 0.0
    bandwidth, latency = link
    ring = sent / bandwidth + ring_steps(kind, n) * latency
    if kind != "all_reduce":
        return ring
    return min(ring, 2 * (math.ceil(math.log2(n)) * latency + whole / bandwidth))
