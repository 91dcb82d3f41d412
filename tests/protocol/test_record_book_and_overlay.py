"""The neighbour overlay's pure rules: record book (what to keep and pass on), overlay (whom to link
with), and membership judged by beats or by records."""

from __future__ import annotations

import contextlib
import math
import random

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from protocol.codec import decode, encode
from protocol.errors import LocalProtocolError, ProtocolError
from protocol.membership import RECORD_DEAD, RECORD_UNHEALTHY, Membership, MembershipConfig, PeerState
from protocol.overlay import FrameKind, NeighbourFrame, Overlay, OverlayConfig, next_beat_at
from protocol.record_book import (
    MAX_RECORDS_PER_FRAME,
    Offer,
    RecordBook,
    RecordBookConfig,
    clamp_refresh,
    refresh_interval,
)

PEERS = [f"p{i}" for i in range(6)]
NEIGHBOURS = ["n0", "n1", "n2"]


def test_refresh_grows_with_the_swarm_so_the_swarm_wide_rate_stays_bounded() -> None:
    config = RecordBookConfig(refresh_budget=2.0, min_refresh=30.0, max_refresh=1800.0)
    assert refresh_interval(0, config) == 30.0
    assert refresh_interval(9_999, config) == 1800.0  # capped: 10,000 / 2 = 5,000 s
    for n in (100, 1_000, 3_000):
        assert (n + 1) / refresh_interval(n, config) <= config.refresh_budget + 1e-9
    assert clamp_refresh(0, config) == 30.0 and clamp_refresh(86_400, config) == 1800.0


def test_offers_are_judged_before_any_signature_is_checked() -> None:
    book = RecordBook("me")
    now = 1_000_000
    assert book.consider("me", now, now) is Offer.OWN
    assert book.consider("a", now + 31_000, now) is Offer.FROM_THE_FUTURE
    assert book.consider("a", now - 10**9, now) is Offer.TOO_OLD
    assert book.consider("a", now, now) is Offer.NEW
    book.store("a", now, b"rec-a", came_from=None)
    assert book.consider("a", now, now) is Offer.KNOWN  # the same issue again: a duplicate
    assert book.consider("a", now - 1, now) is Offer.KNOWN  # an older issue: a replay
    assert book.consider("a", now + 1, now) is Offer.NEW


def test_a_new_neighbour_gets_the_whole_table_ours_first_and_never_its_own_record() -> None:
    book = RecordBook("me")
    for i, peer in enumerate(["me", "a", "b", "n0"]):
        book.store(peer, 10 + i, f"rec-{peer}".encode(), came_from=None)
    book.link_up("n0", random.Random(1))
    sent = book.take("n0", MAX_RECORDS_PER_FRAME)
    assert sent[0] == b"rec-me"
    assert sorted(sent) == [b"rec-a", b"rec-b", b"rec-me"]
    assert book.take("n0") == []


def test_a_full_book_refuses_newcomers_but_updates_known_peers() -> None:
    book = RecordBook("me", RecordBookConfig(max_records=2))
    assert book.store("a", 1, b"a1", came_from=None)
    assert book.store("b", 1, b"b1", came_from=None)
    assert not book.store("c", 1, b"c1", came_from=None)
    assert book.store("a", 2, b"a2", came_from=None)
    held = book.get("a")
    assert held is not None and held.envelope == b"a2"
    book.forget("b")
    assert book.store("c", 1, b"c1", came_from=None)


