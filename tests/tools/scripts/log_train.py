"""A 4-stage SkipNet pipeline with a module build() never uses, for the logging tests.

    torchrun --nproc_per_node 4 log_train.py      (GRAPHC_DEBUG=1, GRAPHC_LOG_RANKS=...)
"""
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from models import PipelineGraph, SkipNet  # noqa: E402


class SpareGraph(PipelineGraph):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spare = nn.Linear(2, 2)   # never used by build(): graphc warns about it


def main():
    torch.manual_seed(0)
    model = SkipNet(4)
    graph = SpareGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), None, 2)
    x, y = torch.randn(8, 16), torch.randint(0, 5, (8,))
    for _ in range(2):
        graph(x, y)  # LOG-TEST: the first call compiles (and warns) here


if __name__ == "__main__":
    main()
