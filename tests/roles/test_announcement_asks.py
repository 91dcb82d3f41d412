"""Whom a joiner asks for the run announcement directly (``/prime-node/run/1``), on the memory network."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import trio

from crypto.keys import WalletKey
from prime_node.p2p.interface import FramedStream
from prime_node.roles.announcement import RUN_PROTOCOL, UNPINNED_ASKS, RunFollower
from prime_node.testing.memory_network import MemoryNetwork
from tests.p2p.helpers import make_config, start_node, wait_until

PEERS = 6


async def asks_by(tmp_path: Path, follower: RunFollower) -> Counter[str]:
    """Start PEERS nodes, then one running ``follower`` that bootstraps from all of them; count the asks
    each peer receives over 10 intervals (none of them has an announcement to give)."""
    network = MemoryNetwork()
    asked: Counter[str] = Counter()
    async with trio.open_nursery() as nursery:
        peers = [
            (await start_node(nursery, network.host, make_config(tmp_path, i), serve_api=False))[0]
            for i in range(PEERS)
        ]
        for peer in peers:

            async def count(stream: FramedStream, peer_id: str = peer.identity.peer_id) -> None:
                asked[peer_id] += 1

            peer.host.set_stream_handler(RUN_PROTOCOL, count)
        bootstrap = tuple(p.host.listen_multiaddrs()[0] for p in peers)
        joiner, _ = await start_node(
            nursery,
            network.host,
            make_config(tmp_path, PEERS, bootstrap=bootstrap),
            services=(follower,),
            serve_api=False,
        )
        await wait_until(lambda: len(joiner.host.connected_peers()) == PEERS, timeout=30)
        await trio.sleep(10 * joiner.config.heartbeat_interval)
        nursery.cancel_scope.cancel()
    return asked


async def test_an_unpinned_joiner_asks_only_its_first_few_peers(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """Without a pin nobody but the trainer and pinned followers has an answer, and gossip brings it:
    asking each of ~18 connected peers was a stream each, for every joiner of a burst."""
    asked = await asks_by(tmp_path, RunFollower("test"))
    assert sum(asked.values()) == UNPINNED_ASKS
    assert max(asked.values()) == 1


async def test_a_pinned_joiner_asks_every_peer_until_it_believes(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """With a pin (here a trainer nobody has heard of) it keeps asking everyone: a peer may learn of the
    run later, and the pinned announcement is what lets the joiner start."""
    asked = await asks_by(tmp_path, RunFollower("test", pinned=WalletKey.generate().address))
    assert len(asked) == PEERS
    assert min(asked.values()) >= 2
