"""One suite for the P2PHost interface, run against both implementations (libp2p on loopback, memory)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.p2p.interface import FramedStream, GossipMessage, P2PHost
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.testing.memory_network import MemoryNetwork

Opener = Callable[[WalletKey], AbstractAsyncContextManager[P2PHost]]


@pytest.fixture(params=["memory", "libp2p"])
def opener(request: pytest.FixtureRequest) -> Opener:
    if request.param == "memory":
        return MemoryNetwork().host
    return functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")


@asynccontextmanager
async def pair(opener: Opener) -> AsyncIterator[tuple[P2PHost, P2PHost]]:
    async with opener(WalletKey.generate()) as a, opener(WalletKey.generate()) as b:
        yield a, b


async def test_connect_reports_the_authenticated_peer_on_both_sides(opener: Opener) -> None:
    async with pair(opener) as (a, b):
        assert all(m.endswith(f"/p2p/{a.peer_id}") for m in a.listen_multiaddrs())
        assert await a.connect(b.listen_multiaddrs()[0]) == b.peer_id
        with trio.fail_after(5):
            while a.peer_id not in b.connected_peers():
                await trio.sleep(0.05)
        assert a.connected_peers() == [b.peer_id]


async def test_a_dialled_connection_is_direct_and_a_stranger_is_not(opener: Opener) -> None:
    async with pair(opener) as (a, b):
        stranger = WalletKey.generate()
        async with opener(stranger) as c:
            assert not a.directly_connected(b.peer_id) and not a.directly_connected(c.peer_id)
            await a.connect(b.listen_multiaddrs()[0])
            assert a.directly_connected(b.peer_id) and not a.directly_connected(c.peer_id)
            assert not a.directly_connected("not-a-peer-id")


async def test_framed_streams_carry_frames_both_ways_and_refuse_oversized_ones(opener: Opener) -> None:
    async with pair(opener) as (a, b):
        seen_peers: list[str] = []

        async def echo(stream: FramedStream) -> None:
            seen_peers.append(stream.remote_peer_id)
            while (frame := await stream.receive_frame(1 << 20)) is not None:
                await stream.send_frame(frame[::-1])

        b.set_stream_handler("/test/echo/1", echo)
        await a.connect(b.listen_multiaddrs()[0])
        stream = await a.open_stream(b.peer_id, "/test/echo/1")
        big = bytes(range(256)) * 1200  # 300 KiB: several yamux reads per frame
        for payload in (b"", b"hello", big):
            await stream.send_frame(payload)
            assert await stream.receive_frame(1 << 20) == payload[::-1]
        await stream.send_frame(b"x" * 2000)
        with pytest.raises(NodeError):
            await stream.receive_frame(100)
        await stream.close()
        assert seen_peers == [a.peer_id]


async def test_a_stream_is_stranded_once_its_connection_is_gone_and_not_before(opener: Opener) -> None:
    async with pair(opener) as (a, b):
        held: list[FramedStream] = []
        done = trio.Event()

        async def hold(stream: FramedStream) -> None:
            held.append(stream)
            await done.wait()

        b.set_stream_handler("/test/hold/1", hold)
        await a.connect(b.listen_multiaddrs()[0])
        stream = await a.open_stream(b.peer_id, "/test/hold/1")
        await stream.send_frame(b"hello")  # the handler runs once the first bytes arrive
        with trio.fail_after(5):
            while not held:
                await trio.sleep(0.01)
        assert not stream.stranded() and not held[0].stranded()
        await a.disconnect(b.peer_id)
        with trio.fail_after(5):
            while not (stream.stranded() and held[0].stranded()):
                await trio.sleep(0.01)
        done.set()


async def test_opening_an_unserved_protocol_fails_cleanly(opener: Opener) -> None:
    async with pair(opener) as (a, b):
        await a.connect(b.listen_multiaddrs()[0])
        with pytest.raises(NodeError):
            await a.open_stream(b.peer_id, "/test/nobody-serves-this/1")


async def test_gossip_reaches_subscribers_with_the_verified_origin(opener: Opener) -> None:
    async with pair(opener) as (a, b):
        got: list[GossipMessage] = []

        async def collect(message: GossipMessage) -> None:
            got.append(message)

        await b.subscribe("t", collect)
        await a.subscribe("t", collect)
        await a.connect(b.listen_multiaddrs()[0])
        with trio.fail_after(15):
            while not got:
                await a.publish("t", b"ping")
                await trio.sleep(0.3)
        assert got[0] == GossipMessage("t", a.peer_id, b"ping")


async def test_providers_are_found_through_the_dht(opener: Opener) -> None:
    async with pair(opener) as (a, b):
        await a.connect(b.listen_multiaddrs()[0])
        await a.provide("/prime-node/run/x")
        with trio.fail_after(10):
            while not (found := await b.find_providers("/prime-node/run/x")):
                await trio.sleep(0.2)
        assert [p.peer_id for p in found] == [a.peer_id]


async def test_a_bad_or_unreachable_address_is_a_node_error(opener: Opener) -> None:
    async with opener(WalletKey.generate()) as a:
        with pytest.raises(NodeError) as bad:
            await a.connect("/not-a-multiaddr")
        assert bad.value.reason == "bad_multiaddr"
