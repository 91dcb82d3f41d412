"""Signed, sequenced gossip for one run, with gap repair over direct streams.

Every frame is a ``GossipFrame`` (topic, sender epoch, per-sender sequence, payload) sealed in an Envelope
by the origin's wallet key. A receiver checks the envelope (domain, freshness, signature, replay), that
its signer is the peer the transport says published it, and that the frame names the topic it came on;
then the per-topic ``SequenceTracker`` decides: deliver, ignore, or ask the origin directly for the
numbers it skipped. Each node keeps its own recent frames per topic to answer such requests.

Topics are scoped to the run: ``prime-node/<run>/<name>``. Services (checkpoints, rollouts, verdicts)
subscribe a handler to a name; they never see unsigned or unverified bytes. A topic may have any number
of handlers: each message is verified and sequenced once, then handed to every one of them in
subscription order (a handler that raises is logged and counted; the others still get the message).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from crypto.keys import Address
from prime_node.errors import NodeError
from prime_node.node.clock import NodeClock
from prime_node.node.core import NodeCore
from prime_node.node.heartbeats import offence_for
from prime_node.p2p.interface import FramedStream, GossipMessage
from protocol.codec import decode, encode
from protocol.envelope import Domain, Envelope, EnvelopeVerifier, seal
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.gossip_sequence import (
    MAX_GOSSIP_PAYLOAD,
    Deliver,
    GossipFrame,
    RepairRequest,
    RequestMissing,
    SequenceTracker,
)
from protocol.scoring import Offence

log = logging.getLogger(__name__)
REPAIR_PROTOCOL = "/prime-node/gossip-repair/1"
HISTORY_PER_TOPIC = 256
MAX_ENVELOPE_FRAME = MAX_GOSSIP_PAYLOAD + 2048


@dataclass(frozen=True)
class Delivered:
    """A verified gossip payload, handed to every service that subscribed to its topic."""

    topic: str
    origin_peer_id: str
    origin: Address
    payload: bytes
    timestamp_ms: int
    repaired: bool


PayloadHandler = Callable[[Delivered], Awaitable[None]]


def topic_name(run_id: str, name: str) -> str:
    return f"prime-node/{run_id}/{name}"


class GossipService:
    def __init__(self, core: NodeCore) -> None:
        self.host = core.host
        self.key = core.key
        self.run_id = core.run_id
        self.clock = core.clock
        self.metrics = core.metrics
        self.policy = core.policy
        self.nursery = core.nursery
        self.domain = Domain("gossip", core.run_id)
        self.verifier = EnvelopeVerifier(self.domain)
        self.epoch_ms = core.clock.wall_ms()
        self._next_sequence: dict[str, int] = {}
        self._history: dict[str, deque[tuple[int, bytes]]] = {}
        self._trackers: dict[str, SequenceTracker] = {}
        self._handlers: dict[str, list[PayloadHandler]] = {}
        self._subscribed: set[str] = set()
        core.host.set_stream_handler(REPAIR_PROTOCOL, self._serve_repair)

    async def subscribe(self, name: str, handler: PayloadHandler) -> str:
        """Add ``handler`` to the topic's handlers (once; subscribing it again changes nothing)."""
        topic = topic_name(self.run_id, name)
        if handler in self._handlers.get(topic, ()):
            return topic
        if topic not in self._subscribed:
            await self.host.subscribe(topic, self._on_gossip)
            self._subscribed.add(topic)
        handlers = self._handlers.setdefault(topic, [])
        if not handlers:  # nothing was listening: sequence numbers seen before mean nothing now
            self._trackers[topic] = SequenceTracker()
        if handler not in handlers:
            handlers.append(handler)
        return topic

    def unsubscribe(self, name: str, handler: PayloadHandler) -> None:
        """Remove ``handler``; the host stays subscribed (mesh membership is cheap, re-joining is not)."""
        handlers = self._handlers.get(topic_name(self.run_id, name), [])
        if handler in handlers:
            handlers.remove(handler)

    def handler_count(self, name: str) -> int:
        return len(self._handlers.get(topic_name(self.run_id, name), ()))

    async def publish(self, name: str, payload: bytes) -> None:
        topic = topic_name(self.run_id, name)
        sequence = self._next_sequence.get(topic, 0)
        self._next_sequence[topic] = sequence + 1
        frame = GossipFrame(topic, self.epoch_ms, sequence, payload)
        envelope = encode(seal(self.key, self.domain, encode(frame), now_ms=self.clock.wall_ms()))
        history = self._history.setdefault(topic, deque(maxlen=HISTORY_PER_TOPIC))
        history.append((sequence, envelope))
        self.metrics.count("gossip_out", len(envelope))
        await self.host.publish(topic, envelope)

    def expire(self) -> None:
        now = self.clock.now()
        for tracker in self._trackers.values():
            given_up = tracker.expire(now)
            if given_up:
                self.metrics.count("gossip_gaps_given_up", 0, given_up)

    async def _on_gossip(self, message: GossipMessage) -> None:
        self.metrics.count("gossip_in", len(message.data))
        if not self.policy.admit_message(message.origin):
            self.metrics.count("gossip_ignored_banned")
            return
        await self._accept(message.topic, message.origin, message.data, from_repair=False)

    async def _accept(self, topic: str, origin_peer_id: str, data: bytes, *, from_repair: bool) -> None:
        tracker = self._trackers.get(topic)
        if tracker is None or not self._handlers.get(topic):
            return
        try:
            envelope = self.verifier.open(data, now_ms=self.clock.wall_ms())
            _check_signer(envelope, origin_peer_id)
            frame = decode(envelope.payload, GossipFrame)
            if frame.topic != topic:
                raise RemoteProtocolError(
                    f"frame for {frame.topic[:60]!r} arrived on {topic}", reason="wrong_topic"
                )
        except ProtocolError as exc:
            offence = offence_for(exc)
            self.metrics.reject(exc.reason)
            if offence is not None:
                log.info("refused gossip from %s on %s: %s", origin_peer_id, topic, exc)
                self.policy.offence(origin_peer_id, offence, exc.reason)
            return
        for action in tracker.observe(origin_peer_id, frame.epoch_ms, frame.sequence, self.clock.now()):
            if isinstance(action, Deliver):
                if action.repaired:
                    self.metrics.count("gossip_repaired")
                delivered = Delivered(
                    topic,
                    origin_peer_id,
                    envelope.signer,
                    frame.payload,
                    envelope.timestamp_ms,
                    action.repaired,
                )
                await self._fan_out(delivered)
            elif isinstance(action, RequestMissing) and not from_repair:
                self.metrics.count("gossip_gaps", 0, action.last - action.first + 1)
                self.nursery.start_soon(self._repair, topic, action)

    async def _fan_out(self, message: Delivered) -> None:
        """Every handler of the topic gets the message; one that fails does not starve the others."""
        for handler in tuple(self._handlers.get(message.topic, ())):
            try:
                await handler(message)
            except Exception:  # a service's bug must not silence the topic for the other services
                self.metrics.count("gossip_handler_errors")
                log.exception("a handler of %s failed on a message from %s", message.topic, message.origin)

    async def _repair(self, topic: str, gap: RequestMissing) -> None:
        try:
            with trio.fail_after(10):
                stream = await self.host.open_stream(gap.sender, REPAIR_PROTOCOL)
                try:
                    await stream.send_frame(encode(RepairRequest(topic, gap.epoch_ms, gap.first, gap.last)))
                    while (frame := await stream.receive_frame(MAX_ENVELOPE_FRAME)) is not None:
                        await self._accept(topic, gap.sender, frame, from_repair=True)
                finally:
                    await stream.close()
        except (NodeError, trio.TooSlowError) as exc:
            log.debug("repair of %s %d..%d from %s failed: %s", topic, gap.first, gap.last, gap.sender, exc)

    async def _serve_repair(self, stream: FramedStream) -> None:
        try:
            raw = await stream.receive_frame(RepairRequest.MAX_BYTES)
            if raw is None:
                return
            request = decode(raw, RepairRequest)
        except RemoteProtocolError as exc:
            self.policy.offence(stream.remote_peer_id, Offence.MALFORMED, exc.reason)
            return
        if request.epoch_ms != self.epoch_ms:
            return
        for sequence, envelope in list(self._history.get(request.topic, ())):
            if request.first <= sequence <= request.last:
                await stream.send_frame(envelope)
                self.metrics.count("gossip_repair_served", len(envelope))


