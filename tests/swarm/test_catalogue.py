"""The checkpoint catalogue (protocol/swarm/catalogue.py): a hypothesis state machine over every event,
checking the invariants after each step, plus unit tests of the rules one at a time."""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from protocol.errors import LocalProtocolError
from protocol.swarm.catalogue import (
    MANIFEST_TIMEOUT,
    MAX_OFFERED_FOLLOWS_PER_PEER,
    MAX_OFFERS_PER_PEER,
    MAX_PENDING_FOLLOWS,
    OFFERED_FOLLOW_TIMEOUT,
    AskManifest,
    Catalogue,
    CatalogueAction,
    CloseSession,
    Drop,
    GiveUp,
    OpenSession,
    SendManifest,
    SendOffer,
    StartFetch,
)
from protocol.swarm.retention import retained_with_deltas

PEERS = st.sampled_from(["a", "b", "c", "d"])
MIDS = st.integers(0, 11).map(lambda i: bytes([i]) * 32)
STEPS = st.integers(0, 6)


def mid_of(i: int) -> bytes:
    return bytes([i]) * 32


class CatalogueMachine(RuleBasedStateMachine):
    """Drives a Catalogue the way the swarm service does and keeps a model of what must hold."""

    @initialize(keep=st.integers(1, 3), follow=st.booleans())
    def start(self, keep: int, follow: bool) -> None:
        self.catalogue: Catalogue[str] = Catalogue(keep=keep, follow=follow)
        self.now = 0.0
        self.up: set[str] = set()
        self.offered_to: set[tuple[str, bytes]] = set()  # our Offer sent while the peer is up
        self.offered_by: set[tuple[str, bytes]] = set()  # its Offer received while up
        self.verified: set[bytes] = set()  # manifests the "service" checked
        self.to_start: set[bytes] = set()  # StartFetch received, not yet carried out
        self.steps: dict[bytes, int] = {}
        self.recent: dict[str, list[bytes]] = {}  # per peer, its newest offers of versions not held
        self.dropped: list[Drop] = []
        self.may_offer_again: set[tuple[str, bytes]] = set()
        self.offered_again: set[tuple[str, bytes]] = set()

    # --- carrying out actions, checking each against the model -----------------------------------------

    def run(self, actions: list[CatalogueAction[str]]) -> None:
        for action in actions:
            if isinstance(action, SendOffer | AskManifest | SendManifest | OpenSession):
                assert action.peer in self.up, action
            if isinstance(action, SendOffer):
                key = (action.peer, action.manifest_id)
                if key in self.may_offer_again:  # its first offer came after ours: once more
                    self.may_offer_again.discard(key)
                    self.offered_again.add(key)
                    continue
                assert key not in self.offered_to, "offered twice on one connection"
                assert action.manifest_id in self.catalogue.versions
                self.offered_to.add(key)
            elif isinstance(action, OpenSession):
                key = (action.peer, action.manifest_id)
                assert key in self.offered_to and key in self.offered_by, "session before both offered"
            elif isinstance(action, SendManifest):
                assert action.manifest_id in self.catalogue.versions
            elif isinstance(action, StartFetch):
                assert action.manifest_id in self.verified, "followed a manifest nobody checked"
                assert self.catalogue.follow
                assert action.manifest_id not in self.catalogue.versions
                self.to_start.add(action.manifest_id)
            elif isinstance(action, Drop):
                assert action.manifest_id not in self.catalogue.versions
                self.dropped.append(action)
                self.forget_version(action.manifest_id)
            elif isinstance(action, GiveUp):
                assert action.manifest_id not in self.catalogue.pending
            elif isinstance(action, CloseSession):
                pass

    def forget_version(self, mid: bytes) -> None:
        self.offered_to = {k for k in self.offered_to if k[1] != mid}
        self.offered_by = {k for k in self.offered_by if k[1] != mid}

    # --- events ---------------------------------------------------------------------------------------

    @rule(peer=PEERS)
    def peer_up(self, peer: str) -> None:
        if peer in self.up:
            return
        self.up.add(peer)
        self.run(self.catalogue.peer_up(peer, self.now))

    @precondition(lambda self: self.up)
    @rule(data=st.data())
    def peer_down(self, data: st.DataObject) -> None:
        peer = data.draw(st.sampled_from(sorted(self.up)))
        self.up.discard(peer)
        self.recent.pop(peer, None)
        self.offered_to = {k for k in self.offered_to if k[0] != peer}
        self.offered_by = {k for k in self.offered_by if k[0] != peer}
        actions = self.catalogue.peer_down(peer)
        assert {a.manifest_id for a in actions if isinstance(a, CloseSession)} == set(self.catalogue.versions)
        self.run(actions)

    @precondition(lambda self: self.up)
    @rule(data=st.data(), mid=MIDS, step=STEPS, have_manifest=st.booleans())
    def offer(self, data: st.DataObject, mid: bytes, step: int, have_manifest: bool) -> None:
        peer = data.draw(st.sampled_from(sorted(self.up)))
        if have_manifest:
            self.verified.add(mid)
        self.their_offer(peer, mid)
        follow = self.catalogue.follow
        self.remember_offer(peer, mid)
        actions = self.catalogue.offer_received(peer, mid, step, self.now, have_manifest=have_manifest)
        if not follow:
            assert not any(isinstance(a, StartFetch) for a in actions)
        if mid not in self.catalogue.following:  # an offered follow asks only the peers that offered it
            holders = set(self.catalogue.offers.get(mid, {}))
            for action in actions:
                if isinstance(action, AskManifest) and action.manifest_id != mid:
                    assert self.catalogue.pending[action.manifest_id].offered_by is None
            assert all(
                a.peer in holders for a in actions if isinstance(a, AskManifest) and a.manifest_id == mid
            )
        self.run(actions)
        assert not self.may_offer_again, "a holder must offer again after a peer's first later offer"

    @precondition(lambda self: self.up)
    @rule(data=st.data(), count=st.integers(1, 300), first=st.integers(0, 10_000))
    def offer_flood(self, data: st.DataObject, count: int, first: int) -> None:
        """A hostile peer offers many made-up ids with high steps."""
        peer = data.draw(st.sampled_from(sorted(self.up)))
        for i in range(first, first + count):
            mid = (1 << 200 | i).to_bytes(32, "big")
            self.their_offer(peer, mid)  # (a flooded id this node followed may be held by now)
            self.remember_offer(peer, mid)
            self.run(self.catalogue.offer_received(peer, mid, 1000 + i, self.now, have_manifest=False))
            assert not self.may_offer_again

    def their_offer(self, peer: str, mid: bytes) -> None:
        """The model's side of receiving ``peer``'s offer of ``mid``."""
        if mid not in self.catalogue.versions:
            return
        key = (peer, mid)
        if key in self.offered_to and key not in self.offered_by:
            self.may_offer_again.add(key)
        self.offered_by.add(key)

    def remember_offer(self, peer: str, mid: bytes) -> None:
        if mid in self.catalogue.versions:
            return
        recent = self.recent.setdefault(peer, [])
        if mid in recent:
            recent.remove(mid)
        recent.append(mid)
        del recent[:-MAX_OFFERS_PER_PEER]

    @precondition(lambda self: self.up)
    @rule(data=st.data(), mid=MIDS)
    def manifest_requested(self, data: st.DataObject, mid: bytes) -> None:
        peer = data.draw(st.sampled_from(sorted(self.up)))
        actions = self.catalogue.manifest_requested(peer, mid)
        assert bool(actions) == (mid in self.catalogue.versions)
        self.run(actions)

    @rule(mid=MIDS, step=STEPS, have_manifest=st.booleans())
    def announce(self, mid: bytes, step: int, have_manifest: bool) -> None:
        if have_manifest:
            self.verified.add(mid)
        self.run(self.catalogue.heard_of(mid, step, self.now, have_manifest=have_manifest))

    @rule(mid=MIDS)
    def fetch_by_id(self, mid: bytes) -> None:
        self.run(self.catalogue.request_manifest(mid, self.now, patient=True))
        assert self.catalogue.pending[mid].asked == self.up

    @precondition(lambda self: any(p.patient for p in self.catalogue.pending.values()))
    @rule(data=st.data())
    def fetch_cancelled(self, data: st.DataObject) -> None:
        mid = data.draw(st.sampled_from(sorted(m for m, p in self.catalogue.pending.items() if p.patient)))
        self.catalogue.release_manifest(mid)

    @precondition(lambda self: self.catalogue.pending)
    @rule(data=st.data(), good=st.booleans())
    def manifest_arrives(self, data: st.DataObject, good: bool) -> None:
        mid = data.draw(st.sampled_from(sorted(self.catalogue.pending)))
        if good:
            self.verified.add(mid)
            self.run(self.catalogue.manifest_verified(mid))
        else:
            self.catalogue.manifest_refused(mid)
            assert mid not in self.catalogue.following
        assert mid not in self.catalogue.pending

    @precondition(lambda self: self.to_start)
    @rule(data=st.data(), starts=st.booleans(), step=STEPS)
    def carry_out_fetch(self, data: st.DataObject, starts: bool, step: int) -> None:
        mid = data.draw(st.sampled_from(sorted(self.to_start)))
        self.to_start.discard(mid)
        if starts and mid not in self.catalogue.versions:
            self.add(mid, step, complete=False)
        else:
            self.catalogue.follow_ended(mid)

    @rule(mid=MIDS, step=STEPS, complete=st.booleans())
    def share_or_fetch(self, mid: bytes, step: int, complete: bool) -> None:
        if mid in self.catalogue.versions:
            with pytest.raises(LocalProtocolError):
                self.catalogue.add_version(mid, step, complete=complete)
            return
        self.add(mid, step, complete=complete)

    @rule(mid=MIDS, step=STEPS, complete=st.booleans(), base=MIDS, produces=MIDS)
    def hold_delta(self, mid: bytes, step: int, complete: bool, base: bytes, produces: bytes) -> None:
        """A delta version from ``base`` to ``produces`` (``target`` names a hypothesis rule target)."""
        target = produces
        if mid in self.catalogue.versions or base == target:
            with pytest.raises(LocalProtocolError):
                self.catalogue.add_version(mid, step, complete=complete, base=base, target=target)
            return
        self.add(mid, step, complete=complete, base=base, target=target)

    def add(self, mid: bytes, step: int, *, complete: bool, base: bytes = b"", target: bytes = b"") -> None:
        for recent in self.recent.values():
            if mid in recent:
                recent.remove(mid)
        for peer, step_offered in self.catalogue.offers.get(mid, {}).items():
            assert peer in self.up and step_offered >= 0
            self.offered_by.add((peer, mid))
        self.steps[mid] = step
        self.run(self.catalogue.add_version(mid, step, complete=complete, base=base, target=target))
        assert mid not in self.catalogue.following
        assert {p for p, m in self.offered_to if m == mid} == self.up

    @precondition(lambda self: any(not e.complete for e in self.catalogue.versions.values()))
    @rule(data=st.data())
    def completes(self, data: st.DataObject) -> None:
        mid = data.draw(
            st.sampled_from(sorted(m for m, e in self.catalogue.versions.items() if not e.complete))
        )
        before = self.snapshot()
        before[mid] = (before[mid][0], True, *before[mid][2:])
        self.run(self.catalogue.version_complete(mid))
        self.check_retained(before)

    @precondition(lambda self: self.catalogue.versions)
    @rule(data=st.data())
    def fetch_fails(self, data: st.DataObject) -> None:
        mid = data.draw(st.sampled_from(sorted(self.catalogue.versions)))
        self.catalogue.remove_version(mid)
        self.forget_version(mid)

    @rule()
    def retain(self) -> None:
        before = self.snapshot()
        self.run(self.catalogue.retain())
        self.check_retained(before)

    @rule(seconds=st.sampled_from([0.5, 5.0, MANIFEST_TIMEOUT / 2, MANIFEST_TIMEOUT]))
    def tick(self, seconds: float) -> None:
        self.now += seconds
        self.run(self.catalogue.tick(self.now))
        for pending in self.catalogue.pending.values():  # answered, or expired
            if pending.offered:  # a fixed deadline that nothing a peer says extends
                assert self.now < pending.deadline <= self.now + OFFERED_FOLLOW_TIMEOUT
            else:
                assert pending.patient or self.now - pending.last_asked < MANIFEST_TIMEOUT

    @rule(keep=st.integers(1, 3), follow=st.booleans())
    def settings_change(self, keep: int, follow: bool) -> None:
        self.catalogue.keep = keep
        self.catalogue.follow = follow

    def snapshot(self) -> dict[bytes, tuple[int, bool, bytes, bytes]]:
        self.dropped = []
        return {m: (e.step, e.complete, e.base, e.target) for m, e in self.catalogue.versions.items()}

    def check_retained(self, before: dict[bytes, tuple[int, bool, bytes, bytes]]) -> None:
        """What retention keeps, stated property by property (protocol/swarm/retention.py)."""
        versions = self.catalogue.versions
        keep = self.catalogue.keep
        dropped = {d.manifest_id for d in self.dropped}
        assert dropped == set(before) - set(versions)
        assert all(before[mid][1] for mid in dropped), "dropped a version still being fetched"
        full_steps = sorted({s for s, done, base, _ in before.values() if done and not base}, reverse=True)
        newest = set(full_steps[:keep])
        floor = min(newest) if len(newest) == keep else -1
        held_fulls = {m for m, e in versions.items() if e.complete and not e.base}
        fulls_before = {m for m, (_, done, base, _) in before.items() if done and not base}
        for mid in dropped:
            step, _, base, target = before[mid]
            if not base:
                assert step not in newest, "dropped one of the newest full steps"
            else:
                assert target not in held_fulls, "dropped a delta whose target is kept"
                assert target in fulls_before or step < floor, "dropped a delta still to be applied"
        pending = [e for e in versions.values() if e.base and e.target not in held_fulls]
        for entry in pending:  # a delta still to be applied keeps the base it needs
            if entry.base in fulls_before and entry.step >= floor:
                assert entry.base in versions, "dropped the base of a delta still to be applied"
        unpinned = {e.step for m, e in versions.items() if m in held_fulls} - {
            versions[e.base].step for e in pending if e.base in versions
        }
        assert len(unpinned) <= keep

    # --- invariants -----------------------------------------------------------------------------------

    @invariant()
    def offers_are_bounded_and_of_versions_not_held(self) -> None:
        catalogue = self.catalogue
        assert not set(catalogue.offers) & set(catalogue.versions)
        for holders in catalogue.offers.values():
            assert holders and set(holders) <= self.up
        for peer in self.up:
            assert sum(peer in holders for holders in catalogue.offers.values()) <= MAX_OFFERS_PER_PEER

    @invariant()
    def no_peer_pushes_out_what_another_offered(self) -> None:
        for peer, recent in self.recent.items():
            for mid in recent:
                assert peer in self.catalogue.offers.get(mid, {}), "an offer was forgotten"

    @invariant()
    def bookkeeping_matches_the_connections(self) -> None:
        assert set(self.catalogue.peers) == self.up
        for entry in self.catalogue.versions.values():
            assert entry.offered_to <= self.up
            assert entry.offered_by <= self.up
            assert {p for p, m in self.offered_to if m == entry.manifest_id} == entry.offered_to

    @invariant()
    def pending_manifests_are_bounded_and_waited_for(self) -> None:
        follows = 0
        offered: dict[str, int] = {}
        for mid, pending in self.catalogue.pending.items():
            assert pending.asked <= self.up
            assert pending.patient >= 0
            if pending.offered:
                assert pending.offered_by is not None
                offered[pending.offered_by] = offered.get(pending.offered_by, 0) + 1
            elif not pending.patient:
                follows += 1
            if not pending.patient:
                assert mid in self.catalogue.following, "a manifest request nobody waits for"
        assert follows <= MAX_PENDING_FOLLOWS
        assert all(count <= MAX_OFFERED_FOLLOWS_PER_PEER for count in offered.values())

    @invariant()
    def following_only_what_is_not_held(self) -> None:
        assert not self.catalogue.following & set(self.catalogue.versions)


