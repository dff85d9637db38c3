"""The execution-plan IR: instructions, per-rank plans, schedules, verification."""
from .instructions import (ACT, GRAD, AllReduce, Backward, Forward, Instruction, OptimizerStep,
                           Recv, Send, TensorSpec, parse_instruction)
from .plan import ExecutionPlan, StageInfo
from .verify import verify_plans

__all__ = ["ACT", "GRAD", "AllReduce", "Backward", "Forward", "Instruction", "OptimizerStep",
           "Recv", "Send", "TensorSpec", "parse_instruction", "ExecutionPlan", "StageInfo",
           "verify_plans"]
