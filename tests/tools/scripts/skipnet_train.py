"""A small training script for `graphc plan` tests: SkipNet with stage s on rank s.

    python skipnet_train.py --stages 4 [--accumulation 4] [--schedule gpipe] [--device cuda]
                            [--eval-graph]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from models import PipelineGraph, SkipNet  # noqa: E402


class EvalGraph(PipelineGraph):
    def build(self, x, y):
        return self.loss_fn(self.model(x), y)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--eval-graph", action="store_true", help="also compile an eval graph")
    parser.add_argument("--out", default="ignored", help="an option named like graphc plan's")
    args = parser.parse_args()
    model = SkipNet(args.stages)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    graph = PipelineGraph(model, opt, None, args.accumulation, args.schedule, args.device)
    x, y = torch.randn(16, 16), torch.randint(0, 5, (16,))
    if args.eval_graph:
        graph.compile(x, y)
        EvalGraph(model, None, None, 2, args.schedule, args.device).compile(x, y)
    for _ in range(3):
        graph(x, y)
    raise SystemExit("unreachable in plan mode: the first step stops the script")


if __name__ == "__main__":
    main()
