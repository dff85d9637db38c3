"""Plan-only mode: the setting lives below the API in graphc/plan_mode.py (the Graph reads
it when it compiles); its names stay importable from here for scripts that use them."""
from ..plan_mode import PlanMode, PlanModeExit, active, plan_mode, stop_before_step

__all__ = ["PlanMode", "PlanModeExit", "active", "plan_mode", "stop_before_step"]
