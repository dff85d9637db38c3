"""The predicted peak (NOTE: Peak memory model) against the measured one
(NOTE: Measured peak memory), per rank, on running ranks of the local world: a small GPT (2 blocks, float64, Adam)
on each layout of tests/tools/memory_layouts.py.

Tolerance: 5%, both ways: 0.95 <= predicted / measured <= 1.05 on every rank, the measured
peak being the highest bytes of the tensors the rank's runtime holds after an instruction
(or once a checkpointed micro-batch is recomputed) over the last of two steps. Observed:
0.9998 - 0.9999 on every layout (what is left, 72-152 bytes, is the step's scalars: a loss,
Adam's step counts). The default suite runs two layouts (ZeRO-3 and a checkpointed pipeline);
the other nine, and three on gloo processes, are `-m slow`.
"""
import pytest
import torch

from graphc.tools.simulate.memory_measured import held_storages
from memory_layouts import gloo_rank_peaks, rank_peaks

TOLERANCE = 0.05
DEFAULT = ("zero3", "pp2ckpt")
SLOW = ("dp2", "zero1", "zero2", "zero3units", "pp2", "pp2xdp2", "tp2", "pp2xdp2zero1", "pp2xdp2zero3")


def _assert_within(layout):
    for peak in rank_peaks(layout, steps=2):
        assert abs(peak.ratio - 1) <= TOLERANCE, f"{layout} {peak}"


@pytest.mark.parametrize("layout", DEFAULT)
def test_predicted_peak_within_5_percent_of_the_measured_one(layout):
    _assert_within(layout)


@pytest.mark.slow
@pytest.mark.parametrize("layout", SLOW)
def test_predicted_peak_within_5_percent_on_more_layouts(layout):
    _assert_within(layout)


@pytest.mark.world
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["zero2", "zero3"])
def test_predicted_peak_within_5_percent_on_gloo_processes(layout):
    """On gloo, ZeRO stages 2 and 3 reduce and gather rank by rank on views (NOTE: ZeRO rows
    in place): the prediction for transport="gloo" against real processes."""
    for peak in gloo_rank_peaks(layout):
        assert abs(peak.ratio - 1) <= TOLERANCE, f"{layout} on gloo {peak}"


def test_probe_counts_each_storage_once_and_a_released_one_not_at_all():
    """A view is its storage (counted whole, once); a storage resized to 0 bytes (a released
    ZeRO stage-3 parameter) holds nothing; a parameter's .grad and an optimizer's state count."""
    whole = torch.zeros(10, 4, dtype=torch.float64)
    released = torch.nn.Parameter(torch.zeros(8))
    released.untyped_storage().resize_(0)
    p = torch.nn.Parameter(torch.zeros(3, dtype=torch.float32))
    p.grad = torch.ones(3, dtype=torch.float32)
    opt = torch.optim.Adam([p])
    opt.step()
    got = held_storages([{"a": whole[:2], "b": [whole[5:], whole.t()]}, released, opt])
    step = opt.state[p]["step"].untyped_storage().nbytes()   # Adam's step: a scalar tensor
    assert sorted(got.values()) == sorted([320, 12, 12, 12, 12, step])   # whole; p, grad, 2 states
