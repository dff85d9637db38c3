"""The simulator's CPU step time for the pipeline example is within 25% of a real 2-rank run
(tests/tools/measure_step_time.py measures and predicts; docs/inspect.md has the numbers)."""
import pytest

from measure_step_time import compare

pytestmark = pytest.mark.world   # measure() spawns two ranks


@pytest.mark.slow
@pytest.mark.parametrize("transport", [
    "shm",
    pytest.param("gloo", marks=pytest.mark.xfail(
        strict=False, reason="gloo isend blocks for milliseconds in the real run, which the "
        "two-process transport benchmark does not reproduce (docs/inspect.md)")),
])
def test_simulated_step_time_within_25_percent_of_measured(transport):
    from graphc.runtime import shm
    if transport == "shm" and not shm.supported():
        pytest.skip("shared-memory transport needs x86-64 Linux")
    predicted, measured, load, _, _ = compare(transport)
    err = abs(predicted - measured) / measured
    print(f"{transport}: predicted {predicted * 1e3:.2f} ms, measured {measured * 1e3:.2f} ms, "
          f"error {err:.1%}, load {load:.2f}")
    assert err <= 0.25, (f"{transport}: predicted {predicted * 1e3:.2f} ms vs measured "
                         f"{measured * 1e3:.2f} ms (1-min load {load:.2f}; a busy machine slows "
                         f"the run, not the prediction)")
