"""README's first snippet, the two-stage pipeline a reader copies first, runs as written and
trains like eager PyTorch on the whole batch (float64 at 1e-10).

Each rank of a local world (threads of this process, the runtime held bitwise to gloo) runs
the snippet's text with the two names it leaves to the reader, `model` (with `stage0` and
`stage1`) and `batches`, and its own `print`; the snippet's loop prints the loss, which is
the full loss on stage 1's rank. tests/test_docs.py checks that the other snippets parse.
"""
import re
import textwrap
from pathlib import Path

import torch
import torch.nn as nn

import graphc
from graphc.runtime.local_world import LocalWorld
from helpers import assert_same_as_eager, eager_train

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
STEPS = 3


def first_snippet() -> str:
    return textwrap.dedent(re.search(r"```python\n(.*?)```", README, re.S).group(1))


class TwoStages(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage0 = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.stage1 = nn.Linear(16, 4)

    def forward(self, x):
        return self.stage1(self.stage0(x))


def _batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g))
            for _ in range(STEPS)]


def _run_snippet(rank: int):
    torch.manual_seed(0)
    model, printed = TwoStages(), []
    names = {"model": model, "batches": _batches(), "print": printed.append, "__name__": "readme"}
    exec(first_snippet(), names)
    graph = next(v for v in names.values() if isinstance(v, graphc.Graph))
    # the whole trained model (collective); a rank's own model holds only its stage trained
    return [float(t) for t in printed if t.numel()], graph.full_state_dict()


def test_readme_pipeline_snippet_runs_and_trains_like_eager():
    snippet = first_snippet()
    assert "set_stage(stage_id=1, placement=P1)" in snippet and "for x, y in batches:" in snippet
    (losses0, state0), (losses1, state1) = LocalWorld(2).run(_run_snippet)
    assert losses0 == []   # stage 0's rank holds no loss: an empty local component
    torch.manual_seed(0)
    ref_losses, ref_state = eager_train(TwoStages(), lambda p: torch.optim.SGD(p, lr=0.1), None,
                                        nn.CrossEntropyLoss(), _batches(), STEPS)
    assert_same_as_eager(losses1, state0, ref_losses, ref_state, "README snippet")
    assert_same_as_eager(losses1, state1, ref_losses, ref_state, "README snippet, rank 1")
