"""The simulator's ring attention with and without its overlap (NOTE: Ring overlap).

    python benchmarks/ring_overlap.py [--seq 4096] [--cp 4] [--device h100]

examples/long_context.py's HF Llama (2 layers of 512, 8 heads, two padded rows) with the
sequence split over --cp ranks (ring), compiled in this process for --cp ranks and simulated
on the device preset's modelled costs twice: each ring step's transfer beside its block's
compute (device_costs' ring_blocks), and the steps timed in turn after the compute (no
ring_blocks, the simulator before the overlap was modelled). Prints both step times.
"""
import argparse
import dataclasses
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from graphc import compiler, sbp  # noqa: E402
from graphc.executable import input_specs  # noqa: E402
from graphc.tools.costs import device_costs  # noqa: E402
from graphc.tools.simulate import simulate  # noqa: E402
from helpers import global_input  # noqa: E402


def compiled_llama(seq: int, cp: int):
    import hf_llama
    import long_context as lc

    class FlatInputs(lc.LongContextGraph):   # the batch's tensors as inputs, one by one
        def build(self, ids, mask, labels):
            out = self.model(input_ids=ids, attention_mask=mask, labels=labels)
            out.loss.backward()
            return out.loss
    mesh = lc.Mesh(1, cp, 1)
    model = hf_llama.make_model(256, argparse.Namespace(seed=0, embd=512, layers=2, heads=8, block=seq))
    graph = FlatInputs(model, torch.optim.AdamW(model.parameters()), mesh, "ring", False)
    g = torch.Generator().manual_seed(0)
    batch = hf_llama.collate([torch.randint(0, 256, (seq - 7,), generator=g) for _ in range(2)], seq)
    specs = input_specs([global_input(batch[k], mesh.placement, sbp.split(1))
                         for k in ("input_ids", "attention_mask", "labels")])
    return compiler.compile(graph, [s.example() for s in specs], cp, [s.layout for s in specs])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--device", default="h100")
    args = parser.parse_args(argv)
    compiled = compiled_llama(args.seq, args.cp)
    costs = device_costs(compiled, args.device)
    beside = simulate(compiled.plans, costs).step_time
    in_turn = simulate(compiled.plans, dataclasses.replace(costs, ring_blocks={})).step_time
    block = max(costs.ring_blocks.values())
    print(f"seq {args.seq} cp{args.cp} {args.device}: one block {block * 1e3:.3f} ms; step with the steps in "
          f"turn {in_turn * 1e3:.3f} ms, beside their blocks {beside * 1e3:.3f} ms ({beside / in_turn:.3f}x)")


if __name__ == "__main__":
    main()
