"""Public value types and the Graph's module wrapping (API.md)."""
import pytest
import torch
import torch.nn as nn

import graphc
from graphc import sbp


def test_placement_and_sbp_print_hash_and_compare():
    p = graphc.placement("cpu", ranks=[0, 1])
    assert repr(p) == 'placement(type="cpu", ranks=[0, 1])'
    assert p == graphc.placement("cpu", [0, 1]) and hash(p) == hash(graphc.placement("cpu", [0, 1]))
    assert repr(graphc.placement("cuda", [[0, 1], [2, 3]])) == 'placement(type="cuda", ranks=[[0, 1], [2, 3]])'
    assert [repr(s) for s in (sbp.split(0), sbp.split(1), sbp.broadcast, sbp.partial_sum)] == \
        ["split(0)", "split(1)", "broadcast", "partial_sum"]
    assert sbp.split(1) == sbp.split(1) and len({sbp.split(0), sbp.split(0), sbp.broadcast}) == 2
    with pytest.raises(Exception):
        p.type = "cuda"


@pytest.mark.parametrize("bad,match", [
    (lambda: graphc.placement("tpu", [0]), "placement type must be one of"),
    (lambda: graphc.placement("cpu", [0, 0]), "distinct"),
    (lambda: graphc.placement("cpu", []), "at least one rank"),
    (lambda: graphc.placement("cpu", [[0, 1], [2]]), "rows of equal length"),
])
def test_bad_placements_are_user_errors(bad, match):
    with pytest.raises(graphc.GraphcError, match=match):
        bad()


def test_global_tensor_from_local_component():
    p = graphc.placement("cpu", [0, 1])
    g = graphc.to_global(torch.ones(4, 3), placement=p, sbp=sbp.split(-1))
    assert g.shape == (4, 6) and g.sbp == (sbp.split(1),) and g.placement == p
    assert torch.equal(g.to_local(), torch.ones(4, 3))
    b = graphc.to_global(torch.ones(4, 3), placement=p, sbp=sbp.broadcast)
    assert b.shape == (4, 3)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
        self.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])


class G(graphc.Graph):
    def __init__(self):
        super().__init__()
        self.net = Net()

    def build(self, x):
        return self.net.seq(x)


def test_blocks_wrap_attributes_indexing_and_config():
    g = G()
    assert g.net.seq[-1].config is g.net.seq[2].config          # one config per module
    g.net.blocks[1].config.set_stage(0, graphc.placement("cpu", [0]))
    assert g._module_configs["net.blocks.1"].stage_id == 0
    assert isinstance(g.net.seq[0].origin, nn.Linear) and len(g.net.blocks) == 3
    assert [b._qualname for b in g.net.blocks] == ["net.blocks.0", "net.blocks.1", "net.blocks.2"]
    assert g.net.seq[0].weight.shape == (2, 2)                  # attributes pass through
    assert "not compiled" in repr(g)


def test_single_process_graph_runs_and_prints():
    g = G()
    out = g(torch.randn(4, 2))
    assert isinstance(out, graphc.GlobalTensor) and out.to_local().shape == (4, 2)
    assert "0F0" in str(g.plan) and "def forward" in repr(g)
    assert g.plan.to_json()["format"] == "graphc.plan/1"


def test_sequential_from_an_ordered_dict_is_indexed_by_its_own_names():
    """ViT's encoder.layers[1] is named "encoder_layer_1", not "1" (it was staged wrong)."""
    from collections import OrderedDict

    class G(graphc.Graph):
        def __init__(self):
            super().__init__()
            self.seq = torch.nn.Sequential(OrderedDict(first=torch.nn.Linear(2, 2), second=torch.nn.Linear(2, 2)))
            self.seq[1].config.set_stage(1, graphc.placement("cpu", [1]))
            self.seq[-2].config.set_stage(0, graphc.placement("cpu", [0]))

        def build(self, x):
            return self.seq(x)

    g = G()
    assert {name: c.stage_id for name, c in g._module_configs.items()} == {"seq.second": 1, "seq.first": 0}