TestCatalogueMachine = CatalogueMachine.TestCase
TestCatalogueMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


# --- the rules one at a time ---------------------------------------------------------------------------


def test_a_session_opens_once_both_sides_offered_in_either_order() -> None:
    catalogue: Catalogue[str] = Catalogue(keep=2, follow=False)
    mid = mid_of(1)
    assert catalogue.peer_up("a", 0.0) == []
    assert catalogue.add_version(mid, 3, complete=True) == [SendOffer("a", mid, 3)]
    # Its first offer after ours: offered once more (it may have forgotten ours), and the session opens.
    assert catalogue.offer_received("a", mid, 3, 0.0, have_manifest=True) == [
        SendOffer("a", mid, 3),
        OpenSession("a", mid),
    ]
    assert catalogue.offer_received("a", mid, 3, 0.0, have_manifest=True) == [OpenSession("a", mid)]
    # The other order: the peer offers before we hold the version.
    other = mid_of(2)
    assert catalogue.offer_received("a", other, 4, 0.0, have_manifest=False) == []
    assert catalogue.offers[other] == {"a": 4}
    assert catalogue.add_version(other, 4, complete=False) == [
        SendOffer("a", other, 4),
        OpenSession("a", other),
    ]
    assert other not in catalogue.offers
    # A new neighbour gets an offer of each version; its own offer then opens the session.
    assert catalogue.peer_up("b", 1.0) == [SendOffer("b", mid, 3), SendOffer("b", other, 4)]
    assert catalogue.offer_received("b", other, 4, 1.0, have_manifest=True) == [
        SendOffer("b", other, 4),
        OpenSession("b", other),
    ]
    assert catalogue.peer_down("b") == [CloseSession("b", mid), CloseSession("b", other)]


