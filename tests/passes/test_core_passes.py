"""trace_build, annotate_stages, propagate_shapes, split_stages and lower_plan in one process."""
import pytest
import torch
import torch.nn as nn

import graphc
from graphc.graph_spec import compile_spec
from graphc import compiler
from graphc.errors import GraphcError
from graphc.meta import META_STAGE, META_STAGE_WHY, META_TENSOR
from graphc.plan.instructions import Recv, Send
from models import PipelineGraph, SkipNet

X, Y = torch.randn(16, 16), torch.randint(0, 5, (16,))


def compiled(p=4, m=4, schedule="1f1b"):
    return compiler.compile(PipelineGraph(SkipNet(p), None, accumulation=m, schedule=schedule), [X, Y], p)


def test_trace_keeps_backward_and_user_module_names():
    gm = compiled().gm
    targets = [n.target for n in gm.graph.nodes]
    assert "backward" in targets
    assert "model.blocks.0.linear" in targets and "model.head" in targets


def test_stages_follow_set_stage_and_data_flow():
    nodes = {n.name: n for n in compiled().gm.graph.nodes}
    assert nodes["model_blocks_2_linear"].meta[META_STAGE] == 2
    assert nodes["model_blocks_2_linear"].meta[META_STAGE_WHY] == "module"
    # the skip add in SkipNet.forward is outside any staged module: forward rule, latest input
    add = next(n for n in nodes.values() if n.op == "call_function" and "add" in n.name)
    assert add.meta[META_STAGE] == 3 and add.meta[META_STAGE_WHY] == "forward"
    # the loss runs on the last stage; inputs run where they are first used
    assert nodes["loss_fn"].meta[META_STAGE] == 3
    assert nodes["x"].meta[META_STAGE] == 0 and nodes["y"].meta[META_STAGE] == 3


def test_shapes_are_per_microbatch():
    nodes = {n.name: n for n in compiled(m=4).gm.graph.nodes}
    assert nodes["x"].meta[META_TENSOR].shape == (4, 16)
    assert nodes["model_head"].meta[META_TENSOR].shape == (4, 5)
    assert nodes["loss_fn"].meta[META_TENSOR].shape == ()


def test_skip_connection_goes_straight_to_its_consumer():
    c = compiled(p=4)
    assert sorted(c.programs[0].send_to) == [1, 3]
    assert sorted(c.programs[3].recv_from) == [0, 2]
    sends = [i for i in c.plans[0].instructions if isinstance(i, Send)]
    assert {i.peer for i in sends} == {1, 3}
    assert not any(isinstance(i, Recv) and i.peer == 0 for i in c.plans[2].instructions)


def test_stage_program_is_runnable_python():
    c = compiled(p=2)
    prog = c.programs[0]
    out = prog.module(*[torch.randn(4, 16) for _ in prog.inputs])
    assert out[0].shape == (4, 16) and "def forward" in prog.code


def test_no_set_stage_gives_one_stage_on_every_rank():
    class G(graphc.Graph):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(16, 5)

        def build(self, x):
            return self.net(x)

    c = compiler.compile(G(), [X], 3)
    assert len(c.stages) == 1 and c.stages[0].ranks == (0, 1, 2)
    assert not c.training and [str(i) for i in c.plans[2].instructions] == ["0F0"]


