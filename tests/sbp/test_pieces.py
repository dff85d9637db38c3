"""The pieces of n-to-m transfers (NOTE: Reshard pieces, graphc/sbp/pieces.py), in one process:
every receiver's box is tiled exactly once, each piece sits where both sides say, and the
gradient's pieces are the value's, reversed."""
import pytest
import torch

from graphc.placement import Broadcast, Split
from graphc.sbp.layout import local_component
from graphc.sbp.pieces import Reshard, pieces

B, S0, S1 = Broadcast(), Split(0), Split(1)

CASES = {
    "2_to_3": ((6, 4), (S0,), (0, 1), (S0,), (2, 3, 4)),
    "3_to_2": ((6, 4), (S0,), (0, 1, 2), (S0,), (3, 4)),
    "2x2_rows_to_2": ((8, 6), (S0, B), ((0, 1), (2, 3)), (S0,), (4, 5)),
    "2x2_both_split_to_3": ((8, 6), (S0, S1), ((0, 1), (2, 3)), (S0,), (4, 5, 6)),
    "cols_to_rows": ((6, 6), (S1,), (0, 1), (S0,), (2, 3, 4)),
    "broadcast_to_split": ((5, 3), (B,), (0, 1), (S0,), (2, 3, 4)),
    "split_to_broadcast": ((5, 3), (S0,), (0, 1, 2), (B,), (3, 4)),
    "uneven_with_an_empty_receiver": ((3, 2), (S0,), (0, 1), (S0,), (2, 3, 4, 5)),
    "1d_to_2x2": ((7, 4), (S0,), (0, 1, 2), (S0, S1), ((3, 4), (5, 6))),
}


def _move(shape, src, src_mesh, dst, dst_mesh, found):
    """Runs the pieces on real tensors: every receiver's local tensor, assembled."""
    full = torch.arange(float(torch.tensor(shape).prod())).reshape(shape)
    local = {r: local_component(full, src, src_mesh, r) for r in _flat(src_mesh)}
    got = {}
    for p in found:
        piece = local[p.src][tuple(slice(a, a + n) for a, n in zip(p.src_at, p.shape))]
        assert tuple(piece.shape) == p.shape
        out = got.setdefault(p.dst, torch.full(p.dst_of, float("nan")))
        window = out[tuple(slice(a, a + n) for a, n in zip(p.dst_at, p.shape))]
        assert not window.numel() or window.isnan().all(), "two pieces fill one place"
        window.copy_(piece)
    return full, got


def _flat(mesh):
    return [r for row in mesh for r in row] if isinstance(mesh[0], tuple) else list(mesh)


@pytest.mark.parametrize("name", list(CASES))
def test_every_receiver_gets_exactly_its_shard(name):
    shape, src, src_mesh, dst, dst_mesh = CASES[name]
    full, got = _move(*CASES[name], pieces(shape, src, src_mesh, dst, dst_mesh))
    assert sorted(got) == sorted(_flat(dst_mesh)), "every receiver gets its input"
    for r in _flat(dst_mesh):
        assert torch.equal(got[r], local_component(full, dst, dst_mesh, r)), (name, r)


@pytest.mark.parametrize("name", list(CASES))
def test_gradients_go_back_in_the_senders_layout(name):
    shape, src, src_mesh, dst, dst_mesh = CASES[name]
    moved = Reshard(shape, src, src_mesh, dst, dst_mesh)
    full, got = _move(shape, dst, dst_mesh, src, src_mesh, moved.backward())
    for r in _flat(src_mesh):
        assert torch.equal(got[r], local_component(full, src, src_mesh, r)), (name, r)
        assert {p.src for p in moved.received_by(r, grad=True)} == {
            p.src for p in moved.backward() if p.dst == r}


def test_only_the_needed_rows_move():
    found = pieces((6, 4), (S0,), (0, 1), (S0,), (2, 3, 4))
    assert [(p.src, p.dst, p.shape[0], p.src_at[0], p.dst_at[0]) for p in found] == [
        (0, 2, 2, 0, 0), (0, 3, 1, 2, 0), (1, 3, 1, 0, 1), (1, 4, 2, 1, 0)]
    assert sum(p.shape[0] for p in found) == 6   # each row once: nothing crosses whole


def test_replicas_share_the_load():
    """A broadcast sender: receiver j takes its rows from replica j mod n."""
    found = pieces((6, 4), (B,), (0, 1), (S0,), (2, 3, 4))
    assert [(p.src, p.dst) for p in found] == [(0, 2), (1, 3), (0, 4)]


def test_partial_sums_are_refused():
    from graphc.placement import PartialSum
    with pytest.raises(ValueError, match="reduce it first"):
        pieces((4,), (PartialSum(),), (0, 1), (B,), (2,))
