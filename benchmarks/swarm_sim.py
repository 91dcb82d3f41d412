"""Simulated checkpoint broadcast: the weight swarm vs the physical bound T*, a one-tier origin and a
SHARDCAST-like relay tree, all under the same modelled links (prime_node/simulation).

Prints one JSON line per configuration, each with ``ratio_to_bound`` = broadcast time / T*, where
T* = max(F/u_s, F/d_min, N·F/(u_s + Σu_i)). Goal for the swarm: ≤ 1.3 at N = 1,000 and 10,000.

    .venv/bin/python benchmarks/swarm_sim.py                 # N = 1,000 and 10,000 (several minutes)
    .venv/bin/python benchmarks/swarm_sim.py --peers 1000    # one size
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

from prime_node.simulation.baselines import one_tier, relay_tree
from prime_node.simulation.links import MB
from prime_node.simulation.swarm_sim import SwarmScenario, SwarmSimulation

CHECKPOINT_BYTES = 16_000 * MB


def swarm_line(peers: int, pieces: int, seed: int, leave_rate: float) -> dict[str, Any]:
    scenario = SwarmScenario(
        peers=peers, size=CHECKPOINT_BYTES, pieces=pieces, seed=seed, leave_rate=leave_rate
    )
    result = SwarmSimulation(scenario).run()
    finished = sorted(result.finish[p] for p in result.live if p in result.finish and p != 0)
    return {
        "benchmark": "swarm_sim",
        "strategy": "swarm" if not leave_rate else "swarm_churn",
        "peers": peers,
        "pieces": pieces,
        "checkpoint_bytes": CHECKPOINT_BYTES,
        "seed": seed,
        "leave_rate": leave_rate,
        "peers_left": peers + 1 - len(result.live),
        "ratio_to_bound": round(result.ratio_to_bound, 4),
        "broadcast_s": round(result.broadcast_time, 2),
        "bound_s": round(result.bound, 2),
        "median_finish_s": round(finished[len(finished) // 2], 2) if finished else None,
        "all_complete": result.all_live_complete,
        "events": result.events,
        "wall_s": round(result.wall_seconds, 1),
    }


def baseline_lines(peers: int, pieces: int, seed: int, fanout: int) -> list[dict[str, Any]]:
    sim = SwarmSimulation(SwarmScenario(peers=peers, size=CHECKPOINT_BYTES, pieces=pieces, seed=seed))
    origin, links = sim.links[0], sim.links[1:]
    lines = []
    started = time.perf_counter()
    flat = one_tier(CHECKPOINT_BYTES, origin, links)
    lines.append(
        {
            "benchmark": "swarm_sim",
            "strategy": "one_tier_origin",
            "peers": peers,
            "seed": seed,
            "ratio_to_bound": round(flat.broadcast_time / sim.bound, 4),
            "broadcast_s": round(flat.broadcast_time, 2),
            "bound_s": round(sim.bound, 2),
            "wall_s": round(time.perf_counter() - started, 1),
        }
    )
    started = time.perf_counter()
    tree = relay_tree(CHECKPOINT_BYTES, pieces, origin, links, fanout=fanout)
    lines.append(
        {
            "benchmark": "swarm_sim",
            "strategy": f"relay_tree_fanout{fanout}",
            "peers": peers,
            "pieces": pieces,
            "seed": seed,
            "ratio_to_bound": round(tree.broadcast_time / sim.bound, 4),
            "broadcast_s": round(tree.broadcast_time, 2),
            "bound_s": round(sim.bound, 2),
            "events": tree.events,
            "wall_s": round(time.perf_counter() - started, 1),
        }
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--peers", type=int, nargs="*", default=[1000, 10000])
    parser.add_argument("--pieces", type=int, default=128, help="pieces per simulated checkpoint")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--fanout", type=int, default=4, help="relay tree fanout")
    parser.add_argument(
        "--churn", type=float, default=0.1, help="leave rate of the churn run (at the smallest N)"
    )
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    jobs: list[Future[Any]] = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for peers in sorted(args.peers, reverse=True):  # the longest first
            jobs.append(pool.submit(swarm_line, peers, args.pieces, args.seed, 0.0))
        if args.churn:
            jobs.append(pool.submit(swarm_line, min(args.peers), args.pieces, args.seed, args.churn))
        for peers in sorted(args.peers):
            jobs.append(pool.submit(baseline_lines, peers, args.pieces, args.seed, args.fanout))
        for job in jobs:
            result = job.result()
            for line in result if isinstance(result, list) else [result]:
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
