import glob
import time

import pytest

LEFTOVER_GLOB = "/dev/shm/graphc-*"  # every file graphc puts in /dev/shm (rings, probes)


@pytest.fixture(autouse=True)
def no_leftovers_in_dev_shm():
    """Every test here, failures included, leaves no graphc file in /dev/shm.

    Files other processes' tests create live for well under a second (unlinked right after
    set-up), so a new file that is still there two seconds later is a leftover.
    """
    before = set(glob.glob(LEFTOVER_GLOB))
    yield
    new = set(glob.glob(LEFTOVER_GLOB)) - before
    if new:
        time.sleep(2)
        new &= set(glob.glob(LEFTOVER_GLOB))
    assert not new, f"left in /dev/shm: {sorted(new)}"
