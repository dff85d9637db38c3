"""The local world (NOTE: Local world, graphc/runtime/local_world.py): every rank of a job as
a thread of this process, running the plans torchrun runs, with in-memory transfers.

- it trains exactly like eager on the whole batch (float64, 1e-10), checked two ways: by
  the check mode's own comparison and by the shared eager oracle (helpers.eager_train);
- a stuck world is a deadlock reported rank by rank, a collective the ranks disagree on
  is named, a rank's error is raised as that rank's;
- the ranks' own process state is theirs (RANK in os.environ, torch's random state);
- `graphc check` runs a script's ranks and exits 0 only when every step agrees.
"""
import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import graphc
import graphc.testing
from graphc.cli import main as cli_main
from graphc.runtime.local_world import LocalDeadlock, LocalWorld
from helpers import assert_same_as_eager, eager_train
from models import OPTIMIZERS, SkipNet, make_batches, make_sched

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SkipGraph(graphc.Graph):
    """SkipNet with its blocks over `pp` stages of `dp` ranks each."""

    def __init__(self, model, opt, pp: int, dp: int, accumulation: int = 2, schedule: str = "1f1b"):
        super().__init__()
        self.model = model
        n = len(model.blocks)
        for s in range(n):
            stage = s * pp // n
            self.model.blocks[s].config.set_stage(stage, graphc.placement("cpu", list(range(stage * dp, (stage + 1) * dp))))
        self.model.head.config.set_stage(pp - 1, graphc.placement("cpu", list(range((pp - 1) * dp, pp * dp))))
        self.loss_fn = nn.CrossEntropyLoss()
        self.config.set_gradient_accumulation_steps(accumulation)
        self.config.set_pipeline_schedule(schedule)
        self.add_optimizer(opt, make_sched(opt))

    def build(self, x, y):
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        return loss


def split_over_data(batches, pp: int, dp: int):
    """Each rank's call arguments: x split(0) over stage 0's dp ranks, y over the last
    stage's (a rank outside passes rows that are not read); plain batches at dp 1."""
    if dp == 1:
        return batches

    def inputs(rank, step):
        out = []
        for t, stage in zip(batches[step], (0, pp - 1)):
            ranks = list(range(stage * dp, (stage + 1) * dp))
            k = ranks.index(rank) if rank in ranks else 0
            out.append(graphc.to_global(t.chunk(dp)[k], placement=graphc.placement("cpu", ranks),
                                        sbp=graphc.sbp.split(0)))
        return tuple(out)
    return inputs


def skip_factory(pp, dp, blocks=4, acc=2):
    def make():
        torch.manual_seed(0)
        model = SkipNet(blocks)
        return SkipGraph(model, OPTIMIZERS["adam"](model.parameters()), pp, dp, acc)
    return make


@pytest.mark.parametrize("pp,dp", [(1, 2), (2, 1), (2, 2), (4, 2)])
def test_local_world_trains_like_eager(pp, dp):
    batches = make_batches(n=3)
    run = graphc.testing.local_world(skip_factory(pp, dp), split_over_data(batches, pp, dp),
                                     nproc=pp * dp, steps=len(batches), check=True)
    assert run.ok, run.text()
    report = run.reports[0]
    assert len(report.rows) == 3 and len(report.per_param) == len(dict(SkipNet(4).named_parameters()))
    # the same verdict from the shared oracle, on the state the ranks gathered
    torch.manual_seed(0)
    want_losses, want_state = eager_train(SkipNet(4), OPTIMIZERS["adam"], make_sched,
                                          nn.CrossEntropyLoss(), batches, 3)
    assert_same_as_eager(run.losses, {f"model.{k}": v for k, v in run.state.items()}
                         if "model.head.weight" in want_state else run.state,
                         want_losses, want_state, f"pp{pp} dp{dp}")


def test_check_names_a_difference():
    """A rank whose optimizer differs (lr) departs from eager: the report says where first."""
    def make(rank):
        torch.manual_seed(0)
        model = SkipNet(2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1 if rank == 0 else 0.2)
        graph = SkipGraph(model, opt, 2, 1)
        return graph
    run = graphc.testing.local_world(make, make_batches(n=2), nproc=2, check=True)
    assert not run.ok
    step, name = run.reports[0].first_departure
    assert step == 0 and name.startswith(("blocks.1", "head")), run.text()  # the stage on rank 1
    assert "DIFFERS" in run.text() and "stage 1 on ranks [1]" in run.text()
    # step 0's forward is right (the learning rate acts in the step): the report says so
    assert "stage output(s) compared agree with eager, so the step departs inside" in run.text()


def test_deadlock_is_reported_rank_by_rank():
    """Rank 1 skips the second call: rank 0 waits for it forever, with processes a hang."""
    batches = make_batches(n=2)

    def rank_main(rank):
        graph = skip_factory(2, 1)()
        graph(*batches[0])
        if rank == 0:
            graph(*batches[1])

    with pytest.raises(LocalDeadlock) as e:
        LocalWorld(2).run(rank_main)
    text = str(e.value)
    assert "rank 1: finished" in text
    assert "rank 0: waits for a transfer from rank 1" in text


