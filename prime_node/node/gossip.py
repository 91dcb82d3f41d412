"""Signed, sequenced gossip for one run, with gap repair over direct streams.

Every frame is a ``GossipFrame`` (topic, sender epoch, per-sender sequence, payload) sealed in an Envelope
by the origin's wallet key. A receiver checks the envelope (domain, freshness, signature, replay), that
its signer is the peer the transport says published it, and that the frame names the topic it came on;
then the per-topic ``SequenceTracker`` decides: deliver, ignore, or ask the origin directly for the
numbers it skipped. Each node keeps its own recent frames per topic to answer such requests.

Every frame, whether it came on gossip or on a repair stream, passes the sender's budget first
(``PeerPolicy.admit_gossip``: flood limit, and the probation budget of a new key), and every verified,
delivered frame counts toward the sender leaving probation. A repair answer is bounded by its request:
only the asked-for numbers of the asked-for epoch, each once; any other frame is charged as unsolicited
(five ban), and reading stops when the sender closes, is banned, or after 10 s. One repair per sender and
topic runs at a time, and answering a request counts as a message from the requester.

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
from prime_node.p2p.interface import FramedStream, GossipMessage
from protocol.codec import decode, encode
from protocol.envelope import Domain, Envelope, EnvelopeVerifier, Reject, seal
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.gossip_sequence import (
    MAX_GOSSIP_PAYLOAD,
    Deliver,
    GossipFrame,
    RepairRequest,
    RequestMissing,
    SequenceTracker,
)
from protocol.peer_record import check_sender
from protocol.scoring import Admission, Offence

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
        self._repairing: set[tuple[str, str]] = set()  # (topic, sender) with a repair stream open
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
        if self.policy.admit_gossip(message.origin) is not Admission.ACCEPT:
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
                self.policy.credit(origin_peer_id)
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
                if (topic, action.sender) not in self._repairing:
                    self._repairing.add((topic, action.sender))
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
                    await self._read_repair(topic, gap, stream)
                finally:
                    await stream.close()
        except (NodeError, trio.TooSlowError) as exc:
            log.debug("repair of %s %d..%d from %s failed: %s", topic, gap.first, gap.last, gap.sender, exc)
        finally:
            self._repairing.discard((topic, gap.sender))

    async def _read_repair(self, topic: str, gap: RequestMissing, stream: FramedStream) -> None:
        """Take the asked-for frames, each once and within the sender's budget, until the sender closes
        the stream; charge anything else (an honest sender closes once it has sent what it holds)."""
        wanted = set(range(gap.first, gap.last + 1))
        while (data := await stream.receive_frame(MAX_ENVELOPE_FRAME)) is not None:
            admission = self.policy.admit_gossip(gap.sender)
            if admission is Admission.BANNED:
                return
            sequence = self._solicited(topic, gap, data, wanted)
            if sequence is None:
                if self.policy.is_banned(gap.sender):
                    return
                continue
            wanted.discard(sequence)
            if admission is Admission.ACCEPT:
                await self._accept(topic, gap.sender, data, from_repair=True)

    def _solicited(self, topic: str, gap: RequestMissing, data: bytes, wanted: set[int]) -> int | None:
        """The frame's sequence number if it is one we asked for and still want; else charge the sender.

        Decoding only (no signature check): the stream itself is authenticated to ``gap.sender``, so what
        arrives on it is that peer's doing whoever signed it; ``_accept`` verifies the frames we keep."""
        try:
            frame = decode(decode(data, Envelope).payload, GossipFrame)
        except RemoteProtocolError as exc:
            self.metrics.reject(exc.reason)
            log.info("malformed repair frame from %s on %s: %s", gap.sender, topic, exc)
            self.policy.offence(gap.sender, Offence.MALFORMED, exc.reason)
            return None
        if frame.topic == topic and frame.epoch_ms == gap.epoch_ms and frame.sequence in wanted:
            return frame.sequence
        self.metrics.reject("unsolicited_repair_frame")
        log.info(
            "unsolicited repair frame from %s: %s #%d (asked %d..%d)",
            gap.sender,
            frame.topic[:60],
            frame.sequence,
            gap.first,
            gap.last,
        )
        self.policy.offence(gap.sender, Offence.UNSOLICITED, "unsolicited_repair_frame")
        return None

    async def _serve_repair(self, stream: FramedStream) -> None:
        if not self.policy.admit_message(stream.remote_peer_id):  # a request costs us: it is a message
            return
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


def _check_signer(envelope: Envelope, sender_peer_id: str) -> None:

    check_sender(envelope, sender_peer_id)
