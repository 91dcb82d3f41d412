"""The authenticated channel: handshake, frames, and hostile peers, each over real TCP on 127.0.0.1 and
over in-memory streams (prime_node/testing/memory_streams.py) on trio's virtual clock."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from crypto.digests import blake3
from crypto.keys import WalletKey
from prime_node.dataplane.channel import AuthenticatedChannel, ChannelError
from prime_node.dataplane.connect import accept_channel, open_channel, serve_channels
from prime_node.dataplane.streams import TCP, StreamTransport
from prime_node.testing.memory_streams import MemoryStreamNetwork
from protocol.dataplane import (
    DIGESTED,
    FRAME_HEADER,
    HEAD_LENGTH,
    MAX_DIGESTED_HEAD,
    TAG_SIZE,
    DigestedFrame,
    Frame,
    FrameDeadlines,
)
from protocol.dataplane_handshake import HANDSHAKE_MAX_FRAME

A, B, C = (WalletKey(hashlib.sha256(label).digest()) for label in (b"a", b"b", b"c"))
HOST = "127.0.0.1"


@pytest.fixture(params=["tcp", "memory"])
def transport(request: pytest.FixtureRequest) -> StreamTransport:
    return TCP if request.param == "tcp" else MemoryStreamNetwork()


@pytest.fixture
def clock(transport: StreamTransport) -> trio.testing.MockClock | None:
    """Memory streams run on virtual time (every wait below is instant); real sockets need the real clock."""
    return (
        trio.testing.MockClock(autojump_threshold=0) if isinstance(transport, MemoryStreamNetwork) else None
    )


async def _listener_outcome(
    transport: StreamTransport,
    listener_key: WalletKey,
    body: Callable[[int, list[object]], Awaitable[None]],
    **options: object,
) -> list[object]:
    """Run one ``accept_channel`` on a fresh port; ``body(port, outcome)`` plays the dialer. The outcome
    list gets the accepted channel (or the ChannelError that refused it)."""
    outcome: list[object] = []
    listeners, port = await transport.open_listeners(HOST, 0)

    async def accept_one() -> None:
        stream = await listeners[0].accept()
        try:
            outcome.append(await accept_channel(stream, listener_key, **options))  # type: ignore[arg-type]
        except ChannelError as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(accept_one)
        await body(port, outcome)
    await listeners[0].aclose()
    return outcome


async def test_two_peers_authenticate_and_exchange_frames_both_ways(
    transport: StreamTransport, clock: object
) -> None:
    received: list[tuple[object, bytes]] = []

    async def echo(channel: AuthenticatedChannel) -> None:
        async for frame in channel:
            received.append((channel.remote, frame))
            await channel.send_frame(frame[::-1])

    frames = [b"", b"hello", os.urandom(1 << 20), os.urandom(100_000)]
    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_channels, B, echo, transport=transport))
        channel = await open_channel(HOST, port, A, expected_peer=B.address, transport=transport)
        assert channel.remote == B.address
        for frame in frames:
            await channel.send_frame(frame)
            assert await channel.receive_frame() == frame[::-1]
        await channel.aclose()
        with trio.fail_after(5):
            while len(received) < len(frames):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert received == [(A.address, frame) for frame in frames]


async def test_a_listener_with_the_wrong_wallet_is_refused(
    transport: StreamTransport, clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    async def dial(port: int, outcome: list[object]) -> None:
        with pytest.raises(ChannelError) as caught:
            await open_channel(HOST, port, A, expected_peer=B.address, transport=transport)
        assert caught.value.reason == "wrong_peer"

    with caplog.at_level(logging.WARNING, logger="prime_node.dataplane"):
        outcome = await _listener_outcome(transport, C, dial)
    assert isinstance(outcome[0], ChannelError)  # the listener saw the dialer hang up
    assert "wrong_peer" in caplog.text


async def test_a_listener_that_names_its_peer_refuses_another_dialer(
    transport: StreamTransport, clock: object
) -> None:
    async def dial(port: int, outcome: list[object]) -> None:
        with pytest.raises(ChannelError):
            channel = await open_channel(HOST, port, C, expected_peer=B.address, transport=transport)
            await channel.receive_frame()  # the listener closes once it sees who signed

    outcome = await _listener_outcome(transport, B, dial, expected_peer=A.address)
    assert isinstance(outcome[0], ChannelError) and outcome[0].reason == "wrong_peer"


async def _flipping_proxy(
    transport: StreamTransport, target_port: int, flip_at: int, task_status: Any
) -> None:
    """A man in the middle: forwards one connection both ways, flipping the byte at offset ``flip_at`` of
    the dialer→listener direction."""
    listeners, port = await transport.open_listeners(HOST, 0)
    task_status.started(port)
    inbound = await listeners[0].accept()
    outbound = await transport.open_stream(HOST, target_port)

    async def pump(source: trio.abc.Stream, sink: trio.abc.Stream, flip: int | None) -> None:
        seen = 0
        try:
            while chunk := await source.receive_some(1 << 16):
                if flip is not None and seen <= flip < seen + len(chunk):
                    edited = bytearray(chunk)
                    edited[flip - seen] ^= 0x01
                    chunk = bytes(edited)
                seen += len(chunk)
                await sink.send_all(chunk)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        await sink.aclose()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(pump, inbound, outbound, flip_at)
        nursery.start_soon(pump, outbound, inbound, None)


@pytest.mark.parametrize("flip_at", [10, 400, 4_000])
async def test_a_man_in_the_middle_flipping_one_byte_is_detected(
    transport: StreamTransport, clock: object, flip_at: int
) -> None:
    """Offset 10 lands in the dialer's hello, 400 in a data frame's header area or body, 4,000 deep in a
    body (the handshake's dialer→listener side is ~240 bytes)."""
    payload = os.urandom(8_000)

    async def dial(port: int, outcome: list[object]) -> None:
        async with trio.open_nursery() as nursery:
            proxy_port = await nursery.start(_flipping_proxy, transport, port, flip_at)
            try:
                channel = await open_channel(
                    HOST, proxy_port, A, expected_peer=B.address, transport=transport
                )
                await channel.send_frame(payload)
                await channel.aclose()
            except ChannelError:
                pass  # a flip in the handshake may surface on the dialer's side first
            with trio.fail_after(5):
                while not outcome:
                    await trio.sleep(0.01)
            if isinstance(outcome[0], AuthenticatedChannel):
                with pytest.raises(ChannelError) as caught:
                    await outcome[0].receive_frame()
                assert caught.value.reason in {"bad_mac", "frame_too_large", "truncated_frame"}
                outcome.append("frame refused")
            nursery.cancel_scope.cancel()

    outcome = await _listener_outcome(transport, B, dial)
    assert outcome[-1] == "frame refused" or isinstance(outcome[0], ChannelError)
    if flip_at >= 400:
        assert outcome[-1] == "frame refused"


async def test_an_oversized_length_is_refused_without_allocating_it(
    transport: StreamTransport, clock: object
) -> None:
    async def dial(port: int, outcome: list[object]) -> None:
        channel = await open_channel(HOST, port, A, expected_peer=B.address, transport=transport)
        with trio.fail_after(5):
            while not outcome:
                await trio.sleep(0.01)
        listener_side = outcome[0]
        assert isinstance(listener_side, AuthenticatedChannel)
        await channel._stream.send_all(FRAME_HEADER.pack(0xFFFF_FFFF))  # a hostile peer's raw bytes
        tracemalloc.start()
        try:
            with pytest.raises(ChannelError) as caught:
                await listener_side.receive_frame()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert caught.value.reason == "frame_too_large"
        assert peak < 1 << 20
        assert listener_side.closed
        await channel.aclose()

    await _listener_outcome(transport, B, dial)


async def test_a_peer_hanging_up_inside_a_frame_is_a_truncation(
    transport: StreamTransport, clock: object
) -> None:
    async def dial(port: int, outcome: list[object]) -> None:
        channel = await open_channel(HOST, port, A, expected_peer=B.address, transport=transport)
        await channel._stream.send_all(FRAME_HEADER.pack(1000) + b"x" * 10)
        await channel.aclose()
        with trio.fail_after(5):
            while not outcome:
                await trio.sleep(0.01)
        listener_side = outcome[0]
        assert isinstance(listener_side, AuthenticatedChannel)
        with pytest.raises(ChannelError) as caught:
            await listener_side.receive_frame()
        assert caught.value.reason == "truncated_frame"

    await _listener_outcome(transport, B, dial)


async def test_an_oversized_handshake_frame_is_refused(transport: StreamTransport, clock: object) -> None:
    async def dial(port: int, outcome: list[object]) -> None:
        stream = await transport.open_stream(HOST, port)
        await stream.send_all(FRAME_HEADER.pack(HANDSHAKE_MAX_FRAME + 1))
        with trio.fail_after(5):
            assert await stream.receive_some(10) == b""  # the listener hung up
        await stream.aclose()

    outcome = await _listener_outcome(transport, B, dial)
    assert isinstance(outcome[0], ChannelError) and outcome[0].reason == "frame_too_large"


async def test_a_silent_dialer_times_out(
    transport: StreamTransport, autojump_clock: trio.testing.MockClock
) -> None:
    async def dial(port: int, outcome: list[object]) -> None:
        stream = await transport.open_stream(HOST, port)
        with trio.fail_after(60):
            while not outcome:
                await trio.sleep(1)
        await stream.aclose()

    outcome = await _listener_outcome(transport, B, dial)
    assert isinstance(outcome[0], ChannelError) and outcome[0].reason == "handshake_timeout"


async def test_closing_our_side_under_a_waiting_receive_is_a_clean_close(
    transport: StreamTransport, clock: object
) -> None:
    async def dial(port: int, outcome: list[object]) -> None:
        channel = await open_channel(HOST, port, A, expected_peer=B.address, transport=transport)
        errors: list[ChannelError] = []

        async def receive() -> None:
            try:
                await channel.receive_frame()
            except ChannelError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await trio.sleep(0.05)
            await channel.aclose()
        assert [e.reason for e in errors] == ["closed"]

    await _listener_outcome(transport, B, dial)


async def test_dialing_a_closed_port_is_a_clear_error(transport: StreamTransport, clock: object) -> None:
    listeners, port = await transport.open_listeners(HOST, 0)
    await listeners[0].aclose()
    with pytest.raises(ChannelError) as caught:
        await open_channel(HOST, port, A, expected_peer=B.address, transport=transport)
    assert caught.value.reason == "dial_failed"


async def test_a_batch_of_small_and_large_frames_arrives_whole_and_in_order(
    transport: StreamTransport, clock: object
) -> None:
    """``send_frames`` writes many frames at once; the receiver cuts small ones out of its read buffer
    and reads large bodies into their own chunks, with the bytes after a body (its tag, the next
    frames) arriving in the same read."""
    sizes = [0, 5, 36, 32 << 10, (32 << 10) + 1, 1 << 20, 3, 70_000, 4 << 20, 1, 2, (64 << 10) - 40]
    frames = [os.urandom(size) for size in sizes] * 3
    received: list[bytes] = []

    async def collect(channel: AuthenticatedChannel) -> None:
        async for frame in channel:
            received.append(frame)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_channels, B, collect, transport=transport))
        channel = await open_channel(HOST, port, A, expected_peer=B.address, transport=transport)
        await channel.send_frames(frames[:10])
        for frame in frames[10:20]:
            await channel.send_frame(frame)
        await channel.send_frames(frames[20:])
        with trio.fail_after(10):
            while len(received) < len(frames):
                await trio.sleep(0.01)
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert [len(frame) for frame in received] == [len(frame) for frame in frames]
    assert received == frames