class Gossip(Protocol):
    """What a service may do with gossip: the node's ``GossipService`` or a ``GossipScope`` of it."""

    @property
    def clock(self) -> NodeClock: ...

    async def subscribe(self, name: str, handler: PayloadHandler) -> str: ...

    def unsubscribe(self, name: str, handler: PayloadHandler) -> None: ...

    async def publish(self, name: str, payload: bytes) -> None: ...


class GossipScope:
    """A service's own view of the node's gossip: what it subscribes through the scope ends when the scope
    closes (a role that stops stops hearing its topics; the node's other subscribers keep theirs)."""

    def __init__(self, gossip: Gossip) -> None:
        self._gossip = gossip
        self._mine: list[tuple[str, PayloadHandler]] = []
        self._closed = False

    @property
    def clock(self) -> NodeClock:
        return self._gossip.clock

    async def subscribe(self, name: str, handler: PayloadHandler) -> str:
        if self._closed:
            raise NodeError(f"subscribing to {name} after the service stopped", reason="not_running")
        self._mine.append((name, handler))
        return await self._gossip.subscribe(name, handler)

    def unsubscribe(self, name: str, handler: PayloadHandler) -> None:
        if (name, handler) in self._mine:
            self._mine.remove((name, handler))
            self._gossip.unsubscribe(name, handler)

    async def publish(self, name: str, payload: bytes) -> None:
        await self._gossip.publish(name, payload)

    def close(self) -> None:
        self._closed = True
        for name, handler in self._mine:
            self._gossip.unsubscribe(name, handler)
        self._mine.clear()


def _check_signer(envelope: Envelope, sender_peer_id: str) -> None:
    from protocol.peer_record import check_sender

    check_sender(envelope, sender_peer_id)
