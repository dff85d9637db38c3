"""config.set_check_microbatching (NOTE: Checked first step): the first step is also run
eagerly on the whole batch and compared; a program graphc would run differently is refused.
The defect is re-introduced by patching the batch-split rule (the attention mask passed
whole, as graphc did before the rule): the check must catch it, in one process and on
real gloo ranks."""
import pytest
import torch

import graphc
import graphc.compiler
import graphc.testing
from helpers import run_world
from passes.test_split_inputs import MaskGraph, MaskedTokens, _mask_data


class CheckedGraph(MaskGraph):
    def __init__(self, model, opt, m, stages=False):
        super().__init__(model, opt, m)
        self.config.set_check_microbatching(True)
        if stages:
            self.model.emb.config.set_stage(0, graphc.placement("cpu", [0]))
            self.model.out.config.set_stage(1, graphc.placement("cpu", [1]))


def _seed_defect(setattr_):
    """graphc before the explicit rule: the mask judged 'not batched' and passed whole, with
    no data-flow confirmation (the check must catch what static analysis no longer sees)."""
    find = graphc.compiler.find_batch_dims
    setattr_(graphc.compiler, "split_inputs", lambda names, *a, **k: [n != "mask" for n in names])
    setattr_(graphc.compiler, "find_batch_dims",
             lambda gm, m, decide=True, split=None: find(gm, m, decide, None))


def _mask_passed_whole(monkeypatch):
    _seed_defect(monkeypatch.setattr)


def _run(m, stages=False):
    torch.manual_seed(0)
    model = MaskedTokens()
    graph = CheckedGraph(model, torch.optim.Adam(model.parameters(), lr=0.01), m, stages)
    return graph(*_mask_data())


def test_a_faithful_first_step_passes_the_check():
    loss = _run(2)
    assert loss.to_local().numel() == 1


def test_the_check_refuses_a_silently_wrong_split(monkeypatch):
    _mask_passed_whole(monkeypatch)
    with pytest.raises(graphc.GraphcError, match=r"(?s)the first step differs from eager .*\(loss .*"
                                                 r"set_whole_inputs"):
        _run(2)


def _world_worker(rank, world, defect):
    if defect:
        _seed_defect(setattr)
    try:
        _run(2, stages=True)
    except graphc.GraphcError as e:
        return str(e)
    return ""


@pytest.mark.world
@pytest.mark.slow   # CI time: the check in the local world: tests/local/test_local_world.py
def test_the_check_on_a_pipeline_passes_or_refuses_on_every_rank():
    assert run_world(_world_worker, 2, False) == ["", ""]
    reports = run_world(_world_worker, 2, True)
    assert all("the first step differs from eager" in r for r in reports), reports


def test_the_check_takes_a_dict_batch():
    """A Hugging Face-style build(self, batch): the check rebuilds the batch for eager."""
    class DictGraph(graphc.Graph):
        def __init__(self, model, opt):
            super().__init__()
            self.model = model
            self.config.set_gradient_accumulation_steps(2)
            self.config.set_check_microbatching(True)
            self.add_optimizer(opt)

        def build(self, batch):
            loss = torch.nn.functional.cross_entropy(self.model(batch["x"]), batch["y"])
            loss.backward()
            return {"loss": loss}

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    out = DictGraph(model, torch.optim.SGD(model.parameters(), lr=0.1))(
        {"x": torch.randn(8, 4), "y": torch.randint(0, 3, (8,))})
    assert out["loss"].to_local().dim() == 0


# -- amp: the eager twin runs under the job's autocast (issue 30, point 7) ---------------------
def _amp_graph(pipeline=False, m=1, check_first=False):
    from test_amp import AmpGraph, Net
    torch.manual_seed(0)
    model = Net()
    graph = AmpGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), pipeline=pipeline)
    graph.config.set_gradient_accumulation_steps(m)
    graph.config.set_check_microbatching(check_first)
    return graph


@pytest.mark.fp32
def test_check_mode_on_an_amp_job_runs_eager_under_the_same_autocast():
    """One process, no accumulation: the twin's autocast step is graphc's, bit for bit."""
    from test_amp import _batches
    run = graphc.testing.local_world(_amp_graph, _batches(), nproc=1, check=True)
    assert run.ok, run.text()
    rows = run.reports[0].rows
    assert [r.dloss for r in rows] == [0.0] * len(rows) and [r.dparam for r in rows] == [0.0] * len(rows), run.text()


@pytest.mark.fp32
@pytest.mark.parametrize("nproc, m", [(1, 2), (2, 2)])
def test_check_mode_on_an_amp_job_is_ok_at_the_amp_tolerance(nproc, m):
    """Micro-batches (and a pipeline) round bf16 elsewhere than eager on the whole batch: the
    values agree to bf16's tolerance (modes.TOLERANCES), which the report states."""
    from test_amp import _batches
    run = graphc.testing.local_world(lambda: _amp_graph(nproc == 2, m), _batches(), nproc=nproc, check=True)
    assert run.ok, run.text()
    assert "bound |d| <= 0.01 * (1 + |eager|)" in run.text()
    assert max(r.dparam for r in run.reports[0].rows) > 0  # (not bitwise: the bound is needed)


@pytest.mark.fp32
def test_the_first_step_check_passes_an_amp_job():
    from test_amp import _batches
    x, y = _batches()[0]
    assert _amp_graph(m=2, check_first=True)(x, y).to_local().dim() == 0


@pytest.mark.fp32
def test_the_check_still_refuses_a_wrong_split_under_amp(monkeypatch):
    _mask_passed_whole(monkeypatch)
    torch.manual_seed(0)
    model = MaskedTokens().float()
    graph = CheckedGraph(model, torch.optim.Adam(model.parameters(), lr=0.01), 2)
    graph.config.enable_amp(True, dtype=torch.bfloat16)
    with pytest.raises(graphc.GraphcError, match=r"the first step differs from eager"):
        graph(*_mask_data())
