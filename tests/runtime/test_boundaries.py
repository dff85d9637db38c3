"""Stage boundaries anywhere: a transformer block cut at every sub-module boundary trains
exactly like eager PyTorch on the whole batch (float64, the oracle of helpers.py).

One world of 2 gloo processes loops over every cut inside the workers, so the sweep pays
for process start-up once. Cuts inside the block send several values at once (the
residual stream, the normed input, head-split q/k views, attention probabilities, the
MLP's hidden activation), in an order of use that differs from their order of production.
"""
import pytest
import torch

from helpers import assert_same_as_eager, eager_train, graphc_train, run_world
from models import OPTIMIZERS
from transformer_models import BlockNet, CutGraph, block_batches, token_loss

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

STEPS = 2
ACCUMULATION = 2
CUTS = range(1, len(BlockNet.LEAVES))
# plain-op attention at every cut; F.scaled_dot_product_attention where the cut is inside it
CONFIGS = [(cut, False) for cut in CUTS] + [(cut, True) for cut in (3, 4, 5)]


def _optimizer(cut: int) -> str:
    return "adam" if cut % 2 else "sgd_momentum"


def _sweep(rank, world):
    out = {}
    batches = block_batches()
    for cut, sdpa in CONFIGS:
        torch.manual_seed(0)
        model = BlockNet(sdpa=sdpa)
        graph = CutGraph(model, OPTIMIZERS[_optimizer(cut)](model.parameters()), (cut,), ACCUMULATION)
        losses, state = graphc_train(graph, batches, STEPS)
        out[(cut, sdpa)] = {"losses": losses, "state": state,
                            "sent": [str(s) for s in graph.compiled.programs[0].send_to[1]]}
    return out


@pytest.mark.slow   # CI time: the cuts pair up in one process (tests/passes/test_split_stages.py)
def test_transformer_block_cut_at_every_position_matches_eager():
    results = run_world(_sweep, 2)
    batches = block_batches()
    refs = {}
    for (cut, sdpa), got in results[1].items():
        key = (sdpa, _optimizer(cut))
        if key not in refs:
            torch.manual_seed(0)
            refs[key] = eager_train(BlockNet(sdpa=sdpa), OPTIMIZERS[key[1]], None, token_loss,
                                    batches, STEPS)
        what = f"cut {cut} ({BlockNet.LEAVES[cut - 1]} | {BlockNet.LEAVES[cut]}) sdpa={sdpa} " \
               f"sending {got['sent']}"
        assert_same_as_eager(got["losses"], got["state"], *refs[key], what)
        for k, v in results[0][(cut, sdpa)]["state"].items():  # every rank: the same model
            torch.testing.assert_close(v, got["state"][k], atol=0, rtol=0)
    # the sweep did cut through residual blocks with several values in flight
    assert max(len(r["sent"]) for r in results[1].values()) >= 3
