"""Plan digests (NOTE: Plan digests): what a rank's peers must agree with, compared as
digests; the first disagreement names both ranks and the instruction where they part."""
import dataclasses
import os
import sys

import pytest

from graphc import compiler
from graphc.executable import input_specs
from graphc.plan.digests import (channel_key, explain, first_disagreement, holders_of, plan_digests,
                                 plan_sequences)
from graphc.plan.instructions import AllReduce, Recv, Send

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "..", "benchmarks"))
import plan_scale  # noqa: E402


@pytest.fixture
def plans(monkeypatch):
    """Every rank's plan of the MLP on pipeline 2 x data 2 x tensor 2, 2 micro-batches."""
    for k, v in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 8), ("LOCAL_WORLD_SIZE", 8)):
        monkeypatch.setenv(k, str(v))
    graph, inputs = plan_scale.mlp_graph(2, 2, 2, 2)
    specs = input_specs(inputs)
    return compiler.compile(graph, [s.example() for s in specs], 8, [s.layout for s in specs]).plans


def _digests(plans):
    return {p.rank: plan_digests(p) for p in plans}


def _replaced(plan, index, ins):
    return dataclasses.replace(plan, instructions=plan.instructions[:index] + [ins] + plan.instructions[index + 1:])


def test_the_compiled_world_agrees(plans):
    digests = _digests(plans)
    assert first_disagreement(digests) is None
    # rank 5 (stage 1) shares its tensor group [4, 5] and its data group [5, 7], and a
    # channel each way with rank 1 (stage 0, the same data and tensor index)
    keys = set(digests[5])
    assert {"collectives over 4,5", "collectives over 5,7", "transfers 1->5", "transfers 5->1"} <= keys
    assert digests[5]["transfers 1->5"] == digests[1]["transfers 1->5"]


def test_a_changed_gradient_bucket_names_both_ranks_and_the_instruction(plans):
    odd = plans[7]
    i, bucket = next((i, ins) for i, ins in enumerate(odd.instructions) if type(ins) is AllReduce)
    shrunk = dataclasses.replace(bucket.tensors[0], shape=(1,) + bucket.tensors[0].shape[1:])
    plans[7] = _replaced(odd, i, dataclasses.replace(bucket, tensors=(shrunk,) + bucket.tensors[1:]))
    key, bad, ref = first_disagreement(_digests(plans))
    assert key == "collectives over 5,7" and {bad, ref} == {5, 7}   # two members: either is the odd one
    text = explain(key, bad, ref, plan_sequences(plans[bad])[key], plan_sequences(plans[ref])[key])
    assert f"instruction #{i} of its plan" in text and str(plans[7].instructions[i]) in text


def test_a_missing_receive_names_the_channel(plans):
    receiver = plans[5]
    i = next(i for i, ins in enumerate(receiver.instructions) if isinstance(ins, Recv))
    plans[5] = dataclasses.replace(receiver, instructions=receiver.instructions[:i] + receiver.instructions[i + 1:])
    key, bad, ref = first_disagreement(_digests(plans))
    assert key == f"transfers {receiver.instructions[i].peer}->5" and {bad, ref} == {1, 5}
    text = explain(key, bad, ref, plan_sequences(plans[bad])[key], plan_sequences(plans[ref])[key])
    assert text.startswith(f"transfer #0 of the {key}: ")
    assert str(next(ins for ins in plans[1].instructions if isinstance(ins, Send) and ins.peer == 5)) in text


def test_a_rank_without_a_groups_collectives_is_found(plans):
    plans[4] = dataclasses.replace(plans[4], instructions=[ins for ins in plans[4].instructions
                                                            if not (type(ins) is AllReduce and ins.ranks == (4, 6))])
    key, bad, ref = first_disagreement(_digests(plans))
    assert key == "collectives over 4,6" and {bad, ref} == {4, 6}
    seqs = {r: plan_sequences(plans[r])[key] for r in (4, 6)}
    k = len(seqs[4])   # rank 4 still lists the group's loss sum (OUTPUT_ALL_REDUCE), then nothing
    assert [e[2] for e in seqs[4]] == [e[2] for e in seqs[6][:k]]
    text = explain(key, bad, ref, seqs[bad], seqs[ref])
    assert f"rank 4 lists no #{k} there ({k} in all)" in text and seqs[6][k][1] in text


@pytest.mark.slow
def test_a_planted_mismatch_is_caught_at_8192_ranks(monkeypatch):
    """At 8192 ranks (pipeline 32 x data 64 x tensor 4): the plan a rank lowers alone agrees,
    digest for digest, with the plans of every peer it shares a key with (the whole world's,
    made from templates), and one micro-batch changed in one of its sends is named by the
    channel's key and both its ends."""
    pp, dp, tp, m = plan_scale.SIZES[8192]
    for k, v in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 8192), ("LOCAL_WORLD_SIZE", 8192)):
        monkeypatch.setenv(k, str(v))
    graph, inputs = plan_scale.mlp_graph(pp, dp, tp, m)
    specs = input_specs(inputs)
    args = ([s.example() for s in specs], 8192, [s.layout for s in specs])
    rank = 4097
    own = compiler.compile(graph, *args, ranks=[rank]).plan_for(rank)
    world = compiler.compile(graph, *args).plans
    mine = plan_digests(own)
    holders = sorted({h for key in mine for h in holders_of(key)} - {rank})
    assert len(holders) >= 64 + 3                  # its data column, tensor row and pipeline peers
    everyone = {h: {k: v for k, v in plan_digests(world[h]).items() if k in mine} for h in holders}
    everyone[rank] = mine
    assert first_disagreement(everyone) is None
    i, send = next((i, ins) for i, ins in enumerate(own.instructions) if isinstance(ins, Send))
    everyone[rank] = plan_digests(_replaced(own, i, dataclasses.replace(send, microbatch=send.microbatch + 1)))
    key, bad, ref = first_disagreement(everyone)
    assert key == channel_key(rank, send.peer) and {bad, ref} == {rank, send.peer}
