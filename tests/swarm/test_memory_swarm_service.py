"""Whole SwarmServices on in-process nodes (prime_node/testing/memory_network.py) whose data planes run on
memory streams (prime_node/testing/memory_streams.py), under trio's autojump clock: gossip announcement,
neighbour choice from peer records, manifest exchange, fetch and follow, with every timer virtual."""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from crypto.keys import WalletKey
from prime_node.node.service import Node
from prime_node.swarm.service import SwarmService, SwarmSettings
from prime_node.testing.memory_network import MemoryNetwork
from prime_node.testing.memory_streams import MemoryStreamNetwork
from prime_node.testing.swarm_fixtures import read_tree, write_model_dir
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until


async def test_two_followers_fetch_the_trainers_checkpoint_over_memory_streams(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    hosts, streams = MemoryNetwork(), MemoryStreamNetwork()
    trainer_key = WalletKey.generate()
    model = write_model_dir(tmp_path / "model", weight_bytes=1 << 18, shards=2, seed=5)
    nodes: list[Node] = []
    swarms: list[SwarmService] = []
    async with trio.open_nursery() as nursery:
        for index in range(3):
            host = f"10.0.0.{index + 1}"
            swarm = SwarmService(
                key=trainer_key if index == 0 else WalletKey.generate(),
                run_id="test",
                trainer=trainer_key.address,
                store_dir=tmp_path / f"store{index}",
                transport=streams,
                settings=SwarmSettings(dataplane_host=host, seed=index),
            )
            # Peer records advertise an IP host, which is where neighbours dial the memory data plane.
            bootstrap = tuple(nodes[0].host.listen_multiaddrs()) if nodes else ()
            config = make_config(tmp_path, index, announce=(f"/ip4/{host}/tcp/4001",), bootstrap=bootstrap)
            node, _ = await start_node(
                nursery, hosts.host, config, key=swarm.key, services=[swarm], serve_api=False
            )
            nodes.append(node)
            swarms.append(swarm)
        await wait_until(lambda: all(sees_all(node, nodes) for node in nodes), timeout=60)
        manifest = await swarms[0].share(model, step=1, piece_size=16 << 10)
        with trio.fail_after(600):
            fetched = [await follower.wait_newer(None) for follower in swarms[1:]]
        assert [step for step, _ in fetched] == [1, 1]
        for _, directory in fetched:
            assert read_tree(directory) == read_tree(model)
        assert all(follower.progress(manifest.id()) == (manifest.piece_count,) * 2 for follower in swarms[1:])
        assert streams.dials > 0 and all(follower.dataplane.bytes_in > 0 for follower in swarms[1:])
        nursery.cancel_scope.cancel()
