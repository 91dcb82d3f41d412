"""The RL loop with both inferers behind NAT (tests/p2p/nat_swarm.py): trainer and validator on a
public peer, one inferer in each of two homes behind MASQUERADE routers. Each home fetches checkpoints,
links its data plane to the other home's over their hole-punched connection, and publishes rollouts that
are validated and trained on. Bulk bytes never ride the relay (a relayed fallback stream is refused).
(The piece trade between homes: tests/p2p/test_nat_netns.py.)

Slow and root-only; skipped where namespaces or iptables are not available.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from prime_node.demo.orchestrator import child_env
from prime_node.testing.netns_nat import NatLab
from tests.p2p.nat_swarm import HOMES, NatSwarm

pytestmark = pytest.mark.slow
DEADLINE_S = float(os.environ.get("NAT_SWARM_DEADLINE", "420"))


# The swarm's own deadline must come first: its NatSwarmError names what was missing and carries the
# nodes' log tails, where pytest-timeout's default (300 s, below DEADLINE_S) only dumps thread stacks.
@pytest.mark.timeout(DEADLINE_S + 120)
def test_two_inferers_behind_nat_fetch_checkpoints_and_get_rollouts_validated_and_trained_on(
    tmp_path: Path,
) -> None:
    why_not = NatLab.available()
    if why_not is not None:
        pytest.skip(f"network namespaces: {why_not}")
    with NatLab() as lab:
        result = NatSwarm(lab, tmp_path, steps=6, env=child_env()).run(DEADLINE_S)
    print("NAT swarm:", json.dumps(result))
    assert result["steps"] >= 6
    for home in HOMES:
        assert result["reachability"][home] == "private"
        assert result["checkpoint_bytes_in"][home] > 0, result
        assert result["accepted_batches"][home] > 0, result  # validated, then trained on
    assert sum(result["hole_punches_ok"].values()) >= 1
    for direction in ("inferer-1->inferer-2", "inferer-2->inferer-1"):
        trade = result["home_to_home"][direction]
        assert trade["bytes"] > 0 and trade["route"] == "libp2p", result  # over the hole-punched connection
    assert result["dataplane_bytes_in_by_route"].get("relayed", 0) == 0
    assert result["relayed_share"] == 0.0