def test_collective_mismatch_is_named():
    def rank_main(rank):
        from graphc import world
        t = torch.ones(3)
        if rank == 0:
            world.current().all_reduce(t)
        else:
            world.current().all_gather([torch.empty(3), torch.empty(3)], t)

    with pytest.raises(graphc.GraphcError, match="collective mismatch.*all_reduce.*all_gather"):
        LocalWorld(2).run(rank_main)


def test_a_ranks_error_is_raised_and_the_others_stop():
    def rank_main(rank):
        from graphc import world
        if rank == 1:
            raise ValueError("rank 1 broke")
        world.current().barrier()

    with pytest.raises(ValueError, match="rank 1 broke"):
        LocalWorld(3).run(rank_main)


def test_each_rank_has_its_own_process_state():
    """RANK in os.environ and torch's generator are the rank's own, as in separate processes:
    a draw on one rank does not move another's generator."""
    torch.manual_seed(5)
    want = torch.rand(2)

    def rank_main(rank):
        from graphc import world
        first = torch.rand(2) if rank == 0 else None
        world.current().barrier()   # hands the baton over between the draws
        second = torch.rand(2)
        return int(os.environ["RANK"]), first, second

    torch.manual_seed(5)
    results = LocalWorld(2).run(rank_main)
    assert [r[0] for r in results] == [0, 1]
    assert torch.equal(results[0][1], want) and torch.equal(results[1][2], want)
    assert os.environ.get("RANK") != "1"


def test_collectives_combine_in_rank_order():
    def rank_main(rank):
        from graphc import world
        w = world.current()
        t = torch.tensor([float(rank + 1)])
        w.all_reduce(t)
        parts = [torch.empty(1) for _ in range(3)]
        w.all_gather(parts, torch.tensor([float(rank)]))
        out = torch.empty(1)
        w.reduce_scatter(out, [torch.tensor([float(rank * 10 + j)]) for j in range(3)])
        recv = [torch.empty(1) for _ in range(3)]
        w.all_to_all(recv, [torch.tensor([float(rank * 10 + j)]) for j in range(3)])
        return t.item(), [p.item() for p in parts], out.item(), [r.item() for r in recv]

    results = LocalWorld(3).run(rank_main)
    for rank, (total, gathered, scattered, swapped) in enumerate(results):
        assert total == 6.0 and gathered == [0.0, 1.0, 2.0]
        assert scattered == sum(r * 10 + rank for r in range(3))
        assert swapped == [r * 10 + rank for r in range(3)]


def test_graphc_check_command_on_the_gpt_example():
    """`graphc check` runs the example's 4 ranks (pipeline 2 x tensor 2, tied embedding) and
    exits 0 with every step equal to eager; a wrong tolerance of 0 makes it return 1 (the
    command's main called in this process: a second interpreter would cost more than the run,
    `python -m graphc` itself is test_plan_cli.py's; one step is enough for the strict run, as
    the first step already differs)."""
    args = ["check", os.path.join(REPO, "examples", "gpt.py"), "--nproc", "4", "--steps", "2",
            "--", "--pp", "2", "--tp", "2", "--layers", "2", "--embd", "32", "--batch", "8"]
    code, out = _cli(args)
    assert code == 0, out
    assert "OK: 2 step(s)" in out and "graphc check: OK" in out
    code, out = _cli(args[:5] + ["1", "--tolerance", "0"] + args[6:])
    # float64 reordering leaves ~1e-16 differences: a zero bound must fail, naming a parameter
    assert code == 1 and "DIFFERS: first at step" in out, out


def _cli(args):
    """graphc's command line in this process: its exit code and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli_main(args)
    return code, out.getvalue()


FAKE_MODES_IN_RANK_THREADS = """
import threading, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from graphc.runtime.local_world import LocalWorld

def traced(_rank=None):
    with FakeTensorMode():
        return tuple(torch.empty(2, 3).shape)

for _ in range(3):
    assert LocalWorld(2).run(traced) == [(2, 3), (2, 3)]
    junk = [bytearray(64) for _ in range(10000)]   # the ended threads' memory used again
    assert traced() == (2, 3)
print("held by", [t.name for t in threading.enumerate() if t.name == "graphc-cuda-guard"])
"""


def test_fake_modes_in_rank_threads_then_on_the_main_thread():
    """NOTE: Fake CUDA guard of a thread: rank threads that enter a FakeTensorMode first, then
    end, leave the main thread's next fake mode a working CUDA guard (a CUDA wheel without a
    GPU segfaulted here); a process of its own, so that its main thread has traced nothing."""
    cuda_wheel_without_gpu = torch.backends.cuda.is_built() and torch.cuda.device_count() == 0
    run = subprocess.run([sys.executable, "-X", "faulthandler", "-c", FAKE_MODES_IN_RANK_THREADS],
                         cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    held = ["graphc-cuda-guard"] if cuda_wheel_without_gpu else []
    assert run.stdout.strip() == f"held by {held}"
