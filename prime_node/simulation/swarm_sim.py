"""The swarm simulator: the real ``protocol.swarm.SwarmNode`` state machines over modelled links.

Every node is an unmodified ``SwarmNode``; the simulator plays the role the node's I/O layer plays in
production: it delivers each message after the link latency, turns ``Upload`` actions into fluid flows
(see fluid.py), answers ``Verify`` (by hashing real bytes in payload mode, otherwise by whether the
sender is one of the scenario's corrupting peers), and calls ``tick`` periodically. Node 0 is the origin
(the trainer, super-seeding); nodes 1..N start empty and stay to seed after completing.

Broadcasts (a ``Have`` to every neighbour) are grouped by the receivers' latency class into one event per
class, which is exact because latencies come from a few classes and saves most of the heap traffic.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from prime_node.simulation.fluid import Flow, FluidNetwork
from prime_node.simulation.links import Link, LinkModel, broadcast_bound
from protocol.codec import Message
from protocol.manifest import Manifest
from protocol.swarm.messages import Have, Piece
from protocol.swarm.swarm_node import (
    AbortUpload,
    Action,
    Completed,
    Disconnect,
    Send,
    SwarmConfig,
    SwarmNode,
    Upload,
    Verify,
)

ORIGIN = 0


@dataclass(frozen=True)
class Payload:
    """Real bytes for small simulations: the origin's checkpoint stream and its manifest."""

    manifest: Manifest
    data: bytes

    def piece(self, index: int) -> bytes:
        start, end = self.manifest.piece_span(index)
        return self.data[start:end]


@dataclass(frozen=True)
class SwarmScenario:
    """One simulated broadcast. ``size`` is F in bytes, cut into ``pieces`` equal pieces."""

    peers: int
    size: float
    pieces: int
    seed: int = 0
    degree: int = 16
    origin_degree: int = 32
    links: LinkModel = field(default_factory=LinkModel)
    peer_config: SwarmConfig = field(default_factory=SwarmConfig)
    origin_config: SwarmConfig = field(default_factory=lambda: SwarmConfig(super_seed=True, upload_slots=4))
    tick_interval: float = 10.0
    corrupt_peers: int = 0
    kills: tuple[tuple[float, float], ...] = ()
    """(time, fraction): at ``time``, that fraction of the live non-origin peers holding pieces leaves."""
    leave_rate: float = 0.0
    """Churn: each peer leaves at a uniformly random time in [0, T*] with this probability."""
    payload: Payload | None = None
    time_limit: float | None = None
    """Give up at this simulated time; None means 20 × T* (a stuck swarm reports an infinite time)."""


@dataclass
class SwarmResult:
    finish: dict[int, float]
    live: set[int]
    bound: float
    broadcast_time: float
    events: int
    wall_seconds: float
    banned: dict[int, set[int]]
    stored: dict[int, dict[int, bytes]]

    @property
    def ratio_to_bound(self) -> float:
        return self.broadcast_time / self.bound

    @property
    def all_live_complete(self) -> bool:
        return all(p in self.finish for p in self.live if p != ORIGIN)


