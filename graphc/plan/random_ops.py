"""Old import path of graphc/ops/random_ops.py, kept for the modules that still import it
(runtime/executor.py, check_step.py, being edited elsewhere): remove once they import
graphc.ops.random_ops. No stage program names these functions here (See NOTE:
Stage-program names in graphc/ops/__init__.py)."""
from ..ops.random_ops import RANDOM_FUNCTIONS, RANDOM_METHODS, drawing, seeded  # noqa: F401