def test_values_flowing_backwards_through_stages_are_rejected():
    class Back(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.a(self.b(x))

    class G(graphc.Graph):
        def __init__(self):
            super().__init__()
            self.m = Back()
            self.m.a.config.set_stage(0, graphc.placement("cpu", [0]))
            self.m.b.config.set_stage(1, graphc.placement("cpu", [1]))

        def build(self, x):
            return self.m(x)

    with pytest.raises(GraphcError, match="runs on stage 0 but uses 'm_b' computed on the later stage 1"):
        compiler.compile(G(), [torch.randn(2, 4)], 2)


def test_history_records_every_pass():
    names = [r.name for r in compiled(p=2).history]
    assert names == ["collect_stages", "declared_layouts", "trace_build (whole batch)", "split_inputs", "propagate_shapes (whole batch)",
                     "find_batch_dims (whole batch)", "check_row_groups", "trace_build",
                     "verify_traced", "warn_unused_parameters", "place_inputs", "check_layout",
                     "annotate_stages", "propagate_shapes", "find_batch_dims", "check_batch_sizes", "verify_annotated",
                     "declared_meshes", "decompose_modules", "defer_batch_norm", "infer_sbp",
                     "warn_replicated_stages", "insert_boxing", "localize_ops", "deal_zigzag", "seed_random_ops",
                     "split_stages", "insert_grad_modes", "insert_autocast_modes", "cast_to_traced_dtypes", "feed_whole_batch", "feed_whole_sums", "insert_checkpoints", "compile_key", "find_plan_symmetry", "lower_plan",
                     "insert_grad_sync", "insert_zero_sync", "insert_zero_units", "insert_tie_sync", "insert_grad_clip", "insert_output_reduce", "list_collectives",
                     "note_stages", "verify_plans"]



def test_compile_takes_a_spec_of_what_it_reads():
    """compile() reads a CompileSpec, not the Graph (issue 13); a Graph passed in is turned
    into its spec first. The spec is a snapshot: later config changes do not reach it."""
    graph = PipelineGraph(SkipNet(2), None, accumulation=2)
    spec = compile_spec(graph)
    assert isinstance(spec, compiler.CompileSpec) and spec.name == "PipelineGraph"
    assert spec.gradient_accumulation_steps == 2 and spec.root is graph._root
    assert {name: c.stage_id for name, c in spec.modules.items() if c.stage_id is not None} == \
        {"model.blocks.0": 0, "model.blocks.1": 1, "model.head": 1}
    graph.config.set_gradient_accumulation_steps(4)
    assert spec.gradient_accumulation_steps == 2
    with pytest.raises(AttributeError):
        spec.pipeline_schedule = "gpipe"
    from_spec = compiler.compile(spec, [X, Y], 2)
    graph.config.set_gradient_accumulation_steps(2)
    from_graph = compiler.compile(graph, [X, Y], 2)
    assert [str(p) for p in from_spec.plans] == [str(p) for p in from_graph.plans]
    assert from_spec.gm.code == from_graph.gm.code and from_spec.num_microbatches == 2

class _Columns(nn.Module):  # Megatron's column- then row-parallel pair on 2 ranks
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class _TensorParallel(graphc.Graph):
    def __init__(self):
        super().__init__()
        where = graphc.placement("cpu", [0, 1])
        model = graphc.to_global(_Columns(), placement=where, sbp=graphc.sbp.broadcast)
        graphc.to_global(model.fc1, placement=where, sbp=graphc.sbp.split(0))
        graphc.to_global(model.fc2.weight, placement=where, sbp=graphc.sbp.split(1))
        self.model = model
        self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))

    def build(self, x, y):
        loss = nn.functional.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _texts(cg):
    return {r.name: r.text.split("\n", 1)[1] if "\n" in r.text else "" for r in cg.history}


def test_history_shows_what_annotating_passes_added():
    """Each annotating pass's record differs from the graph before it by its annotations."""
    text = _texts(compiled(p=2))
    assert text["annotate_stages"] != text["trace_build"]
    assert "model_blocks_1_linear = " in text["annotate_stages"]
    assert "# stage 1 (module)" in text["annotate_stages"] and "[4, 16]" not in text["annotate_stages"]
    assert "[4, 16] grad" in text["propagate_shapes"]   # float64 under the tests' default dtype
    assert "rows@0" in text["find_batch_dims"] and "rows@0" not in text["propagate_shapes"]
    assert "# x: stage 0 (users) | float64[4, 16] | rows@0" in text["find_batch_dims"]


def test_history_shows_sbp_and_boxing_beside_the_code():
    cg = compiler.compile(_TensorParallel(), [torch.randn(8, 8), torch.randint(0, 4, (8,))], 2)
    text = _texts(cg)
    assert text["infer_sbp"] != text["defer_batch_norm"] and "sbp " not in text["defer_batch_norm"]
    linear = next(line for line in text["infer_sbp"].splitlines() if "linear(" in line)
    assert "| sbp split(1) on (0, 1)" in linear        # column-parallel output, beside its line
    assert "boxing all_reduce partial_sum->broadcast" in text["insert_boxing"]
    assert text["split_stages"].startswith("# stage 0: inputs=")


def test_history_shows_the_plans_of_plan_level_passes():
    cg = compiled(p=2)
    text = _texts(cg)
    for name in ("lower_plan", "insert_grad_sync", "insert_tie_sync", "insert_grad_clip",
                 "list_collectives", "note_stages"):
        assert text[name].startswith("# graphc plan: rank 0 of 2"), name
        assert "# graphc plan: rank 1 of 2" in text[name] and "1F0\n" in text[name], name
    assert text["list_collectives"] == "\n\n".join(map(str, cg.plans))
    tp = _texts(compiler.compile(_TensorParallel(), [torch.randn(8, 8), torch.randint(0, 4, (8,))], 2))
    assert ".ALL_REDUCE " in tp["list_collectives"] and ".ALL_REDUCE " not in tp["insert_grad_clip"]


def test_history_of_a_large_world_shows_one_plan_per_stage():
    text = _texts(compiled(p=4, m=4))
    assert text["lower_plan"].count("# graphc plan:") == 4      # every rank of a small world
    from graphc.history import shown_plans
    cg = compiled(p=2)
    wide = [type(cg.plans[0])(r, 16, [], stages=(compiler.StageInfo(0, tuple(range(8))),
                                                 compiler.StageInfo(1, tuple(range(8, 16)))))
            for r in range(16)]
    assert [p.rank for p in shown_plans(wide)] == [0, 8]