def test_offers_of_unknown_versions_are_bounded_per_peer_oldest_forgotten_first() -> None:
    catalogue: Catalogue[str] = Catalogue(keep=1, follow=False)
    catalogue.peer_up("a", 0.0)
    for i in range(MAX_OFFERS_PER_PEER + 10):
        catalogue.offer_received("a", i.to_bytes(32, "big"), i, 0.0, have_manifest=False)
    assert len(catalogue.offers) == MAX_OFFERS_PER_PEER
    assert (0).to_bytes(32, "big") not in catalogue.offers
    assert (MAX_OFFERS_PER_PEER + 9).to_bytes(32, "big") in catalogue.offers


def test_a_flood_of_made_up_offers_does_not_push_out_an_honest_offer() -> None:
    """Issue 13: 6,000 offers of random ids evicted the honest holder's offer, so a later fetch of that
    version never opened its session with the holder and hung."""
    catalogue: Catalogue[str] = Catalogue(keep=2, follow=False)
    real = mid_of(7)
    catalogue.peer_up("honest", 0.0)
    catalogue.peer_up("attacker", 0.0)
    catalogue.offer_received("honest", real, 3, 0.0, have_manifest=False)
    for i in range(6000):
        catalogue.offer_received(
            "attacker", (1 << 200 | i).to_bytes(32, "big"), 10**6, 0.0, have_manifest=False
        )
    assert len(catalogue.offers) == 1 + MAX_OFFERS_PER_PEER
    actions = catalogue.add_version(real, 3, complete=False)
    assert OpenSession("honest", real) in actions