class RecordBookMachine(RuleBasedStateMachine):
    """Whatever arrives in whatever order: each neighbour is sent each peer's newest record at most once
    per issue, never the record it gave us, and the book holds the newest issue of every peer."""

    def __init__(self) -> None:
        super().__init__()
        self.book = RecordBook("me")
        self.newest: dict[str, int] = {}
        self.linked: set[str] = set()
        self.sent: dict[str, list[tuple[str, int]]] = {n: [] for n in NEIGHBOURS}
        self.gave: dict[str, set[tuple[str, int]]] = {n: set() for n in NEIGHBOURS}

    @rule(neighbour=st.sampled_from(NEIGHBOURS))
    def link(self, neighbour: str) -> None:
        if neighbour not in self.linked:
            # A new link starts from nothing: the whole table goes out once more.
            self.linked.add(neighbour)
            self.sent[neighbour], self.gave[neighbour] = [], set()
            self.book.link_up(neighbour, random.Random(0))

    @rule(neighbour=st.sampled_from(NEIGHBOURS))
    def unlink(self, neighbour: str) -> None:
        self.linked.discard(neighbour)
        self.book.link_down(neighbour)

    @rule(
        peer=st.sampled_from(PEERS), issued=st.integers(0, 20), came_from=st.sampled_from([None, *NEIGHBOURS])
    )
    def arrive(self, peer: str, issued: int, came_from: str | None) -> None:
        if self.book.consider(peer, issued, 100) is not Offer.NEW:
            assert issued <= self.newest.get(peer, -1)
            return
        assert self.book.store(peer, issued, f"{peer}:{issued}".encode(), came_from=came_from)
        self.newest[peer] = issued
        if came_from in self.linked:
            self.gave[came_from].add((peer, issued))

    @rule(neighbour=st.sampled_from(NEIGHBOURS), peer=st.sampled_from(PEERS), issued=st.integers(0, 20))
    def duplicate(self, neighbour: str, peer: str, issued: int) -> None:
        if issued <= self.newest.get(peer, -1):
            self.book.seen_from(neighbour, peer, issued)
            if neighbour in self.linked:
                self.gave[neighbour].add((peer, issued))

    @rule(neighbour=st.sampled_from(NEIGHBOURS), limit=st.integers(1, 4))
    def send(self, neighbour: str, limit: int) -> None:
        taken = self.book.take(neighbour, limit)
        assert len(taken) <= limit
        for raw in taken:
            peer, issued = raw.decode().split(":")
            entry = (peer, int(issued))
            assert entry[1] == self.newest[peer]  # only the newest issue goes out
            assert entry not in self.sent[neighbour]  # each issue at most once per neighbour
            assert entry not in self.gave[neighbour] and peer != neighbour
            self.sent[neighbour].append(entry)

    @invariant()
    def book_holds_the_newest(self) -> None:
        for peer, issued in self.newest.items():
            held = self.book.get(peer)
            assert held is not None and held.issued_ms == issued

    @rule(peer=st.sampled_from(PEERS))
    def forget(self, peer: str) -> None:
        self.book.forget(peer)
        self.newest.pop(peer, None)

    @invariant()
    def only_the_newest_bytes_of_each_held_peer_are_known_by_content(self) -> None:
        for peer in PEERS:
            for issued in range(21):
                held = self.book.holding(f"{peer}:{issued}".encode())
                if self.newest.get(peer) == issued:
                    assert held is not None and (held.peer_id, held.issued_ms) == (peer, issued)
                else:
                    assert held is None

    @invariant()
    def pending_is_bounded_by_the_table(self) -> None:
        for neighbour in NEIGHBOURS:
            assert self.book.pending_count(neighbour) <= len(PEERS)


TestRecordBook = RecordBookMachine.TestCase
TestRecordBook.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_overlay_opens_up_to_degree_accepts_up_to_max_and_remembers_refusals() -> None:
    overlay = Overlay("me", OverlayConfig(degree=2, max_degree=3))
    rng = random.Random(0)
    chosen = overlay.choose(["me", "a", "b", "c", "d"], 0.0, rng)
    assert len(chosen) == 2 and "me" not in chosen
    overlay.opening.update(chosen)
    assert overlay.wanted() == 0
    overlay.refused(chosen[0], 0.0)
    overlay.linked(chosen[1], inbound=False)
    assert overlay.wanted() == 1
    again = overlay.choose(["a", "b", "c", "d"], 1.0, rng)
    assert chosen[0] not in again and chosen[1] not in again  # refused recently / already linked
    assert chosen[0] in overlay.choose([chosen[0]], 31.0, rng)  # the refusal is forgotten after a while
    overlay.refused("gone", 40.0, answered=False)  # no answer: retried soon, then less and less often
    assert "gone" not in overlay.choose(["gone"], 41.0, rng) and "gone" in overlay.choose(["gone"], 42.0, rng)
    overlay.opening.discard("gone")
    overlay.refused("gone", 42.0, answered=False)
    assert "gone" not in overlay.choose(["gone"], 45.0, rng) and "gone" in overlay.choose(["gone"], 46.0, rng)
    overlay.opening.clear()
    overlay.links.update({"x", "y"})
    assert not overlay.accepts("z") and overlay.accepts("x") and not overlay.accepts("me")


