"""SBP value helpers: boxing costs order signatures the way OneFlow's copy costs do; layouts."""
import torch

from graphc.placement import Broadcast, PartialSum, Split
from graphc.sbp.cost import boxing_cost, conversion_cost, moved_bytes
from graphc.sbp.layout import (Pieces, axis_groups, coord, local_component, local_shape, place_shard,
                               shard_slices)

B, P = Broadcast(), PartialSum()
T = 1024


def test_costs_follow_the_copy_cost_model():
    n = 4
    assert boxing_cost(Split(0), Split(0), T, n) == 0
    local = boxing_cost(B, Split(0), T, n)
    assert 0 < local < boxing_cost(Split(0), Split(1), T, n)  # slicing beats any transfer
    assert boxing_cost(Split(0), Split(1), T, n) == (n - 1) / n * T
    assert boxing_cost(Split(0), B, T, n) == boxing_cost(P, Split(0), T, n) == (n - 1) * T
    assert boxing_cost(P, B, T, n) == 2 * (n - 1) * T
    assert boxing_cost(P, B, T, 1) == 0                       # one rank: nothing to move


def test_conversion_cost_counts_the_gradient_and_the_collectives():
    n = 2
    # P->S(d) is cheaper forward, but its gradient is all-gathered back: for a value that
    # needs a gradient the all-reduce (identity backward) is as many bytes in one collective
    assert conversion_cost(P, Split(0), T, n, grad=False) < conversion_cost(P, B, T, n, grad=False)
    assert conversion_cost(P, B, T, n, grad=True) < conversion_cost(P, Split(0), T, n, grad=True)
    assert conversion_cost(B, Split(0), T, n, grad=True) > conversion_cost(B, Split(0), T, n, grad=False)
    assert conversion_cost(Split(0), Split(0), T, n, grad=True) == 0


def test_moved_bytes_per_rank_for_ring_collectives():
    assert moved_bytes("all_reduce", T, 4) == 2 * 3 * T // 4
    assert moved_bytes("all_gather", T, 4) == moved_bytes("reduce_scatter", T, 4) == 3 * T // 4
    assert moved_bytes("all_to_all", T, 4) == 3 * T // 16
    assert moved_bytes("all_gather", T, 1) == 0


def test_2d_mesh_groups_coordinates_and_nested_shards():
    mesh = ((0, 1), (2, 3))
    assert axis_groups(mesh, 0) == ((0, 2), (1, 3))          # axis 0: down the columns
    assert axis_groups(mesh, 1) == ((0, 1), (2, 3))          # axis 1: along the rows
    assert coord(mesh, 3) == (1, 1) and coord((4, 5), 5) == (1,)
    sbp = (Split(0), Split(0))                                # axis 0 splits first
    assert local_shape((8, 3), sbp, mesh) == (2, 3)
    full = torch.arange(24).reshape(8, 3)
    pieces = [local_component(full, sbp, mesh, r) for r in range(4)]
    assert torch.equal(torch.cat([pieces[0], pieces[1], pieces[2], pieces[3]]), full)
    assert shard_slices((8, 4), (B, Split(1)), mesh, 1) == (slice(0, 8), slice(2, 4))


def test_a_tensor_stored_in_pieces_holds_each_pieces_shard():
    """See NOTE: fused pieces: rank r holds shard r of each of q, k and v."""
    full = torch.arange(12.).view(6, 2)            # q rows 0-1, k rows 2-3, v rows 4-5
    shards = [local_component(full, (Split(0),), (0, 1), r, pieces=Pieces((2, 2, 2), 0)) for r in (0, 1)]
    assert shards[0][:, 0].tolist() == [0, 4, 8] and shards[1][:, 0].tolist() == [2, 6, 10]
    back = torch.zeros(6, 2)
    for r in (0, 1):
        place_shard(back, shards[r], (Split(0),), (0, 1), r, pieces=Pieces((2, 2, 2), 0))
    assert torch.equal(back, full)


def test_unequal_pieces_hold_each_pieces_shard():
    """Grouped-query q/k/v (See NOTE: fused pieces): pieces of 4, 2 and 2 rows on 2 ranks;
    rank r holds rows r*2.. of q and row r of k and of v, and place_shard puts them back."""
    full = torch.arange(16.).view(8, 2)            # q rows 0-3, k rows 4-5, v rows 6-7
    pieces = Pieces((4, 2, 2), 0)
    shards = [local_component(full, (Split(0),), (0, 1), r, pieces=pieces) for r in (0, 1)]
    assert shards[0][:, 0].tolist() == [0, 2, 8, 12] and shards[1][:, 0].tolist() == [4, 6, 10, 14]
    assert pieces.local_sizes((8, 2), (Split(0),), (0, 1), 1) == [2, 1, 1]
    back = torch.zeros(8, 2)
    for r in (0, 1):
        place_shard(back, shards[r], (Split(0),), (0, 1), r, pieces=pieces)
    assert torch.equal(back, full)


def test_unequal_pieces_checkpoint_as_blocks_at_their_offsets():
    """graph.state_dict() of a tensor in unequal pieces goes to DCP as one block per piece at
    its global offset (graphc/dcp.py)."""
    from graphc.checkpoint.dcp import Layout, _pieces_wrapper
    full = torch.arange(16.).view(8, 2)
    layout = Layout((8, 2), (Split(0),), (0, 1), "cpu", pieces=Pieces((4, 2, 2), 0))
    local = local_component(full, layout.sbp, layout.mesh, 1, pieces=layout.pieces)
    wrapper = _pieces_wrapper(local, layout, 1)
    assert wrapper.local_offsets() == [torch.Size([2, 0]), torch.Size([5, 0]), torch.Size([7, 0])]
    for block, offset in zip(wrapper.local_shards(), wrapper.local_offsets()):
        assert torch.equal(block, full[offset[0]:offset[0] + block.shape[0]])
    assert torch.equal(torch.cat(wrapper.local_shards()), local)
