"""The checks every option group of graph.config shares: an option is set before the graph compiles."""
from __future__ import annotations

from ..errors import GraphcError


def is_count(value) -> bool:
    """An int >= 1 (not a bool): what a number of steps, bytes or receives must be."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


class Options:
    """What each group of `graph.config`'s options (GraphConfig and its bases) reads of the
    Graph: whether it has compiled yet."""

    def _set_switch(self, what: str, attr: str, enabled) -> None:
        """An on/off option: checked open and a bool, then set."""
        self._check_open(what)
        if not isinstance(enabled, bool):
            raise GraphcError(f"{what} expects True or False, found {enabled!r}")
        setattr(self, attr, enabled)

    def _check_open(self, what: str) -> None:
        if self._graph._compiled is not None:
            raise GraphcError(f"graph.config.{what} was called after the graph was compiled; "
                              "set options in the Graph's __init__")
