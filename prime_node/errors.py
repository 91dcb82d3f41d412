"""The error root of prime_node/: failures of the agent's own I/O and configuration.

Each NodeError carries a ``reason`` code and a message written for the person at the terminal: the CLI
prints the message as one line and exits non-zero.
"""

from __future__ import annotations


class NodeError(Exception):
    """A failure the user can act on: a missing file, a wrong password, a port in use, a bad flag."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def first_node_error(exc: BaseException) -> NodeError | None:
    """The NodeError inside an exception group (trio wraps task failures), if there is one."""
    if isinstance(exc, NodeError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            found = first_node_error(inner)
            if found is not None:
                return found
    return None
