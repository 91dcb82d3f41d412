"""The checkpoint catalogue of one node: which versions it holds and who else holds what, sans-IO.

One data-plane connection carries every version two peers share (protocol/swarm/messages.py). A
version's session between two peers starts once each has sent the other an ``Offer`` for it; a peer
that lacks a manifest asks for it with ``ManifestRequest``. This machine keeps that bookkeeping and the
policy around it, and nothing else:

- the versions held (fetching or complete) and their steps, and to/from whom each was offered;
- offers of versions we do not hold, at most ``MAX_OFFERS_PER_PEER`` ids per peer (its oldest forgotten
  first), so a peer offering made-up ids never pushes out what honest neighbours offered (the session of
  a version we later fetch opens with the peers in this table). A holder that offered more versions than
  that hears our offer once we fetch one it offered, and offers it once more, so the session opens even
  though we forgot its first offer;
- the manifests we wait for and whom we asked. A follow the trainer announced asks every neighbour and
  expires after ``MANIFEST_TIMEOUT`` seconds without a new peer to ask (at most ``MAX_PENDING_FOLLOWS``).
  A follow only a peer's offer names is unverified: it asks only the peers that offered it, each peer
  starts at most ``MAX_OFFERED_FOLLOWS_PER_PEER``, and it expires ``OFFERED_FOLLOW_TIMEOUT`` seconds
  after it began whatever anyone says later, so made-up ids cost a bounded wait and crowd out nobody;
- following: fetch on our own every version we hear of, unless we already hold ``keep`` newer ones;
- retention: keep the newest ``keep`` complete full steps, the deltas whose target is kept, and every base
  a delta still to be applied needs (the one rule, protocol/swarm/retention.py). A version is a delta when
  ``add_version`` names its ``base`` and ``target`` manifest ids.

The caller owns connections, transfers, disk, signature checks and time. It reports events and carries
out the returned actions in order:

- ``SendOffer(peer, manifest_id, step)``: send an ``Offer``.
- ``AskManifest(peer, manifest_id)``: send a ``ManifestRequest``.
- ``SendManifest(peer, manifest_id)``: answer a ``ManifestRequest`` with the signed manifest.
- ``OpenSession(peer, manifest_id)`` / ``CloseSession(peer, manifest_id)``: tell that version's transfer
  the peer connected / left.
- ``StartFetch(manifest_id)``: fetch a followed version whose manifest is in hand; the caller checks its
  trainer signature and run first, and reports ``follow_ended`` if it does not start.
- ``Drop(manifest_id, step)``: retention dropped this version (already forgotten here).
- ``GiveUp(manifest_id)``: a followed manifest never came; it is forgotten.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from protocol.errors import LocalProtocolError
from protocol.swarm.retention import retained_with_deltas

MAX_OFFERS_PER_PEER = 16
MANIFEST_TIMEOUT = 60.0
MAX_PENDING_FOLLOWS = 32
MAX_OFFERED_FOLLOWS_PER_PEER = 4
OFFERED_FOLLOW_TIMEOUT = 30.0

P = TypeVar("P", bound=Hashable)


@dataclass(frozen=True, slots=True)
class SendOffer(Generic[P]):
    peer: P
    manifest_id: bytes
    step: int


@dataclass(frozen=True, slots=True)
class AskManifest(Generic[P]):
    peer: P
    manifest_id: bytes


@dataclass(frozen=True, slots=True)
class SendManifest(Generic[P]):
    peer: P
    manifest_id: bytes


@dataclass(frozen=True, slots=True)
class OpenSession(Generic[P]):
    peer: P
    manifest_id: bytes


@dataclass(frozen=True, slots=True)
class CloseSession(Generic[P]):
    peer: P
    manifest_id: bytes


@dataclass(frozen=True, slots=True)
class StartFetch:
    manifest_id: bytes


@dataclass(frozen=True, slots=True)
class Drop:
    manifest_id: bytes
    step: int


@dataclass(frozen=True, slots=True)
class GiveUp:
    manifest_id: bytes


CatalogueAction = (
    SendOffer[P]
    | AskManifest[P]
    | SendManifest[P]
    | OpenSession[P]
    | CloseSession[P]
    | StartFetch
    | Drop
    | GiveUp
)


@dataclass
class HeldEntry(Generic[P]):
    """A version this node holds or fetches."""

    manifest_id: bytes
    step: int
    complete: bool
    base: bytes = b""
    """For a delta, the full version it applies to (empty: a full version)."""
    target: bytes = b""
    """For a delta, the full version it produces."""
    offered_to: set[P] = field(default_factory=set)
    offered_by: set[P] = field(default_factory=set)


@dataclass
class PendingManifest(Generic[P]):
    """A manifest asked of peers. ``patient``: callers waiting with no deadline of ours (0: a follow).
    ``offered_by``: the peer whose unverified offer started this follow (None: the trainer announced it,
    or a caller asked); such a follow ends at ``deadline``."""

    asked: set[P] = field(default_factory=set)
    patient: int = 0
    last_asked: float = 0.0
    offered_by: P | None = None
    deadline: float = 0.0

    @property
    def offered(self) -> bool:
        return self.offered_by is not None and self.patient == 0


class Catalogue(Generic[P]):
    """See the module doc. ``follow``: fetch versions heard of (only when the run's trainer is known)."""

    def __init__(self, *, keep: int, follow: bool) -> None:
        self.keep = keep
        self.follow = follow
        self.peers: dict[P, None] = {}
        self.versions: dict[bytes, HeldEntry[P]] = {}
        self.offers: dict[bytes, dict[P, int]] = {}
        self.offered_ids: dict[P, dict[bytes, None]] = {}
        """Per peer, the ids in ``offers`` it offered, oldest first (bounded by MAX_OFFERS_PER_PEER)."""
        self.pending: dict[bytes, PendingManifest[P]] = {}
        self.following: set[bytes] = set()

    @property
    def keep(self) -> int:
        return self._keep

    @keep.setter
    def keep(self, keep: int) -> None:
        if keep < 1:
            raise LocalProtocolError("keep must be at least 1", reason="bad_keep")
        self._keep = keep

    # --- connections ------------------------------------------------------------------------------------

    def peer_up(self, peer: P, now: float) -> list[CatalogueAction[P]]:
        """Offer every version to a new neighbour and ask it for every manifest we wait for."""
        self.peers[peer] = None
        actions: list[CatalogueAction[P]] = []
        for entry in list(self.versions.values()):
            actions += self._offer(entry, peer)
        for mid, pending in self.pending.items():
            if not pending.offered:  # an offered follow asks only the peers that offered it
                actions += self._ask(mid, pending, peer, now)
        return actions

    def peer_down(self, peer: P) -> list[CatalogueAction[P]]:
        self.peers.pop(peer, None)
        actions: list[CatalogueAction[P]] = []
        for entry in self.versions.values():
            entry.offered_to.discard(peer)
            entry.offered_by.discard(peer)
            actions.append(CloseSession(peer, entry.manifest_id))
        for mid in self.offered_ids.pop(peer, {}):
            self._forget_offer(mid, peer)
        for pending in self.pending.values():
            pending.asked.discard(peer)
        return actions

    # --- messages from peers ----------------------------------------------------------------------------

    def offer_received(
        self, peer: P, mid: bytes, step: int, now: float, *, have_manifest: bool
    ) -> list[CatalogueAction[P]]:
        """``peer`` holds or fetches ``mid``; ``step`` is its unverified claim. ``have_manifest``: its
        signed manifest is already in hand and checked."""
        entry = self.versions.get(mid)
        if entry is not None:
            # Its first offer after ours: it may have forgotten ours (made while it did not hold the
            # version, beyond its MAX_OFFERS_PER_PEER), so its side of the session would never open.
            # Offer once more; a peer that did keep ours just opens its session again (a no-op).
            again = peer in entry.offered_to and peer not in entry.offered_by
            opened = self._offered_by(entry, peer)
            return [SendOffer(peer, mid, entry.step), *opened] if again else opened
        ids = self.offered_ids.setdefault(peer, {})
        ids.pop(mid, None)
        ids[mid] = None
        if len(ids) > MAX_OFFERS_PER_PEER:
            oldest = next(iter(ids))
            del ids[oldest]
            self._forget_offer(oldest, peer)
        self.offers.setdefault(mid, {})[peer] = step
        actions: list[CatalogueAction[P]] = []
        pending = self.pending.get(mid)
        if pending is not None:
            pending.asked.discard(peer)  # asked before it held the version (no answer then); it does now
            actions += self._ask(mid, pending, peer, now)
        return actions + self.heard_of(mid, step, now, have_manifest=have_manifest, offered_by=peer)

    def manifest_requested(self, peer: P, mid: bytes) -> list[CatalogueAction[P]]:
        """Only versions we hold are answered (we hold their signed manifest)."""
        return [SendManifest(peer, mid)] if mid in self.versions else []

    # --- manifests ----------------------------------------------------------------------------------------

    def request_manifest(self, mid: bytes, now: float, *, patient: bool) -> list[CatalogueAction[P]]:
        """Ask every neighbour not yet asked for ``mid``. A patient request never expires until released."""
        pending = self.pending.get(mid)
        if pending is None:
            pending = self.pending[mid] = PendingManifest(last_asked=now)
        pending.patient += patient
        if patient:
            pending.offered_by = None  # a caller waits for it: it is no longer only a peer's claim
        actions: list[CatalogueAction[P]] = []
        for peer in list(self.peers):
            actions += self._ask(mid, pending, peer, now)
        return actions

    def release_manifest(self, mid: bytes) -> None:
        """A patient caller stopped waiting (cancelled) before the manifest came."""
        pending = self.pending.get(mid)
        if pending is not None and pending.patient > 0:
            pending.patient -= 1
            if pending.patient == 0 and mid not in self.following:
                del self.pending[mid]

    def manifest_verified(self, mid: bytes) -> list[CatalogueAction[P]]:
        """A signed manifest for ``mid`` arrived and passed the caller's checks."""
        self.pending.pop(mid, None)
        if mid not in self.following:
            return []
        if not self.follow:  # turned off meanwhile
            self.following.discard(mid)
            return []
        return [StartFetch(mid)]

    def manifest_refused(self, mid: bytes) -> None:
        """The manifest ``mid`` is not one we may accept (not the trainer's): stop waiting and following."""
        self.pending.pop(mid, None)
        self.following.discard(mid)

    # --- following ------------------------------------------------------------------------------------

    def heard_of(
        self, mid: bytes, step: int, now: float, *, have_manifest: bool, offered_by: P | None = None
    ) -> list[CatalogueAction[P]]:
        """An offer (``offered_by`` the peer) or the trainer's announcement names ``mid`` at ``step``:
        follow it if it is new enough. ``have_manifest``: its signed manifest is in hand and checked."""
        if not self.follow or mid in self.versions:
            return []
        pending = self.pending.get(mid)
        if mid in self.following:
            if offered_by is None and pending is not None and pending.offered:
                pending.offered_by = None  # the trainer announced it after all: ask everyone
                return self.request_manifest(mid, now, patient=False)
            return []
        held = sorted({entry.step for entry in self.versions.values()}, reverse=True)  # a delta and its
        if len(held) >= self.keep and step <= held[self.keep - 1]:  # target are one step
            return []
        if have_manifest:
            self.following.add(mid)
            return [StartFetch(mid)]
        if offered_by is not None and pending is None:
            return self._follow_offer(mid, offered_by, now)
        if pending is None and self._pending_follows() >= MAX_PENDING_FOLLOWS:
            return []
        self.following.add(mid)
        return self.request_manifest(mid, now, patient=False)

    def _follow_offer(self, mid: bytes, peer: P, now: float) -> list[CatalogueAction[P]]:
        """Follow a version only ``peer``'s offer names: ask the peers that offered it, for a while."""
        started = sum(1 for p in self.pending.values() if p.offered and p.offered_by == peer)
        if started >= MAX_OFFERED_FOLLOWS_PER_PEER:
            return []
        self.following.add(mid)
        pending = self.pending[mid] = PendingManifest[P](
            last_asked=now, offered_by=peer, deadline=now + OFFERED_FOLLOW_TIMEOUT
        )
        actions: list[CatalogueAction[P]] = []
        for holder in list(self.offers.get(mid, {})):
            actions += self._ask(mid, pending, holder, now)
        return actions

    def follow_ended(self, mid: bytes) -> None:
        """A followed version did not start fetching (wrong run, disk error)."""
        self._stop_following(mid)

    # --- versions held --------------------------------------------------------------------------------

    def add_version(
        self, mid: bytes, step: int, *, complete: bool, base: bytes = b"", target: bytes = b""
    ) -> list[CatalogueAction[P]]:
        """We now hold (``complete``) or fetch ``mid`` (a delta from ``base`` to ``target`` when they are
        given): offer it to everyone, open sessions with those that already offered it."""
        if mid in self.versions:
            raise LocalProtocolError(f"version {mid.hex()} is already held", reason="duplicate_version")
        if bool(base) != bool(target) or (base and base == target):
            raise LocalProtocolError("a delta names a base and a different target", reason="bad_delta")
        entry = self.versions[mid] = HeldEntry[P](mid, step, complete, base, target)
        self._stop_following(mid)
        actions: list[CatalogueAction[P]] = []
        for peer in list(self.peers):
            actions += self._offer(entry, peer)
        for peer in self.offers.pop(mid, {}):
            self.offered_ids.get(peer, {}).pop(mid, None)
            actions += self._offered_by(entry, peer)
        return actions

    def version_complete(self, mid: bytes) -> list[CatalogueAction[P]]:
        """Every piece of ``mid`` is verified and written: it counts for retention."""
        entry = self.versions.get(mid)
        if entry is None:
            raise LocalProtocolError(f"version {mid.hex()} is not held", reason="unknown_version")
        entry.complete = True
        return self.retain()

    def remove_version(self, mid: bytes) -> None:
        """The caller gave up a version (its fetch failed)."""
        self.versions.pop(mid, None)

    def retain(self) -> list[CatalogueAction[P]]:
        """Drop the complete versions the retention rule does not keep (newest ``keep`` full steps, the
        deltas to them, the bases of deltas still to be applied)."""
        held = sorted(self.versions.values(), key=lambda e: e.step, reverse=True)
        actions: list[CatalogueAction[P]] = []
        for entry in retained_with_deltas(held, keep=self.keep):
            del self.versions[entry.manifest_id]
            actions.append(Drop(entry.manifest_id, entry.step))
        return actions

    # --- time ---------------------------------------------------------------------------------------------

    def tick(self, now: float) -> list[CatalogueAction[P]]:
        """Forget followed manifests nobody answered within ``MANIFEST_TIMEOUT`` of our last ask, and
        offered follows at their deadline."""
        actions: list[CatalogueAction[P]] = []
        for mid, pending in list(self.pending.items()):
            if pending.patient:
                continue
            expired = (
                now >= pending.deadline if pending.offered else now - pending.last_asked >= MANIFEST_TIMEOUT
            )
            if expired:
                del self.pending[mid]
                self.following.discard(mid)
                actions.append(GiveUp(mid))
        return actions

    # --- internals ----------------------------------------------------------------------------------------

    def _offer(self, entry: HeldEntry[P], peer: P) -> list[CatalogueAction[P]]:
        if peer in entry.offered_to or peer not in self.peers:
            return []
        entry.offered_to.add(peer)
        actions: list[CatalogueAction[P]] = [SendOffer(peer, entry.manifest_id, entry.step)]
        if peer in entry.offered_by:
            actions.append(OpenSession(peer, entry.manifest_id))
        return actions

    def _offered_by(self, entry: HeldEntry[P], peer: P) -> list[CatalogueAction[P]]:
        entry.offered_by.add(peer)
        if peer not in entry.offered_to:
            return self._offer(entry, peer)
        return [OpenSession(peer, entry.manifest_id)]

    def _ask(self, mid: bytes, pending: PendingManifest[P], peer: P, now: float) -> list[CatalogueAction[P]]:
        if peer in pending.asked:
            return []
        pending.asked.add(peer)
        pending.last_asked = now
        return [AskManifest(peer, mid)]

    def _stop_following(self, mid: bytes) -> None:
        self.following.discard(mid)
        pending = self.pending.get(mid)
        if pending is not None and not pending.patient:
            del self.pending[mid]  # only the follow waited for it

    def _pending_follows(self) -> int:
        """Follows the trainer announced (offered follows are bounded per peer instead)."""
        return sum(1 for pending in self.pending.values() if pending.patient == 0 and not pending.offered)

    def _forget_offer(self, mid: bytes, peer: P) -> None:
        holders = self.offers.get(mid)
        if holders is not None:
            holders.pop(peer, None)
            if not holders:
                del self.offers[mid]
