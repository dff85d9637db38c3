"""The misuse catalogue (docs/errors.md): each mistake raises GraphcError at compile time.

Compile-time checks depend only on the program and the inputs' shapes, which every rank
shares, so every rank raises the same error before any communication (no rank is left
waiting). Multi-rank layouts are compiled for a world size without processes through
graphc.compiler.compile; single-rank ones simply call the graph in this process.
"""
import re

import pytest
import torch
import torch.nn as nn

import graphc
from graphc import GraphcError, compiler
from graphc import sbp as S
from graphc.checkpoint.graph_state import GraphState
from models import PipelineGraph, SkipNet

P = graphc.placement


def raises(*fragments):
    """Expects a GraphcError whose message holds every fragment (in any order)."""
    class _Ctx:
        def __enter__(self):
            self.cm = pytest.raises(GraphcError)
            self.info = self.cm.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.cm.__exit__(*exc)
            msg = str(self.info.value)
            for f in fragments:
                assert f in msg, f"{f!r} not in message:\n{msg}"
            return handled
    return _Ctx()


class TwoStage(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        return self.b(self.a(x))


class Train(graphc.Graph):
    """A configurable training graph: stages maps submodule name -> (stage id, ranks)."""

    def __init__(self, model=None, stages=None, acc=1, opt=True, body=None):
        super().__init__()
        self.model = model if model is not None else TwoStage()
        for name, (sid, ranks) in (stages or {}).items():
            getattr(self.model, name).config.set_stage(sid, P("cpu", ranks=ranks))
        self.config.set_gradient_accumulation_steps(acc)
        if opt:
            self.add_optimizer(torch.optim.SGD(self.model.parameters(), lr=0.1))
        self._body = body

    def build(self, x):
        if self._body is not None:
            return self._body(self, x)
        loss = self.model(x).sum()
        loss.backward()
        return loss


def compile_for(graph, world, *inputs):
    return compiler.compile(graph, list(inputs) or [torch.randn(4, 8)], world)


X = torch.randn(4, 8)


# -- stages and placements ---------------------------------------------------------------
def test_stage_ids_with_a_gap():
    g = Train(stages={"a": (0, [0]), "b": (2, [1])})
    with raises("stage ids must be 0, 1, ..., p-1", "found [0, 2]", "missing [1]", "Fix"):
        compile_for(g, 2)


def test_same_stage_id_with_two_placements():
    g = Train(stages={"a": (0, [0]), "b": (0, [1])})
    with raises("stage 0 is given two placements", "module 'model.a'", "module 'model.b'", "Fix"):
        compile_for(g, 2)


def test_rank_in_two_stages():
    g = Train(stages={"a": (0, [0]), "b": (1, [0])})
    with raises("'1f1b' runs one stage per rank", "ranks [0]: stages [0, 1]", "module 'model.b'",
                "Fix", "interleaved_1f1b"):
        compile_for(g, 2)


def test_placement_rank_outside_the_world():
    g = Train(stages={"a": (0, [0]), "b": (1, [3])})
    with raises("module 'model.b'", "names rank(s) [3]", "the world has 2 rank(s)",
                "--nproc_per_node 4"):
        compile_for(g, 2)


def test_negative_stage_id():
    g = Train()
    with raises("module 'model.a'", "stage_id must be an int >= 0", "found -1"):
        g.model.a.config.set_stage(-1, P("cpu", ranks=[0]))


def test_set_stage_without_a_placement():
    g = Train()
    with raises("module 'model.a'", "set_stage needs a graphc.placement", "found [0]"):
        g.model.a.config.set_stage(0, [0])


def test_set_stage_after_the_first_call():
    g = Train()
    g(X)
    with raises("module 'model.a'", "set_stage was called after the graph was compiled",
                "Call set_stage in the Graph's __init__"):
        g.model.a.config.set_stage(0, P("cpu", ranks=[0]))


def test_staged_module_never_called():
    def body(self, x):
        loss = self.model.a(x).sum()
        loss.backward()
        return loss
    g = Train(stages={"a": (0, [0]), "b": (1, [1])}, body=body)
    with raises("module 'model.b' is set to stage 1", "never runs anything on that stage", "Fix"):
        compile_for(g, 2)


def test_stages_in_reverse_order_of_use():
    g = Train(stages={"a": (1, [1]), "b": (0, [0])})
    with raises("runs on stage 0 but uses", "later stage 1", "Fix: give the stages ids in the order"):
        compile_for(g, 2)


def test_stages_of_different_sizes_exchange_values_n_to_m():
    """No longer an error: an n-to-m transfer moves the value in pieces (docs/sbp.md); a
    broadcast value reaches each receiver from one sender, its gradient goes back from one."""
    g = Train(stages={"a": (0, [0]), "b": (1, [1, 2])})
    plans = compile_for(g, 3).plans
    sends = {(p.rank, ins.peer, ins.direction) for p in plans for ins in p.instructions
             if ins.op == "send"}
    assert {(0, 1, "F"), (0, 2, "F"), (1, 0, "B")} <= sends and (2, 0, "B") not in sends


def test_split_input_whose_shards_do_not_divide_into_microbatches():
    """10 rows over 4 ranks are held 3, 3, 3, 1 (torch.chunk): no rank's rows halve alike."""
    p4 = graphc.placement("cpu", [0, 1, 2, 3])
    with raises("input 'x'", "hold [3, 3, 3, 1] rows", "2 micro-batches", "[2, 2, 1, 0]", "Fix"):
        compiler.compile(Train(acc=2), [torch.randn(10, 8)], 4, [(p4, (S.split(0),))])


def test_parameter_shared_by_stages_of_different_sizes():
    # a parameter shared across stages is tied (summed replica by replica, insert_tie_sync)
    model = TwoStage()
    model.b.weight = model.a.weight
    g = Train(model, stages={"a": (0, [0, 1]), "b": (1, [2])})
    with raises("['model.a.weight'] are used on stages [0, 1], which run on [2, 1] ranks",
                "same number of ranks", "Fix"):
        compile_for(g, 3)


# -- accumulation and batches -------------------------------------------------------------
def test_accumulation_steps_below_one():
    g = Train()
    with raises("gradient accumulation steps must be an int >= 1", "found 0"):
        g.config.set_gradient_accumulation_steps(0)


def test_batch_not_divisible_by_accumulation_steps():
    g = Train(acc=3)
    with raises("input 'x' has batch size 4", "not divisible by the 3 gradient accumulation steps",
                "multiple of 3"):
        g(X)


def test_unknown_pipeline_schedule():
    g = Train()
    with raises("unknown pipeline schedule 'zb'", "'1f1b'", "'gpipe'"):
        g.config.set_pipeline_schedule("zb")


def test_config_after_the_first_call():
    g = Train()
    g(X)
    with raises("set_gradient_accumulation_steps was called after the graph was compiled", "__init__"):
        g.config.set_gradient_accumulation_steps(2)


# -- backward() ---------------------------------------------------------------------------
def test_backward_on_a_non_scalar():
    def body(self, x):
        out = self.model(x)
        out.backward()
        return out
    with raises("backward() is called on", "with shape [4, 8]", "must be a scalar loss",
                "test_misuse.py", "out.backward()", "loss.mean()"):
        Train(body=body)(X)


def test_backward_called_twice():
    def body(self, x):
        a = self.model(x).sum()
        a.backward()
        b = self.model(x).mean()
        b.backward()
        return a
    with raises("calls backward() 2 times", "b.backward()", "call backward() once"):
        Train(body=body)(X)


def test_backward_with_arguments():
    def body(self, x):
        loss = self.model(x).sum()
        loss.backward(torch.ones(()))
        return loss
    with raises("takes no arguments", "scales the loss"):
        Train(body=body)(X)


def test_backward_on_a_loss_without_parameters():
    def body(self, x):
        loss = (x * 2).sum()
        loss.backward()
        return loss
    with raises("does not depend on any parameter that requires grad", "Fix"):
        Train(body=body)(X)


# -- what build() may do ------------------------------------------------------------------
def test_item_inside_build_points_at_the_users_line():
    def body(self, x):
        loss = self.model(x).sum()
        print(loss.item())
        return loss
    with raises("build() calls .item()", "test_misuse.py", "print(loss.item())",
                ".to_local().item()"):
        Train(body=body, opt=False)(X)


def test_python_control_flow_on_a_tensor_points_at_the_users_line():
    def body(self, x):
        h = self.model(x)
        if h.sum() > 0:
            h = h * 2
        return h.sum()
    with raises("could not trace", "test_misuse.py", "if h.sum() > 0:", "torch.where"):
        Train(body=body, opt=False)(X)


def test_shape_error_inside_build_names_node_and_line():
    def body(self, x):
        loss = self.model(x[:, :5]).sum()
        loss.backward()
        return loss
    with raises("node 'model_a'", "fails on one micro-batch's shapes", "found: RuntimeError",
                "Fix: check the shapes"):
        Train(body=body)(X)


def test_build_not_defined():
    class NoBuild(graphc.Graph):
        def __init__(self):
            super().__init__()
            self.model = TwoStage()
    with raises("NoBuild must define build(self, ...)"):
        NoBuild()(X)


def test_missing_super_init():
    class NoSuper(graphc.Graph):
        def __init__(self):
            self.model = TwoStage()

        def build(self, x):
            return self.model(x)
    with raises("NoSuper.__init__ must call super().__init__() before assigning 'model'"):
        NoSuper()


def test_module_assigned_after_compiling():
    g = Train()
    g(X)
    with raises("module 'extra' was assigned after the graph was compiled"):
        g.extra = nn.Linear(2, 2)


# -- inputs -------------------------------------------------------------------------------
def test_input_rank_changes_on_a_later_call():
    """A new batch size compiles a second plan (tests/passes/test_trace_build.py); a new
    number of dimensions is another program."""
    g = Train()
    g(X)
    with raises("input 0 of Train has shape [4, 8, 1]", "compiled for [4, 8]", "Fix"):
        g(X.unsqueeze(-1))


def test_input_dtype_kind_changes_on_a_later_call():
    g = Train()
    g(X)
    with raises("dtype torch.int64", "compiled for [4, 8] torch.float64"):
        g(X.long())


def test_wrong_number_of_inputs_on_a_later_call():
    """Another number of inputs is another input structure (NOTE: Input trees): it is
    compiled, and build()'s own signature refuses it; the first plan still runs."""
    g = Train()
    g(X)
    with raises("build() takes 1 inputs (x), found 2", "Fix"):
        g(X, X)
    g(X)


def test_wrong_number_of_inputs_at_compile():
    with raises("build() takes 1 inputs (x), found 2"):
        Train()(X, X)


def test_non_tensor_input():
    with raises("input 0 of the graph is a float", "Fix"):
        Train()(1.5)


def test_input_placed_away_from_its_stage():
    g = Train(stages={"a": (0, [0])})
    x = graphc.to_global(X, placement=P("cpu", ranks=[1]), sbp=S.broadcast)
    with raises("input 'x' is placed on", "first used on stage 0, which runs on ranks [0]",
                "graphc.to_global(t, placement=graphc.placement(\"cpu\", ranks=[0])"):
        compiled = compile_for(g, 2)
        from graphc.executable import check_input_placements, input_specs
        check_input_placements(compiled, input_specs([x]))


# -- optimizer ----------------------------------------------------------------------------
def test_optimizer_over_parameters_the_graph_does_not_own():
    g = Train(opt=False)
    stray = nn.Linear(3, 3)
    g.add_optimizer(torch.optim.SGD(stray.parameters(), lr=0.1))
    with raises("the optimizer holds a parameter of shape [3, 3]", "no module of the graph owns",
                "Fix"):
        g(X)


def test_add_optimizer_twice():
    g = Train()
    with raises("add_optimizer was called twice"):
        g.add_optimizer(torch.optim.SGD(g.model.parameters(), lr=0.1))


def test_add_optimizer_with_a_non_optimizer():
    with raises("add_optimizer expects a torch.optim.Optimizer, found list"):
        Train(opt=False).add_optimizer([1])


# -- placements, sbp, to_global -----------------------------------------------------------
def test_placement_with_unknown_device_type():
    with raises("placement type must be one of", "found 'tpu'"):
        P("tpu", ranks=[0])


def test_placement_with_repeated_ranks():
    with raises("placement ranks must be distinct, found [0, 0]"):
        P("cpu", ranks=[0, 0])


def test_split_dim_out_of_range():
    with raises("split(2) is out of range for a tensor with 2 dims", "[-2, 1]"):
        graphc.to_global(X, placement=P("cpu", ranks=[0]), sbp=S.split(2))


def test_to_global_of_an_unsupported_object():
    with raises("to_global expects an nn.Module, a parameter or a tensor, found str"):
        graphc.to_global("x", placement=P("cpu", ranks=[0]), sbp=S.broadcast)


def test_to_global_without_a_placement():
    with raises("to_global needs placement=graphc.placement(...)", "found [0, 1]"):
        graphc.to_global(X, placement=[0, 1], sbp=S.broadcast)


def _placed(a_ranks, b_ranks):
    model = TwoStage()
    graphc.to_global(model.a, placement=P("cpu", ranks=a_ranks), sbp=S.broadcast)
    graphc.to_global(model.b, placement=P("cpu", ranks=b_ranks), sbp=S.broadcast)
    return model


def test_op_reading_values_on_two_placements_without_set_stage():
    with raises("module 'model.b' at", "test_misuse.py", "reads 'model_a' (placed by parameter "
                "model.a.weight) on placement(type=\"cpu\", ranks=[0])", "its parameter "
                "model.b.weight on placement(type=\"cpu\", ranks=[1])", "graphc.to_global", "Fix"):
        compile_for(Train(model=_placed([0], [1])), 2)


def test_placements_sharing_some_ranks_without_set_stage():
    def body(g, x):
        h = graphc.to_global(g.model.a(x), placement=P("cpu", ranks=[1, 2]), sbp=S.broadcast)
        loss = g.model.b(h).sum()
        loss.backward()
        return loss
    with raises("share rank(s) [1] without being the same ranks", "Fix"):
        compile_for(Train(model=_placed([0, 1], [1, 2]), body=body), 3)


def test_value_sent_back_to_an_earlier_placement_without_set_stage():
    def body(g, x):
        h = g.model.b(graphc.to_global(g.model.a(x), placement=P("cpu", ranks=[1]), sbp=S.broadcast))
        loss = (graphc.to_global(h, placement=P("cpu", ranks=[0]), sbp=S.broadcast) * 2).sum()
        loss.backward()
        return loss
    with raises("build() moves values between", "in both directions", "Fix"):
        compile_for(Train(model=_placed([0], [1]), body=body), 2)


# -- state ----------------------------------------------------------------------------------
def test_state_dict_before_compiling():
    with raises("state_dict() needs a compiled graph", "graph.compile(*inputs)"):
        Train().state_dict()


def test_loading_a_plain_model_state_dict():
    g = Train()
    g(X)
    with raises("load_state_dict expects a graph.state_dict()", "load a plain model state dict"):
        g.load_state_dict(g.model.state_dict())


def test_loading_another_ranks_checkpoint():
    g = Train()
    g(X)
    sd = g.state_dict()
    sd["rng"]["rank1"] = sd["rng"].pop("rank0")  # the file rank 1 saved
    with raises("saved by rank 1, but is loaded on rank 0", "load the file each rank saved",
                "several ranks save to the same path", "f\"ckpt/rank{rank}.pt\"", "dcp.save"):
        g.load_state_dict(sd)


@pytest.mark.parametrize("value,why", [("0.001", "every run would fail as a stall"),
                                       ("1e9", "a stalled rank look like a hang")])
def test_graphc_timeout_out_of_range(monkeypatch, value, why):
    """Checked when read (graphc/env.py), here at the first call's compile."""
    monkeypatch.setenv("GRAPHC_TIMEOUT", value)
    with raises(f"GRAPHC_TIMEOUT={value} is out of range", "the longest a rank waits for another",
                "expected 1 to 604800 s", why, "Fix: unset it (default 300 s)"):
        Train()(X)


def test_sync_batch_norm_on_cpu():
    """torch's SyncBatchNorm refuses cpu tensors once a process group exists (a one-rank gloo
    group here, as on every rank of a torchrun job); graphc says why and what to use."""
    import torch.distributed as dist
    model = nn.Sequential(nn.Linear(8, 8), nn.SyncBatchNorm(8), nn.Linear(8, 8))
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with raises("torch.nn.SyncBatchNorm(8) runs on a cpu placement at", "test_misuse.py",
                    "torch's SyncBatchNorm needs CUDA", "plain BatchNorm is sync-BN here",
                    "set_deferred_batch_norm(True)", "Fix: build the model with nn.BatchNorm1d/2d/3d"):
            Train(model=model)(X)
    finally:
        dist.destroy_process_group()


def test_bad_graphc_timeout(monkeypatch):
    from graphc.runtime.dist_env import timeout_seconds
    monkeypatch.setenv("GRAPHC_TIMEOUT", "soon")
    with raises("GRAPHC_TIMEOUT must be a number of seconds, found 'soon'"):
        timeout_seconds()


# -- modules outside any stage --------------------------------------------------------------
def test_unstaged_module_used_in_build_follows_its_inputs():
    """The rule: with set_stage on some modules, a module build() calls outside them runs
    where the forward rule puts it (after its inputs): no error, and it is owned."""
    g = Train(stages={"a": (0, [0])})
    compiled = compile_for(g, 1)
    state = GraphState(g._root, compiled, 0, None, None)
    assert state.owner["model.b.weight"] == 0


def test_unused_module_with_parameters_warns():
    def body(self, x):
        loss = self.model.a(x).sum()
        loss.backward()
        return loss
    with pytest.warns(UserWarning, match=r"\['model.b'\] of Train have parameters but build\(\) "
                                         r"never uses them"):
        Train(body=body)(X)


def test_local_tensor_that_is_not_its_ranks_shard(monkeypatch):
    monkeypatch.setenv("RANK", "3")  # as torchrun sets it, before graphc starts the group
    with raises("rank 3", "has shape [3, 8]", "[10, 8]", "is [1, 8]", "Fix"):
        graphc.to_global(torch.randn(3, 8), placement=P("cpu", ranks=[0, 1, 2, 3]),
                         sbp=S.split(0), shape=(10, 8))


def test_to_global_inside_build_to_no_stages_placement():
    def body(self, x):
        h = graphc.to_global(self.model.a(x), placement=P("cpu", ranks=[0, 1]), sbp=S.broadcast)
        loss = self.model.b(h).sum()
        loss.backward()
        return loss
    g = Train(stages={"a": (0, [0]), "b": (1, [1])}, body=body)
    with raises("to_global at", "from stage 0 (ranks [0])", "no pipeline stage's placement", "Fix"):
        compile_for(g, 2)


def test_to_global_inside_build_with_sbp_for_another_mesh():
    def body(self, x):
        h = graphc.to_global(self.model(x), placement=P("cpu", ranks=[0, 1]),
                             sbp=(S.split(0), S.broadcast))
        loss = h.sum()
        loss.backward()
        return loss
    with raises("to_global at", "with sbp (split(0), broadcast)", "Fix"):
        compile_for(Train(body=body), 2)


# -- devices, optimizers, checkpoints, sbp values, environment (issue 14) --------------------
def test_cuda_placement_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    g = Train()
    g.model.a.config.set_stage(0, P("cuda", ranks=[0]))
    with raises("module 'model.a' is placed on placement(type=\"cuda\", ranks=[0])",
                "this machine has no CUDA device", "Fix: use graphc.placement(\"cpu\", ranks=[0])",
                "a machine with GPUs"):
        g(X)


def test_lr_scheduler_that_is_not_one():
    g = Train(opt=False)
    with raises("lr_sch must be a torch.optim.lr_scheduler.LRScheduler, found float", "StepLR"):
        g.add_optimizer(torch.optim.SGD(g.model.parameters(), lr=0.1), lr_sch=0.1)


def test_lr_scheduler_that_needs_a_metric():
    g = Train(opt=False)
    opt = torch.optim.SGD(g.model.parameters(), lr=0.1)
    with raises("ReduceLROnPlateau", "needs a metric", "call lr_sch.step(metric) yourself",
                "StepLR"):
        g.add_optimizer(opt, lr_sch=torch.optim.lr_scheduler.ReduceLROnPlateau(opt))


def test_lr_scheduler_of_another_optimizer():
    g = Train(opt=False)
    other = torch.optim.SGD(g.model.parameters(), lr=0.1)
    with raises("lr_sch (StepLR) was built on another optimizer", "Fix: build the scheduler"):
        g.add_optimizer(torch.optim.SGD(g.model.parameters(), lr=0.1),
                        lr_sch=torch.optim.lr_scheduler.StepLR(other, step_size=1))


def test_optimizer_that_needs_a_closure():
    g = Train(opt=False)
    with raises("LBFGS needs a closure", "once per call", "Fix: use an optimizer"):
        g.add_optimizer(torch.optim.LBFGS(g.model.parameters()))


def _checkpoint():
    g = Train()
    g(X)
    return g, g.state_dict()


def test_loading_a_checkpoint_of_other_shapes():
    g, sd = _checkpoint()
    sd["model"]["a.weight"] = torch.zeros(4, 8)  # copy_ would broadcast it silently
    with raises("checkpoint key 'a.weight' has shape [4, 8]", "has shape [8, 8]", "Fix"):
        g.load_state_dict(sd)


def test_loading_a_checkpoint_without_its_model_entry():
    _, sd = _checkpoint()
    del sd["model"]
    with raises("has no 'model' entry", "Fix: save graph.state_dict() whole"):
        Train().load_state_dict(sd)  # at the call, before compiling


def test_loading_a_path_instead_of_a_dict():
    with raises("found the path 'ckpt/rank0.pt'", "graph.load_state_dict(graphc.load('ckpt/rank0.pt'))"):
        Train().load_state_dict("ckpt/rank0.pt")


def test_loading_a_checkpoint_of_another_optimizer_type():
    _, sd = _checkpoint()  # SGD
    g = Train(opt=False)
    g.add_optimizer(torch.optim.Adam(g.model.parameters()))
    g(X)
    with raises("optimizer state comes from torch.optim.sgd.SGD", "torch.optim.adam.Adam", "Fix"):
        g.load_state_dict(sd)


def test_unknown_checkpoint_entry_unless_not_strict():
    g, sd = _checkpoint()
    sd["modle"] = {}
    with raises("unknown entries ['modle']", "strict=False"):
        g.load_state_dict(sd)
    del sd["modle"]
    sd["model"]["c.weight"] = torch.zeros(2)
    with raises("'model' holds ['c.weight']", "which the model does not have", "strict=False"):
        g.load_state_dict(sd)
    g.load_state_dict(sd, strict=False)


def test_missing_checkpoint_key_unless_not_strict():
    g, sd = _checkpoint()
    del sd["model"]["b.bias"]
    with raises("lacks ['b.bias']", "strict=False"):
        g.load_state_dict(sd)
    before = g.model.b.bias.detach().clone()
    sd["model"]["a.bias"] = torch.full((8,), 7.0)
    g.load_state_dict(sd, strict=False)
    assert torch.equal(g.model.b.bias, before) and bool((g.model.a.bias == 7).all())


def test_save_or_load_of_something_that_is_not_a_path(tmp_path):
    with raises("graphc.save expects a file path", "found dict"):
        graphc.save({}, {})
    with raises("graphc.load expects a file path", "found int"):
        graphc.load(3)
    with raises("is a directory", "Fix"):
        graphc.save({}, str(tmp_path))


def test_split_of_a_bool():
    with raises("sbp.split(dim) needs an int dim, found True (bool)", "sbp.split(0)"):
        S.split(True)


def test_split_of_a_non_int():
    with raises("sbp.split(dim) needs an int dim, found 1.0 (float)"):
        S.split(1.0)


def test_placement_rank_that_is_a_bool():
    with raises("placement ranks must be ints, found True (bool)", "ranks=[0, 1]"):
        P("cpu", ranks=[True])
    with raises("placement ranks must be a list of ints", "found str '01'"):
        P("cpu", ranks="01")


def test_split_of_a_0d_tensor():
    with raises("to_global on a tensor of shape []", "split(0) cannot lay out a 0-d tensor",
                "sbp.broadcast"):
        graphc.to_global(torch.tensor(1.0), placement=P("cpu", ranks=[0, 1]), sbp=S.split(0))
    model = TwoStage()
    model.scale = nn.Parameter(torch.tensor(2.0))
    with raises("tensor 'scale' (shape [])", "cannot lay out a 0-d tensor"):
        graphc.to_global(model, placement=P("cpu", ranks=[0, 1]), sbp=S.split(0))


def test_split_of_a_0d_value_inside_build():
    def body(self, x):
        loss = graphc.to_global(self.model(x).sum(), placement=P("cpu", ranks=[0, 1]),
                                sbp=S.split(0))
        loss.backward()
        return loss
    with raises("to_global at", "split(0) cannot lay out a 0-d tensor"):
        compile_for(Train(body=body), 2)


def test_config_values_of_the_wrong_type():
    g = Train()
    with raises("unknown pipeline schedule ['1f1b']"):
        g.config.set_pipeline_schedule(["1f1b"])
    with raises("recv window must be an int >= 1, found True"):
        g.config.set_recv_window(True)


@pytest.mark.parametrize("name,value,expected", [
    ("GRAPHC_SHM_MAX_MB", "abc", "an int number of MiB >= 1"),
    ("GRAPHC_DEBUG", "abc", "an int >= 0"),
    ("GRAPHC_TIMEOUT", "-5", "a finite number > 0"),
    ("GRAPHC_HEARTBEAT_TIMEOUT", "nan", "a finite number > 0"),
    ("GRAPHC_PLAN_NPROC", "abc", "a number of ranks >= 1"),
])
def test_bad_numeric_graphc_environment_variable(monkeypatch, name, value, expected):
    from graphc.runtime import comm, watchdog
    from graphc.runtime.dist_env import timeout_seconds
    from graphc import modes
    read = {"GRAPHC_SHM_MAX_MB": comm.shm_max_bytes, "GRAPHC_DEBUG": compiler.debug_level,
            "GRAPHC_TIMEOUT": timeout_seconds, "GRAPHC_HEARTBEAT_TIMEOUT": watchdog.heartbeat_timeout_seconds,
            "GRAPHC_PLAN_NPROC": modes.active_plan}[name]
    monkeypatch.setenv(name, value)
    with raises(name, repr(value), expected):
        read()


def test_bad_graphc_debug_is_refused_at_compile(monkeypatch):
    monkeypatch.setenv("GRAPHC_DEBUG", "verbose")
    with raises("GRAPHC_DEBUG must be an int >= 0, found 'verbose'", "GRAPHC_DEBUG=0"):
        Train()(X)


# -- what tracing refuses (graphc/passes/trace_build.py) --------------------------------------
def test_clip_grad_norm_inside_build():
    def body(self, x):
        loss = self.model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        return loss
    with raises("build() calls torch.nn.utils.clip_grad_norm_", "test_misuse.py",
                "self.config.set_grad_clip_norm(max_norm)"):
        Train(body=body)(X)


def test_clip_grad_value_inside_build():
    def body(self, x):
        loss = self.model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_value_(self.model.parameters(), 1.0)
        return loss
    with raises("build() calls torch.nn.utils.clip_grad_value_", "Fix: remove it"):
        Train(body=body)(X)


def test_control_flow_on_a_tensor_value():
    def body(self, x):
        out = self.model(x)
        if out.mean() > 0:
            out = -out
        loss = out.sum()
        loss.backward()
        return loss
    with raises("graphc could not trace Train.build()", "if out.mean() > 0", "torch.where",
                "control flow on shapes (x.size(), x.shape, len(x)) is fine"):
        Train(body=body)(X)


class _Grads(nn.Module):
    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)
        self.register_buffer("last", torch.zeros(8))

    def forward(self, x):
        y = self.l(x)
        self.last = y.mean(1).sum() * torch.ones(8)  # keeps the autograd graph: refused
        return y


