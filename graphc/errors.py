"""User-facing error types. Every mistake in a user's program raises one of these."""


class GraphcError(Exception):
    """An error caused by the user's program, inputs or configuration.

    Messages name the module, node or rank involved, what was expected, what was
    found, and how to fix it.
    """


class PlanError(GraphcError):
    """A compiled execution plan failed verification (send/recv mismatch, deadlock)."""


class RankFailedError(GraphcError):
    """Another rank failed or timed out while this rank was running a step."""


def defined_at(fn) -> str:
    """'name defined at file:line' of a user's function (a hook), for messages."""
    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    where = f" defined at {code.co_filename}:{code.co_firstlineno}" if code is not None else ""
    return f"{getattr(fn, '__name__', type(fn).__name__)}{where}"