async def test_over_tcp_a_body_trickling_under_the_low_water_mark_still_counts_as_progress() -> None:
    """A reader waiting inside a large body asks the kernel to wake it only once many bytes are in
    (``SO_RCVLOWAT``), but it still looks every ``idle / 20`` s: the last 256 KiB of a 1 MiB body sent in
    16 KiB slices every 0.2 s (far under the mark) never trip a 0.5 s idle deadline, and arrive intact."""
    deadlines = FrameDeadlines(idle=0.5, grace=30.0, min_rate=1 << 20)
    body = os.urandom(1 << 20)
    outcome: list[object] = []

    async def receive_one(channel: AuthenticatedChannel) -> None:
        try:
            outcome.append(await channel.receive_frame())
        except ChannelError as exc:
            outcome.append(exc)

    async with trio.open_nursery() as nursery:
        port = await nursery.start(
            functools.partial(serve_channels, B, receive_one, deadlines=deadlines, transport=TCP)
        )
        channel = await open_channel(HOST, port, A, expected_peer=B.address, transport=TCP)
        header, tag = channel._sealer.seal(body)
        wire = header + body + tag
        slice_size = 16 << 10
        await channel._stream.send_all(wire[: 768 << 10])  # then a wait for the rest, under the mark
        for start in range(768 << 10, len(wire), slice_size):
            await trio.sleep(0.2)
            await channel._stream.send_all(wire[start : start + slice_size])
        with trio.fail_after(10):
            while not outcome:
                await trio.sleep(0.01)
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert outcome == [body]


