"""The gossipsub router's heartbeat (prime_node/p2p/gossip_router.py): fast while a mesh is thin or
changing, slow once every topic's mesh holds degree_low..degree_high peers or every subscriber there is;
and a real two-host swarm still delivers a publish at once while the router is settled."""

from __future__ import annotations

import functools
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from crypto.keys import WalletKey
from prime_node.p2p.gossip_router import LeanPubsub, SettlingGossipSub
from prime_node.p2p.interface import GossipMessage
from prime_node.p2p.libp2p_host import GOSSIPSUB_PROTOCOL, _gossipsub, open_libp2p_host

TOPIC = "prime-node/test/checkpoints"


class _Pubsub:
    """What the router's mesh upkeep reads from its pubsub: which peers subscribe to which topic."""

    def __init__(self, peer_topics: dict[str, set[ID]]) -> None:
        self.peer_topics = peer_topics


def _peer() -> ID:
    from libp2p.crypto.secp256k1 import create_new_key_pair

    return ID.from_pubkey(create_new_key_pair(WalletKey.generate().secret).public_key)


def _router(subscribers: int, in_mesh: int) -> tuple[SettlingGossipSub, list[ID]]:
    router = _gossipsub(1)
    assert isinstance(router, SettlingGossipSub)
    peers = [_peer() for _ in range(subscribers)]
    router.pubsub = _Pubsub({TOPIC: set(peers)})  # type: ignore[assignment]
    for peer in peers:
        router.peer_protocol[peer] = TProtocol(GOSSIPSUB_PROTOCOL)
    router.mesh[TOPIC] = set(peers[:in_mesh])
    return router, peers


def test_a_thin_mesh_heartbeats_fast_until_it_is_filled() -> None:
    router, _ = _router(15, 2)
    router.mesh_heartbeat()  # grafts up to the degree
    assert router.heartbeat_interval == router.fast_interval
    assert len(router.mesh[TOPIC]) == router.degree
    grafts, prunes = router.mesh_heartbeat()
    assert not grafts and not prunes
    assert router.heartbeat_interval == router.settled_interval > router.fast_interval


def test_a_lost_mesh_peer_brings_the_fast_heartbeat_back() -> None:
    router, peers = _router(15, 6)
    router.mesh_heartbeat()
    assert router.heartbeat_interval == router.settled_interval
    for peer in peers[: 6 - router.degree_low + 1]:  # below degree_low
        router.mesh[TOPIC].discard(peer)
    router.mesh_heartbeat()
    assert router.heartbeat_interval == router.fast_interval


def test_a_small_swarm_settles_with_every_subscriber_in_the_mesh() -> None:
    router, _ = _router(2, 2)
    router.mesh_heartbeat()
    assert router.heartbeat_interval == router.settled_interval


async def test_a_publish_is_delivered_at_once_while_the_heartbeat_is_slow() -> None:
    opener = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
    async with opener(WalletKey.generate()) as a, opener(WalletKey.generate()) as b:
        got: list[GossipMessage] = []
        arrived = trio.Event()

        async def collect(message: GossipMessage) -> None:
            got.append(message)
            arrived.set()

        await b.subscribe("t", collect)
        await a.subscribe("t", collect)
        await a.connect(b.listen_multiaddrs()[0])
        host: Any = a
        router: SettlingGossipSub = host._pubsub.router
        with trio.fail_after(60):  # the mesh forms at the fast heartbeat, then settles
            while len(got) < 1:
                await a.publish("t", b"warm-up")
                await trio.sleep(0.3)
            router.settled_interval = 600.0  # so a delivery within the wait below cannot be a heartbeat's
            while router.heartbeat_interval != router.settled_interval:
                await trio.sleep(0.3)
        arrived = trio.Event()
        with trio.fail_after(60):  # far less than the settled heartbeat: pushed on publish
            await a.publish("t", b"manifest")
            await arrived.wait()
        assert got[-1] == GossipMessage("t", a.peer_id, b"manifest")


class _Stream:
    """Collects what Pubsub.write_msg writes (one varint-prefixed RPC per write)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)


async def test_rpcs_after_the_hello_go_without_the_signed_peer_record() -> None:
    from libp2p.pubsub.pb import rpc_pb2
    from libp2p.utils.varint import decode_varint_with_size

    pubsub = object.__new__(LeanPubsub)  # write_msg needs no pubsub state on success
    rpc = rpc_pb2.RPC(publish=[rpc_pb2.Message(data=b"manifest", topicIDs=["t"])], senderRecord=b"r" * 300)
    streams = [_Stream(), _Stream()]
    for stream in streams:  # one RPC object sent to several peers, as gossipsub does
        assert await pubsub.write_msg(stream, rpc)  # type: ignore[arg-type]
    for stream in streams:
        (frame,) = stream.writes
        length, size = decode_varint_with_size(frame)
        sent = rpc_pb2.RPC.FromString(frame[size : size + length])
        assert not sent.HasField("senderRecord")
        assert sent.publish[0].data == b"manifest"
    assert rpc.senderRecord == b"r" * 300  # the caller's RPC is left as it was
