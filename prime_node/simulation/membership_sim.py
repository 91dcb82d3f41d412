"""Membership at scale: the real neighbour overlay, record book and membership state machines, simulated.

Every node is an unmodified ``protocol.overlay.Overlay`` and ``protocol.record_book.RecordBook``; the
simulator plays the part ``prime_node/node/neighbour_links.py`` plays in production:

- **Links** form in rounds of one heartbeat interval: each node below its degree calls ``Overlay.choose``
  over the peers it believes healthy, its hellos reach their targets in random order, and the target
  answers with the node's own rule (``Overlay.accepts`` plus the smaller-peer-ID tie break), the opener
  with ``room_for`` (else a bye) or ``refused`` (busy: the refusal carries a sample of peers). A node
  refused that still wants links asks again ``REFILL_PAUSE`` of an interval later, within the same
  round (``NeighbourLinks.refill_loop``). A joiner knows a bootstrap sample of peers until its first
  link hands it the whole table. To keep ``choose`` cheap, a node that knows the whole swarm offers it
  a fresh random sample of ``candidates`` of them, which leaves the choice uniformly random.
- **Records** move event by event (heapq): a record of a peer a node never heard of is passed on after
  ``URGENT_DELAY`` (the batching pause) plus the link latency; any other new record rides each link's
  next beat (a uniform phase per link direction in the beat interval). Every hop goes through the books'
  ``consider`` / ``store`` / ``seen_from`` / ``take``, so duplicate suppression is the real one.
- Only a sample of records is tracked (a full table of N records in each of N books would not fit at
  N = 10,000): what the measurements need is how one record spreads, which does not depend on the others.

Pure and deterministic from the scenario's seed: no clock, no I/O.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from protocol.membership import Membership, MembershipConfig, PeerState
from protocol.overlay import BUSY_SAMPLE, REFILL_PAUSE, Overlay, OverlayConfig
from protocol.record_book import Offer, RecordBook, RecordBookConfig, refresh_interval

BEAT_S = 2.0
"""The heartbeat interval (NodeConfig.heartbeat_interval's default): one frame per link direction."""
URGENT_DELAY = 0.05
"""neighbour_links.URGENT_DELAY: a record of an unknown peer waits this long for the rest of its burst."""
LATENCY_S = (0.005, 0.080)
NEIGHBOUR_MEMBERSHIP = MembershipConfig(3 * BEAT_S, 6 * BEAT_S, 120.0)
"""What prime_node/node/service.py builds from the default node config (3 and 6 missed beats)."""
_Wake = Callable[[str, bool, float], None]


@dataclass(frozen=True)
class MembershipScenario:
    peers: int = 10_000
    seed: int = 0
    overlay: OverlayConfig = field(default_factory=OverlayConfig)
    book: RecordBookConfig = field(default_factory=lambda: RecordBookConfig(max_records=1_000))
    batches: int = 20
    """Joiners arrive in this many equal batches; each batch settles before the next arrives."""
    bootstrap: int = BUSY_SAMPLE
    candidates: int = 64
    max_rounds: int = 200
    """Rounds per settling phase at most (a round is one beat interval)."""


@dataclass(frozen=True)
class Degrees:
    min: int
    mean: float
    max: int
    below_degree: int
    connected: bool
    symmetric: bool


@dataclass(frozen=True)
class Formation:
    degrees: Degrees
    rounds: int
    """Rounds in all settling phases together."""
    last_batch_rounds: int
    refusals: int
    byes: int


@dataclass(frozen=True)
class Spread:
    """One record's dissemination, from its issue to the last live node."""

    eager: bool
    reached: int
    live: int
    time_to_all: float
    p50_arrival: float
    max_hops: int
    mean_hops: float
    copies_per_node: float
    """Copies each node received (1 is ideal; the rest are duplicates the books dropped)."""


@dataclass
class _Spreading:
    arrival: dict[str, float] = field(default_factory=dict)
    hops: dict[str, int] = field(default_factory=dict)
    copies: int = 0


@dataclass(frozen=True)
class Departure:
    """How long departed peers stay healthy / alive in survivors' ``Membership`` tables (s after leaving)."""

    view: str
    refresh_s: float
    healthy_p50: float
    healthy_max: float
    dead_p50: float
    dead_max: float


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class MembershipSimulation:
    def __init__(self, scenario: MembershipScenario) -> None:
        self.scenario = scenario
        self.rng = random.Random(scenario.seed)
        self.ids = [f"p{i:06d}" for i in range(scenario.peers)]
        self.overlays: dict[str, Overlay] = {}
        self.live: set[str] = set()
        self.believed: list[str] = []
        """Peers the swarm believes healthy (joined, and departed ones whose records have not aged out)."""
        self.knows_all: set[str] = set()
        self.known: dict[str, list[str]] = {}
        self.books: dict[str, RecordBook] = {}
        self.latency: dict[tuple[str, str], float] = {}
        self.phase: dict[tuple[str, str], float] = {}
        self.envelopes: dict[bytes, tuple[str, int]] = {}
        self.now = 0.0
        self.refusals = 0
        self.byes = 0

    # -- overlay -----------------------------------------------------------------------------------------

    def form(self) -> Formation:
        """Nodes join batch by batch, each batch settling (every node at its degree) before the next."""
        size = max(1, -(-self.scenario.peers // self.scenario.batches))
        rounds = last = 0
        for start in range(0, len(self.ids), size):
            batch = self.ids[start : start + size]
            self.believed.extend(batch)
            for peer_id in batch:
                self.overlays[peer_id] = Overlay(peer_id, self.scenario.overlay)
                self.live.add(peer_id)
                count = min(len(self.believed), self.scenario.bootstrap + 1)
                others = [p for p in self.rng.sample(self.believed, count) if p != peer_id]
                self.known[peer_id] = others[: self.scenario.bootstrap]
            last = self.settle()
            rounds += last
        return Formation(self.degrees(), rounds, last, self.refusals, self.byes)

    def settle(self) -> int:
        """Maintain rounds until every live node has its degree (or ``max_rounds``); the rounds run."""
        for done in range(self.scenario.max_rounds):
            if not self._round():
                return done
        return self.scenario.max_rounds

    def _round(self) -> bool:
        """One heartbeat interval: every node below its degree asks at its beat; one refused asks again
        every ``REFILL_PAUSE`` of the interval while it still wants links."""
        wanting = sorted(p for p in self.live if self.overlays[p].wanted() > 0)
        if not wanting:
            return False
        start = self.now
        for step in range(round(1 / REFILL_PAUSE)):
            self.now = start + step * REFILL_PAUSE * BEAT_S
            refused = self._ask(wanting)
            wanting = sorted(p for p in refused if self.overlays[p].wanted() > 0)
            if not wanting:
                break
        self.now = start + BEAT_S
        return True

    def _ask(self, wanting: list[str]) -> set[str]:
        """The ``wanting`` nodes send their hellos; returns the openers an attempt ended without a link."""
        self.rng.shuffle(wanting)
        hellos: list[tuple[str, str]] = []
        refused: set[str] = set()
        for peer_id in wanting:
            overlay = self.overlays[peer_id]
            for target in overlay.choose(self._candidates(peer_id), self.now, self.rng):
                if target not in self.live:
                    overlay.refused(target, self.now)  # the dial failed: it left
                    refused.add(peer_id)
                    continue
                overlay.opening.add(target)
                hellos.append((peer_id, target))
        self.rng.shuffle(hellos)
        for opener, target in hellos:
            if not self._hello(opener, target):
                refused.add(opener)
        return refused

    def _candidates(self, peer_id: str) -> list[str]:
        if peer_id in self.knows_all:
            return self.rng.sample(self.believed, min(self.scenario.candidates, len(self.believed)))
        return self.known[peer_id]

    def _hello(self, opener: str, target: str) -> bool:
        """One hello, answered as NeighbourLinks._serve / _open answer it; True if the link stands."""
        mine, theirs = self.overlays[opener], self.overlays[target]
        if opener in theirs.links or opener in theirs.opening:
            welcome = opener < target
        else:
            welcome = theirs.accepts(opener)
        if not welcome:
            self.refusals += 1
            mine.refused(target, self.now)
            if opener not in self.knows_all:  # the busy frame's sample of the target's records
                self.known[opener] = self.known[opener] + self.rng.sample(
                    self.believed, min(BUSY_SAMPLE, len(self.believed))
                )
            return False
        theirs.linked(opener, inbound=True)
        self.knows_all.update((opener, target))  # link_up: each sends the other its whole table
        if mine.room_for(target):
            mine.linked(target, inbound=False)
            return True
        self.byes += 1
        theirs.unlinked(opener)
        mine.refused(target, self.now)
        return False

    def degrees(self) -> Degrees:
        live = sorted(self.live)
        counts = [len(self.overlays[p].links) for p in live]
        symmetric = all(
            q in self.live and p in self.overlays[q].links for p in live for q in self.overlays[p].links
        )
        return Degrees(
            min=min(counts),
            mean=round(sum(counts) / len(counts), 2),
            max=max(counts),
            below_degree=sum(c < self.scenario.overlay.degree for c in counts),
            connected=self.connected(),
            symmetric=symmetric,
        )

    def connected(self) -> bool:
        start = min(self.live)
        seen = {start}
        queue = deque([start])
        while queue:
            for q in self.overlays[queue.popleft()].links:
                if q in self.live and q not in seen:
                    seen.add(q)
                    queue.append(q)
        return len(seen) == len(self.live)

    # -- records -----------------------------------------------------------------------------------------

    def sync_books(self) -> None:
        """Give every live node a book whose links match its overlay. A new link's full-table sync
        (``link_up``) is taken as done: every tracked record has reached every live node before."""
        for peer_id in sorted(self.live):
            book = self.books.setdefault(peer_id, RecordBook(peer_id, self.scenario.book))
            links = self.overlays[peer_id].links
            for gone in set(book.links()) - links:
                book.link_down(gone)
            for new in sorted(links - set(book.links())):
                book.link_up(new, self.rng)
                while book.take(new):
                    pass

    def spread(self, origin: str, issued_ms: int) -> Spread:
        """``origin`` issues its record as of ``issued_ms``; run until no frame is left to send."""
        book = self.books[origin]
        eager = book.get(origin) is None  # nobody knows it yet: a new peer's first record
        envelope = f"{origin}/{issued_ms}".encode()
        self.envelopes[envelope] = (origin, issued_ms)
        state = _Spreading({origin: self.now}, {origin: 0})
        heap: list[tuple[float, int, str, str, tuple[bytes, ...]]] = []
        scheduled: set[tuple[str, str, float]] = set()
        seq = 0

        def wake(node: str, urgent: bool, now: float) -> None:
            nonlocal seq
            for neighbour in self.books[node].links():
                if urgent:
                    when = now + URGENT_DELAY
                else:
                    phase = self.phase.setdefault((node, neighbour), self.rng.uniform(0, BEAT_S))
                    when = phase + BEAT_S * max(0, -(-(now - phase) // BEAT_S))
                if (node, neighbour, when) not in scheduled:
                    scheduled.add((node, neighbour, when))
                    seq += 1
                    heapq.heappush(heap, (when, seq, node, neighbour, ()))

        book.store(origin, issued_ms, envelope, came_from=None)
        wake(origin, eager, self.now)
        while heap:
            now, _, node, peer, records = heapq.heappop(heap)
            if records:  # a frame from ``peer`` arrives at ``node``
                self._receive(node, peer, records, now, state, wake)
                continue
            scheduled.discard((node, peer, now))
            taken = tuple(self.books[node].take(peer))
            if taken and peer in self.live:
                seq += 1
                heapq.heappush(heap, (now + self._latency(node, peer), seq, peer, node, taken))
        times = [t - self.now for p, t in state.arrival.items() if p != origin]
        hops = [h for p, h in state.hops.items() if p != origin]
        return Spread(
            eager=eager,
            reached=len(state.arrival),
            live=len(self.live),
            time_to_all=round(max(times), 3),
            p50_arrival=round(percentile(times, 0.5), 3),
            max_hops=max(hops),
            mean_hops=round(sum(hops) / len(hops), 2),
            copies_per_node=round(state.copies / (len(self.live) - 1), 2),
        )

    def _receive(
        self,
        node: str,
        sender: str,
        records: tuple[bytes, ...],
        now: float,
        state: _Spreading,
        wake: _Wake,
    ) -> None:
        book = self.books[node]
        now_ms = int(now * 1000)
        urgent = stored = False
        for envelope in records:
            state.copies += 1
            peer_id, issued_ms = self.envelopes[envelope]
            offer = book.consider(peer_id, issued_ms, now_ms)
            if offer is Offer.KNOWN:
                book.seen_from(sender, peer_id, issued_ms)
            if offer is not Offer.NEW:
                continue
            urgent |= book.get(peer_id) is None
            stored = True
            book.store(peer_id, issued_ms, envelope, came_from=sender)
            state.arrival[node] = now
            state.hops[node] = state.hops[sender] + 1
        if stored:
            wake(node, urgent, now)

    def _latency(self, a: str, b: str) -> float:
        key = (a, b) if a < b else (b, a)
        if key not in self.latency:
            self.latency[key] = self.rng.uniform(*LATENCY_S)
        return self.latency[key]

    # -- churn -------------------------------------------------------------------------------------------

    def churn(self, fraction: float) -> list[str]:
        """Remove ``fraction`` of the live nodes at once: their links break (survivors see the streams
        reset). Departed peers stay in ``believed``: their records have not aged out yet, so survivors
        still pick them and learn only from the failed dial."""
        departed = self.rng.sample(sorted(self.live), int(fraction * len(self.live)))
        for peer_id in departed:
            self.live.discard(peer_id)
        for peer_id in departed:
            for neighbour in sorted(self.overlays[peer_id].links):
                if neighbour in self.live:
                    self.overlays[neighbour].unlinked(peer_id)
            self.books.pop(peer_id, None)
        return departed

    def departures(self, departed: list[str], lazy_p50: float) -> list[Departure]:
        """How long the departed stay healthy for a non-neighbour (the real Membership, records issued
        every ``refresh_interval(N)``, the last one at a uniform phase before leaving and heard
        ``lazy_p50`` s after its issue) and for a neighbour (the last beat at a uniform phase)."""
        refresh = refresh_interval(self.scenario.peers - 1, self.scenario.book)
        sample = departed[:500]
        far: Membership[None] = Membership()
        for peer_id in sample:
            issued = self.now - self.rng.uniform(0, refresh)
            far.heard_record(peer_id, None, issued_at=issued, refresh=refresh, now=issued + lazy_p50)
        near: Membership[None] = Membership(NEIGHBOUR_MEMBERSHIP)
        for peer_id in sample:
            near.heard(peer_id, None, self.now - self.rng.uniform(0, BEAT_S))
        return [
            _watch("non_neighbour", far, self.now, refresh / 200, refresh),
            _watch("neighbour", near, self.now, 0.1, BEAT_S),
        ]


def _watch(view: str, table: Membership[None], start: float, step: float, refresh: float) -> Departure:
    healthy: dict[str, float] = {}
    dead: dict[str, float] = {}
    watched = len(table)
    for i in range(1, 10_000):
        now = start + i * step
        for change in table.tick(now):
            if change.after is not PeerState.HEALTHY:
                healthy.setdefault(change.peer_id, now - start)
            if change.after in (PeerState.DEAD, None):
                dead.setdefault(change.peer_id, now - start)
        if len(dead) == watched:
            break
    h, d = list(healthy.values()), list(dead.values())
    return Departure(
        view,
        round(refresh, 1),
        round(percentile(h, 0.5), 1),
        round(max(h, default=0.0), 1),
        round(percentile(d, 0.5), 1),
        round(max(d, default=0.0), 1),
    )
