"""Simulated swarms driving the real SwarmNode state machines, with real bytes checked against a real
manifest: corrupting peers, seeders killed mid-transfer, churn, and the origin's super-seeding."""

from __future__ import annotations

import random

import pytest

from crypto.digests import blake3
from crypto.keys import WalletKey
from prime_node.simulation.baselines import one_tier, relay_tree
from prime_node.simulation.links import MB, LinkModel
from prime_node.simulation.swarm_sim import (
    ORIGIN,
    Payload,
    SwarmResult,
    SwarmScenario,
    SwarmSimulation,
    simulate,
)
from protocol.manifest import build_manifest
from protocol.swarm.swarm_node import Upload

PIECE = 1024


def make_payload(size: int = 48 * PIECE + 100, seed: int = 0) -> Payload:
    data = random.Random(seed).randbytes(size)
    hashes = b"".join(blake3(data[i : i + PIECE]) for i in range(0, size, PIECE))
    manifest = build_manifest(
        run="sim",
        step=1,
        piece_size=PIECE,
        files=[("config.json", 100), ("model.safetensors", size - 100)],
        piece_hashes=hashes,
        signer=WalletKey(bytes(31) + b"\x01").address,
    )
    return Payload(manifest, data)


# Slow links so that a few kilobytes take visible time next to the latencies.
SLOW = LinkModel(upload_range=(2_000, 20_000), download_range=(20_000, 100_000), origin_upload=50_000)


def scenario(**changes: object) -> SwarmScenario:
    base: dict[str, object] = {
        "peers": 24,
        "size": 0.0,
        "pieces": 0,
        "degree": 6,
        "origin_degree": 4,
        "links": SLOW,
        "payload": make_payload(),
        "seed": 3,
    }
    base.update(changes)
    return SwarmScenario(**base)  # type: ignore[arg-type]


def assert_identical(result: SwarmResult, payload: Payload, peers: set[int]) -> None:
    count = payload.manifest.piece_count
    for peer in peers:
        stored = result.stored[peer]
        assert sorted(stored) == list(range(count)), f"peer {peer} is missing pieces"
        assert b"".join(stored[i] for i in range(count)) == payload.data


def test_every_peer_ends_with_identical_bytes() -> None:
    payload = make_payload()
    result = simulate(scenario(payload=payload))
    assert result.all_live_complete
    assert_identical(result, payload, result.live - {ORIGIN})
    assert not result.banned
    assert result.bound < result.broadcast_time < float("inf")


def test_corrupting_peers_are_banned_and_everyone_else_completes_byte_identical() -> None:
    payload = make_payload(seed=1)
    sim = SwarmSimulation(scenario(payload=payload, corrupt_peers=3, seed=5))
    result = sim.run()
    honest = result.live - {ORIGIN} - sim.corrupt
    assert_identical(result, payload, honest)
    banned_by_anyone = set().union(*result.banned.values()) if result.banned else set()
    assert banned_by_anyone <= sim.corrupt, "an honest peer was banned"
    # Every corrupting peer that uploaded anything got banned by whoever received it.
    assert banned_by_anyone, "no corrupt piece was ever sent"
    for bad in banned_by_anyone:
        assert all(bad not in sim.nodes[p].peers for p in range(len(sim.nodes)) if bad in sim.nodes[p].banned)


def test_half_the_seeders_killed_mid_transfer_the_rest_complete() -> None:
    payload = make_payload(seed=2)
    calm = simulate(scenario(payload=payload, seed=7))
    kill_at = calm.broadcast_time / 2
    sim = SwarmSimulation(scenario(payload=payload, seed=7, kills=((kill_at, 0.5),)))
    result = sim.run()
    killed = set(range(1, len(sim.nodes))) - result.live
    assert len(killed) >= 5, "the kill should hit a good share of the swarm"
    assert any(p not in result.finish or result.finish[p] > kill_at for p in result.live - {ORIGIN})
    assert result.all_live_complete
    assert_identical(result, payload, result.live - {ORIGIN})


def test_random_churn_leaves_every_remaining_peer_complete() -> None:
    payload = make_payload(seed=4)
    result = simulate(scenario(payload=payload, leave_rate=0.3, seed=11))
    assert len(result.live) < 25
    assert result.all_live_complete
    assert_identical(result, payload, result.live - {ORIGIN})


class RecordingSimulation(SwarmSimulation):
    """Notes every upload the origin starts, in order."""

    def __init__(self, scenario: SwarmScenario) -> None:
        super().__init__(scenario)
        self.origin_uploads: list[int] = []

    def _upload(self, node: int, action: Upload) -> None:
        if node == ORIGIN:
            self.origin_uploads.append(action.index)
        super()._upload(node, action)


def test_origin_serves_every_piece_once_before_any_piece_twice() -> None:
    sim = RecordingSimulation(scenario(seed=13))
    result = sim.run()
    assert result.all_live_complete
    count = sim.piece_count
    first_pass = sim.origin_uploads[:count]
    assert sorted(first_pass) == list(range(count)), "a piece was served twice before all were served"


def test_no_payload_swarm_beats_both_baselines() -> None:
    size = 1_000 * MB
    sim = SwarmSimulation(SwarmScenario(peers=150, size=size, pieces=64, seed=1))
    result = sim.run()
    assert result.all_live_complete
    origin, peers = sim.links[0], sim.links[1:]
    assert result.broadcast_time >= result.bound
    assert result.broadcast_time < relay_tree(size, 64, origin, peers, fanout=4).broadcast_time
    assert result.broadcast_time < one_tier(size, origin, peers).broadcast_time


def test_one_tier_matches_the_closed_form_when_the_origin_is_the_bottleneck() -> None:
    model = LinkModel()
    rng = random.Random(0)
    origin, peers = model.origin(rng), model.draw(50, rng)
    result = one_tier(1_000 * MB, origin, peers)
    latency = max(origin.latency + p.latency for p in peers)
    assert result.broadcast_time == pytest.approx(50 * 1_000 * MB / origin.upload + 2 * latency)


@pytest.mark.slow
@pytest.mark.timeout(900)  # hang guard: ~10 × a quiet run
def test_a_thousand_peers_complete_and_beat_the_relay_tree() -> None:
    size = 16_000 * MB
    sim = SwarmSimulation(SwarmScenario(peers=1000, size=size, pieces=64, seed=2))
    result = sim.run()
    assert result.all_live_complete and len(result.finish) == 1000
    origin, peers = sim.links[0], sim.links[1:]
    assert result.broadcast_time < relay_tree(size, 64, origin, peers, fanout=4).broadcast_time
