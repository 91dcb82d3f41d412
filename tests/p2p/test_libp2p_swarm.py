"""Real libp2p hosts on 127.0.0.1 (TCP + Noise + yamux, Kademlia, gossipsub), several nodes per process."""

from __future__ import annotations

import functools
from pathlib import Path

import trio

from prime_node.p2p.libp2p_host import open_libp2p_host
from protocol.membership import PeerState
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")


async def test_eight_nodes_find_all_others_from_one_bootstrap_and_mark_a_killed_one_dead(
    tmp_path: Path,
) -> None:
    async with trio.open_nursery() as nursery:
        first, _ = await start_node(nursery, OPEN, make_config(tmp_path, 0))
        boot = first.advertised_multiaddrs()[0]
        nodes = [first]
        scopes = []
        for i in range(1, 8):
            node, scope = await start_node(nursery, OPEN, make_config(tmp_path, i, bootstrap=(boot,)))
            nodes.append(node)
            scopes.append(scope)
        await wait_until(lambda: all(sees_all(n, nodes) for n in nodes), timeout=45)
        # Eight nodes are fewer than the default degree, so the overlay links every pair: each node
        # then learns the victim's death from its own missed beats (non-neighbours age out with records).
        await wait_until(lambda: all(len(n.links.neighbours()) == len(nodes) - 1 for n in nodes), timeout=30)
        victim = nodes[5]
        scopes[4].cancel()
        # Every other node marks it dead; how soon (dead window + beats) is asserted in virtual time by
        # tests/p2p/test_node_memory.py, since a loaded machine stretches real beats.
        config = first.config
        await wait_until(
            lambda: all(
                victim.identity.peer_id in n.peers_in(PeerState.DEAD) for n in nodes if n is not victim
            ),
            timeout=10 * (config.dead_window + 3 * config.heartbeat_interval),
        )
        nursery.cancel_scope.cancel()
