"""Simulated membership at scale: the real overlay, record book and membership state machines
(prime_node/simulation/membership_sim.py) at N = 1,000 and 10,000.

Prints one JSON line per scenario and size: ``formation`` (degrees, connectivity, rounds), ``convergence``
(time until every live node holds a new peer's record, sent at once, and a refresh, riding the beats;
p50/p99/max over the sampled records), ``traffic`` (per-node bytes/s in steady state: beats plus
refreshes, from measured frame sizes and measured copies per record) and ``churn`` (10% leave at once).

    .venv/bin/python benchmarks/membership_sim.py                # N = 1,000 and 10,000 (~1-3 minutes)
    .venv/bin/python benchmarks/membership_sim.py --peers 1000   # one size
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from prime_node.simulation.membership_sim import (
    BEAT_S,
    MembershipScenario,
    MembershipSimulation,
    Spread,
    percentile,
)
from protocol.codec import encode
from protocol.envelope import Domain, seal
from protocol.overlay import NeighbourFrame
from protocol.peer_record import HardwareSummary, PeerRecord
from protocol.record_book import RecordBookConfig, refresh_interval

TRANSPORT_OVERHEAD = 4 + 12 + 2 + 16
"""Per frame on the wire: our length prefix, a yamux header, a Noise length and its AEAD tag."""


def frame_sizes() -> tuple[int, int]:
    """(an empty beat on the wire, what one typical signed peer record adds to a frame), both measured."""
    key = WalletKey.generate()
    peer_id = peer_id_from_public_key(key.public_key)
    record = PeerRecord(
        key.address,
        peer_id,
        "inferer",
        (f"/ip4/203.0.113.7/tcp/4001/p2p/{peer_id}", f"/ip4/203.0.113.7/udp/4001/quic-v1/p2p/{peer_id}"),
        HardwareSummary(cpu_cores=32, ram_mib=262_144, gpu_count=8, gpu_vram_mib=81_920),
        (1200, 1210, 1220, 1230),
        37,
        "0.9.0",
        dataplane_port=4002,
        refresh_s=1800,
    )
    envelope = encode(seal(key, Domain("peer_record", "demo"), encode(record), now_ms=1_764_000_000_000))
    now_ms = 1_764_000_000_000
    empty = len(encode(NeighbourFrame("beat", now_ms, ())))
    with_one = len(encode(NeighbourFrame("beat", now_ms, (envelope,))))
    return empty + TRANSPORT_OVERHEAD, with_one - empty


def summary(spreads: list[Spread]) -> dict[str, Any]:
    times = [s.time_to_all for s in spreads]
    return {
        "records": len(spreads),
        "all_reached": all(s.reached == s.live for s in spreads),
        "time_to_all_p50_s": percentile(times, 0.5),
        "time_to_all_p99_s": percentile(times, 0.99),
        "time_to_all_max_s": max(times),
        "node_arrival_p50_s": percentile([s.p50_arrival for s in spreads], 0.5),
        "hops_mean": round(sum(s.mean_hops for s in spreads) / len(spreads), 2),
        "hops_max": max(s.max_hops for s in spreads),
        "copies_per_node": round(sum(s.copies_per_node for s in spreads) / len(spreads), 2),
    }


def run(peers: int, records: int, seed: int) -> list[dict[str, Any]]:
    started = time.perf_counter()
    scenario = MembershipScenario(peers=peers, seed=seed)
    sim = MembershipSimulation(scenario)
    formation = sim.form()
    lines: list[dict[str, Any]] = [{"scenario": "formation", "peers": peers, **dataclasses.asdict(formation)}]
    sim.sync_books()
    origins = sim.rng.sample(sorted(sim.live), records)
    eager = [sim.spread(origin, 1_000) for origin in origins]
    lazy = [sim.spread(origin, 2_000) for origin in origins]
    lines.append({"scenario": "convergence", "peers": peers, "eager": summary(eager), "lazy": summary(lazy)})

    beat_bytes, record_bytes = frame_sizes()
    config = RecordBookConfig()
    refresh = refresh_interval(peers - 1, config)
    degree = formation.degrees.mean
    copies = summary(lazy)["copies_per_node"]
    beats = 2 * degree * beat_bytes / BEAT_S  # in and out
    refreshes_per_s = peers / refresh
    records_bps = 2 * refreshes_per_s * copies * record_bytes
    lines.append(
        {
            "scenario": "traffic",
            "peers": peers,
            "assumed_beat_bytes": beat_bytes,
            "measured_record_bytes": record_bytes,
            "mean_degree": degree,
            "refresh_interval_s": refresh,
            "swarm_refreshes_per_s": round(refreshes_per_s, 2),
            "record_copies_per_node": copies,
            "beat_bytes_per_s": round(beats),
            "record_bytes_per_s": round(records_bps),
            "total_bytes_per_s": round(beats + records_bps),
        }
    )

    departed = sim.churn(0.1)
    rounds = sim.settle()
    degrees = sim.degrees()
    sim.sync_books()
    after = [sim.spread(origin, 3_000) for origin in sim.rng.sample(sorted(sim.live), max(1, records // 2))]
    lines.append(
        {
            "scenario": "churn",
            "peers": peers,
            "departed": len(departed),
            "refill_rounds": rounds,
            "degrees": dataclasses.asdict(degrees),
            "new_record_after": summary(after),
            "departed_views": [
                dataclasses.asdict(d) for d in sim.departures(departed, summary(lazy)["node_arrival_p50_s"])
            ],
            "wall_s": round(time.perf_counter() - started, 1),
        }
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--peers", type=int, nargs="*", default=[1_000, 10_000])
    parser.add_argument("--records", type=int, default=10, help="sampled records per kind (eager, lazy)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for peers in args.peers:
        for line in run(peers, args.records, args.seed):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
