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
