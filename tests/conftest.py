import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import helpers  # noqa: E402
from helpers import ORACLE_DTYPE  # noqa: E402

# test modules build their constants and models at import: those are float64 too
torch.set_default_dtype(ORACLE_DTYPE)

# One intra-op thread, as every rank computes (torchrun's OMP_NUM_THREADS=1, run_world's
# ranks, the local world's threads): on tensors this small a second OpenMP thread buys
# nothing and costs its wake-up and spin on a shared 2-core machine (a BatchNorm forward
# 0.28 ms on one thread, 5 ms on two at load 9; tests/sbp and three BatchNorm files 12 s of
# CPU instead of 20). The variable carries it to the processes the tests start.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(autouse=True)
def _oracle_dtype(request):
    """Every test computes in float64 (the oracle of helpers.py) unless marked fp32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if request.node.get_closest_marker("fp32") else ORACLE_DTYPE)
    yield
    torch.set_default_dtype(old)


# NOTE: World marker. A test that spawns ranks (helpers.run_world, reliability/launch.py's
# torchrun and bare_world, a torchrun command line) is marked @pytest.mark.world, so that
# `pytest -m "not world"` is the one-process inner loop (README: Tests). Two checks keep the
# marks true: tests/test_world_marker.py reads every test file, and here each test's mark is
# recorded before its fixtures are set up, so a launcher reached some way that reading
# misses refuses to start (helpers.require_world_marker).
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    helpers.WORLD_TEST = item.get_closest_marker("world") is not None
