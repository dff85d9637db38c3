"""Trains a 2-stage pipeline for a few steps and writes what it ended with.

    python two_hosts_train.py OUT_DIR   (one process per rank, torchrun's variables set)

Each rank writes OUT_DIR/rank<R>.pt: the transport of each of its channels, the losses
and its parameters, so a test can compare a run split over two "hosts" with one that is not.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers import ORACLE_DTYPE  # noqa: E402
from models import PipelineGraph, SkipNet, make_batches  # noqa: E402


def main(out_dir: str):
    torch.set_default_dtype(ORACLE_DTYPE)
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    model = SkipNet(int(os.environ["WORLD_SIZE"]))
    graph = PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=2)
    losses = [graph(x, y) for x, y in make_batches()]
    losses = [l.to_local().clone() for l in losses]
    kinds = {f"{src}->{dst}": kind for (src, dst), kind in graph._runtime.p2p.kinds.items()}
    torch.save({"kinds": kinds, "losses": losses,
                "state": graph.state_dict()["model"]}, os.path.join(out_dir, f"rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
