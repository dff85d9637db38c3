"""The actor runtime: executes one rank's ExecutionPlan with torch.distributed."""
from .actors import Runtime, StepStats

__all__ = ["Runtime", "StepStats"]
