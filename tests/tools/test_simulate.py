"""simulate(): bubble fractions, communication delays, live activations, deadlock."""
from dataclasses import replace

import pytest

from graphc import PlanError
from graphc.passes.lower_plan import lower_plan
from graphc.plan.instructions import AllReduce, Recv, TensorSpec
from graphc.plan.plan import StageInfo
from graphc.plan.program import StageProgram
from graphc.tools.costs import CostModel
from graphc.sbp.cost import moved_bytes
from graphc.tools.simulate import simulate

SPEC = TensorSpec("h", (4, 1024), "float32")    # 16 KiB


def chain_plans(p, m, schedule="1f1b", training=True, checkpointing="never"):
    """Plans of a p-stage chain (stage s on rank s) lowered exactly as the compiler does."""
    progs = [StageProgram(s, None, [], [], {}, {s - 1: [SPEC]} if s else {},
                          {s + 1: [SPEC]} if s < p - 1 else {}, {"h": True}) for s in range(p)]
    stages = [StageInfo(s, (s,)) for s in range(p)]
    return lower_plan(progs, stages, schedule, m, training, p, checkpointing)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
def test_bubble_fraction_matches_formula(schedule, p, m):
    result = simulate(chain_plans(p, m, schedule), CostModel.uniform(p))
    expected = (p - 1) / (m + p - 1)
    assert abs(result.bubble_fraction - expected) <= 0.01 * max(expected, 1e-9) + 1e-12, \
        (result.bubble_fraction, expected)
    assert result.step_time == pytest.approx(3 * (m + p - 1))


@pytest.mark.parametrize("schedule,bound", [("gpipe", lambda p, s, m: m),
                                            ("1f1b", lambda p, s, m: min(p - s, m))])
def test_peak_live_microbatches(schedule, bound):
    p, m = 4, 8
    costs = CostModel.uniform(p)
    costs.activation_bytes = {s: 1000 for s in range(p)}
    for r in simulate(chain_plans(p, m, schedule), costs).ranks:
        assert r.peak_live_microbatches == bound(p, r.rank, m)
        assert r.peak_activation_bytes == 1000 * bound(p, r.rank, m)


@pytest.mark.parametrize("mode,rank0,rank1", [
    ("never", 2 * 10**6, 10**6),                 # 1F1B holds p - s micro-batches whole
    ("always", 10**6 + 100, 10**6),              # inputs only, plus one recompute at a time
    ("except_last", 2 * 10**6, 10**6)])          # the last micro-batch is kept whole
def test_peak_activation_bytes_follow_the_checkpoint_mode(mode, rank0, rank1):
    costs = CostModel.uniform(2)
    costs.activation_bytes = {0: 10**6, 1: 10**6}
    costs.input_bytes = {0: 100}                 # stage 1's inputs: what it receives, SPEC
    got = [r.peak_activation_bytes for r in simulate(chain_plans(2, 4, "1f1b", True, mode), costs).ranks]
    assert got == [rank0, rank1]
    assert SPEC.nbytes < 10**6


def test_transfers_add_latency_and_wire_time():
    costs = CostModel.uniform(2)
    costs.latency, costs.bandwidth = 0.5, SPEC.nbytes / 0.25      # 0.75 per transfer
    result = simulate(chain_plans(2, 1), costs)
    # F0, transfer, F1, B1, transfer back, B0
    assert result.step_time == pytest.approx(1 + 0.75 + 1 + 2 + 0.75 + 2)


def test_unsatisfiable_recv_is_reported():
    plans = chain_plans(2, 2)
    plans[1].instructions.insert(0, Recv(1, 5, 0, "F", 0, (SPEC,)))
    with pytest.raises(PlanError, match="rank 1"):
        simulate(plans, CostModel.uniform(2))


def test_table_lists_every_rank():
    text = simulate(chain_plans(3, 4), CostModel.uniform(3)).table(unit="units", scale=1)
    assert [line.split()[0] for line in text.splitlines()[1:4]] == ["0", "1", "2"]
    assert "mean bubble 33.3%" in text


# -- transport CPU costs, steady state, contention ------------------------------------------
def test_send_cost_is_on_the_senders_timeline():
    costs = CostModel.uniform(2)
    costs.send_overhead, costs.send_per_byte = 0.25, 0.5 / SPEC.nbytes      # 0.75 per send
    costs.recv_overhead, costs.recv_per_byte = 0.125, 0.125 / SPEC.nbytes   # 0.25 per recv
    result = simulate(chain_plans(2, 1), costs)
    send = costs.send_cost(SPEC.nbytes)
    recv = costs.recv_cost(SPEC.nbytes)
    for rank, spans in result.timeline.items():
        sends = [s for s in spans if s.kind == "send"]
        assert sends and all(s.end - s.start == pytest.approx(send) for s in sends)
        # the rank's next instruction starts only after its send's CPU time
        nxt = spans[spans.index(sends[0]) + 1]
        assert nxt.start == pytest.approx(sends[0].end)
    # F0, send, recv, F1, B1, send, recv, B0
    assert result.step_time == pytest.approx(1 + send + recv + 1 + 2 + send + recv + 2)


