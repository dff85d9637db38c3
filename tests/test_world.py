"""TorchWorld's collectives on a gloo world (graphc/world.py).

- all_to_all moves part i of each rank's list to rank i (parts of one shape, as
  ops/conversions.py pads them and gloo requires), both by dist.all_to_all and by the flat
  form torch < 2.13 uses on gloo (docs/design.md: Torch versions); the flat form runs on
  every torch, so 2.13's CI covers it too.
"""
import pytest
import torch

from graphc import world
from graphc.runtime.dist_env import ensure_process_group
from helpers import run_world

pytestmark = pytest.mark.world  # spawns ranks (tests/test_world_marker.py)


def _swap(rank, size):
    ensure_process_group()
    # rank r sends to rank j the part [r * 10 + j, r * 10 + j + 0.5]
    send = [torch.tensor([rank * 10 + j, rank * 10 + j + 0.5]) for j in range(size)]
    listed = [torch.empty(2) for _ in range(size)]
    flat = [torch.empty(2) for _ in range(size)]
    if world._GLOO_LIST_ALL_TO_ALL:
        world.current().all_to_all(listed, send)
    else:
        listed = None   # gloo before 2.13 has no list all_to_all: the flat form is the one used
    world._all_to_all_flat(flat, send, None)
    return listed, flat


def test_all_to_all_sends_part_i_to_rank_i():
    for rank, (listed, flat) in enumerate(run_world(_swap, 2)):
        expected = [torch.tensor([src * 10 + rank, src * 10 + rank + 0.5]) for src in range(2)]
        for got in (listed, flat):
            if got is not None:
                assert all(torch.equal(g, e) for g, e in zip(got, expected)), (rank, got)
