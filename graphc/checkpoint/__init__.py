"""The checkpoint room: a graph's state across its plans (graph_state.py: GraphState, rank
agreement), that state in DCP form (dcp.py: NOTE: DCP state dict), and graphc.save /
graphc.load, atomic files (files.py)."""
from .files import load, save

__all__ = ["load", "save"]
