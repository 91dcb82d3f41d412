"""Direct links to a bounded set of neighbours: heartbeats, and the peer records that ride on them. One
file because one stream per link carries both, read and written by the same per-link loops, and a record's
checks charge the neighbour that passed it on through that link.

DESIGN §4: a node beats to D neighbours (protocol/overlay.py), not to everyone, and learns the rest of
the swarm from signed peer records passed from neighbour to neighbour (protocol/record_book.py). One
long-lived ``/prime-node/neighbour/2`` stream per link carries ``NeighbourFrame``s both ways. Measured
on loopback, py-libp2p's gossipsub lost over half of the heartbeats in a 16-node swarm, which is why
liveness and records never ride gossip.

Records arrive from neighbours who are not their owners, so each is checked on its own: the envelope's
domain, its signature, and that the record describes its signer (``check_record_signer``). A record is
verified only when it is newer than the one held; an exact copy of a held record costs a lookup, an older
issue a decode. A neighbour that passes on a forged or malformed record is charged for it (an honest node
verifies before passing anything on).
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import trio

from prime_node.errors import NodeError
from prime_node.node.core import NodeCore
from prime_node.p2p.dht_interop import KnowsOfferedProtocols
from prime_node.p2p.interface import FramedStream, PeerAddresses
from protocol.codec import decode, encode
from protocol.dial_backoff import DialBackoff
from protocol.envelope import Domain, Envelope, Reject, check_signature, seal
from protocol.errors import ProtocolError, RemoteProtocolError
from protocol.membership import Membership, PeerState, StateChanged
from protocol.overlay import (
    BUSY_SAMPLE,
    MAX_NEIGHBOUR_FRAME,
    REFILL_PAUSE,
    FrameKind,
    NeighbourFrame,
    Overlay,
    OverlayConfig,
    next_beat_at,
)
from protocol.peer_record import PeerRecord, check_record_signer
from protocol.record_book import MAX_RECORDS_PER_FRAME, Offer, RecordBook, RecordBookConfig, clamp_refresh
from protocol.scoring import Offence

log = logging.getLogger(__name__)
NEIGHBOUR_PROTOCOL = "/prime-node/neighbour/2"
ANSWER_TIMEOUT = 10.0
SEND_TIMEOUT = 10.0
FRAMES_PER_SECOND = 8
"""Frames one link sends per second at most (a full-table sync is paced under peers' flood limit)."""
DIAL_YIELD_DELAY = 1.0
SILENT_LINK_CHECKS = 3
"""A link that carried nothing over this many on-time checks in a row, on a stream whose connection is
gone, is closed and its peer asked again (``check_silence``)."""
LATE_CHECK = 1.5
"""A check this many intervals after the previous one finds our own process stalled: it counts nothing."""
URGENT_DELAY = 0.05
"""A record of a peer we never heard of is passed on after this pause (others from the same burst join it)."""

ChangeHandler = Callable[[list[StateChanged]], None]


@dataclass
class _Link:
    peer_id: str
    stream: FramedStream
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    wake: trio.Event = field(default_factory=trio.Event)
    heard: bool = True
    """A frame arrived since the last silence check."""
    quiet_checks: int = 0
    """On-time silence checks in a row that found nothing arrived."""


class NeighbourLinks:
    def __init__(
        self,
        core: NodeCore,
        membership: Membership[PeerRecord],
        *,
        interval: float,
        on_changes: ChangeHandler,
        overlay: OverlayConfig | None = None,
        book: RecordBookConfig | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.core = core
        self.host = core.host
        self.clock = core.clock
        self.metrics = core.metrics
        self.policy = core.policy
        self.membership = membership
        self.interval = interval
        self.on_changes = on_changes
        self.own_peer_id = core.host.peer_id
        self.domain = Domain("peer_record", core.run_id)
        self.overlay = Overlay(self.own_peer_id, overlay or OverlayConfig())
        self.book = RecordBook(self.own_peer_id, book or RecordBookConfig())
        self.dials = DialBackoff()
        """Which record addresses may be dialled now, which are proven (protocol/dial_backoff.py)."""
        self.rng = rng or random.Random()
        self.latency_ms: dict[str, int] = {}
        self._links: dict[str, _Link] = {}
        self._last_check: float | None = None
        self._short_of_links = trio.Event()
        """Set when an attempt ended without a link while links are still wanted (``refill_loop``)."""
        core.host.set_stream_handler(NEIGHBOUR_PROTOCOL, self._serve)

    # -- our own record ----------------------------------------------------------------------------------

    def issue(self, record: PeerRecord, *, urgent: bool) -> None:
        """Sign ``record`` now and pass it to every neighbour (at once if ``urgent``, else with the beats)."""
        envelope = seal(self.core.key, self.domain, encode(record), now_ms=self.clock.wall_ms())
        self.book.store(self.own_peer_id, envelope.timestamp_ms, encode(envelope), came_from=None)
        self.metrics.count("records_issued")
        if urgent:
            self._wake_all()

    # -- choosing neighbours -----------------------------------------------------------------------------

    def neighbours(self) -> list[str]:
        return sorted(self._links)

    def wanted(self) -> int:
        return self.overlay.wanted()

    def may_leave(self, peer_id: str) -> bool:
        return self.overlay.may_leave(peer_id)

    def short_of_candidates(self, healthy: list[str]) -> bool:
        return self.overlay.short_of_candidates(healthy)

    def maintain(self, candidates: list[str]) -> None:
        """Open links to random ``candidates`` (healthy peers, connected peers) while below the degree.
        Not to a peer whose identify lists no ``NEIGHBOUR_PROTOCOL`` (another libp2p program connected to
        us): a trainer retried one every 30 s; asked again once its identify names the protocol."""
        if isinstance(self.host, KnowsOfferedProtocols):
            host = self.host
            candidates = [p for p in candidates if host.offers(p, NEIGHBOUR_PROTOCOL) is not False]
        for peer_id in self.overlay.choose(candidates, self.clock.now(), self.rng):
            if self.policy.is_banned(peer_id):
                continue
            self.overlay.opening.add(peer_id)
            self.core.nursery.start_soon(self._open, peer_id)

    async def refill_loop(self, candidates: Callable[[], list[str]]) -> None:
        """Ask other ``candidates`` soon after an attempt was refused or failed while links are still
        wanted, not at the next heartbeat. The first members of a swarm fill their slots first, and a
        joiner learns of them first (from its bootstrap's refusal sample): in a 40-node test swarm such a
        joiner was refused by all four picks, waited a whole interval per round, and held formation back
        to 3 or 4 intervals. Paced to one round per ``REFILL_PAUSE`` intervals; every refusal sidelines
        its peer (``Overlay.refused``), so the rounds stop when no candidate is left."""
        while True:
            await self._short_of_links.wait()
            self._short_of_links = trio.Event()
            await trio.sleep(REFILL_PAUSE * self.interval)
            if self.overlay.wanted():
                self.metrics.count("neighbour_refills")
                self.maintain(candidates())

    def _no_link(self, peer_id: str, *, answered: bool = True) -> None:
        """An attempt to link with ``peer_id`` ended without a link."""
        self.overlay.refused(peer_id, self.clock.now(), answered=answered)
        if self.overlay.wanted():
            self._short_of_links.set()

    def check_silence(self) -> None:
        """Once per interval: close links that stopped carrying frames without failing. Seen in a
        32-process swarm: a neighbour stream that delivered its first frame and nothing after, for 5–25 s,
        while both ends kept the link (its peer flapped unhealthy): its connection had been dropped under
        it. A link is closed only when its stream is stranded so, and quiet over checks that ran on time.
        A quiet link on a live connection stays: its peer is slow (a loaded machine, a stalled process) and
        its beats judge it. Closing it, and the connection when the peer answered the hello late, turned
        such stalls into peers counted dead until their next record (docs/benchmarks.md, *Discovery*)."""
        now = trio.current_time()
        on_time = self._last_check is None or now - self._last_check <= LATE_CHECK * self.interval
        self._last_check = now
        if not on_time:
            for link in self._links.values():
                link.heard, link.quiet_checks = False, 0
            return
        for link in list(self._links.values()):
            link.quiet_checks = 0 if link.heard else link.quiet_checks + 1
            link.heard = False
            if link.quiet_checks >= SILENT_LINK_CHECKS and link.stream.stranded():
                log.info("link to %s: its connection is gone and nothing came for %d intervals; asking again",
                         link.peer_id, link.quiet_checks)  # fmt: skip
                self.metrics.count("neighbour_links_silent")
                link.scope.cancel()

    async def _open(self, peer_id: str) -> None:
        stream: FramedStream | None = None
        try:
            if peer_id not in self.host.connected_peers() and self.own_peer_id > peer_id:
                # With one connection allowed per peer, two peers dialling each other at once lose one
                # connection and the streams on it: the larger peer ID lets the other dial first.
                await trio.sleep(DIAL_YIELD_DELAY)
            with trio.fail_after(ANSWER_TIMEOUT):
                proof = None
                if peer_id not in self.host.connected_peers():
                    proof = await self._dial(peer_id)
                stream = await self.host.open_stream(peer_id, NEIGHBOUR_PROTOCOL)
                await stream.send_frame(self._frame(FrameKind.HELLO, self._own()))
                raw = await stream.receive_frame(MAX_NEIGHBOUR_FRAME)
                if raw is None:
                    raise NodeError("the peer closed the link", reason="closed")
                answer = self._decode(peer_id, raw)
        except (NodeError, trio.TooSlowError) as exc:
            log.info("link to %s not opened: %s", peer_id, str(exc) or type(exc).__name__)
            self.metrics.count("neighbour_open_failures")
            self._no_link(peer_id, answered=False)
            if stream is not None:
                # The peer may have welcomed us after all: left open, this stream would stay a link there
                # on which we never beat, and the peer would mark us dead 6 intervals later.
                with trio.move_on_after(1), contextlib.suppress(NodeError):
                    await stream.reset()
            return
        if answer is None or answer.kind not in (FrameKind.WELCOME, FrameKind.BUSY):
            self._no_link(peer_id)
            with trio.move_on_after(1):
                await stream.reset()
            return
        if proof is not None:  # the peer answered on the connection our dial to this address opened
            self.dials.reached(proof)
        self._take_records(peer_id, answer)
        if answer.kind == FrameKind.BUSY or not self.overlay.room_for(peer_id):
            if peer_id not in self._links:
                # It answered: alive. If we judged it by beats (a link of ours ended), records now.
                self.on_changes(self.membership.unlinked(peer_id, self.clock.now()))
            if answer.kind == FrameKind.BUSY:
                self.metrics.count("neighbour_refused_us")
            else:  # inbound links filled us while we waited: withdraw politely
                with trio.move_on_after(1), contextlib.suppress(NodeError):
                    await stream.send_frame(self._frame(FrameKind.BYE, ()))
            self._no_link(peer_id)
            with trio.move_on_after(1):
                await stream.close()
            return
        await self._run_link(peer_id, stream, answer, inbound=False)

    async def _dial(self, peer_id: str) -> str | None:
        """Dial ``peer_id`` at the addresses its record names that may be dialled now
        (protocol/dial_backoff.py): a record's addresses are only its owner's claim, so each failed dial
        rests their endpoints, doubling. Returns the one address the dial may prove (``_open`` marks it
        proven once the peer answered on the connection), or None."""
        held = self.membership.get(peer_id)
        if held is None:
            raise NodeError("no address for the peer", reason="no_address")
        planned = self.dials.plan(held.record.multiaddrs, self.clock.now())
        if not planned:
            self.metrics.count("dials_resting")
            raise NodeError("every address of the peer is resting after failed dials", reason="dial_resting")
        try:
            await self.host.connect_peer(PeerAddresses(peer_id, planned))
        except NodeError:
            self.dials.failed(planned, self.clock.now())
            self.metrics.count("dial_strikes", 0, len(planned))
            raise
        except trio.Cancelled:
            # Our answer deadline ran out mid-dial: as good as a failed dial (a listener that never
            # completes the handshake must not be dialled again at once).
            self.dials.failed(planned, self.clock.now())
            raise
        return _proof_of(planned, direct=self.host.directly_connected(peer_id))

    async def _serve(self, stream: FramedStream) -> None:
        peer_id = stream.remote_peer_id
        if not self.policy.admit_message(peer_id):
            return
        try:
            with trio.fail_after(ANSWER_TIMEOUT):
                raw = await stream.receive_frame(MAX_NEIGHBOUR_FRAME)
        except (NodeError, trio.TooSlowError):
            return
        hello = None if raw is None else self._decode(peer_id, raw)
        if hello is None or hello.kind != FrameKind.HELLO:
            return
        self._take_records(peer_id, hello)
        if not self._accepts(peer_id):
            self.metrics.count("neighbour_refusals")
            sampled = self.book.sample(BUSY_SAMPLE, self.rng, excluding=peer_id)
            sample = [r for r in sampled if self._passable(r)]
            with trio.move_on_after(SEND_TIMEOUT):
                await stream.send_frame(self._frame(FrameKind.BUSY, sample))
                await stream.close()
            return
        self.overlay.accepting.add(peer_id)  # hold the slot while the welcome goes out
        try:
            with trio.fail_after(SEND_TIMEOUT):
                await stream.send_frame(self._frame(FrameKind.WELCOME, self._own()))
        except (NodeError, trio.TooSlowError):
            self.overlay.accepting.discard(peer_id)
            return
        await self._run_link(peer_id, stream, hello, inbound=True)

    def _accepts(self, peer_id: str) -> bool:
        """Take an inbound link? Of two links a pair opened at once, the one the smaller peer ID opened
        stays (both ends apply the same rule, so exactly one survives)."""
        if self.policy.is_banned(peer_id):
            return False
        if peer_id in self._links or peer_id in self.overlay.opening or peer_id in self.overlay.accepting:
            return peer_id < self.own_peer_id
        return self.overlay.accepts(peer_id)

    # -- one link ----------------------------------------------------------------------------------------

    async def _run_link(
        self, peer_id: str, stream: FramedStream, first: NeighbourFrame, *, inbound: bool
    ) -> None:
        old = self._links.get(peer_id)
        if old is not None:
            old.scope.cancel()
        link = _Link(peer_id, stream)
        self._links[peer_id] = link
        self.overlay.linked(peer_id, inbound=inbound)
        self.book.link_up(peer_id, self.rng)
        self._beat_from(peer_id, first)
        self.metrics.event(self.clock.uptime(), "neighbour", f"linked {peer_id[-8:]}")
        said_bye = False
        try:
            with link.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._ends_link, link, self._send_loop(link))
                    said_bye = await self._ends_link(link, self._receive_loop(link))
                    link.scope.cancel()
        finally:
            if self._links.get(peer_id) is link:
                del self._links[peer_id]
                self.overlay.unlinked(peer_id)
                self.book.link_down(peer_id)
                self.latency_ms.pop(peer_id, None)
                if not said_bye:
                    self.metrics.count("neighbour_links_lost")
                if not self._ask_again(peer_id) and said_bye and peer_id in self.host.connected_peers():
                    self.on_changes(self.membership.unlinked(peer_id, self.clock.now()))
            with trio.CancelScope(shield=True), trio.move_on_after(1), contextlib.suppress(NodeError):
                await stream.reset()

    def _ask_again(self, peer_id: str) -> bool:
        """A link ended: the peer died, or only the link did (its connection was replaced, a send timed
        out on a loaded machine, or it said ``bye``). Send it one hello: a welcome links us again, a
        ``busy`` proves it alive (judged by its records from then on), and no answer leaves it judged by
        its last beat (dead 6 intervals after it). Without this a live peer looked dead until its next
        record, up to a refresh period later. A ``bye`` alone is not proof of life: a stranger that said
        it and left stayed healthy on the record it had sent for 2.5 refresh periods (75 s), and a dial
        to the addresses in that record was the only check (issue 35, item 5). Only while a slot is free:
        links never pass the maximum. True if the hello is on its way."""
        slots = self.overlay.slots()
        if peer_id in slots or len(slots) >= self.overlay.config.max_degree or self.policy.is_banned(peer_id):
            return False
        self.overlay.opening.add(peer_id)
        try:
            self.core.nursery.start_soon(self._open, peer_id)
        except RuntimeError:  # the node is stopping: its nursery takes no new tasks
            self.overlay.opening.discard(peer_id)
            return False
        self.metrics.count("neighbour_rechecks")
        return True

    async def _ends_link(self, link: _Link, loop: Coroutine[Any, Any, bool | None]) -> bool:
        """Run one of a link's two loops; a failure of either (the peer hung up, a send timed out) ends the
        link quietly, not the node. True if the peer said goodbye."""
        try:
            return bool(await loop)
        except (NodeError, trio.TooSlowError) as exc:
            log.debug("link to %s ended: %s", link.peer_id, exc or type(exc).__name__)
            link.scope.cancel()
            return False

    async def _receive_loop(self, link: _Link) -> bool:
        """Read frames until the link ends; True if the peer said goodbye."""
        while (raw := await link.stream.receive_frame(MAX_NEIGHBOUR_FRAME)) is not None:
            link.heard = True
            self.metrics.count("heartbeat_frames_in", len(raw))
            if not self.policy.admit_message(link.peer_id):
                return False
            frame = self._decode(link.peer_id, raw)
            if frame is None:
                continue
            if frame.kind == FrameKind.BYE:
                return True
            self._take_records(link.peer_id, frame)
            self._beat_from(link.peer_id, frame)
        return False

    async def _send_loop(self, link: _Link) -> None:
        next_beat = trio.current_time()
        while True:
            with trio.move_on_at(next_beat):
                await link.wake.wait()
            link.wake = trio.Event()
            now = trio.current_time()
            if now < next_beat:
                await trio.sleep(URGENT_DELAY)  # let the rest of a burst join this frame
            records = [r for r in self.book.take(link.peer_id, MAX_RECORDS_PER_FRAME) if self._passable(r)]
            frame = self._frame(FrameKind.BEAT, records)
            with trio.fail_after(SEND_TIMEOUT):
                await link.stream.send_frame(frame)
            self.metrics.count("heartbeats_sent", len(frame) + 4)
            self.metrics.count("records_sent", 0, len(records))
            next_beat = next_beat_at(trio.current_time(), self.interval)
            if self.book.pending_count(link.peer_id):
                await trio.sleep(1 / FRAMES_PER_SECOND)
                link.wake.set()

    def _wake_all(self) -> None:
        for link in self._links.values():
            link.wake.set()

    # -- frames and records ------------------------------------------------------------------------------

    def _own(self) -> tuple[bytes, ...]:
        own = self.book.get(self.own_peer_id)
        return () if own is None else (own.envelope,)

    def _passable(self, envelope: bytes) -> bool:
        """May a held record be passed on? Not one of a member we no longer count healthy (a neighbour
        that left, judged by its last beat), nor one whose every address failed our own dial to its owner
        (protocol/dial_backoff.py ``disproven``): either would send our neighbours to dial a listener that
        is not, or no longer, its owner's. Our own record always goes."""
        held = self.book.holding(envelope)
        if held is None or held.peer_id == self.own_peer_id:
            return True
        member = self.membership.get(held.peer_id)
        if member is None or (
            member.state is PeerState.HEALTHY and not self.dials.disproven(member.record.multiaddrs)
        ):
            return True
        self.metrics.count("records_withheld")
        return False

    def _frame(self, kind: FrameKind, records: list[bytes] | tuple[bytes, ...]) -> bytes:
        return encode(NeighbourFrame(kind.value, self.clock.wall_ms(), tuple(records)))

    def _decode(self, peer_id: str, raw: bytes) -> NeighbourFrame | None:
        try:
            return decode(raw, NeighbourFrame)
        except ProtocolError as exc:
            self.metrics.reject(exc.reason)
            log.info("malformed neighbour frame from %s: %s", peer_id, exc)
            self.policy.offence(peer_id, Offence.MALFORMED, exc.reason)
            return None

    def _beat_from(self, peer_id: str, frame: NeighbourFrame) -> None:
        held = self.book.get(peer_id)
        member = self.membership.get(peer_id)
        if held is None or member is None:
            return  # a neighbour we hold no record of is not a member yet (its hello carried it)
        self.metrics.count("heartbeats_received")
        self.latency_ms[peer_id] = max(self.clock.wall_ms() - frame.sent_ms, 0)
        self.on_changes(self.membership.heard(peer_id, member.record, self.clock.now()))

    def _take_records(self, sender: str, frame: NeighbourFrame) -> None:
        urgent = False
        for raw in frame.records:
            try:
                urgent |= self._take_record(sender, raw)
            except ProtocolError as exc:
                self.metrics.reject(exc.reason)
                offence = _offence(exc.reason)
                log.info("refused a peer record passed on by %s: %s", sender, exc)
                if offence is not None:
                    self.policy.offence(sender, offence, exc.reason)
                if self.policy.is_banned(sender):
                    return
        if urgent:
            self._wake_all()

    def _take_record(self, sender: str, raw: bytes) -> bool:
        """Verify and store one record; True if it names a peer we never heard of (pass it on at once)."""
        self.metrics.count("records_in")
        held_copy = self.book.holding(raw)
        if held_copy is not None:
            self.book.seen_from(sender, held_copy.peer_id, held_copy.issued_ms)
            return False
        envelope = decode(raw, Envelope)
        if envelope.domain != str(self.domain):
            raise RemoteProtocolError("peer record for another run or purpose", reason=Reject.WRONG_DOMAIN)
        record = decode(envelope.payload, PeerRecord)
        now_ms = self.clock.wall_ms()
        offer = self.book.consider(record.peer_id, envelope.timestamp_ms, now_ms)
        if offer is Offer.FROM_THE_FUTURE:
            raise RemoteProtocolError("peer record dated in the future", reason=Reject.FROM_THE_FUTURE)
        if offer is Offer.KNOWN:
            self.book.seen_from(sender, record.peer_id, envelope.timestamp_ms)
        if offer is not Offer.NEW:
            return False
        check_signature(envelope)
        check_record_signer(record, envelope.signer)
        if self.policy.is_banned(record.peer_id):
            return False
        held = self.membership.get(record.peer_id)
        known = held is not None
        if held is not None and held.record.multiaddrs != record.multiaddrs:
            self.overlay.refused_by.pop(record.peer_id, None)  # new addresses (a relay slot): try again
        if not self.book.store(record.peer_id, envelope.timestamp_ms, raw, came_from=sender):
            self.metrics.count("records_dropped_full")
            return False
        self.metrics.count("records_new")
        refresh = clamp_refresh(record.refresh_s, self.book.config)
        age = max(now_ms - envelope.timestamp_ms, 0) / 1000
        now = self.clock.now()
        self.on_changes(
            self.membership.heard_record(
                record.peer_id, record, issued_at=now - age, refresh=refresh, now=now
            )
        )
        return not known

    def forget(self, peer_id: str) -> None:
        self.book.forget(peer_id)


def _proof_of(planned: tuple[str, ...], *, direct: bool) -> str | None:
    """The one address a successful dial to ``planned`` proves: the only one tried, or the only direct
    (relayed) one when the connection is direct (relayed). Several of a kind prove none: the transport
    does not say which answered."""
    if len(planned) == 1:
        return planned[0]
    kind = [a for a in planned if ("/p2p-circuit" in a) != direct]
    return kind[0] if len(kind) == 1 else None


def _offence(reason: str) -> Offence | None:
    if reason in (Reject.FROM_THE_FUTURE, Reject.EXPIRED):
        return None  # clocks differ between the owner, the neighbour and us: not proof of anything
    if reason == Reject.BAD_SIGNATURE:
        return Offence.INVALID_SIGNATURE
    if reason in (Reject.SIGNER_MISMATCH, "signer_mismatch"):
        return Offence.SIGNER_MISMATCH
    return Offence.MALFORMED
