"""examples/gpt.py (tied embeddings, shape asserts, causal attention) against eager PyTorch.

Float64, whole batch, AdamW, 3 steps, tolerance 1e-10 (helpers.py): pipeline 2 (1F1B and
GPipe), data 2 and tensor 2 on 2 ranks; pipeline 4 on 4 ranks; pipeline x tensor x data
2x2x2 on 8 ranks (slow); ZeRO stage 3 (width 64) on tensor 2 x data 2 (2-D: a weight's rows
split by tensor parallelism, then its local rows by ZeRO, the tied embedding and head among
them) and on pipeline 2 x data 2 (the tie
across stages stays whole), with a last batch of another shape (a second plan). No op of the
tensor-parallel plans falls back to broadcast.
"""
import os
import sys

import pytest
import torch

from helpers import assert_same_as_eager, run_world

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
import gpt  # noqa: E402

pytestmark = pytest.mark.world  # every test here spawns ranks (tests/test_world_marker.py)

STEPS = 3


def _args(extra=()):
    import argparse  # the example's own defaults, overridden like a user's command line
    parser = argparse.ArgumentParser()
    for name, default in (("layers", 4), ("embd", 32), ("heads", 4), ("block", 16), ("batch", 8),
                          ("accumulation", 2), ("seed", 0)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser.parse_args(list(extra))


def _batches(ids, args):
    """STEPS batches, then a last, smaller one (a second plan, compiled for its shape)."""
    yield from gpt.batches(ids, args.batch, args.block, STEPS)
    yield from gpt.batches(ids, args.batch // 2, args.block, 1, seed=1)


def _train(rank, world, configs, extra=()):
    out = {}
    ids, vocab = gpt.load_corpus()
    args = _args(extra)
    for name, (pp, tp, dp, schedule, *zero) in configs.items():
        layout = gpt.Layout(pp, tp, dp)
        model = gpt.make_model(vocab, args)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        graph = gpt.GPTGraph(model, opt, layout, args.accumulation, schedule, *zero)
        losses = []
        for x, y in _batches(ids, args):
            loss = graph(*gpt.global_inputs(layout, rank, x, y)).to_local()
            losses += [loss.item()] if loss.numel() else []
        out[name] = {"losses": losses, "state": graph.full_state_dict(), "plan": str(graph.plan)}
    return out


def _eager(extra=()):
    ids, vocab = gpt.load_corpus()
    args = _args(extra)
    model = gpt.make_model(vocab, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    losses = []
    for x, y in _batches(ids, args):
        loss = gpt.lm_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check(results, names, extra=()):
    ref_losses, ref_state = _eager(extra)
    for name in names:
        for rank, res in enumerate(results):
            got = res[name]
            assert set(got["state"]) == set(ref_state), "full_state_dict keys are model.state_dict()'s"
            if got["losses"]:
                assert_same_as_eager(got["losses"], got["state"], ref_losses, ref_state, f"{name} rank {rank}")
            else:
                assert_same_as_eager([], got["state"], [], ref_state, f"{name} rank {rank}")
            assert torch.equal(got["state"]["transformer.wte.weight"], got["state"]["lm_head.weight"])
            if "tp" in name:
                assert "fallback" not in got["plan"], f"{name}: an op fell back to broadcast"


@pytest.mark.slow   # CI time: the GPT on pp2 (1f1b) and dp2 runs by default in the local sweep (tests/local/test_sweep.py), held bitwise to gloo by tests/local/test_local_vs_gloo.py
def test_gpt_on_two_ranks_matches_eager():
    configs = {"pp2-1f1b": (2, 1, 1, "1f1b"), "dp2": (1, 1, 2, "1f1b")}
    _check(run_world(_train, 2, configs), configs)


@pytest.mark.slow   # CI time: the GPT on gpipe and tp2 also runs in the local sweep (tests/local)
def test_gpt_gpipe_and_tensor_2_on_two_ranks_match_eager():
    configs = {"pp2-gpipe": (2, 1, 1, "gpipe"), "tp2": (1, 2, 1, "1f1b")}
    _check(run_world(_train, 2, configs), configs)


@pytest.mark.slow  # pipeline 4 with a tie is also in tests/runtime/test_tied.py
def test_gpt_pipeline_of_four_matches_eager():
    configs = {"pp4": (4, 1, 1, "1f1b")}
    _check(run_world(_train, 4, configs), configs)


@pytest.mark.slow
def test_gpt_pipeline_tensor_data_2x2x2_matches_eager():
    configs = {"pp2-tp2-dp2": (2, 2, 2, "1f1b")}
    _check(run_world(_train, 8, configs, timeout=600), configs)


@pytest.mark.slow   # CI time: ZeRO-3 on pipeline x data runs in tests/zero/test_zero3_numerics.py, the sweep's GPT ZeRO configurations in the local world
def test_gpt_zero_3_on_tensor_2_x_data_2_and_pipeline_2_x_data_2_matches_eager():
    configs = {"tp2-dp2-zero3": (1, 2, 2, "1f1b", 3), "pp2-dp2-zero3": (2, 1, 2, "1f1b", 3)}
    wide = ("--embd", "64")   # the tied embedding's local [20, 64] reaches shard_min_size (1024)
    results = run_world(_train, 4, configs, wide)
    _check(results, configs, wide)
    released = results[0]["tp2-dp2-zero3"]["plan"].split("RELEASE", 1)[1].split("\n")[0]
    # weights split by tensor parallelism, their local rows split again by ZeRO (2-D), the tie too
    assert "mlp.fc.weight:f64[128,64]" in released and "lm_head.weight:f64[20,64]" in released
