"""Heartbeats pushed directly to every connected peer, on one long-lived stream per peer.

Membership must not depend on a lossy medium: measured on loopback, py-libp2p's gossipsub lost over half
of the heartbeats in a 16-node swarm (DESIGN §11 lists its other limits). So each beat, a node sends its
signed peer record to each peer it is connected to, over ``/prime-node/heartbeat/1`` (length-prefixed
frames, one Envelope per frame). The receiver checks the envelope (domain, freshness, signature, replay)
and that its signer is the key the *connection* authenticated, then hands the record to the node. The
gossip topic ``heartbeats`` still carries the record at a lower rate, so peers we are not connected to
(swarms larger than ``max_peers``) still learn about us.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from prime_node.errors import NodeError
from prime_node.p2p.interface import FramedStream
from protocol.codec import encode
from protocol.envelope import Domain, Envelope, EnvelopeVerifier, Reject, seal
from protocol.errors import ProtocolError
from protocol.peer_record import check_sender
from protocol.scoring import Offence

if TYPE_CHECKING:
    from prime_node.node.core import NodeCore

log = logging.getLogger(__name__)
HEARTBEAT_PROTOCOL = "/prime-node/heartbeat/1"
MAX_HEARTBEAT_FRAME = 8192
SEND_TIMEOUT = 5.0

# (sender peer ID, verified envelope) -> None; the node parses the record and updates membership.
EnvelopeHandler = Callable[[str, Envelope], Awaitable[None]]


def offence_for(error: ProtocolError) -> Offence | None:
    """How much a refused envelope says about its sender (None: nothing, e.g. a redelivery)."""
    if error.reason in (Reject.REPLAY, Reject.BEHIND_REPLAY_WINDOW):
        return None
    if error.reason == Reject.BAD_SIGNATURE:
        return Offence.INVALID_SIGNATURE
    if error.reason in (Reject.SIGNER_MISMATCH, "signer_mismatch", "bad_peer_id"):
        return Offence.SIGNER_MISMATCH
    if error.reason in (Reject.EXPIRED, Reject.FROM_THE_FUTURE):
        return Offence.STALE
    return Offence.MALFORMED


class DirectHeartbeats:
    def __init__(self, core: NodeCore, on_envelope: EnvelopeHandler) -> None:
        self.host = core.host
        self.key = core.key
        self.clock = core.clock
        self.metrics = core.metrics
        self.policy = core.policy
        self.nursery = core.nursery
        self.on_envelope = on_envelope
        self.domain = Domain("heartbeat", core.run_id)
        self.verifier = EnvelopeVerifier(self.domain)
        self._streams: dict[str, FramedStream] = {}
        self._sending: set[str] = set()
        core.host.set_stream_handler(HEARTBEAT_PROTOCOL, self._serve)

    def beat(self, payload: bytes) -> None:
        """Seal ``payload`` once and send it to every connected, unbanned peer (in the background)."""
        frame = encode(seal(self.key, self.domain, payload, now_ms=self.clock.wall_ms()))
        connected = set(self.host.connected_peers())
        for peer_id in list(self._streams):
            if peer_id not in connected:
                self.nursery.start_soon(self._drop, peer_id)
        for peer_id in sorted(connected):
            if peer_id not in self._sending and not self.policy.is_banned(peer_id):
                self._sending.add(peer_id)
                self.nursery.start_soon(self._send, peer_id, frame)

    async def _send(self, peer_id: str, frame: bytes) -> None:
        try:
            with trio.fail_after(SEND_TIMEOUT):
                stream = self._streams.get(peer_id)
                if stream is None:
                    stream = await self.host.open_stream(peer_id, HEARTBEAT_PROTOCOL)
                    self._streams[peer_id] = stream
                await stream.send_frame(frame)
            self.metrics.count("heartbeats_sent", len(frame))
        except (NodeError, trio.TooSlowError) as exc:
            log.debug("heartbeat to %s failed: %s", peer_id, exc or type(exc).__name__)
            self.metrics.count("heartbeat_send_failures")
            self.metrics.reject(f"heartbeat_send_{getattr(exc, 'reason', 'timeout')}")
            await self._drop(peer_id)
        finally:
            self._sending.discard(peer_id)

    async def _drop(self, peer_id: str) -> None:
        stream = self._streams.pop(peer_id, None)
        if stream is not None:
            with trio.move_on_after(1):
                await stream.reset()

    async def _serve(self, stream: FramedStream) -> None:
        sender = stream.remote_peer_id
        while (frame := await stream.receive_frame(MAX_HEARTBEAT_FRAME)) is not None:
            self.metrics.count("heartbeat_frames_in", len(frame))
            if not self.policy.admit_message(sender):
                return  # banned: hang up; the policy disconnects the peer
            try:
                envelope = self.verifier.open(frame, now_ms=self.clock.wall_ms())
                check_sender(envelope, sender)
            except ProtocolError as exc:
                self.metrics.reject(exc.reason)
                offence = offence_for(exc)
                if offence is not None:
                    log.info("refused heartbeat from %s: %s", sender, exc)
                    self.policy.offence(sender, offence, exc.reason)
                continue
            await self.on_envelope(sender, envelope)
