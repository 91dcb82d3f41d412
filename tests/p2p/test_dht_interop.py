"""Our DHT as other libp2p implementations see it (issue 36, item 11), checked on the wire bytes: real hosts
on 127.0.0.1, Kademlia messages written and read by hand (varint-prefixed ``kademlia.proto`` Messages on
``/ipfs/kad/1.0.0``), as a go or js peer would send them.

- FIND_NODE for a node's own ID lists that node with its addresses (a go peer drops an address-less record,
  so a standard ``findPeer`` had nothing to dial);
- ADD_PROVIDER and GET_PROVIDERS carry the run's key as a sha2-256 multihash (a go or js server resets a
  stream with any other key);
- no neighbour-link stream is opened to a peer whose identify does not list the protocol, until it does.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from crypto.keys import WalletKey
from prime_node.node.neighbour_links import NEIGHBOUR_PROTOCOL
from prime_node.p2p.interface import FramedStream
from prime_node.p2p.libp2p_host import Libp2pHost, open_libp2p_host
from protocol.dht_key import is_sha256_multihash, provider_cid, provider_key
from tests.p2p.helpers import make_config, start_node, wait_until

KAD = "/ipfs/kad/1.0.0"
OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
RUN_KEY = "/prime-node/run/interop"


def _multihash(key: bytes) -> tuple[int, bytes]:
    """(hash function code, digest) of a multihash, read as go-libp2p's ``mh.Cast`` does; ValueError if
    ``key`` is not one. Codes and lengths under 128 only (one-byte varints: every common hash)."""
    if len(key) < 2 or key[0] >= 0x80 or key[1] >= 0x80 or len(key) != 2 + key[1]:
        raise ValueError(f"not a multihash: {key[:8].hex()}...")
    return key[0], key[2:]


def _id(peer_id: str) -> Any:
    from libp2p.peer.id import ID

    return ID.from_base58(peer_id)


async def _write_message(stream: Any, message: Any) -> None:
    from libp2p.utils import encode_varint_prefixed

    await stream.write(encode_varint_prefixed(message.SerializeToString()))


async def _read_message(stream: Any) -> Any:
    from libp2p.kad_dht.pb.kademlia_pb2 import Message
    from libp2p.utils import read_varint_prefixed_bytes

    message = Message()
    message.ParseFromString(await read_varint_prefixed_bytes(stream))
    return message


async def _ask(client: Libp2pHost, server: str, message: Any) -> Any:
    """Send one Kademlia message to ``server`` on a fresh stream and read its answer."""
    from libp2p.custom_types import TProtocol

    stream = await client._host.new_stream(_id(server), [TProtocol(KAD)])
    try:
        await _write_message(stream, message)
        return await _read_message(stream)
    finally:
        await stream.close()


# -- the run key ---------------------------------------------------------------------------------------


@given(st.text(max_size=200))
def test_a_provider_key_is_the_sha256_multihash_of_the_name(name: str) -> None:
    key = provider_key(name)
    assert is_sha256_multihash(key)
    assert _multihash(key) == (0x12, hashlib.sha256(name.encode()).digest())


def test_the_cid_form_is_what_libp2p_parses_back_to_the_same_key() -> None:
    from libp2p.kad_dht.kad_dht import _encode_key

    assert provider_cid(RUN_KEY).startswith("bafkrei")  # CIDv1, raw, sha2-256: go's nsToCid
    assert _encode_key(provider_cid(RUN_KEY)) == provider_key(RUN_KEY)


async def test_provider_messages_carry_the_run_key_as_a_sha256_multihash() -> None:
    """A DHT server that behaves as go-libp2p's does (a non-multihash key resets the stream) records every
    ADD_PROVIDER and GET_PROVIDERS our node sends it; each key is 0x12 0x20 + sha256 of the run's name."""
    from libp2p.custom_types import TProtocol
    from libp2p.kad_dht.pb.kademlia_pb2 import Message

    seen: list[tuple[int, bytes]] = []
    refused: list[bytes] = []

    async def standard_server(stream: Any) -> None:
        try:
            while True:
                message = await _read_message(stream)
                if message.type in (Message.MessageType.ADD_PROVIDER, Message.MessageType.GET_PROVIDERS):
                    seen.append((message.type, bytes(message.key)))
                    try:
                        _multihash(bytes(message.key))
                    except ValueError:
                        refused.append(bytes(message.key))
                        await stream.reset()
                        return
                if message.type == Message.MessageType.ADD_PROVIDER:
                    continue  # go-libp2p answers nothing
                answer = Message()
                answer.type = message.type
                answer.key = message.key
                await _write_message(stream, answer)
        except Exception:
            return

    async with OPEN(WalletKey.generate()) as server, OPEN(WalletKey.generate()) as node:
        server._host.set_stream_handler(TProtocol(KAD), standard_server)
        await node.connect(server.listen_multiaddrs()[0])
        both = {Message.MessageType.ADD_PROVIDER, Message.MessageType.GET_PROVIDERS}
        with trio.fail_after(30):
            await node.provide(RUN_KEY)
            await node.find_providers(RUN_KEY)
            while {kind for kind, _ in seen} != both:
                await trio.sleep(0.05)
    print(f"keys sent: {[(kind, key.hex()) for kind, key in seen]}")
    assert not refused
    assert {key for _, key in seen} == {provider_key(RUN_KEY)}
    assert all(is_sha256_multihash(key) for _, key in seen)


