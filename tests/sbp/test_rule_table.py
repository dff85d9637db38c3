"""The SBP rule table, checked by running it (See NOTE: SBP rule check, tests/sbp/rule_check.py):
every registered rule's every claimed signature, on small random shapes and 2 and 3 ranks,
gives each rank its local component of the whole op's output (float64, 1e-10)."""

import pytest
import torch
import torch.nn.functional as F

from graphc.placement import Split
from graphc.sbp import rules
from rule_check import Sample, check_sample
from rule_samples import NOT_SAMPLED, SAMPLES, first_and, one

SEEDS = range(2)


def _keys(sample_list):
    return {s.key for s in sample_list}


def test_every_rule_key_has_a_sample():
    """A key of RULES without a sample (or a reason in NOT_SAMPLED) fails: a new rule comes
    with its sample, so the checker covers the whole table."""
    missing = [k for k in rules.RULES if k not in _keys(SAMPLES) and k not in NOT_SAMPLED]
    assert missing == [], f"add a Sample to tests/sbp/rule_samples.py for {missing}"
    assert not set(NOT_SAMPLED) & _keys(SAMPLES)


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda s: s.name)
def test_rule_claims_hold_on_shards(sample):
    failures = [f for seed in SEEDS for f in check_sample(sample, seed)]
    assert failures == [], "\n".join(failures[:5])


def _squeeze_keeping_split_dims(ctx):
    """A wrong rule for x.squeeze(d): S(k) -> S(k) for every k it keeps, as if the squeezed
    dim left the others' numbers alone (the dims after it move one down)."""
    x = ctx.node.args[0]
    shape = ctx.meta(x).shape
    return [({x: Split(k)}, Split(k)) for k, size in enumerate(shape) if size > 1 and ctx.splits(size)]


def _squeeze_moving_split_dims(ctx):
    x, d = ctx.node.args[0], ctx.node.args[1]
    shape = ctx.meta(x).shape
    return [({x: Split(k)}, Split(k - (k > d))) for k, size in enumerate(shape)
            if k != d and ctx.splits(size)]


SQUEEZE = Sample("squeeze", one(lambda rng: (rng.randint(2, 4), 1, rng.randint(2, 4))),
                 lambda ts, s: ((ts[0], 1), {}))


def test_a_wrong_rule_is_caught_with_its_shapes():
    failures = check_sample(SQUEEZE, 0, rule=_squeeze_keeping_split_dims)
    assert failures and all("squeeze on" in f for f in failures)
    assert failures[0] == ("squeeze on 2 ranks, inputs [(3, 1, 3)] laid out {'x0': split(2)} -> "
                           "split(2): claims split(2) of a 2-D output (ranks computed shapes "
                           "[(3, 2), (3, 1)])")
    assert check_sample(SQUEEZE, 0, rule=_squeeze_moving_split_dims) == []   # the right one passes


def test_a_wrong_rule_in_the_table_fails_its_sample(monkeypatch):
    """permute's rule with the permutation read backwards: the registered table's sample fails."""
    def transposed(ctx):
        x = ctx.node.args[0]
        perm = rules.permutation(ctx.node, len(ctx.meta(x).shape))
        return [({x: Split(j)}, Split(perm[j])) for j in range(len(perm)) if ctx.splits(ctx.meta(x).shape[j])]
    monkeypatch.setitem(rules.RULES, "permute", transposed)
    sample = next(s for s in SAMPLES if s.key == "permute")
    assert any("permute on" in f for seed in SEEDS for f in check_sample(sample, seed))


def test_the_empty_channel_shard_it_found_is_caught():
    """Pooling's rule before `fills`: 4 channels split over 3 ranks (2, 2, 0)
    leave rank 2 an empty channel dim, which max_pool2d refuses."""
    def pool_without_fills(ctx):
        keep = len(ctx.out.shape) - 2
        return [c for c in rules._split_candidates(ctx) if c[1].dim < keep]
    sample = Sample(F.max_pool2d, lambda rng: (torch.randn(4, 4, 6, 6, dtype=torch.float64),), first_and(2))
    failures = check_sample(sample, 0, ranks=(3,), rule=pool_without_fills)
    assert any("laid out {'x0': split(1)} -> split(1): rank 2 raised on local inputs [(4, 0, 6, 6)]" in f
               for f in failures), failures
    assert check_sample(sample, 0, ranks=(3,)) == []      # the registered rule, with fills
