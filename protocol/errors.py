"""The error root of protocol/, split as h11 does: who broke the protocol, us or the remote side.

A RemoteProtocolError means bytes or messages from a peer are invalid: log it, score the peer down, drop
the message. A LocalProtocolError means our own code tried something the protocol forbids: a bug.
Anything else escaping a decoder is a bug too.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Root of every protocol failure. ``reason`` is a short stable code callers may branch on."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class LocalProtocolError(ProtocolError):
    """We asked for something the protocol does not allow (encoding an oversized message, say)."""


class RemoteProtocolError(ProtocolError):
    """A peer sent something invalid: malformed bytes, a bad signature, a stale or replayed message."""


class InvariantError(LocalProtocolError):
    """A message or setting built with values that break one of its invariants (``__post_init__`` checks).

    Built locally it is our own misuse; the codec turns it into a RemoteProtocolError when the values came
    off the wire.
    """
