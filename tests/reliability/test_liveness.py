"""A live rank is judged by GRAPHC_TIMEOUT only, and the store's values are not trusted.

NOTE: Liveness (graphc/runtime/liveness.py) and NOTE: Failure page (graphc/runtime/shm.py).
Each world case runs a 2-stage pipeline (SkipNet, 1F1B, accumulation 2, SGD) on 2 real gloo
ranks and checks it trains like eager PyTorch on the whole batch (float64, 1e-10).
"""
import ctypes
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import graphc
from graphc.runtime import shm, watchdog
from helpers import assert_same_as_eager, eager_train, run_world
from models import PipelineGraph, SkipNet, make_batches

STEPS = 3
HOLD_SECONDS = 6   # the GIL held in C by rank 1, three times the heartbeat setting below
HEARTBEAT = "2"    # GRAPHC_HEARTBEAT_TIMEOUT


def _train(rank, world, before_step=lambda step: None):
    torch.manual_seed(0)
    model = SkipNet(world)
    graph = PipelineGraph(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation=2)
    losses = []
    for step, (x, y) in enumerate(make_batches(STEPS)):
        before_step(step)
        loss = graph(x, y).to_local()
        losses += [loss.item()] if loss.numel() else []
    return {"losses": losses, "state": graph.full_state_dict()}


def _eager():
    torch.manual_seed(0)
    return eager_train(SkipNet(2), lambda p: torch.optim.SGD(p, lr=0.1), None,
                       nn.CrossEntropyLoss(), make_batches(STEPS), STEPS)


def _check_like_eager(results, what):
    ref_losses, ref_state = _eager()
    assert_same_as_eager(results[1]["losses"], results[0]["state"], ref_losses, ref_state, what)


def _holds_the_gil(rank, world):
    """Rank 1 spends HOLD_SECONDS in a C call that keeps the GIL (libc sleep through
    ctypes.PyDLL), so its watchdog thread cannot run; rank 0's watchdog must not declare it
    dead (a heartbeat counter would stop for 6 s, past GRAPHC_HEARTBEAT_TIMEOUT=2)."""
    os.environ["GRAPHC_HEARTBEAT_TIMEOUT"] = HEARTBEAT
    libc = ctypes.PyDLL(None)  # PyDLL: the GIL stays held during the call

    def before_step(step):
        if step == 1 and rank == 1:
            libc.sleep(HOLD_SECONDS)
    return _train(rank, world, before_step)


@pytest.mark.world
def test_a_rank_holding_the_gil_in_c_is_not_declared_dead():
    results = run_world(_holds_the_gil, 2, timeout=180)
    _check_like_eager(results, "a rank held the GIL for 6 s")


FORGED = {
    watchdog.PAGE_KEY: "../../../tmp/graphc-forged-page",   # a path instead of a token
    watchdog.FAILED_KEY: "stop everything",                  # not 'rank <r>: ...'
    watchdog.ALIVE_KEY.format(1): "no address; rm -rf /",     # not '<host> <port>'
}


def _forged_store(rank, world):
    """Before any graphc call, rank 0 writes garbage under the keys the watchdogs read."""
    dist.init_process_group("gloo")
    keys = dist.PrefixStore("graphc/0/", dist.distributed_c10d._get_default_store())
    if rank == 0:
        for key, value in FORGED.items():
            keys.set(key, value)
    dist.barrier()
    return _train(rank, world)


@pytest.mark.world
def test_forged_store_values_do_not_stop_a_healthy_job():
    results = run_world(_forged_store, 2, timeout=180)
    _check_like_eager(results, "garbage under the watchdog's store keys")
    assert not os.path.exists("/tmp/graphc-forged-page")


# -- the failure page in one process: what a store client can plant ---------------------------
def _store(token):
    store = dist.HashStore()
    store.set(watchdog.PAGE_KEY, token)
    return store


@pytest.mark.skipif(not shm.supported(), reason="the failure page needs /dev/shm on x86-64")
def test_a_symlink_planted_at_the_page_name_is_not_followed(tmp_path):
    """A store client reads (or chooses) the token and plants a symlink at the page's name:
    graphc must neither write through it nor take it for the page."""
    token = "0123456789abcdef" * 2
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    link = shm.page_path(token)
    os.symlink(victim, link)
    try:
        page = watchdog._open_page(_store(token))
        assert page is None
        assert victim.read_bytes() == b"precious" and os.path.islink(link)
    finally:
        os.unlink(link)


@pytest.mark.skipif(not shm.supported(), reason="the failure page needs /dev/shm on x86-64")
def test_the_page_is_created_exclusively_under_a_token_graphc_made(monkeypatch):
    """No key yet: the watchdog draws the token itself; the file is this user's, mode 0600."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # stays named until a second rank maps it
    store = dist.HashStore()
    page = watchdog._open_page(store)
    try:
        token = store.get(watchdog.PAGE_KEY).decode()
        assert page is not None and page.path == shm.page_path(token)
        st = os.lstat(page.path)
        assert st.st_uid == os.geteuid() and st.st_mode & 0o777 == 0o600
        page.write("rank 1: ValueError: x")
        second = watchdog._open_page(store)  # another rank of this host: opens, never creates
        assert second.read() == "rank 1: ValueError: x"
        second.close()
    finally:
        page.close()
    assert not os.path.exists(page.path)


@pytest.mark.parametrize("token", ["../../../tmp/x", "ABCDEF" * 6, "0" * 31, "0" * 33 + "/"])
def test_a_page_token_that_graphc_never_makes_is_ignored(token):
    assert shm.page_path(token) is None
    assert watchdog._open_page(_store(token)) is None
