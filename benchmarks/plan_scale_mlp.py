"""plan_scale.py's MLP as a training script, for timing `graphc plan` itself (imports included):

    graphc plan benchmarks/plan_scale_mlp.py --nproc 8192 --out /tmp/plans --simulate h100

The world size comes from WORLD_SIZE (graphc plan sets it from --nproc): one of
plan_scale.SIZES, whose layout (P x D x T, micro-batches) it builds.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import plan_scale  # noqa: E402

graph, inputs = plan_scale.mlp_graph(*plan_scale.SIZES[int(os.environ["WORLD_SIZE"])])
graph(*inputs)
