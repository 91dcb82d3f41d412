"""Hostile weight-swarm peers for tests (issue 13): real ``SwarmService`` nodes that take from the swarm
and give nothing back.

``hoard(swarm, mode)`` rewires a running service's outgoing data-plane frames:

- ``SIT``: it offers the version, so the origin opens a session and reveals pieces to it, but it never
  requests anything: the revealed pieces sit with it.
- ``TAKE``: it downloads like anyone, but hides what it holds (an empty bitfield, no ``have``) and
  refuses every request, so nothing it took ever reaches another peer.

Start the service with ``upload=False`` as well, so its transfers refuse requests themselves.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable

from prime_node.swarm.service import SwarmService
from protocol.codec import decode_any, encode
from protocol.dataplane import DigestedFrame, Frame
from protocol.swarm.messages import Bitfield, Have, ManifestEnvelope, Piece, Request


class HoardMode(enum.Enum):
    SIT = "sit"
    TAKE = "take"


def hoard(swarm: SwarmService, mode: HoardMode) -> None:
    """Make ``swarm`` a hoarder of kind ``mode`` from now on (see the module doc)."""
    send = swarm.dataplane.send
    max_bytes = max(Piece.MAX_BYTES, ManifestEnvelope.MAX_BYTES)

    def hoarding_send(peer: Hashable, frame: Frame) -> None:
        if isinstance(frame, DigestedFrame):  # a piece: hoarders still upload what they are asked for
            send(peer, frame)  # type: ignore[arg-type]
            return
        message = decode_any(frame, max_bytes=max_bytes)
        if isinstance(message, Have) or (mode is HoardMode.SIT and isinstance(message, Request)):
            return
        if isinstance(message, Bitfield):
            frame = encode(Bitfield(message.manifest_id, bytes(len(message.bits))))
        send(peer, frame)  # type: ignore[arg-type]

    swarm.dataplane.send = hoarding_send  # type: ignore[method-assign]
