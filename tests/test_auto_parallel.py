"""enable_auto_parallel at run time (NOTE: Run-time search in graphc/auto/layout.py, NOTE:
Search cache in graphc/auto/cache.py): a Graph that declares nothing asks for a searched
layout; in the local world every rank trains on rank 0's choice and equals eager PyTorch on
the whole batch in float64 at 1e-10; a second job with the same model and world takes the
layout from the cache without searching; a question that differs is searched again."""
import os
import sys

import pytest
import torch

import graphc
from graphc.auto.cache import entry_path, search_key
from graphc.auto.layout import AutoRequest, named_searcher
from graphc.runtime.local_world import LocalWorld
from helpers import assert_close

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402

BATCH, BLOCK = 8, 8


class AutoParallelGPT(graphc.Graph):
    def __init__(self, model, cache, top=2):
        super().__init__()
        self.model = model
        self.config.enable_auto_parallel(True, device="h100", top=top, cache=cache)
        self.add_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))

    def build(self, idx, targets):
        loss = lm_loss(self.model(idx), targets)
        loss.backward()
        return loss


def _gpt(layers):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=17, block_size=BLOCK, n_layer=layers, n_head=2, n_embd=16))


def _batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 17, (BATCH, BLOCK), generator=g), torch.randint(0, 17, (BATCH, BLOCK), generator=g))
            for _ in range(n)]


def _train(cache, data, world, layers, top):
    def rank_main(rank):
        graph = AutoParallelGPT(_gpt(layers), cache, top)
        losses = [graph(x, y).to_local() for x, y in data]
        return graph.config.layout, [float(l) for l in losses if l.numel()], graph.full_state_dict(rank0_only=True)
    return LocalWorld(world).run(rank_main)


def _eager(data, layers):
    model = _gpt(layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in data:
        loss = lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


# by default 2 ranks, 2 layers and one candidate simulated (CI time); 4 ranks, 4 layers and two
# candidates with -m slow
@pytest.mark.parametrize("world,layers,top", [(2, 2, 1), pytest.param(4, 4, 2, marks=pytest.mark.slow)])
def test_every_rank_trains_on_rank_0s_search_as_eager_then_the_cache_answers(tmp_path, capfd, world, layers, top):
    data = _batches(1 if world == 2 else 2)
    runs = _train(str(tmp_path), data, world, layers, top)
    layouts = {layout for layout, _, _ in runs}
    assert len(layouts) == 1 and next(iter(layouts)).world == world, layouts
    want_losses, want_state = _eager(data, layers)
    losses = next(l for _, l, _ in runs if l)
    for got, want in zip(losses, want_losses):
        assert_close(torch.tensor(got), torch.tensor(want), "loss")
    for k, v in want_state.items():
        assert_close(runs[0][2][k], v, k)
    assert "searched in" in capfd.readouterr().err
    assert len(os.listdir(tmp_path)) == 1          # one question, one file
    # the next job's rank 0 asks the same question: the cache answers, no search
    graph = AutoParallelGPT(_gpt(layers), str(tmp_path), top)
    x, y = data[0]
    again = named_searcher()(graph._compile_spec(), [x, y], world, [True, True], graph._optimizer, graph.config.auto)
    assert {again} == layouts and "from the search cache" in capfd.readouterr().err


def test_the_cache_key_changes_with_the_model_the_world_and_the_device(tmp_path):
    """One file per question (See NOTE: Search cache): another world size, device or model
    is another key and another file; the same question, the same file."""
    def key(layers, nproc, device):
        graph = AutoParallelGPT(_gpt(layers), str(tmp_path))
        spec = graph._compile_spec()
        x, y = _batches(1)[0]
        return search_key(spec, [x, y], nproc, [True, True], graph._optimizer, device, 2 ** 30, 2)
    base, wider, other, deeper = key(2, 2, "h100"), key(2, 4, "h100"), key(2, 2, "a100"), key(3, 2, "h100")
    assert key(2, 2, "h100") == base
    assert wider["cluster"] != base["cluster"] and other["cluster"] != base["cluster"]
    assert deeper["model"] != base["model"]
    assert len({entry_path(str(tmp_path), "G", k) for k in (base, wider, other, deeper)}) == 4


def test_a_search_that_fits_nothing_is_refused_on_every_rank(tmp_path):
    """Rank 0's search error reaches every rank as a GraphcError (no rank waits for a layout)."""
    class Tiny(AutoParallelGPT):
        def __init__(self, model):
            super().__init__(model, str(tmp_path), 1)
            self.config.enable_auto_parallel(True, device="h100", memory=1e-6, cache=str(tmp_path))

    def rank_main(rank):
        with pytest.raises(graphc.GraphcError, match="fits") as info:
            Tiny(_gpt(2))(*_batches(1)[0])
        return str(info.value)
    messages = LocalWorld(2).run(rank_main)
    assert "no layout on 2 ranks fits" in messages[0] and "rank 0's search failed" in messages[1]


def test_enable_auto_parallel_checks_its_arguments():
    graph = AutoParallelGPT(_gpt(2), None)
    assert graph.config.auto == AutoRequest("h100", None, 2, None)
    with pytest.raises(graphc.GraphcError, match="memory is GiB per rank"):
        graph.config.enable_auto_parallel(True, memory=-1)
    graph.config.enable_auto_parallel(False)
    assert graph.config.auto is None