async def test_digested_frames_arrive_with_the_digest_of_what_arrived(
    transport: StreamTransport, clock: object
) -> None:
    """Plain and digested frames, small (cut from the read buffer) and large (read into chunks), in one
    batch and one by one: each arrives as sent, a digested one with the BLAKE3 of its bulk computed on
    receipt, and ``receive_frame`` gives its head and bulk joined."""
    bulks = [os.urandom(size) for size in (0, 7, 30_000, (32 << 10) + 1, 1 << 20, 3 << 20)]
    frames: list[Frame] = [b"plain", *(DigestedFrame(os.urandom(45), bulk, blake3(bulk)) for bulk in bulks)]
    frames += [DigestedFrame(b"", bulk) for bulk in bulks[:4]]  # no digest given: the sender hashes
    frames += [os.urandom(70_000)]
    received: list[Frame] = []
    joined: list[bytes] = []

    async def collect(channel: AuthenticatedChannel) -> None:
        async for frame in channel.frames():
            received.append(frame)
            if len(received) == len(frames):
                joined.append(await channel.receive_frame())

    async with trio.open_nursery() as nursery:
        port = await nursery.start(functools.partial(serve_channels, B, collect, transport=transport))
        channel = await open_channel(HOST, port, A, expected_peer=B.address, transport=transport)
        await channel.send_frames(frames[:5])
        for frame in frames[5:]:
            await channel.send_frame(frame)  # type: ignore[arg-type]
        await channel.send_frames([DigestedFrame(b"head", b"bulk")])
        with trio.fail_after(10):
            while not joined:
                await trio.sleep(0.01)
        await channel.aclose()
        nursery.cancel_scope.cancel()
    assert joined == [b"headbulk"]
    for sent, got in zip(frames, received, strict=True):
        if isinstance(sent, DigestedFrame):
            assert isinstance(got, DigestedFrame)
            assert (got.head, bytes(got.bulk), got.digest) == (sent.head, bytes(sent.bulk), blake3(sent.bulk))
        else:
            assert got == sent


