"""One node's part in the swarm of one checkpoint version: a sans-IO state machine. One file because it
is one machine: the piece exchange and super-seeding read and write the same peer sessions, picker and
upload queue, and each transition keeps their invariants together (tests/swarm checks them as one).

The caller owns connections, storage and time. It reports events (a peer connected or left, a message
arrived, a piece it was asked to check passed or failed, an upload finished, time passed) and carries out
the returned actions, in order:

- ``Send(peer, message)``: encode and send one message.
- ``Upload(peer, index)``: read piece ``index`` and send it as a ``Piece``; call ``upload_done`` after.
- ``AbortUpload(peer, index)``: stop sending that piece if still sending (the peer cancelled it).
- ``Verify(peer, index, data)``: check ``data`` against the manifest, store it if good, then call
  ``piece_checked`` with the verdict. (Hashing is the caller's, so it can run off the event loop.)
- ``Disconnect(peer, reason)``: close the connection; the peer is already forgotten here.
- ``Completed()``: every piece is verified and stored.

Protocol per connection: both sides send a ``Bitfield`` first, then ``Have`` for each piece they verify;
the downloader sends ``Request``s (a few per peer), the uploader answers with ``Piece`` or ``Reject``;
``Cancel`` withdraws a request. A peer that sends a piece failing its hash, or a piece nobody asked it
for, is banned: disconnected and refused on reconnect, and its outstanding pieces are asked of others.
``have``s go only to peers that lack pieces; on completion a node sends its full bitfield to the others,
so a complete peer that keeps seeding knows when no connected peer wants the version (``peers_wanting``).

Super-seeding (for the origin): instead of its full bitfield, the origin reveals to each peer only a
few pieces, and while any piece has never been uploaded, each revealed piece is one nobody has received
from it and that is revealed to no one else; requests for pieces not revealed are refused. So the origin
uploads every piece once before it uploads any piece twice, and the swarm holds a full copy after one
origin upload of F bytes. After that first pass it reveals the least-served pieces first.

That economy relies on peers re-serving what they got; a peer that takes reveals and never requests them,
or downloads pieces and serves nobody, would keep a piece from everyone else for as long as it stays. So
``tick`` checks deadlines: a revealed piece not requested within the *spread deadline* (since its reveal
or the peer's last request to us), or a piece uploaded in the first pass that no other peer announces
within twice that while its holder has made no piece spread (or is hoarding), is *opened*: announced to
every peer that lacks it and served to anyone, ordinary seeding for that piece. The deadline adapts to
the swarm: ``spread_factor`` times the moving average of one hop (our upload to the receiver's ``have``),
between ``spread_floor`` and ``spread_timeout`` (``spread_timeout`` only while no hop was ever measured).
Each missed deadline is a strike against the peer; a peer with more strikes than pieces it made spread
gets one reveal at a time instead of ``reveal_per_peer``, and its upload requests are served after
everyone else's (a peer's progress counts the pieces we sent it, not only those it admits to holding).

The hop time and each peer's strikes and spread pieces are also kept across versions, in a
``SpreadMemory`` the caller shares between the nodes of every version it seeds (protocol/swarm/spread.py):
a new version's deadline starts from the hops measured before (hoarders given every piece of a small
version held it for the full ``spread_timeout`` when each version started from nothing: issue 35), peers
that re-served before get reveals first, and while such peers are known, a peer without that record gets
one reveal at a time in the first pass and a peer that hoarded before one at a time throughout.
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass, field

from protocol.codec import Message
from protocol.errors import RemoteProtocolError
from protocol.swarm.messages import Bitfield, Cancel, Have, Piece, Reject, Request
from protocol.swarm.picker import PickerLimits, PiecePicker
from protocol.swarm.pieceset import from_wire, full_set, to_wire
from protocol.swarm.spread import SpreadMemory
from protocol.swarm.uploader import UploadScheduler

MAX_CANCELLED_REMEMBERED = 64


@dataclass(frozen=True, slots=True)
class Send:
    peer: Hashable
    message: Message


@dataclass(frozen=True, slots=True)
class Upload:
    peer: Hashable
    index: int


@dataclass(frozen=True, slots=True)
class AbortUpload:
    peer: Hashable
    index: int


@dataclass(frozen=True, slots=True)
class Verify:
    peer: Hashable
    index: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Disconnect:
    peer: Hashable
    reason: str


@dataclass(frozen=True, slots=True)
class Completed:
    pass


Action = Send | Upload | AbortUpload | Verify | Disconnect | Completed


@dataclass(frozen=True)
class SwarmConfig:
    """Tuning of one node; the defaults are what the simulator measured (docs/weight-swarm.md)."""

    limits: PickerLimits = field(default_factory=PickerLimits)
    upload_slots: int = 4
    max_requests_from_peer: int = 8
    super_seed: bool = False
    reveal_per_peer: int = 2
    request_timeout: float = 600.0
    max_timeouts: int = 3
    serve_laggards_first: bool = True
    spread_timeout: float = 30.0
    """Super-seeding: the longest a revealed piece may go unrequested (an uploaded one: twice that) before
    the origin serves it to everyone; also the deadline while no hop was ever measured (this version or,
    through a shared ``SpreadMemory``, an earlier one)."""
    spread_floor: float = 0.25
    spread_factor: float = 4.0


@dataclass(slots=True)
class PeerSession:
    """What this node knows about one connected peer."""

    bits: int = 0
    requested_at: dict[int, float] = field(default_factory=dict)
    cancelled: dict[int, None] = field(default_factory=dict)
    timeouts: int = 0
    revealed: dict[int, float] = field(default_factory=dict)
    """Super-seeding: pieces revealed to this peer and not yet sent, with the time of the reveal."""
    last_request: float = float("-inf")
    """When it last asked us for a piece."""
    sent: int = 0
    """Pieces we uploaded to it (whether or not it admits to holding them)."""
    strikes: int = 0
    spread: int = 0
    """Super-seeding: deadlines it missed, and pieces we sent it first that others then announced."""
    service_time: float = 0.0
    """Moving average of request-to-arrival time: how quickly this peer answers us (0: no sample yet)."""

    @property
    def hoarding(self) -> bool:
        return self.strikes > self.spread


class SwarmNode:
    """See the module doc. ``have`` is the set of pieces already verified on disk (bit i = piece i);
    ``memory``: what the node learnt on earlier versions (a fresh one when not given; the swarm's holdings
    share one across every version they hold)."""

    def __init__(
        self,
        manifest_id: bytes,
        piece_count: int,
        *,
        rng: random.Random,
        config: SwarmConfig | None = None,
        have: int = 0,
        memory: SpreadMemory | None = None,
    ) -> None:
        self.manifest_id = manifest_id
        self.piece_count = piece_count
        self.full = full_set(piece_count)
        self.rng = rng
        self.config = config or SwarmConfig()
        self.picker = PiecePicker(piece_count, rng, have=have, limits=self.config.limits)
        self.uploads = UploadScheduler(
            slots=self.config.upload_slots, per_peer=self.config.max_requests_from_peer
        )
        self.peers: dict[Hashable, PeerSession] = {}
        self.banned: set[Hashable] = set()
        self.super_seed = self.config.super_seed and self.picker.complete
        self.served = [0] * piece_count
        self.reveals = [0] * piece_count
        self.never_served = piece_count
        """First-pass pieces left: never uploaded and not opened."""
        self.open = 0
        """Super-seeding: pieces served to anyone because they did not spread (see the module doc)."""
        self.unspread: dict[int, tuple[Hashable, float]] = {}
        """First-pass pieces uploaded and not yet announced by another peer: receiver, upload time."""
        self.memory = memory if memory is not None else SpreadMemory()
        self.opened_unrequested = 0
        self.opened_unspread = 0
        """Super-seeding: pieces opened because a reveal went unrequested, or an upload did not spread."""
        self.first_pass_at: float | None = None
        """Super-seeding: when the last never-uploaded piece was uploaded (the swarm then holds a copy)."""

    @property
    def have(self) -> int:
        return self.picker.have

    @property
    def hop_time(self) -> float:
        """Moving average of one hop: our upload to the receiver's ``have``, on this version and the
        earlier ones sharing ``memory`` (0: no sample yet)."""
        return self.memory.hop_time

    @property
    def complete(self) -> bool:
        return self.picker.complete

    def peers_wanting(self, asked_since: float | None = None) -> list[Hashable]:
        """Connected peers that have not announced every piece (with ``asked_since``: only those whose
        last request to us came at or after it). What a fetcher that keeps seeding waits for; a
        super-seeding origin never announces every piece, so callers leave it out."""
        full = self.full
        return [
            peer
            for peer, session in self.peers.items()
            if session.bits != full and (asked_since is None or session.last_request >= asked_since)
        ]

    # --- connection events -----------------------------------------------------------------------------

    def connected(self, peer: Hashable, now: float) -> list[Action]:
        if peer in self.banned:
            return [Disconnect(peer, "banned")]
        if peer in self.peers:
            return []
        self.peers[peer] = PeerSession()
        self.picker.add_peer(peer)
        if self.super_seed:
            bits = to_wire(self.open, self.piece_count)
            actions: list[Action] = [Send(peer, Bitfield(self.manifest_id, bits))]
            return actions + self._reveal(peer, now)
        return [Send(peer, Bitfield(self.manifest_id, to_wire(self.have, self.piece_count)))]

    def disconnected(self, peer: Hashable, now: float) -> list[Action]:
        if peer not in self.peers:
            return []
        self._forget(peer)
        actions: list[Action] = self._start_uploads()
        if self.super_seed:
            actions += self._reveal_all(now)
        return actions + self._fill_all(now)

    def _forget(self, peer: Hashable) -> None:
        session = self.peers.pop(peer)
        for index in session.revealed:
            self.reveals[index] -= 1
        for index in [i for i, (holder, _) in self.unspread.items() if holder == peer]:
            del self.unspread[index]  # served and gone: the second pass serves it again
        self.picker.remove_peer(peer)
        self.uploads.drop_peer(peer)

    def ban(self, peer: Hashable, reason: str, now: float) -> list[Action]:
        """Disconnect ``peer`` and refuse it from now on (callers use it too, e.g. for undecodable frames)."""
        self.banned.add(peer)
        if peer in self.peers:
            self._forget(peer)
        actions: list[Action] = [Disconnect(peer, reason)]
        actions += self._start_uploads()
        if self.super_seed:
            actions += self._reveal_all(now)
        return actions + self._fill_all(now)

    # --- messages --------------------------------------------------------------------------------------

    def receive(self, peer: Hashable, message: Message, now: float) -> list[Action]:
        """Handle one decoded message from ``peer``. Protocol violations disconnect the peer."""
        if peer not in self.peers:
            return []
        if (
            type(message) is Have
            and message.manifest_id == self.manifest_id
            and 0 <= message.index < self.piece_count
        ):
            return self._on_have(peer, message.index, now)  # the commonest message, on the fast path
        if getattr(message, "manifest_id", None) != self.manifest_id:
            return (
                [Send(peer, Reject(self.manifest_id, 0, "wrong_manifest"))]
                if isinstance(message, Request)
                else []
            )
        try:
            if isinstance(message, Have):
                return self._on_have(peer, message.index, now)
            if isinstance(message, Bitfield):
                return self._on_bitfield(peer, from_wire(message.bits, self.piece_count), now)
            if isinstance(message, Request):
                return self._on_request(peer, message.index, now)
            if isinstance(message, Cancel):
                return self._on_cancel(peer, message.index)
            if isinstance(message, Reject):
                return self._on_reject(peer, message.index, now)
            if isinstance(message, Piece):
                return self.piece_arrived(peer, message.index, message.data, now)
        except RemoteProtocolError as exc:
            return self.ban(peer, exc.reason, now)
        return []

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.piece_count:
            raise RemoteProtocolError(f"piece {index} outside 0..{self.piece_count - 1}", reason="bad_index")

    def _on_have(self, peer: Hashable, index: int, now: float) -> list[Action]:
        self._check_index(index)
        session = self.peers[peer]
        session.bits |= 1 << index
        picker = self.picker
        picker.peer_has(peer, index)
        actions: list[Action] = []
        if self.super_seed:
            if index in self.unspread:
                self._seen(peer, index, now)
            if index in session.revealed:
                del session.revealed[index]
                self.reveals[index] -= 1
                actions += self._reveal_all(now)
        limits = picker.limits
        if (
            picker.needed
            and picker.outstanding < limits.total
            and len(picker.inflight[peer]) < limits.per_peer
        ):
            actions += self._requests(picker.fill((peer,)), now)
        return actions

    def _on_bitfield(self, peer: Hashable, bits: int, now: float) -> list[Action]:
        session = self.peers[peer]
        session.bits |= bits
        self.picker.peer_has_all(peer, bits)
        if self.super_seed:
            for index in [i for i in self.unspread if bits >> i & 1]:
                self._seen(peer, index, now)
            return self._reveal(peer, now)
        return self._requests(self.picker.fill((peer,)), now)

    def _on_request(self, peer: Hashable, index: int, now: float) -> list[Action]:
        self._check_index(index)
        if not self.have >> index & 1:
            return [Send(peer, Reject(self.manifest_id, index, "missing"))]
        session = self.peers[peer]
        session.last_request = now
        if self.super_seed and index not in session.revealed and not self.open >> index & 1:
            return [Send(peer, Reject(self.manifest_id, index, "not_offered"))]
        if not self.uploads.request(peer, index):
            return [Send(peer, Reject(self.manifest_id, index, "too_many_requests"))]
        return self._start_uploads()

    def _on_cancel(self, peer: Hashable, index: int) -> list[Action]:
        self._check_index(index)
        if self.uploads.cancel(peer, index):
            return [AbortUpload(peer, index), *self._start_uploads()]
        return []

    def _on_reject(self, peer: Hashable, index: int, now: float) -> list[Action]:
        self._check_index(index)
        session = self.peers[peer]
        if not self.picker.is_inflight(peer, index):
            return []
        session.requested_at.pop(index, None)
        self.picker.request_failed(peer, index)
        # It will not serve this piece: stop counting it as a holder, then ask the others.
        session.bits &= ~(1 << index)
        self.picker.peer_lacks(peer, index)
        return self._fill_all(now)

    def piece_arrived(self, peer: Hashable, index: int, data: bytes, now: float) -> list[Action]:
        """A piece came in from ``peer``: ask the caller to verify it, ignore it, or ban the sender."""
        self._check_index(index)
        session = self.peers[peer]
        if self.picker.is_inflight(peer, index):
            return [Verify(peer, index, data)]
        if index in session.cancelled or self.have >> index & 1:
            return []  # we cancelled it, or end game delivered it twice: a race, not misbehaviour
        raise RemoteProtocolError(
            f"piece {index} was not requested from this peer", reason="unsolicited_piece"
        )

    # --- caller reports --------------------------------------------------------------------------------

    def piece_checked(self, peer: Hashable, index: int, valid: bool, now: float) -> list[Action]:
        """The verdict on a piece the caller was asked to verify (and, if valid, has stored)."""
        if not valid:
            if peer in self.peers:
                return self.ban(peer, "corrupt_piece", now)
            return self._fill_all(now)
        session = self.peers.get(peer)
        if session is not None:
            asked = session.requested_at.pop(index, None)
            if asked is not None:
                sample = now - asked
                session.service_time = (
                    sample if not session.service_time else 0.7 * session.service_time + 0.3 * sample
                )
        if self.have >> index & 1:
            self.picker.request_failed(peer, index)
            return []
        actions: list[Action] = []
        for other in self.picker.completed(index):
            if other == peer:
                continue
            other_session = self.peers[other]
            other_session.requested_at.pop(index, None)
            self._remember_cancel(other_session, index)
            actions.append(Send(other, Cancel(self.manifest_id, index)))
        have = Have(self.manifest_id, index)
        full = self.full
        actions += [Send(p, have) for p, s in self.peers.items() if s.bits != full]
        if self.picker.complete:
            # Peers that hold everything got no `have`s from us; tell them we are complete too, so a
            # fetcher that keeps seeding knows when nobody needs it any more (``peers_wanting``).
            done = Bitfield(self.manifest_id, to_wire(full, self.piece_count))
            actions += [Send(p, done) for p, s in self.peers.items() if s.bits == full]
            actions.append(Completed())
        return actions + self._fill_all(now)

    def upload_done(self, peer: Hashable, index: int, now: float) -> list[Action]:
        """An ``Upload`` finished sending (or was aborted by the caller)."""
        if not self.uploads.finished(peer, index):
            return self._start_uploads()
        actions = self._start_uploads()
        if self.super_seed:
            self.served[index] += 1
            first = self.served[index] == 1 and not self.open >> index & 1
            if first:
                self.never_served -= 1
                if not self.never_served:
                    self.first_pass_at = now
            session = self.peers.get(peer)
            if session is None:
                return actions
            session.sent |= 1 << index
            if first:
                self.unspread[index] = (peer, now)
            if index in session.revealed:
                del session.revealed[index]
                self.reveals[index] -= 1
            actions += self._reveal_all(now) if self.never_served == 0 and first else self._reveal(peer, now)
        return actions

    def tick(self, now: float) -> list[Action]:
        """Time passed: requests unanswered for ``request_timeout`` are cancelled and asked elsewhere;
        a peer that lets ``max_timeouts`` requests expire is disconnected."""
        actions: list[Action] = []
        expired = False
        limit = now - self.config.request_timeout
        for peer, session in list(self.peers.items()):
            for index, asked in list(session.requested_at.items()):
                if asked > limit:
                    continue
                expired = True
                del session.requested_at[index]
                self.picker.request_failed(peer, index)
                self._remember_cancel(session, index)
                actions.append(Send(peer, Cancel(self.manifest_id, index)))
                session.timeouts += 1
            if session.timeouts >= self.config.max_timeouts:
                self._forget(peer)
                actions.append(Disconnect(peer, "unresponsive"))
        if self.super_seed:
            actions += self._open_stuck(now)
        return actions + self._fill_all(now) if expired else actions

    # --- super-seeding: pieces that do not spread ------------------------------------------------------

    def spread_deadline(self) -> float:
        """How long a revealed piece may wait for its request (see the module doc)."""
        config, memory = self.config, self.memory
        if not memory.hops:
            return config.spread_timeout
        return min(config.spread_timeout, max(config.spread_floor, config.spread_factor * memory.hop_time))

    def _seen(self, peer: Hashable, index: int, now: float) -> None:
        """``peer`` announced ``index``, a first-pass piece not yet seen spreading."""
        holder, sent_at = self.unspread[index]
        if peer == holder:  # one hop: our upload reached it and it verified the piece
            self.memory.hop(peer, now - sent_at)
            return
        if self.peers[peer].sent >> index & 1:
            return  # it got the piece from us, not from the holder
        del self.unspread[index]
        self.memory.spread(holder)
        session = self.peers.get(holder)
        if session is not None:
            session.spread += 1

    def _open_stuck(self, now: float) -> list[Action]:
        """Open the pieces whose reveal or first upload missed its deadline; strike their peers."""
        deadline = self.spread_deadline()
        stuck: list[int] = []
        for peer, session in self.peers.items():
            for index, revealed_at in list(session.revealed.items()):
                if now - max(revealed_at, session.last_request) >= deadline:
                    del session.revealed[index]
                    self.reveals[index] -= 1
                    session.strikes += 1
                    self.memory.strike(peer)
                    stuck.append(index)
                    self.opened_unrequested += 1
        for index, (holder, sent_at) in list(self.unspread.items()):
            if now - sent_at < 2 * deadline:
                continue
            keeper = self.peers[holder]
            if keeper.spread and not keeper.hoarding:
                # It re-serves what it gets: this piece is only not requested yet (peers fetch other
                # pieces first). Opening it would make us upload it again on the binding link.
                continue
            lacking = [s for p, s in self.peers.items() if p != holder and not (s.bits | s.sent) >> index & 1]
            if not lacking:
                continue  # nobody else wants it (yet)
            del self.unspread[index]
            if any(not s.hoarding for s in lacking):  # it had someone to serve it to
                self.peers[holder].strikes += 1
                self.memory.strike(holder)
            stuck.append(index)
            self.opened_unspread += 1
        if not stuck:
            return []
        return self._open(stuck) + self._reveal_all(now)

    def _open(self, indices: list[int]) -> list[Action]:
        actions: list[Action] = []
        for index in indices:
            if self.open >> index & 1:
                continue
            self.open |= 1 << index
            if not self.served[index]:
                self.never_served -= 1
            have = Have(self.manifest_id, index)
            actions += [Send(p, have) for p, s in self.peers.items() if not s.bits >> index & 1]
        return actions

    # --- internals -------------------------------------------------------------------------------------

    def _remember_cancel(self, session: PeerSession, index: int) -> None:
        session.cancelled[index] = None
        if len(session.cancelled) > MAX_CANCELLED_REMEMBERED:
            del session.cancelled[next(iter(session.cancelled))]

    def _requests(self, picks: list[tuple[Hashable, int]], now: float) -> list[Action]:
        actions: list[Action] = []
        for peer, index in picks:
            self.peers[peer].requested_at[index] = now
            actions.append(Send(peer, Request(self.manifest_id, index)))
        return actions

    def _fill_all(self, now: float) -> list[Action]:
        """Offer requests to the peers that have answered fastest first (untried peers count as fast), so
        the end game's duplicate requests go where they finish soonest."""
        if self.picker.complete or not self.peers:
            return []
        order = sorted(self.peers.items(), key=_by_service_time)
        return self._requests(self.picker.fill([peer for peer, _ in order]), now)

    def _start_uploads(self) -> list[Action]:
        peer_bits, peers, count = self.picker.peer_bits, self.peers, self.piece_count
        if self.config.serve_laggards_first:
            # Pieces sent count as held (a peer cannot jump the queue by hiding them); hoarders go last.
            def progress(peer: Hashable) -> int:
                session = peers[peer]
                return (peer_bits[peer] | session.sent).bit_count() + count * self._hoarding(peer, session)

            started = self.uploads.start_ready(progress)
        else:
            started = self.uploads.start_ready(lambda peer: 0)
        return [Upload(peer, index) for peer, index in started]

    def _hoarding(self, peer: Hashable, session: PeerSession) -> bool:
        """It hoards on this version, or did on earlier ones (``memory``)."""
        return session.hoarding or self.memory.hoarded(peer)

    def _reveal_all(self, now: float) -> list[Action]:
        """Top up every peer's reveals, peers that re-served before first (``SpreadMemory.standing``)."""
        actions: list[Action] = []
        for peer in sorted(self.peers, key=self.memory.standing):
            actions += self._reveal(peer, now)
        return actions

    def _quota(self, peer: Hashable, session: PeerSession) -> int:
        if self._hoarding(peer, session):
            return 1
        memory = self.memory
        if self.never_served and memory.proven_peers and not memory.proven(peer):
            return 1  # first pass: leave the fresh pieces to peers known to re-serve them
        return self.config.reveal_per_peer

    def _reveal(self, peer: Hashable, now: float) -> list[Action]:
        """Super-seeding: top up the pieces revealed to ``peer`` (see the module doc)."""
        session = self.peers[peer]
        actions: list[Action] = []
        quota = self._quota(peer, session)
        while len(session.revealed) < quota:
            index = self._piece_to_reveal(session)
            if index is None:
                break
            session.revealed[index] = now
            self.reveals[index] += 1
            actions.append(Send(peer, Have(self.manifest_id, index)))
        return actions

    def _piece_to_reveal(self, session: PeerSession) -> int | None:
        told = session.bits | self.open  # open pieces were announced to every peer already
        lacking = [i for i in range(self.piece_count) if not (told >> i & 1) and i not in session.revealed]
        if self.never_served:
            # First pass: only pieces never uploaded and revealed to nobody else.
            fresh = [i for i in lacking if self.served[i] == 0 and self.reveals[i] == 0]
            return self.rng.choice(fresh) if fresh else None
        if not lacking:
            return None
        least = min(self.served[i] + self.reveals[i] for i in lacking)
        return self.rng.choice([i for i in lacking if self.served[i] + self.reveals[i] == least])


def _by_service_time(item: tuple[Hashable, PeerSession]) -> float:
    return item[1].service_time
