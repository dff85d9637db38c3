"""benchmarks/plan_scale.py's MLP on a pipeline x data x tensor layout, for `graphc plan`.

    graphc plan tests/tools/scripts/mlp_layouts.py --pp 2 --dp 2 --nproc 4 --out plans --simulate
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..",
                                "benchmarks"))

import plan_scale  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for name in ("pp", "dp", "tp"):
        parser.add_argument(f"--{name}", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=2)
    args = parser.parse_args()
    graph, inputs = plan_scale.mlp_graph(args.pp, args.dp, args.tp, args.microbatches, rows_per_mb=2)
    graph(*inputs)