class SwarmSimulation:
    def __init__(self, scenario: SwarmScenario) -> None:
        self.scenario = s = scenario
        self.rng = random.Random(s.seed)
        if s.payload is not None:
            self.piece_count = s.payload.manifest.piece_count
            self.manifest_id = s.payload.manifest.id()
        else:
            self.piece_count = s.pieces
            self.manifest_id = random.Random(s.seed + 1).randbytes(32)
        self.links: list[Link] = [s.links.origin(self.rng), *s.links.draw(s.peers, self.rng)]
        self.latency = [link.latency for link in self.links]
        self.net = FluidNetwork([x.upload for x in self.links], [x.download for x in self.links])
        count = s.peers + 1
        self.nodes: list[SwarmNode] = [
            SwarmNode(
                self.manifest_id,
                self.piece_count,
                rng=random.Random(self.rng.getrandbits(64)),
                config=s.origin_config if i == ORIGIN else s.peer_config,
                have=(1 << self.piece_count) - 1 if i == ORIGIN else 0,
            )
            for i in range(count)
        ]
        self.alive = [True] * count
        self.neighbours: list[set[int]] = [set() for _ in range(count)]
        self.flows: dict[tuple[int, int, int], Flow] = {}
        self.finish: dict[int, float] = {}
        self.corrupt = set(self.rng.sample(range(1, count), s.corrupt_peers)) if s.corrupt_peers else set()
        self.stored: dict[int, dict[int, bytes]] = {i: {} for i in range(count)} if s.payload else {}
        self.bound = broadcast_bound(self._piece_bytes_total(), self.links[ORIGIN].upload, self.links[1:])
        self.remaining = s.peers

    def _piece_bytes_total(self) -> float:
        payload = self.scenario.payload
        return float(payload.manifest.total_size) if payload else self.scenario.size

    def _piece_size(self, index: int) -> float:
        payload = self.scenario.payload
        return (
            float(payload.manifest.piece_length(index)) if payload else self.scenario.size / self.piece_count
        )

    # --- set-up ----------------------------------------------------------------------------------------

    def _topology(self) -> list[tuple[int, int]]:
        s, rng = self.scenario, self.rng
        edges: set[tuple[int, int]] = set()
        for a in range(1, s.peers + 1):
            for _ in range(max(1, s.degree // 2)):
                b = rng.randrange(1, s.peers + 1)
                if b != a:
                    edges.add((min(a, b), max(a, b)))
        for b in rng.sample(range(1, s.peers + 1), min(s.origin_degree, s.peers)):
            edges.add((ORIGIN, b))
        return sorted(edges)

    def run(self) -> SwarmResult:
        started = time.perf_counter()
        s = self.scenario
        for a, b in self._topology():
            self.neighbours[a].add(b)
            self.neighbours[b].add(a)
        for a in range(s.peers + 1):
            self.net.at(0.0, self._connect_all, a)
        for moment, fraction in s.kills:
            self.net.at(moment, self._kill_fraction, fraction)
        if s.leave_rate:
            for peer in range(1, s.peers + 1):
                if self.rng.random() < s.leave_rate:
                    self.net.at(self.rng.uniform(0, self.bound), self._kill, peer)
        for peer in range(s.peers + 1):
            self.net.at(self.rng.uniform(0, s.tick_interval), self._tick, peer)
        limit = s.time_limit if s.time_limit is not None else 20 * self.bound
        self.net.run(until=limit, stop=lambda: self.remaining == 0)
        live = {i for i, alive in enumerate(self.alive) if alive}
        done = [self.finish[p] for p in live if p in self.finish and p != ORIGIN]
        broadcast = max(done) if len(done) == len(live) - 1 else float("inf")
        return SwarmResult(
            finish=dict(self.finish),
            live=live,
            bound=self.bound,
            broadcast_time=broadcast,
            events=self.net.events,
            wall_seconds=time.perf_counter() - started,
            banned={i: {int(p) for p in n.banned} for i, n in enumerate(self.nodes) if n.banned},  # type: ignore[call-overload]
            stored=self.stored,
        )

    def _connect_all(self, node: int) -> None:
        for other in sorted(self.neighbours[node]):
            self._apply(node, self.nodes[node].connected(other, self.net.now))

    # --- churn -----------------------------------------------------------------------------------------

    def _kill_fraction(self, fraction: float) -> None:
        holders = [p for p in range(1, len(self.nodes)) if self.alive[p] and self.nodes[p].have]
        for peer in self.rng.sample(holders, int(len(holders) * fraction)):
            self._kill(peer)

    def _kill(self, peer: int) -> None:
        if not self.alive[peer]:
            return
        self.alive[peer] = False
        if peer not in self.finish:
            self.remaining -= 1
        for flow in list(self.net.leaving[peer] | self.net.entering[peer]):
            self.net.stop_flow(flow)
            self.flows.pop(flow.args[0], None)
        for other in list(self.neighbours[peer]):
            self.neighbours[other].discard(peer)
            self.net.at(self.net.now + self.latency[other], self._disconnected, other, peer)
        self.neighbours[peer].clear()

    def _disconnected(self, node: int, peer: int) -> None:
        if self.alive[node]:
            self._apply(node, self.nodes[node].disconnected(peer, self.net.now))

    def _tick(self, node: int) -> None:
        if not self.alive[node]:
            return
        self._apply(node, self.nodes[node].tick(self.net.now))
        self.net.at(self.net.now + self.scenario.tick_interval, self._tick, node)

    # --- actions ---------------------------------------------------------------------------------------

    def _apply(self, node: int, actions: list[Action]) -> None:
        if not actions:
            return
        now = self.net.now
        latency = self.latency
        batches: dict[tuple[int, float], tuple[Message, list[int]]] = {}
        for action in actions:
            if isinstance(action, Send):
                peer = action.peer
                assert isinstance(peer, int)
                if isinstance(action.message, Have):
                    batches.setdefault((id(action.message), latency[peer]), (action.message, []))[1].append(
                        peer
                    )
                else:
                    self.net.at(
                        now + latency[node] + latency[peer], self._deliver, node, peer, action.message
                    )
            elif isinstance(action, Upload):
                self._upload(node, action)
            elif isinstance(action, Verify):
                self._verify(node, action)
            elif isinstance(action, AbortUpload):
                flow = self.flows.pop((node, action.peer, action.index), None)  # type: ignore[arg-type]
                if flow is not None:
                    self.net.stop_flow(flow)
            elif isinstance(action, Disconnect):
                self._drop_link(node, action.peer)  # type: ignore[arg-type]
            elif isinstance(action, Completed) and node not in self.finish:
                self.finish[node] = now
                if self.alive[node] and node != ORIGIN:
                    self.remaining -= 1
        for (_, peer_latency), (message, peers) in batches.items():
            self.net.at(now + latency[node] + peer_latency, self._deliver_many, node, peers, message)

    def _deliver(self, src: int, dst: int, message: Message) -> None:
        if self.alive[dst] and src in self.neighbours[dst]:
            self._apply(dst, self.nodes[dst].receive(src, message, self.net.now))

    def _deliver_many(self, src: int, dsts: list[int], message: Message) -> None:
        alive, neighbours, nodes, now = self.alive, self.neighbours, self.nodes, self.net.now
        for dst in dsts:
            if alive[dst] and src in neighbours[dst]:
                actions = nodes[dst].receive(src, message, now)
                if actions:
                    self._apply(dst, actions)

    def _upload(self, node: int, action: Upload) -> None:
        peer = action.peer
        assert isinstance(peer, int)
        key = (node, peer, action.index)
        self.flows[key] = self.net.start_flow(node, peer, self._piece_size(action.index), self._uploaded, key)

    def _uploaded(self, key: tuple[int, int, int]) -> None:
        node, peer, index = key
        self.flows.pop(key, None)
        self._apply(node, self.nodes[node].upload_done(peer, index, self.net.now))
        data = b""
        payload = self.scenario.payload
        if payload is not None:
            data = payload.piece(index) if node == ORIGIN else self.stored[node][index]
            if node in self.corrupt:
                data = bytes([data[0] ^ 0xFF]) + data[1:]
        self.net.at(
            self.net.now + self.latency[node] + self.latency[peer],
            self._deliver,
            node,
            peer,
            Piece(self.manifest_id, index, data),
        )

    def _verify(self, node: int, action: Verify) -> None:
        peer = action.peer
        assert isinstance(peer, int)
        payload = self.scenario.payload
        if payload is not None:
            valid = payload.manifest.piece_is_valid(action.index, action.data)
            if valid:
                self.stored[node][action.index] = action.data
        else:
            valid = peer not in self.corrupt
        self._apply(node, self.nodes[node].piece_checked(peer, action.index, valid, self.net.now))

    def _drop_link(self, node: int, peer: int) -> None:
        between = [f for f in self.net.leaving[node] | self.net.entering[node] if peer in (f.src, f.dst)]
        for flow in between:
            self.net.stop_flow(flow)
            self.flows.pop(flow.args[0], None)
        self.neighbours[node].discard(peer)
        if node in self.neighbours[peer]:
            self.neighbours[peer].discard(node)
            self.net.at(
                self.net.now + self.latency[node] + self.latency[peer], self._disconnected, peer, node
            )


def simulate(scenario: SwarmScenario) -> SwarmResult:
    return SwarmSimulation(scenario).run()
