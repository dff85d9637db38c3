"""The simulator's model-state bytes per rank equal the tensors on real ranks (See NOTE:
Model-state bytes in graphc/tools/simulate/model_state.py).

On 2 gloo ranks, replicated data parallel and ZeRO stages 1, 2 and 3, two steps each with
Adam: the simulator's parameters, gradients and optimizer state per rank equal, byte for
byte, what is counted from the rank's tensors:
  params     the storage of the model's parameters and of the optimizer's (ZeRO's shard
             parameters) after the second step, each storage once (stage 3 frees the whole
             ones: 0 bytes);
  grads      at the second step's optimizer step (a step pre-hook: ZeRO steps bucket by
             bucket), the storage of every gradient the optimizer sees, and the gradient
             buffers the runtime keeps (GradSync's flat buckets, stage 1's packed buckets),
             each storage once;
  optimizer  the optimizer's state tensors with a dim (Adam's exp_avg, exp_avg_sq).
One parameter has 33 rows, so its shards are uneven (17 and 16) and its buckets padded.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphc
from graphc.tools.simulate import model_inputs, model_state
from helpers import run_world

D_IN, HIDDEN, ODD, BATCH = 32, 128, 33, 16


class Uneven(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = nn.Linear(D_IN, HIDDEN), nn.Linear(HIDDEN, ODD), nn.Linear(ODD, 4)

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Graph(graphc.Graph):
    def __init__(self, model, opt, zero):
        super().__init__()
        self.model = model
        self.config.set_gradient_accumulation_steps(2)
        if zero:
            self.config.enable_zero(True, stage=zero, shard_min_size=1024)
        self.add_optimizer(opt)

    def build(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        return loss


def _storages(tensors) -> int:
    """Bytes of the distinct storages under `tensors` (views of one buffer count it once)."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _measure(rank, world):
    where = graphc.placement("cpu", list(range(world)))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, D_IN, generator=g), torch.randint(0, 4, (BATCH,), generator=g)
    n = BATCH // world
    gx = graphc.to_global(x[rank * n:(rank + 1) * n], placement=where, sbp=graphc.sbp.split(0))
    gy = graphc.to_global(y[rank * n:(rank + 1) * n], placement=where, sbp=graphc.sbp.split(0))
    out = {}
    for zero in (0, 1, 2, 3):
        torch.manual_seed(0)
        model = graphc.to_global(Uneven(), placement=where, sbp=graphc.sbp.broadcast)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        graph = Graph(model, opt, zero)
        graph(gx, gy)
        grads = []

        def at_step(optimizer, args, kwargs):
            sync = graph._runtime.grad_sync
            kept = [*getattr(sync, "flats", {}).values(), *getattr(sync, "wides", {}).values(),
                    *getattr(sync, "packed", {}).values()]
            grads.extend(kept + [p.grad for grp in optimizer.param_groups for p in grp["params"]
                                 if p.grad is not None])
        hook = opt.register_step_pre_hook(at_step)
        graph(gx, gy)
        hook.remove()
        shards = [p for grp in opt.param_groups for p in grp["params"]]
        measured = (_storages([*model.parameters(), *shards]), _storages(grads),
                    sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                        if torch.is_tensor(v) and v.dim()))
        compiled = graph.compiled   # a running rank holds its own plan (NOTE: Plans of some ranks)
        sim = model_state(graph.plan, model_inputs(compiled, opt).params[rank])
        out[zero] = {"measured": measured, "simulated": (sim.params, sim.grads, sim.optimizer)}
    return out


@pytest.mark.world
def test_simulated_model_state_equals_measured():
    results = run_world(_measure, 2)
    for rank, res in enumerate(results):
        for zero, got in res.items():
            assert got["simulated"] == got["measured"], (rank, zero, got)
    whole = sum(p.numel() for p in Uneven().parameters()) * 8
    rank0 = {zero: got["measured"] for zero, got in results[0].items()}
    assert rank0[0][0] == whole and rank0[3][0] < 0.6 * whole       # stage 3 holds rows
    assert rank0[0][2] == 2 * whole and rank0[1][2] < 0.6 * 2 * whole   # ZeRO shards Adam
    assert rank0[2][1] < rank0[0][1] < rank0[1][1]   # stage 2 rows; stage 1 keeps its packed buckets
