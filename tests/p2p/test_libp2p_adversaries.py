"""Hostile peers against real libp2p nodes on 127.0.0.1: plaintext dials, forged peer records, flooding."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import trio

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from prime_node.node.clock import NodeClock
from prime_node.node.core import NodeCore
from prime_node.node.gossip import GossipService
from prime_node.node.heartbeats import HEARTBEAT_PROTOCOL
from prime_node.node.metrics import NodeMetrics
from prime_node.node.peers import PeerPolicy
from prime_node.node.runner import local_hardware
from prime_node.node.service import HEARTBEAT_TOPIC
from prime_node.p2p.libp2p_host import Libp2pHost, open_libp2p_host
from protocol.codec import encode
from protocol.envelope import Domain, seal
from protocol.gossip_sequence import GossipFrame
from protocol.peer_record import PeerRecord
from protocol.scoring import Offence, ScoringConfig
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")


def record_for(key: WalletKey, multiaddrs: tuple[str, ...] = ()) -> PeerRecord:
    peer_id = peer_id_from_public_key(key.public_key)
    return PeerRecord(key.address, peer_id, "validator", multiaddrs, local_hardware(), (), 0, "0.1.0")


async def test_a_plaintext_only_dial_is_refused(tmp_path: Path) -> None:
    import multiaddr
    from libp2p import new_host
    from libp2p.crypto.secp256k1 import create_new_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr
    from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport

    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, OPEN, make_config(tmp_path, 0))
        key_pair = create_new_key_pair(os.urandom(32))
        plaintext = new_host(key_pair=key_pair, sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(key_pair)})
        async with plaintext.run([multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
            info = info_from_p2p_addr(multiaddr.Multiaddr(node.advertised_multiaddrs()[0]))
            with pytest.raises(Exception), trio.fail_after(15):  # noqa: B017  (py-libp2p's error types vary)
                await plaintext.connect(info)
            assert str(plaintext.get_id()) not in node.host.connected_peers()
            assert plaintext.get_connected_peers() == []
        nursery.cancel_scope.cancel()


async def _adversary_gossip(host: Libp2pHost, key: WalletKey, nursery: trio.Nursery) -> GossipService:
    clock, metrics = NodeClock(), NodeMetrics()
    policy = PeerPolicy(host, clock, metrics, nursery, ScoringConfig())
    gossip = GossipService(NodeCore(host, key, "test", clock, metrics, policy, nursery))

    async def ignore(_: object) -> None:
        return None

    await gossip.subscribe(HEARTBEAT_TOPIC, ignore)
    return gossip


async def test_a_peer_record_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, OPEN, make_config(tmp_path, 0))
        forger_key, victim_key = WalletKey.generate(), WalletKey.generate()
        async with OPEN(forger_key) as forger:
            gossip = await _adversary_gossip(forger, forger_key, nursery)
            await forger.connect(node.advertised_multiaddrs()[0])
            domain = Domain("gossip", "test")
            topic = f"prime-node/test/{HEARTBEAT_TOPIC}"
            for sequence in range(12):
                # 1: an envelope signed by the victim's key, published over the forger's connection.
                frame = GossipFrame(topic, 1, sequence, encode(record_for(victim_key)))
                now_ms = gossip.clock.wall_ms()
                await forger.publish(topic, encode(seal(victim_key, domain, encode(frame), now_ms=now_ms)))
                # 2: the forger's own envelope around a record that claims the victim's identity.
                await gossip.publish(HEARTBEAT_TOPIC, encode(record_for(victim_key)))
                await trio.sleep(0.4)
            await wait_until(lambda: node.metrics.rejections["signer_mismatch"] >= 2, timeout=10)
            victim_peer_id = peer_id_from_public_key(victim_key.public_key)
            assert node.membership.get(victim_peer_id) is None
            assert node.membership.get(forger.peer_id) is None
            assert node.policy.score(forger.peer_id) < 0
        nursery.cancel_scope.cancel()


async def test_a_direct_heartbeat_signed_by_another_key_is_refused(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, OPEN, make_config(tmp_path, 0))
        forger_key, victim_key = WalletKey.generate(), WalletKey.generate()
        async with OPEN(forger_key) as forger:
            await forger.connect(node.advertised_multiaddrs()[0])
            stream = await forger.open_stream(node.identity.peer_id, HEARTBEAT_PROTOCOL)
            domain = Domain("heartbeat", "test")
            now_ms = node.direct_heartbeats.clock.wall_ms()
            await stream.send_frame(
                encode(seal(victim_key, domain, encode(record_for(victim_key)), now_ms=now_ms))
            )
            await stream.send_frame(
                encode(seal(forger_key, domain, encode(record_for(victim_key)), now_ms=now_ms))
            )
            await stream.send_frame(b"\x93\x01junk")
            await wait_until(lambda: node.metrics.rejections["signer_mismatch"] >= 2, timeout=10)
            await wait_until(lambda: node.metrics.rejections["malformed"] >= 1, timeout=10)
            assert node.membership.get(peer_id_from_public_key(victim_key.public_key)) is None
            assert node.membership.get(forger.peer_id) is None
            expected = -(2 * ScoringConfig().penalties[Offence.SIGNER_MISMATCH])
            assert node.policy.score(forger.peer_id) <= expected + 5  # (minus a few seconds' recovery)
            await stream.close()
        nursery.cancel_scope.cancel()


async def test_a_flooding_peer_is_banned_while_the_others_keep_delivering(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        # Honest nodes send one heartbeat per second; ten per second from one origin is a flood.
        scoring = ScoringConfig(flood_limit=10)
        first, _ = await start_node(nursery, OPEN, make_config(tmp_path, 0), scoring=scoring)
        boot = first.advertised_multiaddrs()[0]
        nodes = [first]
        for i in range(1, 4):
            node, _ = await start_node(
                nursery, OPEN, make_config(tmp_path, i, bootstrap=(boot,)), scoring=scoring
            )
            nodes.append(node)
        await wait_until(lambda: all(sees_all(n, nodes) for n in nodes), timeout=30)
        flooder_key = WalletKey.generate()
        async with OPEN(flooder_key) as flooder:
            gossip = await _adversary_gossip(flooder, flooder_key, nursery)
            for node in nodes:
                await flooder.connect(node.advertised_multiaddrs()[0])
            record = encode(record_for(flooder_key, tuple(flooder.listen_multiaddrs())))
            await trio.sleep(1.5)  # let the gossip mesh include the flooder

            async def flood() -> None:
                while True:
                    await gossip.publish(HEARTBEAT_TOPIC, record)
                    await trio.sleep(1 / 80)

            with trio.move_on_after(25):
                async with trio.open_nursery() as flood_nursery:
                    flood_nursery.start_soon(flood)
                    await wait_until(
                        lambda: all(n.policy.is_banned(flooder.peer_id) for n in nodes), timeout=24
                    )
                    flood_nursery.cancel_scope.cancel()
            assert all(n.policy.is_banned(flooder.peer_id) for n in nodes)
            before = [n.metrics.counters["heartbeats_received"] for n in nodes]
            await trio.sleep(3 * first.config.heartbeat_interval)
            for node, count in zip(nodes, before, strict=True):
                assert node.metrics.counters["heartbeats_received"] >= count + 2 * (len(nodes) - 1)
                assert sees_all(node, nodes)
                assert flooder.peer_id not in node.host.connected_peers() or node.policy.is_banned(
                    flooder.peer_id
                )
            for node in nodes:
                assert all(node.policy.score(o.identity.peer_id) == 0.0 for o in nodes if o is not node)
        nursery.cancel_scope.cancel()