def test_offered_follows_ask_the_offerers_are_bounded_per_peer_and_expire_at_a_fixed_deadline() -> None:
    """Issue 13: waits for made-up ids never expired (each re-offer and each new link restarted their
    clock) and filled the follow slots, so the trainer's next version was not followed."""
    catalogue: Catalogue[str] = Catalogue(keep=2, follow=True)
    catalogue.peer_up("attacker", 0.0)
    catalogue.peer_up("honest", 0.0)
    fake = [(1 << 200 | i).to_bytes(32, "big") for i in range(MAX_PENDING_FOLLOWS + 8)]
    for now in (0.0, 10.0, 20.0):  # the attacker keeps offering its ids, and a new peer connects
        for mid in fake:
            actions = catalogue.offer_received("attacker", mid, 10**6, now, have_manifest=False)
            assert all(a == AskManifest("attacker", mid) for a in actions)
        assert catalogue.peer_up(f"new{now}", now) == []
    offered = [m for m, p in catalogue.pending.items() if p.offered_by == "attacker"]
    assert len(offered) == MAX_OFFERED_FOLLOWS_PER_PEER
    # The honest neighbour's offer is still followed, asked of it alone.
    real = mid_of(9)
    assert catalogue.offer_received("honest", real, 4, 25.0, have_manifest=False) == [
        AskManifest("honest", real)
    ]
    # The trainer announces another version: every neighbour is asked.
    announced = mid_of(10)
    asked = catalogue.heard_of(announced, 5, 25.0, have_manifest=False)
    assert {a.peer for a in asked if isinstance(a, AskManifest)} == set(catalogue.peers)
    gave_up = catalogue.tick(OFFERED_FOLLOW_TIMEOUT)
    assert {a.manifest_id for a in gave_up if isinstance(a, GiveUp)} == set(offered)
    assert real in catalogue.pending and announced in catalogue.pending
    assert catalogue.manifest_verified(real) == [StartFetch(real)]


