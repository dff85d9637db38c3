"""Ranks agree before the first step, or every rank stops with the same GraphcError.

NOTE: Rank agreement
Each rank compiles on its own, so a rank given other input shapes, another accumulation
setting or schedule, a checkpoint of another step, or a model initialised with another
seed would otherwise train on mismatched buffers or wait out GRAPHC_TIMEOUT and die in a
raw gloo error that blames a healthy rank. After compiling (and loading a checkpoint),
every rank writes a small fingerprint of what it is about to run to the c10d store and
reads everyone's: one exchange, O(world) store requests, before any collective. The facts
name the compiled program by its compile key (NOTE: Plan cache) and carry this rank's plan
digests, which only its peers compare (See NOTE: Plan digests, graphc/plan/digests.py). A rank
that never arrives (it did not call the graph, or called another one) is named after
GRAPHC_TIMEOUT. Replicated parameters are compared by checksum among the ranks that hold
them: they must start equal, as DDP requires (graphc refuses rather than broadcasts, so
a forgotten torch.manual_seed is found, not hidden).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Dict, List, Optional

import torch

from .. import world as world_of_ranks
from ..errors import GraphcError
from ..plan.digests import explain, first_disagreement, plan_digests, plan_sequences



def fingerprint_tensor(t: torch.Tensor) -> str:
    """A checksum of a tensor's values (equal tensors give equal strings on any rank)."""
    # a copy: .numpy() marks the storage it reads as not resizable, and ZeRO stage 3 resizes
    # parameters' storage (See NOTE: ZeRO stage 3, runtime/zero.py)
    data = t.detach().cpu().contiguous().view(torch.uint8).clone()
    return hashlib.sha1(data.numpy().tobytes() if data.numel() else b"").hexdigest()[:16]


def check_agreement(facts: Dict[str, Any], holders: Dict[str, List[int]], what: str,
                    tag: str, timeout: float, store=None, plan=None) -> None:
    """Exchanges `facts` (JSON values) between all ranks; raises GraphcError on any mismatch.

    facts: name -> value every rank must agree on; entries named "param:<key>" are compared
    only among the ranks listed in holders[key] (a replicated parameter's placement).
    tag: names this exchange the same way on every rank (the graph, by class and creation
    order, and its compile count), so a rank that skipped a graph is found, not paired with
    the next exchange.
    plan: this rank's plan, whose PLAN_DIGESTS fact (plan_digests) its peers' must match
    (See NOTE: Plan digests, graphc/plan/digests.py).
    """
    everyone = world_of_ranks.multi()
    if everyone is None:
        return
    rank, world = everyone.rank, everyone.size
    store = store or everyone.store()
    prefix = f"graphc/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/agree/{tag}/"
    store.set(prefix + str(rank), json.dumps(facts, sort_keys=True, default=str))
    everyone = _gather(store, prefix, world, timeout, what)
    problems = _mismatches(everyone, holders)
    if not problems and plan is not None:
        _check_plan_digests(store, prefix, everyone, plan, timeout, what)
    if problems:
        raise GraphcError(
            f"rank {rank}: the ranks disagree on {what}:\n  " + "\n  ".join(problems[:8]) +
            ("\n  ..." if len(problems) > 8 else "") +
            "\n  Every rank must run the same program on inputs of the same shapes, with the same "
            "settings and checkpoint step, and parameters that are replicated must start equal. "
            "Fix: launch every rank with the same script and arguments, seed every rank the same "
            "(torch.manual_seed) before building the model, and load every rank's checkpoint "
            "from the same save.")


def _gather(store, prefix: str, world: int, timeout: float, what: str) -> Dict[int, Dict[str, Any]]:
    keys = [prefix + str(r) for r in range(world)]
    wait_for_ranks(store, keys, timeout, what)
    return {r: json.loads(store.get(k)) for r, k in enumerate(keys)}