def test_a_refused_attempt_does_not_free_the_slot_of_the_same_peers_hello_being_accepted() -> None:
    """The race CI met (9 links, maximum 8): we open to p while p's hello to us is being accepted; p
    answers our hello busy (it keeps the link it opened), and other hellos arrive before our welcome is
    out. The acceptance still holds its slot, so the others find us full."""
    overlay = Overlay("me", OverlayConfig(degree=1, max_degree=2))
    overlay.opening.add("p")
    assert overlay.accepts("p")  # p's hello: the same peer, the same slot
    overlay.accepting.add("p")
    overlay.refused("p", 0.0)  # our hello to p: busy
    assert overlay.accepts("a")
    overlay.linked("a", inbound=True)
    assert not overlay.accepts("b")
    overlay.linked("p", inbound=True)  # our welcome to p went out
    assert overlay.links == {"a", "p"}


OVERLAY_PEERS = [f"q{i}" for i in range(5)]


class OverlayMachine(RuleBasedStateMachine):
    """Drives one node's overlay the way NeighbourLinks does, with every interleaving of its own attempts,
    others' hellos and links ending: links never outnumber ``max_degree``. (CI once saw 9 links with a
    maximum of 8: our attempt to a peer was refused while that peer's own hello was being accepted, and
    the refusal freed the slot the acceptance was holding.)"""

    def __init__(self) -> None:
        super().__init__()
        self.overlay = Overlay("me", OverlayConfig(degree=2, max_degree=3))
        self.rng = random.Random(0)
        self.now = 0.0
        self.welcoming: set[str] = set()
        """Hellos we accepted whose welcome is under way (the link stands once it is sent, whatever the
        overlay's state then)."""

    @rule()
    def open_links(self) -> None:
        for peer_id in self.overlay.choose(OVERLAY_PEERS, self.now, self.rng):
            self.overlay.opening.add(peer_id)

    @rule(peer_id=st.sampled_from(OVERLAY_PEERS), welcomed=st.booleans())
    def our_attempt_answered(self, peer_id: str, welcomed: bool) -> None:
        if peer_id not in self.overlay.opening:
            return
        if welcomed and self.overlay.room_for(peer_id):
            self.overlay.linked(peer_id, inbound=False)
        else:
            self.overlay.refused(peer_id, self.now, answered=welcomed or self.rng.random() < 0.5)

    @rule(peer_id=st.sampled_from(OVERLAY_PEERS))
    def their_hello(self, peer_id: str) -> None:
        if peer_id not in self.welcoming and self.overlay.accepts(peer_id):
            self.overlay.accepting.add(peer_id)
            self.welcoming.add(peer_id)

    @rule(peer_id=st.sampled_from(OVERLAY_PEERS), sent=st.booleans())
    def our_welcome_done(self, peer_id: str, sent: bool) -> None:
        if peer_id not in self.welcoming:
            return
        self.welcoming.discard(peer_id)
        if sent:
            self.overlay.linked(peer_id, inbound=True)
        else:
            self.overlay.accepting.discard(peer_id)

    @rule()
    def everyone_says_hello(self) -> None:
        """A burst of inbound links (what fills a node in a swarm larger than its degree)."""
        for peer_id in OVERLAY_PEERS:
            if peer_id not in self.welcoming and self.overlay.accepts(peer_id):
                self.overlay.linked(peer_id, inbound=True)

    @rule(peer_id=st.sampled_from(OVERLAY_PEERS))
    def link_ends(self, peer_id: str) -> None:
        if peer_id in self.overlay.links:
            self.overlay.unlinked(peer_id)

    @rule(dt=st.floats(0, 40))
    def time_passes(self, dt: float) -> None:
        self.now += dt

    @invariant()
    def bounded(self) -> None:
        assert self.welcoming <= self.overlay.slots()  # every acceptance under way holds its slot
        assert len(self.overlay.slots()) <= self.overlay.config.max_degree
        assert len(self.overlay.links) <= self.overlay.config.max_degree


