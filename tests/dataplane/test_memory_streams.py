"""The in-memory stream transport (prime_node/testing/memory_streams.py): a correct trio stream, a network
that refuses and frees addresses as sockets do, and the channel's handshake timeouts in virtual time."""

from __future__ import annotations

import errno
import functools
import hashlib

import pytest
import trio
import trio.testing

from crypto.keys import WalletKey
from prime_node.dataplane.channel import HANDSHAKE_TIMEOUT, AuthenticatedChannel, ChannelError
from prime_node.dataplane.connect import accept_channel, open_channel, serve_channels
from prime_node.testing.memory_streams import MemoryPipeStream, MemoryStreamNetwork, memory_pipe_pair
from protocol.dataplane import FRAME_HEADER

A, B = (WalletKey(hashlib.sha256(label).digest()) for label in (b"a", b"b"))
HOST = "10.0.0.1"


async def test_a_pipe_pair_passes_trios_half_closeable_stream_checks() -> None:
    async def pair() -> tuple[MemoryPipeStream, MemoryPipeStream]:
        return memory_pipe_pair(4096)  # smaller than the checks' 16 KiB chunks: sends must wait for reads

    async def clogged() -> tuple[MemoryPipeStream, MemoryPipeStream]:
        left, right = memory_pipe_pair(64)
        await left.send_all(b"x" * 64)
        await right.send_all(b"y" * 64)
        return left, right

    await trio.testing.check_half_closeable_stream(pair, clogged)


async def test_a_sender_blocks_once_the_buffer_is_full_until_the_peer_reads(
    autojump_clock: trio.testing.MockClock,
) -> None:
    left, right = memory_pipe_pair(100)
    await left.send_all(b"a" * 100)  # fits: returns at once
    with trio.move_on_after(60) as stalled:
        await left.send_all(b"b")
    assert stalled.cancelled_caught  # a peer that does not read pushes back, as a TCP window does
    assert await right.receive_some() == b"a" * 100
    await left.send_all(b"c")
    assert await right.receive_some() == b"c"
    with pytest.raises(ValueError, match="capacity"):
        memory_pipe_pair(0)


async def test_the_network_refuses_unknown_and_closed_addresses_and_taken_ports() -> None:
    network = MemoryStreamNetwork()
    with pytest.raises(ConnectionRefusedError):
        await network.open_stream(HOST, 1234)
    listeners, port = await network.open_listeners(HOST, 0)
    second, other_port = await network.open_listeners(HOST, 0)
    assert port != other_port
    with pytest.raises(OSError) as taken:
        await network.open_listeners(HOST, port)
    assert taken.value.errno == errno.EADDRINUSE
    dialed = await network.open_stream(HOST, port)
    accepted = await listeners[0].accept()
    await dialed.send_all(b"ping")
    assert await accepted.receive_some() == b"ping"
    await listeners[0].aclose()
    with pytest.raises(ConnectionRefusedError):
        await network.open_stream(HOST, port)
    with pytest.raises(trio.ClosedResourceError):
        await listeners[0].accept()
    assert (await network.open_listeners(HOST, port))[1] == port  # the address is free again
    await second[0].aclose()
    assert network.dials == 3


async def test_a_full_backlog_refuses_and_closing_a_listener_ends_what_it_never_accepted() -> None:
    network = MemoryStreamNetwork(backlog=1)
    listeners, port = await network.open_listeners(HOST, 0)
    waiting = await network.open_stream(HOST, port)
    with pytest.raises(ConnectionRefusedError):
        await network.open_stream(HOST, port)
    await listeners[0].aclose()
    assert await waiting.receive_some() == b""  # the dialer sees the connection end


async def test_a_dialer_that_never_speaks_times_out_in_virtual_time(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    listeners, port = await network.open_listeners(HOST, 0)
    silent = await network.open_stream(HOST, port)
    start = trio.current_time()
    with pytest.raises(ChannelError) as caught:
        await accept_channel(await listeners[0].accept(), B)
    assert caught.value.reason == "handshake_timeout"
    assert trio.current_time() - start == pytest.approx(HANDSHAKE_TIMEOUT)
    assert await silent.receive_some() == b""  # the listener hung up on it
    await silent.aclose()


async def test_a_listener_that_stalls_mid_handshake_times_the_dialer_out(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The listener reads the dialer's hello and then says nothing: the dialer gives up on its own."""
    network = MemoryStreamNetwork()
    listeners, port = await network.open_listeners(HOST, 0)
    hello: list[bytes] = []

    async def stall() -> None:
        stream = await listeners[0].accept()
        hello.append(await stream.receive_some())
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(stall)
        start = trio.current_time()
        with pytest.raises(ChannelError) as caught:
            await open_channel(
                HOST, port, A, expected_peer=B.address, handshake_timeout=3.0, transport=network
            )
        assert caught.value.reason == "handshake_timeout"
        assert trio.current_time() - start == pytest.approx(3.0)
        assert hello and hello[0]
        nursery.cancel_scope.cancel()


async def test_serve_channels_on_memory_streams_with_a_frame_cap(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    received: list[bytes] = []
    failures: list[str] = []

    async def collect(channel: AuthenticatedChannel) -> None:
        try:
            async for frame in channel:
                received.append(frame)
        except ChannelError as exc:
            failures.append(exc.reason)
            raise

    async with trio.open_nursery() as nursery:
        serve = functools.partial(serve_channels, B, collect, host=HOST, max_frame=1000, transport=network)
        port = await nursery.start(serve)
        with pytest.raises(ChannelError) as taken:
            await serve_channels(A, collect, host=HOST, port=port, transport=network)
        assert taken.value.reason == "port_in_use"
        channel = await open_channel(HOST, port, A, expected_peer=B.address, transport=network)
        await channel.send_frame(b"x" * 1000)
        await channel._stream.send_all(FRAME_HEADER.pack(1001))  # a header announcing more than the cap
        await trio.sleep(1)
        assert received == [b"x" * 1000]
        assert failures == ["frame_too_large"]
        with pytest.raises(ChannelError) as dropped:
            await channel.receive_frame()
        assert dropped.value.reason == "closed"  # the listener hung up
        nursery.cancel_scope.cancel()
