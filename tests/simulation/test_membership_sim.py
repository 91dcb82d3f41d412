"""The membership simulator at small N: the real overlay and record book keep their invariants."""

from __future__ import annotations

from prime_node.simulation.membership_sim import MembershipScenario, MembershipSimulation
from protocol.overlay import OverlayConfig

PEERS = 200


def _formed(seed: int = 1) -> MembershipSimulation:
    sim = MembershipSimulation(MembershipScenario(peers=PEERS, seed=seed))
    formation = sim.form()
    assert formation.rounds < 20 * sim.scenario.max_rounds  # every batch settled before the bound
    sim.sync_books()
    return sim


def test_overlay_settles_connected_with_bounded_symmetric_degrees() -> None:
    sim = _formed()
    config = sim.scenario.overlay
    degrees = sim.degrees()
    assert degrees.connected and degrees.symmetric
    assert degrees.below_degree == 0 and degrees.min >= config.degree
    for peer_id in sim.live:
        overlay = sim.overlays[peer_id]
        assert len(overlay.links) <= config.max_degree
        assert peer_id not in overlay.links and not overlay.opening


def test_small_max_degree_still_forms_a_connected_overlay() -> None:
    scenario = MembershipScenario(peers=PEERS, seed=2, overlay=OverlayConfig(degree=3, max_degree=4))
    sim = MembershipSimulation(scenario)
    sim.form()
    degrees = sim.degrees()
    assert degrees.max <= 4 and degrees.connected and degrees.symmetric


def test_new_record_and_refresh_reach_every_live_node() -> None:
    sim = _formed()
    origin = sorted(sim.live)[7]
    eager = sim.spread(origin, 1_000)
    lazy = sim.spread(origin, 2_000)
    for spread in (eager, lazy):
        assert spread.reached == spread.live == PEERS
        assert 1 <= spread.copies_per_node <= sim.scenario.overlay.max_degree
    assert eager.eager and not lazy.eager
    assert eager.time_to_all < lazy.time_to_all  # sent at once vs riding the next beats
    for peer_id in sim.live:
        held = sim.books[peer_id].get(origin)
        assert held is not None and held.issued_ms == 2_000
        assert all(sim.books[peer_id].pending_count(n) == 0 for n in sim.books[peer_id].links())


def test_survivors_refill_links_after_ten_percent_churn() -> None:
    sim = _formed(seed=3)
    departed = sim.churn(0.1)
    assert len(departed) == PEERS // 10
    rounds = sim.settle()
    assert rounds < sim.scenario.max_rounds
    degrees = sim.degrees()
    assert degrees.connected and degrees.symmetric and degrees.below_degree == 0
    assert degrees.max <= sim.scenario.overlay.max_degree
    assert not any(set(departed) & sim.overlays[p].links for p in sim.live)
    sim.sync_books()
    spread = sim.spread(sorted(sim.live)[0], 3_000)
    assert spread.reached == spread.live == PEERS - len(departed)


def test_departed_peers_age_out_slower_for_non_neighbours_than_for_neighbours() -> None:
    sim = _formed(seed=4)
    departed = sim.churn(0.1)
    far, near = sim.departures(departed, 1.0)
    assert near.healthy_max <= 6.0 + 0.2 and near.dead_max <= 12.0 + 0.2
    assert far.refresh_s == (PEERS - 1 + 1) / 2
    assert far.healthy_max <= 2.5 * far.refresh_s + 1 and far.dead_max <= 5 * far.refresh_s + 1
    assert far.healthy_p50 > near.dead_max


def test_the_simulation_is_deterministic_from_its_seed() -> None:
    first, second = _formed(seed=5), _formed(seed=5)
    assert first.degrees() == second.degrees()
    origin = sorted(first.live)[0]
    assert first.spread(origin, 1_000) == second.spread(origin, 1_000)
