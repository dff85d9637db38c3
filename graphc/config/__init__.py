"""Per-module and per-graph configuration, set by the user in Graph.__init__.

module_config.py   `graph.<module>.config` (ModuleConfig): a module's stage, its checkpointing
graph_config.py    `graph.config` (GraphConfig): the whole graph's options, with its bases
parallel_options.py   layouts, ZeRO, sequence and context parallelism, expert capacity
precision_options.py  autocast, the gradient reduce dtype, parameter dtype
options.py         what every option group checks: set before the graph compiles
"""
from .graph_config import GraphConfig
from .module_config import ModuleConfig

__all__ = ["GraphConfig", "ModuleConfig"]
