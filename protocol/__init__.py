"""protocol: prime-node's sans-IO core.

Message types, the wire codec and the state machines of every exchange. Takes bytes, events and a
``now``; returns bytes and actions. No trio, no libp2p, no torch, no sockets, no clock reads.
"""

from protocol.codec import (
    ExactLen,
    IntRange,
    MaxLen,
    Message,
    decode,
    decode_any,
    encode,
    message,
    registered_types,
)
from protocol.envelope import Domain, Envelope, EnvelopeVerifier, FreshnessWindow, Reject, ReplayCache, seal
from protocol.errors import LocalProtocolError, ProtocolError, RemoteProtocolError

__all__ = [
    "Domain",
    "Envelope",
    "EnvelopeVerifier",
    "ExactLen",
    "FreshnessWindow",
    "IntRange",
    "LocalProtocolError",
    "MaxLen",
    "Message",
    "ProtocolError",
    "Reject",
    "RemoteProtocolError",
    "ReplayCache",
    "decode",
    "decode_any",
    "encode",
    "message",
    "registered_types",
    "seal",
]
