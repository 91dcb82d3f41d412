"""Super-seeding across versions (issue 35 item 4): the spread deadline and each peer's record carry from
one version's origin node to the next through a shared ``SpreadMemory``.

The fetches here run in virtual time: an event queue drives a super-seeding ``SwarmNode`` and simulated
peers (an honest fetcher, hoarders that SIT on their reveals or TAKE pieces and never let them spread)."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.swarm.messages import Bitfield, Have, Request
from protocol.swarm.pieceset import from_wire
from protocol.swarm.spread import SpreadMemory
from protocol.swarm.swarm_node import Action, SwarmConfig, SwarmNode, Upload
from tests.swarm.test_node import MID, sent

PIECES = 8
FULL = (1 << PIECES) - 1
LATENCY = 0.01
"""One way, per message."""
TRANSFER = 0.04
"""One piece on the wire."""
TICK = 0.25
"""How often the caller ticks the node (prime_node/swarm/service.py's TICK)."""
HOP = LATENCY
"""What the origin measures: from the end of its upload to the receiver's ``have``."""


def origin_of_version(memory: SpreadMemory, seed: int = 0) -> SwarmNode:
    """A new version's super-seeding origin, sharing ``memory`` the way the swarm's holdings do."""
    return SwarmNode(
        MID, PIECES, rng=random.Random(seed), config=SwarmConfig(super_seed=True), have=FULL, memory=memory
    )


class Swarm:
    """Virtual time around one origin: ``honest`` peers request what they are told of and announce what
    they get (to the origin and each other); ``sitters`` never request; ``takers`` download what is revealed
    to them and announce nothing."""

    def __init__(self, origin: SwarmNode) -> None:
        self.origin = origin
        self.now = 0.0
        self.queue: list[tuple[float, int, Callable[[], None]]] = []
        self.order = itertools.count()
        self.honest: dict[str, int] = {}
        """What each honest peer holds."""
        self.asked: dict[str, int] = {}
        self.done_at: dict[str, float] = {}
        self.takers: set[str] = set()
        self._ticking = False

    def at(self, when: float, event: Callable[[], None]) -> None:
        heapq.heappush(self.queue, (when, next(self.order), event))

    def connect(self, peer: str, when: float, kind: str = "honest") -> None:
        if kind == "honest":
            self.honest[peer], self.asked[peer] = 0, 0
        elif kind == "take":
            self.takers.add(peer)

        def arrive() -> None:
            self.apply(self.origin.connected(peer, self.now))
            self.apply(self.origin.receive(peer, Bitfield(MID, bytes(1)), self.now))

        self.at(when, arrive)
        if not self._ticking:
            self._ticking = True
            self.at(when + TICK, self.tick)

    def tick(self) -> None:
        self.apply(self.origin.tick(self.now))
        if not self.honest or any(have != FULL for have in self.honest.values()):
            self.at(self.now + TICK, self.tick)

    def run(self, until: float) -> None:
        while self.queue and self.queue[0][0] <= until:
            self.now, _, event = heapq.heappop(self.queue)
            event()

    def apply(self, actions: list[Action]) -> None:
        for peer, message in sent(actions, Have):
            self.told(str(peer), 1 << message.index)  # type: ignore[attr-defined]
        for peer, message in sent(actions, Bitfield):
            self.told(str(peer), from_wire(message.bits, PIECES))  # type: ignore[attr-defined]
        for action in actions:
            if isinstance(action, Upload):
                self.at(self.now + TRANSFER, lambda a=action: self.uploaded(a.peer, a.index))  # type: ignore[misc]

    def told(self, peer: str, pieces: int) -> None:
        if peer in self.takers:
            for index in _indices(pieces):
                self.at(self.now + LATENCY, lambda i=index: self.request(peer, i))  # type: ignore[misc]
        if peer not in self.honest:
            return
        for index in _indices(pieces & ~(self.honest[peer] | self.asked[peer])):
            self.asked[peer] |= 1 << index
            self.at(self.now + LATENCY, lambda i=index: self.request(peer, i))  # type: ignore[misc]

    def request(self, peer: str, index: int) -> None:
        self.apply(self.origin.receive(peer, Request(MID, index), self.now))

    def uploaded(self, peer: object, index: int) -> None:
        self.apply(self.origin.upload_done(peer, index, self.now))
        if peer in self.honest:
            self.at(self.now + LATENCY, lambda: self.verified(str(peer), index))

    def verified(self, peer: str, index: int) -> None:
        if self.honest[peer] >> index & 1:
            return
        self.honest[peer] |= 1 << index
        if self.honest[peer] == FULL:
            self.done_at.setdefault(peer, self.now)
        self.apply(self.origin.receive(peer, Have(MID, index), self.now))
        for other in self.honest:  # it re-serves the piece to the honest peers that lack it
            if not (self.honest[other] | self.asked[other]) >> index & 1:
                self.asked[other] |= 1 << index
                self.at(self.now + TRANSFER + LATENCY, lambda o=other: self.verified(o, index))  # type: ignore[misc]


def _indices(pieces: int) -> list[int]:
    return [i for i in range(PIECES) if pieces >> i & 1]


def _measure_hops(memory: SpreadMemory) -> None:
    """Version N: one honest peer fetches it alone, so the origin measures its hops."""
    swarm = Swarm(origin_of_version(memory))
    swarm.connect("honest", 0.0)
    swarm.run(60.0)
    assert swarm.done_at


def _hoarded_fetch(memory: SpreadMemory, kind: str, hoarders: int = 4) -> tuple[float, float]:
    """Version N+1: ``hoarders`` get every piece first; returns (the origin's deadline when the honest
    fetch starts, how long that fetch took in virtual seconds)."""
    swarm = Swarm(origin_of_version(memory, seed=1))
    for i in range(hoarders):
        swarm.connect(f"hoarder{i}", 0.0, kind)
    swarm.run(0.05)  # they hold every reveal (takers: have asked for them) before the honest peer comes
    deadline = swarm.origin.spread_deadline()
    start = swarm.now
    swarm.connect("honest", start)
    swarm.run(600.0)
    return deadline, swarm.done_at["honest"] - start


def test_hoarders_hold_a_new_version_for_the_deadline_measured_on_the_last_not_its_maximum() -> None:
    """Issue 35 item 4: every version started at the 30 s maximum, so sitters given a new version's
    reveals held its fetch ~30 s though the origin had measured 10 ms hops on the version before."""
    memory = SpreadMemory()
    _measure_hops(memory)
    config = SwarmConfig()
    measured = max(config.spread_floor, config.spread_factor * HOP)
    for kind in ("sit", "take"):
        deadline, virtual_s = _hoarded_fetch(memory, kind)
        # SIT: reveals open one deadline after they were made; TAKE: an upload twice that after it; then a
        # tick, the piece's request, transfer and verification (virtual time: no machine noise here).
        assert virtual_s <= 2 * measured + 2 * TICK + 4 * (TRANSFER + 2 * LATENCY), (kind, virtual_s)
        assert deadline == measured  # not config.spread_timeout, as when each version started from nothing
    assert abs(memory.hop_time - HOP) < 1e-9


def test_without_any_hop_measured_the_deadline_is_still_its_maximum() -> None:
    deadline, virtual_s = _hoarded_fetch(SpreadMemory(), "sit")
    assert deadline == SwarmConfig().spread_timeout
    assert virtual_s >= deadline - 1.0  # the sitters' reveals open only then (what the memory shortens)


def test_a_version_with_no_memory_given_learns_alone() -> None:
    one = SwarmNode(MID, PIECES, rng=random.Random(0), config=SwarmConfig(super_seed=True), have=FULL)
    two = SwarmNode(MID, PIECES, rng=random.Random(0), config=SwarmConfig(super_seed=True), have=FULL)
    assert one.memory is not two.memory


def test_peers_that_re_served_before_get_the_fresh_pieces_first_and_hoarders_one() -> None:
    memory = SpreadMemory()
    # Version N: two honest peers fetch together and re-serve to each other; a sitter misses deadlines.
    swarm = Swarm(origin_of_version(memory))
    swarm.connect("a", 0.0)
    swarm.connect("b", 0.0)
    swarm.connect("sitter", 0.0, "sit")
    swarm.run(120.0)
    assert set(swarm.done_at) == {"a", "b"}
    assert memory.proven("a") and memory.proven("b") and memory.hoarded("sitter")
    assert memory.standing("a") == 0 and memory.standing("stranger") == 1 and memory.standing("sitter") == 2
    # Version N+1: the sitter and a stranger connect first; they get one reveal each, not two.
    origin = origin_of_version(memory, seed=1)
    assert len(sent(origin.connected("sitter", 0.0), Have)) == 1
    assert len(sent(origin.connected("stranger", 0.0), Have)) == 1
    assert len(sent(origin.connected("a", 0.0), Have)) == SwarmConfig().reveal_per_peer


def test_reveals_freed_go_to_proven_peers_first() -> None:
    memory = SpreadMemory()
    memory.spread("proven")
    origin = SwarmNode(
        MID, 2, rng=random.Random(0), config=SwarmConfig(super_seed=True), have=0b11, memory=memory
    )
    for peer in ("a", "b", "x", "proven"):  # first pass, a proven peer known: strangers get one each
        origin.connected(peer, 0.0)
    assert [len(origin.peers[p].revealed) for p in ("a", "b", "x", "proven")] == [1, 1, 0, 0]
    freed = next(iter(origin.peers["a"].revealed))
    actions = origin.disconnected("a", 1.0)  # its reveal is free again: the proven peer gets it, not x
    assert sent(actions, Have) == [("proven", Have(MID, freed))]


def test_the_memory_keeps_at_most_its_peer_count_and_its_proven_count_right() -> None:
    memory = SpreadMemory(max_peers=3)
    for peer in ("a", "b", "c", "d"):
        memory.spread(peer)
    assert len(memory) == 3 and memory.record("a") is None and memory.proven_peers == 3
    memory.strike("b")
    assert memory.proven_peers == 2 and not memory.proven("b") and not memory.hoarded("b")


@settings(max_examples=200, deadline=None)
@given(
    events=st.lists(st.tuples(st.sampled_from(["spread", "strike"]), st.integers(0, 6)), max_size=60),
    cap=st.integers(1, 5),
)
def test_the_proven_count_matches_the_records(events: list[tuple[str, int]], cap: int) -> None:
    memory = SpreadMemory(max_peers=cap)
    for what, peer in events:
        getattr(memory, what)(peer)
        assert len(memory) <= cap
        assert memory.proven_peers == sum(memory.proven(p) for p in range(7))


@settings(max_examples=100, deadline=None)
@given(samples=st.lists(st.tuples(st.integers(0, 5), st.floats(-1.0, 100.0)), min_size=1, max_size=30))
def test_the_carried_deadline_stays_between_its_floor_and_its_maximum(
    samples: list[tuple[int, float]],
) -> None:
    memory = SpreadMemory(max_peers=3)
    for peer, sample in samples:
        memory.hop(peer, sample)
    config = SwarmConfig()
    deadline = origin_of_version(memory).spread_deadline()
    assert config.spread_floor <= deadline <= config.spread_timeout


def test_one_slow_peer_does_not_stretch_the_deadline_it_carries_to_the_next_version() -> None:
    """The carried hop time is the median of the peers' own averages: a hoarder that announces its pieces
    late (or a peer on a slow link) stretches its own average, not everyone's."""
    memory = SpreadMemory()
    for _ in range(20):
        memory.hop("a", 0.02)
        memory.hop("b", 0.03)
        memory.hop("late", 29.0)
    assert memory.hop_time == 0.03
    assert origin_of_version(memory).spread_deadline() == SwarmConfig().spread_floor