def wait_for_ranks(store, keys: List[str], timeout: float, what: str) -> None:
    """Waits until every rank r has written keys[r]; after `timeout` seconds, a GraphcError
    naming the ranks that never did (they did not call the graph)."""
    deadline = time.monotonic() + timeout
    while not store.check(keys):  # one request per poll: true once every rank has written
        if time.monotonic() > deadline:
            present = [store.check([k]) for k in keys]
            missing = [r for r, ok in enumerate(present) if not ok]
            raise GraphcError(
                f"rank(s) {missing} did not reach {what} within GRAPHC_TIMEOUT ({timeout:g} s) "
                f"while rank(s) {[r for r, ok in enumerate(present) if ok]} did. A graph must be "
                "called by every rank of the job, the same number of times. Fix: call the graph "
                "on every rank (a rank without a stage still calls it), or raise GRAPHC_TIMEOUT "
                "if those ranks are only slow.")
        time.sleep(0.02)


def _mismatches(everyone: Dict[int, Dict[str, Any]], holders: Dict[str, List[int]]) -> List[str]:
    problems = []
    names = sorted({n for facts in everyone.values() for n in facts} - {PLAN_DIGESTS})
    for name in names:
        ranks = holders.get(name[len("param:"):], []) if name.startswith("param:") else sorted(everyone)
        values: Dict[str, List[int]] = {}
        for r in ranks:
            if name in everyone.get(r, {}):
                values.setdefault(json.dumps(everyone[r][name], sort_keys=True), []).append(r)
        if len(values) > 1:
            shown = "; ".join(f"ranks {rs}: {v}" for v, rs in values.items())
            label = (f"replicated parameter '{name[len('param:'):]}' (checksums)" if name.startswith("param:")
                     else name)
            problems.append(f"{label}: {shown}")
    return problems


PLAN_DIGESTS = "plan digests"   # the fact that differs by rank, compared among peers only


def _check_plan_digests(store, prefix: str, everyone: Dict[int, Dict[str, Any]], plan, timeout: float,
                        what: str) -> None:
    """Every group's members and every channel's ends have equal digests (See NOTE: Plan
    digests), else the same GraphcError on every rank, naming the two ranks that differ and
    the first instruction where they part (their sequences of that key, published by them)."""
    found = first_disagreement({r: facts.get(PLAN_DIGESTS, {}) for r, facts in everyone.items()})
    if found is None:
        return
    key, odd, ref = found
    if plan.rank in (odd, ref):
        store.set(f"{prefix}detail/{plan.rank}", json.dumps(plan_sequences(plan).get(key, [])))
    keys = [f"{prefix}detail/{odd}", f"{prefix}detail/{ref}"]
    wait_for_ranks(store, keys, timeout, f"{what} (the plans' detail)")
    odd_seq, ref_seq = (json.loads(store.get(k)) for k in keys)
    raise GraphcError(
        f"rank {plan.rank}: the ranks' plans do not pair up: {explain(key, odd, ref, odd_seq, ref_seq)}. "
        f"Ranks {odd} and {ref} would pair different instructions there, and the job would hang "
        "or exchange mismatched buffers. Every rank compiled the same program (equal compile keys), so a plan was "
        "changed after compiling, or graphc lowered it wrongly. Fix: run `graphc plan` on the "
        "script with this world size, which verifies every rank's plan together, and report "
        "what it says to graphc.")


def step_facts(compiled, options, steps: Optional[int], rank: Optional[int] = None) -> Dict[str, Any]:
    """What every rank must agree on for a compiled graph run with `options` (RunOptions);
    with `rank`, also its plan's digests, which its peers' must match (See NOTE: Plan digests)."""
    facts = {"input shapes and dtypes": [[list(s), str(d)] for s, d in compiled.input_meta],
             "gradient accumulation steps": options.gradient_accumulation_steps,
             "pipeline schedule": options.pipeline_schedule,
             "compile key": compiled.key.digest if compiled.key is not None else None,
             # GRAPHC_VERIFY_PLANS: a rank holding its own plan exchanges groups and channels
             # with the others at start (collectives), one holding every plan does not
             "plans compiled": "every rank's" if compiled.whole_world else "its own",
             "checkpoint step": steps}
    if rank is not None:
        facts[PLAN_DIGESTS] = plan_digests(compiled.plan_for(rank))
    return facts