TestOverlay = OverlayMachine.TestCase
TestOverlay.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


@given(st.lists(st.binary(max_size=64), max_size=MAX_RECORDS_PER_FRAME), st.sampled_from(list(FrameKind)))
def test_neighbour_frames_round_trip(records: list[bytes], kind: FrameKind) -> None:
    frame = NeighbourFrame(kind.value, 123, tuple(records))
    assert decode(encode(frame), NeighbourFrame) == frame


@given(st.binary(max_size=512))
def test_hostile_neighbour_frames_fail_with_protocol_errors(data: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode(data, NeighbourFrame)


def test_unknown_frame_kinds_and_oversized_frames_are_refused() -> None:
    with pytest.raises(ProtocolError):
        decode(encode(NeighbourFrame("beat", 1, ())).replace(b"beat", b"evil"), NeighbourFrame)
    with pytest.raises(ProtocolError):
        encode(NeighbourFrame("beat", 1, tuple(b"x" for _ in range(MAX_RECORDS_PER_FRAME + 1))))


CONFIG = MembershipConfig(unhealthy_after=3.0, dead_after=6.0, forget_after=20.0)


def test_a_non_neighbour_ages_out_with_its_records() -> None:
    membership: Membership[str] = Membership(CONFIG)
    membership.heard_record("far", "r1", issued_at=0.0, refresh=30.0, now=1.0)
    assert membership.in_state(PeerState.HEALTHY) == ["far"]
    membership.tick(RECORD_UNHEALTHY * 30.0 - 0.1)
    assert membership.in_state(PeerState.HEALTHY) == ["far"]
    membership.tick(RECORD_UNHEALTHY * 30.0 + 0.1)
    assert membership.in_state(PeerState.UNHEALTHY) == ["far"]
    membership.heard_record("far", "r2", issued_at=80.0, refresh=30.0, now=80.5)  # a refresh: alive again
    assert membership.in_state(PeerState.HEALTHY) == ["far"]
    membership.tick(80.0 + RECORD_DEAD * 30.0)
    assert membership.in_state(PeerState.DEAD) == ["far"]
    membership.tick(80.0 + 10 * 30.0)
    assert len(membership) == 0


def test_a_killed_neighbour_dies_on_missed_beats_even_with_a_young_record() -> None:
    membership: Membership[str] = Membership(CONFIG)
    membership.heard_record("near", "r", issued_at=0.0, refresh=30.0, now=0.0)
    membership.heard("near", "r", 1.0)
    membership.tick(1.0 + CONFIG.dead_after)
    assert membership.in_state(PeerState.DEAD) == ["near"]  # the record (75 s of life) does not count


def test_a_neighbour_that_says_bye_is_judged_by_its_records_again() -> None:
    membership: Membership[str] = Membership(CONFIG)
    membership.heard_record("near", "r", issued_at=0.0, refresh=30.0, now=0.0)
    membership.heard("near", "r", 1.0)
    membership.unlinked("near", 2.0)
    membership.tick(1.0 + CONFIG.dead_after + 1)
    assert membership.in_state(PeerState.HEALTHY) == ["near"]
    # A record issued after the last beat also moves it back to record windows.
    membership.heard("near", "r", 10.0)
    membership.heard_record("near", "r2", issued_at=11.0, refresh=30.0, now=11.0)
    membership.tick(11.0 + CONFIG.dead_after + 1)
    assert membership.in_state(PeerState.HEALTHY) == ["near"]


def test_a_record_already_dead_on_arrival_adds_no_member() -> None:
    membership: Membership[str] = Membership(CONFIG)
    assert membership.heard_record("old", "r", issued_at=0.0, refresh=30.0, now=RECORD_DEAD * 30.0) == []
    assert len(membership) == 0


def test_the_overlay_says_when_the_known_peers_cannot_fill_its_links() -> None:
    overlay = Overlay("me", OverlayConfig(degree=3, max_degree=6))
    assert overlay.short_of_candidates(["a", "b"])  # wants 3, two could be linked
    assert not overlay.short_of_candidates(["a", "b", "c", "me"])
    overlay.refused("c", 0.0)
    assert overlay.short_of_candidates(["a", "b", "c"])  # c said busy: not a candidate for a while


@given(
    links=st.sets(st.sampled_from("abcdefghij"), max_size=10),
    opening=st.sets(st.sampled_from("bklm"), max_size=4),
    accepting=st.sets(st.sampled_from("bkn"), max_size=3),
)
def test_a_bootstrap_is_left_only_with_full_links_elsewhere_and_no_link_with_it_under_way(
    links: set[str], opening: set[str], accepting: set[str]
) -> None:
    """The discovery benchmark's tails at N = 64: a joiner hung up on its bootstrap while their link was
    being accepted or asked again, and each side judged the other dead by its last beat."""
    overlay = Overlay("me", OverlayConfig(degree=4, max_degree=16))
    overlay.links, overlay.opening, overlay.accepting = set(links), set(opening), set(accepting)
    bootstrap = "b"
    assert overlay.may_leave(bootstrap) == (
        bootstrap not in links | opening | accepting and len(links) >= overlay.config.degree
    )


def test_a_bootstrap_being_linked_again_is_not_left() -> None:
    overlay = Overlay("me", OverlayConfig(degree=2, max_degree=4))
    overlay.links.update({"x", "y"})
    assert overlay.may_leave("b")
    overlay.opening.add("b")  # our re-ask after the link to it was lost
    assert not overlay.may_leave("b")
    overlay.refused("b", 0.0)
    overlay.accepting.add("b")  # its own hello, welcome on the way
    assert not overlay.may_leave("b")
    overlay.linked("b", inbound=True)
    assert not overlay.may_leave("b")
    overlay.unlinked("b")
    overlay.unlinked("y")
    assert not overlay.may_leave("b")  # one link left: the bootstrap may still be needed


@given(
    now=st.floats(0, 1e7, allow_nan=False),
    interval=st.floats(0.01, 600, allow_nan=False),
    later=st.floats(0, 1e4, allow_nan=False),
)
@example(now=278810.0, interval=352.92225039890974, later=352.0)  # a grid point one ulp off (a CI-sized run)
def test_links_beat_on_one_grid(now: float, interval: float, later: float) -> None:
    """The next beat is after ``now``, at most one interval away, on a multiple of the interval; so two
    links of a node that sent at different moments beat together from then on."""
    due = next_beat_at(now, interval)
    assert now < due <= now + interval * (1 + 1e-9)
    assert math.isclose(due / interval, round(due / interval), abs_tol=1e-6)
    other = next_beat_at(now + later % interval, interval)  # a link that beat later in the same interval
    assert other in (due, next_beat_at(due, interval))
    assert next_beat_at(due, interval) > due  # a beat sent on a grid point is due a whole interval later


def test_a_beat_sent_early_keeps_its_link_on_the_grid() -> None:
    assert next_beat_at(10.0, 2.0) == 12.0  # sent on the grid: one interval later
    assert next_beat_at(10.7, 2.0) == 12.0  # sent early for urgent records: back on the grid
    assert next_beat_at(11.999, 2.0) == 12.0
    grid_point = 53 * 87.6485700942941  # divides back to just under 53: still due one interval later
    assert math.isclose(next_beat_at(grid_point, 87.6485700942941), 54 * 87.6485700942941)
    with pytest.raises(LocalProtocolError):
        next_beat_at(1.0, 0.0)
