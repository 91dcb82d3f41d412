"""The RL loop across NAT in network namespaces (needs root and iptables): trainer and validator public,
one inferer in each of two homes behind MASQUERADE routers (tests/p2p/nat_swarm.py).

Prints ONE JSON line: ``relayed_share`` (data-plane bytes that went through a relay / all data-plane
bytes received; goal <= 0.05), ``time_to_direct_s`` per home (its first relayed connection to a direct
one, as the node measures it), data-plane bytes received per route (``tcp``: the data plane's own TCP
connection; ``libp2p``: the fallback stream on a direct, hole-punched libp2p connection; ``relayed``),
what the homes' data planes sent each other, checkpoint bytes and accepted batches per home, and the
wall time. (The demo's checkpoints are small; the piece trade between homes is measured by
tests/p2p/test_nat_netns.py's trade test.)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prime_node.demo.orchestrator import child_env
from prime_node.testing.netns_nat import NatLab
from tests.p2p.nat_swarm import NatSwarm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--deadline", type=float, default=600.0)
    args = parser.parse_args()
    why_not = NatLab.available()
    if why_not is not None:
        print(json.dumps({"benchmark": "nat_swarm", "skipped": why_not}))
        return
    with tempfile.TemporaryDirectory(prefix="nat-swarm-") as workdir, NatLab() as lab:
        result = NatSwarm(lab, Path(workdir), steps=args.steps, env=child_env(), say=lambda _: None).run(
            args.deadline
        )
    print(json.dumps({"benchmark": "nat_swarm", **result}))


if __name__ == "__main__":
    main()