def test_following_asks_every_neighbour_then_fetches_the_checked_manifest() -> None:
    catalogue: Catalogue[str] = Catalogue(keep=2, follow=True)
    catalogue.peer_up("a", 0.0)
    mid = mid_of(5)
    assert catalogue.heard_of(mid, 9, 0.0, have_manifest=False) == [AskManifest("a", mid)]
    assert catalogue.peer_up("b", 1.0) == [AskManifest("b", mid)]
    assert catalogue.manifest_verified(mid) == [StartFetch(mid)]
    assert catalogue.pending == {}
    catalogue.add_version(mid, 9, complete=False)
    assert catalogue.following == set()
    # An announcement whose manifest is already checked starts the fetch at once.
    assert catalogue.heard_of(mid_of(6), 10, 1.0, have_manifest=True) == [StartFetch(mid_of(6))]


def test_no_following_when_disabled_or_when_keep_newer_versions_are_held() -> None:
    catalogue: Catalogue[str] = Catalogue(keep=2, follow=False)
    catalogue.peer_up("a", 0.0)
    assert catalogue.heard_of(mid_of(1), 5, 0.0, have_manifest=True) == []
    catalogue.follow = True
    catalogue.add_version(mid_of(2), 6, complete=True)
    catalogue.add_version(mid_of(3), 7, complete=False)
    assert catalogue.heard_of(mid_of(1), 5, 0.0, have_manifest=True) == []  # older than the two held
    assert catalogue.heard_of(mid_of(1), 8, 0.0, have_manifest=True) == [StartFetch(mid_of(1))]
    assert catalogue.heard_of(mid_of(1), 8, 0.0, have_manifest=True) == []  # already following