async def test_two_nodes_find_each_others_providers_under_the_multihash_key() -> None:
    """Our own DHT servers store and serve the records under the multihash: one node provides, another
    finds it, and the record lies in the first one's store under ``provider_key``."""
    async with OPEN(WalletKey.generate()) as a, OPEN(WalletKey.generate()) as b:
        await b.connect(a.listen_multiaddrs()[0])
        await b.provide(RUN_KEY)
        with trio.fail_after(30):
            while not (found := await a.find_providers(RUN_KEY)):
                await trio.sleep(0.1)
        assert [p.peer_id for p in found] == [b.peer_id]
        assert a._dht.provider_store.get_providers(provider_key(RUN_KEY))
        assert not a._dht.provider_store.get_providers(RUN_KEY.encode())


# -- FIND_NODE for a node itself -----------------------------------------------------------------------


async def test_find_node_for_a_node_itself_lists_it_with_its_addresses() -> None:
    from libp2p.kad_dht.pb.kademlia_pb2 import Message
    from multiaddr import Multiaddr

    async with OPEN(WalletKey.generate()) as node, OPEN(WalletKey.generate()) as asker:
        await asker.connect(node.listen_multiaddrs()[0])
        request = Message()
        request.type = Message.MessageType.FIND_NODE
        request.key = _id(node.peer_id).to_bytes()
        with trio.fail_after(30):
            answer = await _ask(asker, node.peer_id, request)
    own = [peer for peer in answer.closerPeers if bytes(peer.id) == request.key]
    assert own, "the node does not list itself"
    addrs = [str(Multiaddr(raw)) for raw in own[0].addrs]
    print(f"FIND_NODE for itself: {addrs}")
    listen = node.listen_multiaddrs()[0].rsplit("/p2p/", 1)[0]
    assert listen in addrs
    assert all("/ip4/0.0.0.0/" not in a for a in addrs)


async def test_a_node_listening_on_the_wildcard_answers_with_interface_addresses() -> None:
    """Listening on 0.0.0.0, the addresses given are the interfaces' (0.0.0.0 is dialable by nobody)."""
    from libp2p.kad_dht.pb.kademlia_pb2 import Message
    from multiaddr import Multiaddr

    async with (
        open_libp2p_host(WalletKey.generate(), listen="/ip4/0.0.0.0/tcp/0") as node,
        OPEN(WalletKey.generate()) as asker,
    ):
        port = node.nat.listen_ports()[0]
        await asker.connect(f"/ip4/127.0.0.1/tcp/{port}/p2p/{node.peer_id}")
        request = Message()
        request.type = Message.MessageType.FIND_NODE
        request.key = _id(node.peer_id).to_bytes()
        with trio.fail_after(30):
            answer = await _ask(asker, node.peer_id, request)
    own = [peer for peer in answer.closerPeers if bytes(peer.id) == request.key]
    addrs = [str(Multiaddr(raw)) for raw in own[0].addrs]
    assert f"/ip4/127.0.0.1/tcp/{port}" in addrs
    assert all("/ip4/0.0.0.0/" not in a for a in addrs)


# -- neighbour links and identify ----------------------------------------------------------------------


async def test_no_neighbour_link_is_tried_toward_a_peer_whose_identify_lacks_the_protocol(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A libp2p peer that does not offer ``/prime-node/neighbour/2`` connects to a node: once identify
    told the node so, the node opens no neighbour stream to it (it used to retry every 2-30 s); when the
    peer starts offering the protocol (identify push), the node links to it."""
    import protocol.overlay

    monkeypatch.setattr(protocol.overlay, "FAILURE_PAUSE", 0.2)  # retries, if any, come fast
    attempts: list[str] = []
    async with trio.open_nursery() as nursery, OPEN(WalletKey.generate()) as stranger:
        config = make_config(tmp_path, 0, heartbeat_interval=0.5)
        node, _ = await start_node(nursery, OPEN, config, serve_api=False)
        host = node.host
        assert isinstance(host, Libp2pHost)
        open_stream = host.open_stream

        async def counting_open_stream(peer_id: str, protocol_id: str) -> FramedStream:
            if protocol_id == NEIGHBOUR_PROTOCOL and peer_id == stranger.peer_id:
                attempts.append(peer_id)
            return await open_stream(peer_id, protocol_id)

        host.open_stream = counting_open_stream  # type: ignore[method-assign]
        await stranger.connect(node.advertised_multiaddrs()[0])
        stranger_id = _id(stranger.peer_id)
        await wait_until(
            lambda: (
                stranger_id in host._host._identified_peers
                and stranger.peer_id not in node.links.overlay.opening
            ),
            timeout=30,
        )
        before = len(attempts)
        for _ in range(8):  # 8 heartbeats: the node picks its connected peers as candidates on each
            await trio.sleep(config.heartbeat_interval)
        print(f"neighbour attempts: {before} before identify finished, {len(attempts) - before} after")
        assert len(attempts) == before
        assert host.offers(stranger.peer_id, NEIGHBOUR_PROTOCOL) is False

        opened = trio.Event()

        async def neighbour(stream: FramedStream) -> None:
            opened.set()

        stranger.set_stream_handler(NEIGHBOUR_PROTOCOL, neighbour)  # pushes identify to its peers
        with trio.fail_after(30):
            await opened.wait()
        assert host.offers(stranger.peer_id, NEIGHBOUR_PROTOCOL) is True
        nursery.cancel_scope.cancel()