def test_buffer_assigned_a_value_that_requires_grad():
    with raises("assigns a value that requires grad to the buffer 'last' of _Grads",
                "assign value.detach()"):
        Train(model=_Grads())(X)


def test_deferred_batch_norm_not_a_bool():
    g = Train()
    with raises("set_deferred_batch_norm expects True or False, found 'yes'"):
        g.config.set_deferred_batch_norm("yes")


def test_replicated_parameters_must_start_equal_is_named_in_the_catalogue():
    """The multi-rank agreement cases (tests/reliability/test_agreement.py) in one process:
    the checker itself names the ranks and values that disagree."""
    from graphc.runtime.agreement import _mismatches
    problems = _mismatches({0: {"param:w": "aa", "plan hash": "p"}, 1: {"param:w": "bb", "plan hash": "p"}},
                           {"w": [0, 1]})
    assert problems == ["replicated parameter 'w' (checksums): ranks [0]: \"aa\"; ranks [1]: \"bb\""]


class CompiledInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = torch.compile(nn.Linear(8, 8))

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def test_torch_compiled_submodule():
    """fx cannot trace torch.compile's wrapper: the refusal names the module, the user's
    line that calls it, and the fix (the uncompiled module, e.g. its _orig_mod)."""
    with raises("module 'model.b' is a torch.compile'd Linear (an OptimizedModule)",
                "test_misuse.py", "return self.b(torch.tanh(self.a(x)))",
                "graphc compiles the whole step itself",
                "Fix: give the Graph the uncompiled module: drop the torch.compile(...) call",
                "model.b = model.b._orig_mod"):
        Train(model=CompiledInside())(X)
    model = CompiledInside()
    model.b = model.b._orig_mod  # the fix the message gives trains
    Train(model=model)(X)


def test_torch_compiled_model():
    with raises("module 'model' is a torch.compile'd TwoStage", "self.model = model._orig_mod"):
        Train(model=torch.compile(TwoStage()))(X)


def test_torch_compiled_function():
    double = torch.compile(lambda t: t * 2)
    with raises("could not trace Train.build()", "call the function itself, not torch.compile(fn)"):
        Train(body=lambda self, x: double(self.model(x)))(X)