def test_a_followed_manifest_nobody_sends_expires_but_a_patient_request_waits() -> None:
    catalogue: Catalogue[str] = Catalogue(keep=2, follow=True)
    catalogue.peer_up("a", 0.0)
    followed, fetched = mid_of(1), mid_of(2)
    catalogue.heard_of(followed, 3, 0.0, have_manifest=False)
    catalogue.request_manifest(fetched, 0.0, patient=True)
    assert catalogue.tick(MANIFEST_TIMEOUT - 1) == []
    catalogue.peer_up("b", MANIFEST_TIMEOUT - 1)  # a new peer to ask: the clock restarts
    assert catalogue.tick(MANIFEST_TIMEOUT + 1) == []
    assert catalogue.tick(2 * MANIFEST_TIMEOUT) == [GiveUp(followed)]
    assert followed not in catalogue.following and followed not in catalogue.pending
    assert fetched in catalogue.pending
    catalogue.release_manifest(fetched)
    assert fetched not in catalogue.pending


def test_follow_requests_are_bounded() -> None:
    catalogue: Catalogue[str] = Catalogue(keep=1, follow=True)
    catalogue.peer_up("a", 0.0)
    for i in range(MAX_PENDING_FOLLOWS + 5):
        catalogue.heard_of(i.to_bytes(32, "big"), 100 + i, 0.0, have_manifest=False)
    assert len(catalogue.pending) == MAX_PENDING_FOLLOWS
    # A checked manifest needs no request, so the bound does not stop the trainer's own announcements.
    assert catalogue.heard_of(mid_of(255), 1000, 0.0, have_manifest=True) == [StartFetch(mid_of(255))]


def test_retention_keeps_the_newest_keep_complete_steps() -> None:
    catalogue: Catalogue[str] = Catalogue(keep=2, follow=False)
    for step in (1, 2, 3):
        catalogue.add_version(mid_of(step), step, complete=True)
    catalogue.add_version(mid_of(9), 9, complete=False)  # fetching: not counted
    assert catalogue.retain() == [Drop(mid_of(1), 1)]
    assert catalogue.version_complete(mid_of(9)) == [Drop(mid_of(2), 2)]
    assert sorted(catalogue.versions) == [mid_of(3), mid_of(9)]


