"""Old import path of graphc/ops/conversions.py, kept for the modules that still import it
(runtime/actors.py, runtime/collectives.py, runtime/executor.py and tools/costs.py, being
edited elsewhere): remove once they import graphc.ops.conversions. No stage program names
these functions here (See NOTE: Stage-program names in graphc/ops/__init__.py)."""
from ..ops.conversions import (all_reduce_sum, box, compiled_groups, create_groups,  # noqa: F401
                               my_group, shapes_only, vocab_parallel_embedding)
