"""tools/routing.py: expert exchanges priced by a recorded routing (NOTE: Routing log); the
recording itself and the priced plans of a real Mixtral: tests/examples/test_hub_experts.py."""
import json

import pytest

import graphc
from graphc.tools.routing import load_factor, read_routing


def test_the_busiest_member_against_the_balanced_load():
    """ep2, 4 experts (rank 0 holds 0-1, rank 1 holds 2-3), 4 pairs per rank: balanced, each
    sends 2 to the other. Rank 1 routing all 4 to experts 0-1 and rank 0 keeping its own:
    rank 0 receives 4 rows, twice the balanced load; a routing that stays home moves nothing."""
    layer = "model.layers.0.mlp.experts"
    skewed = {0: {layer: {0: [3, 1, 0, 0]}}, 1: {layer: {0: [2, 2, 0, 0]}}}
    assert load_factor(skewed, layer, 0, (0, 1)) == 2.0
    balanced = {0: {layer: {0: [1, 1, 1, 1]}}, 1: {layer: {0: [1, 1, 1, 1]}}}
    assert load_factor(balanced, layer, 0, (0, 1)) == 1.0
    home = {0: {layer: {0: [2, 2, 0, 0]}}, 1: {layer: {0: [0, 0, 2, 2]}}}
    assert load_factor(home, layer, 0, (0, 1)) == 0.0


def test_recorded_files_are_read_and_a_missing_layer_is_named(tmp_path):
    for rank, counts in ((0, [3, 1, 0, 0]), (1, [2, 2, 0, 0])):
        (tmp_path / f"routing_rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "step": 0, "layers": {"L": {"0": counts}}}))
    routing = read_routing(str(tmp_path))
    assert routing[1]["L"][0] == [2, 2, 0, 0]
    with pytest.raises(graphc.GraphcError, match=r"no recorded counts of 'L' micro-batch 1 on rank\(s\) \[0, 1\]"):
        load_factor(routing, "L", 1, (0, 1))
    with pytest.raises(graphc.GraphcError, match=r"GRAPHC_ROUTING_OUT="):
        read_routing(str(tmp_path / "empty"))
