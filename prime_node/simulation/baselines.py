"""What the swarm replaces, under the same modelled links, for comparison.

- One-tier origin: every peer downloads the whole checkpoint straight from the origin (one HTTP server).
  The origin's upload is water-filled among the downloads still running; each download is also capped by
  its peer's download rate. This is exact for the fluid model, so it is computed in closed form per
  completion rather than event by event.
- Relay tree (SHARDCAST-like): the origin sends to ``fanout`` relays, each relay to ``fanout`` more, and so
  on (the fastest uploaders placed nearest the root, which favours the baseline). Each node forwards
  piece by piece as pieces arrive (pipelined, as SHARDCAST's shards are), one flow per child at a time,
  over the same fluid network as the swarm.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from prime_node.simulation.fluid import FluidNetwork
from prime_node.simulation.links import Link, LinkModel


@dataclass(frozen=True)
class BaselineResult:
    broadcast_time: float
    events: int


def one_tier(size: float, origin: Link, peers: list[Link]) -> BaselineResult:
    """Every peer downloads ``size`` bytes from the origin at once, the origin's upload water-filled among
    the downloads still running. Steps from one completion to the next (exact for the fluid model)."""
    remaining = {i: size for i in range(len(peers))}
    now = 0.0
    steps = 0
    while remaining:
        rates = _water_fill(origin.upload, {i: peers[i].download for i in remaining})
        step = min(remaining[i] / rates[i] for i in remaining)
        now += step
        steps += 1
        for i in list(remaining):
            remaining[i] -= rates[i] * step
            if remaining[i] <= size * 1e-12:
                del remaining[i]
    latency = max(origin.latency + p.latency for p in peers)
    return BaselineResult(now + 2 * latency, steps)


def _water_fill(capacity: float, caps: dict[int, float]) -> dict[int, float]:
    rates = {}
    left = capacity
    ordered = sorted(caps.items(), key=lambda item: item[1])
    for position, (key, cap) in enumerate(ordered):
        rate = min(cap, left / (len(ordered) - position))
        rates[key] = rate
        left -= rate
    return rates


def relay_tree(size: float, pieces: int, origin: Link, peers: list[Link], *, fanout: int) -> BaselineResult:
    """A pipelined relay tree of the given fanout (see the module doc)."""
    order = sorted(range(1, len(peers) + 1), key=lambda i: -peers[i - 1].upload)
    parent_of: dict[int, int] = {}
    children: dict[int, list[int]] = {0: []}
    queue = [0]
    head = 0
    for node in order:
        while len(children[queue[head]]) >= fanout:
            head += 1
        parent = queue[head]
        children[parent].append(node)
        children[node] = []
        parent_of[node] = parent
        queue.append(node)
    links = [origin, *peers]
    net = FluidNetwork([x.upload for x in links], [x.download for x in links])
    piece = size / pieces
    held = [0] * len(links)
    held[0] = pieces
    sending: set[tuple[int, int]] = set()
    sent = {(parent, child): 0 for child, parent in parent_of.items()}
    finish: list[float] = []

    def pump(parent: int) -> None:
        for child in children[parent]:
            link = (parent, child)
            if link in sending or sent[link] >= held[parent]:
                continue
            sending.add(link)
            net.start_flow(parent, child, piece, arrived, parent, child)

    def arrived(parent: int, child: int) -> None:
        sending.discard((parent, child))
        sent[(parent, child)] += 1
        net.at(net.now + links[parent].latency + links[child].latency, received, child)
        pump(parent)

    def received(child: int) -> None:
        held[child] += 1
        if held[child] == pieces:
            finish.append(net.now)
        pump(child)

    net.at(0.0, pump, 0)
    net.run()
    return BaselineResult(max(finish), net.events)


def draw_links(model: LinkModel, peers: int, seed: int) -> tuple[Link, list[Link]]:
    """The same links the swarm simulation of this seed draws (origin first, then the peers)."""
    rng = random.Random(seed)
    origin = model.origin(rng)
    return origin, model.draw(peers, rng)
