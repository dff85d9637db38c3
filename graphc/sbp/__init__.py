"""SBP machinery below the passes: meshes and layouts, the rule table, costs, local op forms.

See docs/sbp.md for the rule table and the boxing table (its one home: sbp/boxing.py); the
passes that use this are passes/infer_sbp.py, passes/insert_boxing.py and
passes/localize_ops.py.
"""
from .cost import boxing_cost
from .layout import axis_groups, local_shape, mesh_shape
from .rules import RULES, rule_for

__all__ = ["boxing_cost", "axis_groups", "local_shape", "mesh_shape", "RULES", "rule_for"]
