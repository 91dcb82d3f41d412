"""Hostile peers against real libp2p nodes on 127.0.0.1: plaintext dials, forged peer records passed on
by a neighbour, flooding."""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

import pytest
import trio

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.node.neighbour_links import NEIGHBOUR_PROTOCOL
from prime_node.node.runner import local_hardware
from prime_node.node.service import Node
from prime_node.p2p.interface import FramedStream
from prime_node.p2p.libp2p_host import Libp2pHost, open_libp2p_host
from protocol.codec import decode, encode
from protocol.envelope import Domain, seal
from protocol.overlay import MAX_NEIGHBOUR_FRAME, FrameKind, NeighbourFrame
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


def _record_envelope(signer: WalletKey, record: PeerRecord, now_ms: int) -> bytes:
    return encode(seal(signer, Domain("peer_record", "test"), encode(record), now_ms=now_ms))


def _frame(kind: FrameKind, records: tuple[bytes, ...], now_ms: int) -> bytes:
    return encode(NeighbourFrame(kind.value, now_ms, records))


async def _open_link(forger: Libp2pHost, key: WalletKey, node: Node) -> FramedStream:
    """Become the node's neighbour the honest way: a hello with our own valid record. A node that learned
    our record from another node (a loaded machine makes that likelier) may be opening a link to us at the
    same moment; of two such links the smaller peer ID's stays, so it may answer busy: we serve no
    neighbour protocol, its attempt fails, and we say hello again, as an honest peer would."""
    await forger.connect(node.advertised_multiaddrs()[0])
    with trio.fail_after(60):  # a guard against a hang
        while True:
            stream = await forger.open_stream(node.identity.peer_id, NEIGHBOUR_PROTOCOL)
            now_ms = node.links.clock.wall_ms()
            own = _record_envelope(key, record_for(key, tuple(forger.listen_multiaddrs())), now_ms)
            await stream.send_frame(_frame(FrameKind.HELLO, (own,), now_ms))
            answer = await stream.receive_frame(MAX_NEIGHBOUR_FRAME)
            assert answer is not None
            kind = decode(answer, NeighbourFrame).kind
            if kind == FrameKind.WELCOME:
                return stream
            assert kind == FrameKind.BUSY and node.identity.peer_id < forger.peer_id
            await stream.close()
            await trio.sleep(0.5)


async def test_forged_peer_records_passed_on_by_a_neighbour_are_refused_and_charged(tmp_path: Path) -> None:
    """Passing on others' records is what neighbours do, so a record signed by its owner is taken whoever
    relays it; a record about one key signed by another, or with a broken signature, is refused and the
    neighbour who passed it on is charged."""
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, OPEN, make_config(tmp_path, 0))
        forger_key, victim_key, honest_key = WalletKey.generate(), WalletKey.generate(), WalletKey.generate()
        async with OPEN(forger_key) as forger:
            stream = await _open_link(forger, forger_key, node)
            now_ms = node.links.clock.wall_ms()
            claims_victim = _record_envelope(forger_key, record_for(victim_key), now_ms)
            relayed = _record_envelope(honest_key, record_for(honest_key), now_ms)
            broken = bytearray(_record_envelope(victim_key, record_for(victim_key), now_ms))
            broken[-10] ^= 0xFF  # inside the signature
            await stream.send_frame(_frame(FrameKind.BEAT, (claims_victim, relayed, bytes(broken)), now_ms))
            await stream.send_frame(b"\x93\x01junk")
            await wait_until(lambda: node.metrics.rejections["signer_mismatch"] >= 1, timeout=10)
            await wait_until(lambda: node.metrics.rejections["malformed"] >= 1, timeout=10)
            await wait_until(
                lambda: node.membership.get(peer_id_from_public_key(honest_key.public_key)) is not None,
                timeout=10,
            )
            assert node.metrics.rejections["bad_signature"] + node.metrics.rejections["signer_mismatch"] >= 2
            assert node.membership.get(peer_id_from_public_key(victim_key.public_key)) is None
            penalties = ScoringConfig().penalties
            assert node.policy.score(forger.peer_id) <= -penalties[Offence.SIGNER_MISMATCH] + 5
            await stream.close()
        nursery.cancel_scope.cancel()


async def test_a_flooding_peer_is_banned_while_the_others_keep_delivering(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        # Honest neighbours send one frame per second; ten per second from one peer is a flood.
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
            streams = [await _open_link(flooder, flooder_key, node) for node in nodes]

            async def flood(stream: FramedStream) -> None:
                with contextlib.suppress(NodeError):  # until the node hangs up on us
                    while True:
                        await stream.send_frame(_frame(FrameKind.BEAT, (), first.links.clock.wall_ms()))
                        await trio.sleep(1 / 80)

            with trio.move_on_after(25):
                async with trio.open_nursery() as flood_nursery:
                    for stream in streams:
                        flood_nursery.start_soon(flood, stream)
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
