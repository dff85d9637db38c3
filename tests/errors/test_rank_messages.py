"""Mistakes only a multi-rank run shows, named for the user (docs/errors.md), on real ranks:
every rank saving its checkpoint to one path, a rank that runs out of data under data
parallel. Each asserts the message's content: what happened, where (which ranks), the fix."""
import os
import sys

import pytest
import torch

import graphc
from helpers import run_world
from models import PipelineGraph, SkipNet, make_batches

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "reliability"))
from launch import torchrun  # noqa: E402

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)


def _save_to_one_path(rank, world, folder):
    """Both stages of a pipeline save to ckpt.pt, then resume from it."""
    import torch.distributed as dist
    torch.manual_seed(0)
    model = SkipNet(world)
    graph = PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = make_batches(1)[0]
    graph(x, y)
    path = os.path.join(folder, "ckpt.pt")
    graphc.save(graph.state_dict(), path)
    dist.barrier()          # both have written: the file is the last writer's
    try:
        graph.load_state_dict(graphc.load(path))
        return None
    except graphc.GraphcError as e:
        return str(e)


def test_every_rank_saving_to_one_path(tmp_path):
    messages = run_world(_save_to_one_path, 2, str(tmp_path), timeout=180)
    saver = next(r for r, m in enumerate(messages) if m is None)   # it loads its own file
    (other,) = [r for r in range(2) if r != saver]
    message = messages[other]
    for fragment in (f"this checkpoint was saved by rank {saver}, but is loaded on rank {other}",
                     "when several ranks save to the same path they write the same file",
                     f"only the last writer's (rank {saver}'s) is left",
                     "f\"ckpt/rank{rank}.pt\"", "dcp.save(graph.state_dict(), checkpoint_id=d)"):
        assert fragment in message, message
    assert "different model" not in message


def test_a_rank_that_ran_out_of_data():
    """Rank 1's shard gives 2 batches, rank 0's 3 (no drop_last): rank 1 exits normally after
    its second step, and rank 0's third call names it instead of gloo's 'remote worker
    crashing'."""
    out = torchrun(os.path.join(HERE, "scripts", "uneven_data.py"), [], 2, timeout=120)
    assert out.returncode != 0, out.output
    assert "rank 1 out of data" in out.output and "rank 0 out of data" not in out.output
    for fragment in ("RankFailedError: rank 0: rank(s) [1] stopped calling the graph",
                     "their script ended normally before their call 3, which rank 0 is making",
                     "Every rank must call the graph the same number of times",
                     "drop_last=True", "the same number of steps"):
        assert fragment in out.output, out.output[-4000:]
    assert out.seconds < 60, out.seconds     # named at once, not after GRAPHC_TIMEOUT (60 s)
