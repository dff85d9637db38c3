import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

from helpers import ORACLE_DTYPE  # noqa: E402

# test modules build their constants and models at import: those are float64 too
torch.set_default_dtype(ORACLE_DTYPE)


@pytest.fixture(autouse=True)
def _oracle_dtype(request):
    """Every test computes in float64 (the oracle of helpers.py) unless marked fp32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32 if request.node.get_closest_marker("fp32") else ORACLE_DTYPE)
    yield
    torch.set_default_dtype(old)