def test_polling_receiver_notices_data_late_only_after_waiting():
    costs = CostModel.uniform(2)
    costs.poll_delay = [(1.0, 0.1), (3.0, 0.3)]
    assert costs.noticed(0.0) == 0.0
    assert costs.noticed(2.0) == pytest.approx(0.2)
    assert costs.noticed(10.0) == pytest.approx(0.3)
    plain = simulate(chain_plans(2, 1), CostModel.uniform(2))
    late = simulate(chain_plans(2, 1), costs)
    # rank 1 waits 1 (F0 of rank 0) and rank 0 waits 3 (F1 + B1 on rank 1)
    assert late.step_time == pytest.approx(plain.step_time + costs.noticed(1.0) + costs.noticed(3.0))


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (3, 6), (4, 8)])
def test_steady_state_equals_one_step_for_a_balanced_pipeline(schedule, p, m):
    one = simulate(chain_plans(p, m, schedule), CostModel.uniform(p))
    many = simulate(chain_plans(p, m, schedule), CostModel.uniform(p), steps=5)
    assert many.steps == 5 and len(many.step_ends) == 5
    assert many.first_step_time == pytest.approx(one.step_time)
    assert many.step_time == pytest.approx(one.step_time)
    assert many.bubble_fraction == pytest.approx(one.bubble_fraction)
    # each step's spans are tagged with their step, in order on every rank
    for spans in many.timeline.values():
        assert [s.step for s in spans] == sorted(s.step for s in spans)


def test_next_step_overlaps_a_slow_optimizer_on_another_rank():
    costs = CostModel.uniform(2)
    costs.optimizer, costs.stage_of_rank = {1: 4.0}, {0: 0, 1: 1}
    one = simulate(chain_plans(2, 1), costs)
    many = simulate(chain_plans(2, 1), costs, steps=6)
    # one step: F0, F1, B1 then rank 1's optimizer ends last
    assert one.step_time == pytest.approx(costs.forward[0] + costs.forward[1] + costs.backward[1] + 4.0)
    # in the steady state rank 0 starts its next forward while rank 1 still steps its
    # optimizer, so the period is rank 1's own work per step
    assert many.step_time == pytest.approx(costs.forward[1] + costs.backward[1] + 4.0)
    assert many.step_time < one.step_time
    rank0, rank1 = many.timeline[0], many.timeline[1]
    opt1 = next(s for s in rank1 if s.kind == "optimizer" and s.step == 0)
    f0_next = next(s for s in rank0 if s.kind == "forward" and s.step == 1)
    assert f0_next.start < opt1.end


def test_draining_sends_waits_for_delivery_when_the_transport_completes_on_delivery():
    costs = CostModel.uniform(2)
    costs.latency = 5.0
    free = simulate(chain_plans(2, 1), costs)
    costs.sends_complete_on_delivery = True
    drained = simulate(chain_plans(2, 1), costs)
    # rank 1's last instruction is its send of B1's gradient; its step ends on delivery
    send = [s for s in drained.timeline[1] if s.kind == "send"][-1]
    assert drained.ranks[1].finish == pytest.approx(send.end + costs.latency)
    assert free.ranks[1].finish == pytest.approx(send.end)


def test_ranks_outnumbering_cores_share_them():
    plans = chain_plans(4, 4)
    alone = simulate(plans, CostModel.uniform(4))
    assert simulate(plans, CostModel.uniform(4), cores=4).step_time == pytest.approx(alone.step_time)
    shared = simulate(plans, CostModel.uniform(4), cores=2)
    assert shared.step_time == pytest.approx(2 * alone.step_time)


def test_multi_step_deadlock_names_the_step():
    plans = chain_plans(2, 2)
    plans[1].instructions.append(Recv(1, 0, 0, "F", 0, (SPEC,)))
    with pytest.raises(PlanError, match="rank 1"):
        simulate(plans, CostModel.uniform(2), steps=3)


@pytest.mark.world
def test_measure_transport_between_two_processes():
    from graphc.runtime import shm
    from graphc.tools.costs import measure_transport
    if not shm.supported():
        pytest.skip("shared-memory transport needs x86-64 Linux")
    tc = measure_transport("shm", nbytes=SPEC.nbytes, repeats=2)
    assert tc.kind == "shm"
    assert tc.send_overhead + tc.send_per_byte * SPEC.nbytes > 0      # a memcpy is not free
    assert min(tc.send_overhead, tc.send_per_byte, tc.recv_overhead, tc.recv_per_byte, tc.latency) >= 0
    assert [w for w, _ in tc.poll_delay] == sorted(w for w, _ in tc.poll_delay)
    costs = tc.apply(CostModel.uniform(2))
    assert costs.send_cost(SPEC.nbytes) == pytest.approx(tc.send_overhead + tc.send_per_byte * SPEC.nbytes)
    assert not costs.sends_complete_on_delivery
    bandwidth, latency = tc.collective_link      # gloo's all-reduce, calibrated alongside
    assert bandwidth > 0 and latency >= 0 and costs.collective_link == tc.collective_link
    # NOTE: Collectives in context: an all-reduce after each gap of compute, longer gaps later
    computed = [c for c, _ in tc.collective_skew]
    assert len(computed) == 4 and computed == sorted(computed) and costs.collective_skew == tc.collective_skew
    assert min(extra for _, extra in tc.collective_skew) >= 0


def test_the_collective_link_reproduces_the_measured_all_reduces():
    """NOTE: Calibrated collectives: the fitted link charges a 2-rank all-reduce of each
    measured size the time measured for it, and larger groups by the ring's steps."""
    from graphc.tools.network import collective_seconds
    from graphc.tools.transport_costs import link_through
    sizes, seconds = (8, 1 << 20), (150e-6, 1.2e-3)
    link = link_through(sizes, seconds)
    for b, t in zip(sizes, seconds):
        assert collective_seconds("all_reduce", moved_bytes("all_reduce", b, 2), b, 2, link) == pytest.approx(t)
    assert link_through(sizes, (2e-4, 1e-4)) == (float("inf"), 1e-4)   # noise: no negative bandwidth
    ins = AllReduce((0, 1), (TensorSpec("g", (1 << 18,), "float32"),))
    calibrated = replace(CostModel.uniform(1), collective_link=link)
    assert calibrated.collective(ins) == pytest.approx(seconds[1])