async def _refused_reason(
    transport: StreamTransport, send: Callable[[AuthenticatedChannel], Awaitable[None]]
) -> str:
    """Open a channel, let ``send`` write to it (in the background: it may block until read), and return
    the reason the listener refused the frame with."""

    async def dial(port: int, outcome: list[object]) -> None:
        channel = await open_channel(HOST, port, A, expected_peer=B.address, transport=transport)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send, channel)
            with trio.fail_after(5):
                while not outcome:
                    await trio.sleep(0.01)
            assert isinstance(outcome[0], AuthenticatedChannel)
            with pytest.raises(ChannelError) as caught:
                await outcome[0].receive()
            outcome.append(caught.value.reason)
            nursery.cancel_scope.cancel()
        await channel.aclose()

    outcome = await _listener_outcome(transport, B, dial)
    return str(outcome[-1])


@pytest.mark.parametrize("size", [100, 200_000])
async def test_a_digested_frame_whose_digest_is_not_its_bulks_fails_its_mac(
    transport: StreamTransport, clock: object, size: int
) -> None:
    """What a sender's MAC names is the digest; bytes that do not hash to it (a piece that went bad on the
    sender's disk, or bytes changed on the way) are refused before anyone looks at them."""
    bulk = os.urandom(size)

    async def send(channel: AuthenticatedChannel) -> None:
        await channel.send_frames([DigestedFrame(b"h", bulk, blake3(bulk[1:] + b"x"))])

    assert await _refused_reason(transport, send) == "bad_mac"


@pytest.mark.parametrize("flip_at", [0, 4, 5, 60, 5_000])
async def test_a_man_in_the_middle_flipping_a_digested_frame_is_detected(
    transport: StreamTransport, clock: object, flip_at: int
) -> None:
    """One bit flipped in the length word (over the cap), the head length, the head, the bulk: each is
    refused at that frame. The frame is sealed with the channel's own keys and counter and written raw,
    flipped: what a man in the middle would forward."""
    bulk = os.urandom(8_000)
    frame = DigestedFrame(os.urandom(50), bulk, blake3(bulk))

    async def send(channel: AuthenticatedChannel) -> None:
        start, tag = channel._sealer.seal_digested(frame)
        wire = bytearray(start + bulk + tag)
        wire[flip_at] ^= 0x01
        await channel._stream.send_all(bytes(wire))

    reason = await _refused_reason(transport, send)
    assert reason == ("frame_too_large" if flip_at == 0 else "bad_mac")


@pytest.mark.parametrize(("head_length", "length"), [(MAX_DIGESTED_HEAD + 1, 100_000), (50, 20)])
async def test_a_digested_head_over_its_cap_is_refused(
    transport: StreamTransport, clock: object, head_length: int, length: int
) -> None:
    """A head length over MAX_DIGESTED_HEAD, or longer than its frame, is refused from its 2-byte field."""

    async def send(channel: AuthenticatedChannel) -> None:
        rest = bytes(length - HEAD_LENGTH.size + TAG_SIZE)
        await channel._stream.send_all(
            FRAME_HEADER.pack(DIGESTED | length) + HEAD_LENGTH.pack(head_length) + rest
        )

    assert await _refused_reason(transport, send) == "bad_frame_head"