def test_retention_keeps_the_deltas_to_kept_versions_and_the_bases_of_deltas_to_apply() -> None:
    catalogue: Catalogue[str] = Catalogue(keep=1, follow=True)
    full = {step: mid_of(step) for step in (1, 2, 3)}
    delta = {step: mid_of(10 + step) for step in (2, 3)}
    catalogue.add_version(full[1], 1, complete=True)
    catalogue.add_version(full[2], 2, complete=True)
    catalogue.add_version(delta[2], 2, complete=True, base=full[1], target=full[2])
    assert catalogue.retain() == [Drop(full[1], 1)]  # the delta to step 2 is kept with its target
    # Delta 3 is fetched: step 2 is its base, so it stays even once another step would push it out.
    catalogue.add_version(delta[3], 3, complete=False, base=full[2], target=full[3])
    assert catalogue.version_complete(delta[3]) == []
    catalogue.add_version(mid_of(7), 7, complete=True)  # a newer full step arrives meanwhile
    assert set(catalogue.retain()) == {Drop(full[2], 2), Drop(delta[2], 2), Drop(delta[3], 3)}
    # ... but a delta older than every kept step pins nothing: step 2 and both deltas went.
    assert sorted(catalogue.versions) == [mid_of(7)]


def test_a_delta_still_to_apply_pins_its_base_until_its_target_is_held() -> None:
    catalogue: Catalogue[str] = Catalogue(keep=1, follow=True)
    base, target, delta = mid_of(1), mid_of(2), mid_of(3)
    catalogue.add_version(base, 1, complete=True)
    catalogue.add_version(delta, 2, complete=True, base=base, target=target)
    catalogue.add_version(mid_of(4), 1, complete=True)  # another full version of the base's step
    assert catalogue.retain() == []
    actions = catalogue.add_version(target, 2, complete=True)
    assert actions == []
    assert set(catalogue.retain()) == {Drop(base, 1), Drop(mid_of(4), 1)}
    assert sorted(catalogue.versions) == [target, delta]
    with pytest.raises(LocalProtocolError):
        catalogue.add_version(mid_of(9), 3, complete=False, base=target, target=target)


def test_invariants_raise_protocol_errors() -> None:
    with pytest.raises(LocalProtocolError):
        Catalogue[str](keep=0, follow=True)
    catalogue: Catalogue[str] = Catalogue(keep=1, follow=True)
    catalogue.add_version(mid_of(1), 1, complete=False)
    with pytest.raises(LocalProtocolError):
        catalogue.add_version(mid_of(1), 1, complete=False)
    with pytest.raises(LocalProtocolError):
        catalogue.version_complete(mid_of(2))
    with pytest.raises(LocalProtocolError):
        retained_with_deltas([], keep=0)


@dataclass(frozen=True)
class Held:
    """A version as the retention rule sees it (``base``/``target`` empty for a full version)."""

    step: int
    manifest_id: bytes
    base: bytes = b""
    target: bytes = b""
    complete: bool = True


def test_the_retention_rule_keeps_whole_steps() -> None:
    versions = [Held(5, b"5"), Held(4, b"4a"), Held(4, b"4b"), Held(3, b"3")]
    assert [v.step for v in retained_with_deltas(versions, keep=2)] == [3]
    assert retained_with_deltas(versions, keep=3) == []


def test_the_retention_rule_keeps_the_deltas_of_kept_steps_and_their_bases() -> None:
    full = {s: Held(s, bytes([s]) * 32) for s in (1, 2, 3)}
    delta3 = Held(3, b"\x33" * 32, full[2].manifest_id, full[3].manifest_id)
    delta2 = Held(2, b"\x22" * 32, full[1].manifest_id, full[2].manifest_id)
    versions = [*full.values(), delta2, delta3]
    assert retained_with_deltas(versions, keep=1) == [full[1], full[2], delta2]
    # A delta whose target is not stored yet is still to be applied: its base stays.
    pending = Held(4, b"\x44" * 32, full[3].manifest_id, b"\x04" * 32)
    assert retained_with_deltas([*full.values(), pending], keep=1) == [full[1], full[2]]
