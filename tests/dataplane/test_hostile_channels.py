"""Authenticated but hostile peers against a node's DataPlane (prime_node/swarm/transport.py): frames
announced and never sent, frames trickled, and requests whose answers are never read. Memory streams on
trio's virtual clock, and real TCP on 127.0.0.1 with short deadlines. The same attacks on a real node
process: test_hostile_victim.py."""

from __future__ import annotations

import functools
import hashlib
import logging
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing

from crypto.keys import Address, WalletKey
from prime_node.dataplane.budget import MemoryBudget
from prime_node.dataplane.channel import AuthenticatedChannel
from prime_node.dataplane.connect import open_channel
from prime_node.dataplane.streams import TCP, StreamTransport
from prime_node.swarm.transport import DataPlane, DataPlaneSettings
from prime_node.testing.memory_streams import MemoryStreamNetwork, memory_pipe_pair
from protocol.dataplane import (
    DEFAULT_FRAME_GRACE,
    DEFAULT_FRAME_IDLE,
    DEFAULT_FRAME_MIN_RATE,
    DEFAULT_MAX_FRAME,
    FRAME_HEADER,
    FrameDeadlines,
)

HOST = "127.0.0.1"
VICTIM = WalletKey(hashlib.sha256(b"victim").digest())
HONEST = WalletKey(hashlib.sha256(b"honest").digest())
HOSTILE = [WalletKey(hashlib.sha256(b"hostile %d" % i).digest()) for i in range(24)]
MiB = 1 << 20


@dataclass
class Node:
    """A DataPlane that answers every frame it receives with ``answer_size`` fresh bytes (as a node
    answers a piece request), recording what it got."""

    plane: DataPlane
    port: int
    answer_size: int
    received: list[tuple[Address, bytes]] = field(default_factory=list)

    @property
    def address(self) -> Address:
        return self.plane.key.address


async def start_node(
    nursery: trio.Nursery, transport: StreamTransport, key: WalletKey, *, answer_size: int = 0, **options: Any
) -> Node:
    holder: list[Node] = []

    def on_frame(peer: Address, frame: bytes) -> None:
        node = holder[0]
        node.received.append((peer, frame))
        if node.answer_size:
            node.plane.send(peer, frame[:8].ljust(8, b"\0") + bytes(node.answer_size))  # a fresh buffer

    plane = DataPlane(
        key,
        on_up=lambda _: None,
        on_frame=on_frame,
        on_down=lambda _: None,
        transport=transport,
        budget=options.pop("budget", None),
        settings=DataPlaneSettings(**options),
    )
    port = await nursery.start(functools.partial(plane.run, HOST, 0))
    holder.append(Node(plane, port, answer_size))
    return holder[0]


async def hostile_channels(
    transport: StreamTransport, victim: Node, count: int
) -> list[AuthenticatedChannel]:
    """``count`` channels from fresh identities, each with a valid handshake."""
    return [
        await open_channel(HOST, victim.port, key, expected_peer=victim.address, transport=transport)
        for key in HOSTILE[:count]
    ]


async def wait_closed(channel: AuthenticatedChannel) -> None:
    """Read raw bytes (whatever the victim managed to send) until the victim hangs up."""
    try:
        while await channel._stream.receive_some(1 << 16):
            pass
    except trio.BrokenResourceError:
        pass


async def honest_round_trip(transport: StreamTransport, victim: Node, requests: int) -> list[bytes]:
    """An honest peer's DataPlane dials the victim, sends ``requests`` frames, at most two unanswered at a
    time (as a downloader keeps a few requests in flight), and collects the answers."""
    answers: list[bytes] = []
    async with trio.open_nursery() as nursery:
        peer = await start_node(nursery, transport, HONEST)
        peer.plane.dial(victim.address, HOST, victim.port)
        with trio.fail_after(30):
            while victim.address not in peer.plane.links:
                await trio.sleep(0.05)
            for index in range(requests):
                while index - len(peer.received) >= 2:
                    await trio.sleep(0.01)
                peer.plane.send(victim.address, index.to_bytes(8, "big"))
            while len(peer.received) < requests:
                await trio.sleep(0.05)
        answers = [frame for _, frame in peer.received]
        nursery.cancel_scope.cancel()
    return answers


async def test_frames_announced_and_never_sent_cost_a_chunk_each_and_stall_out(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """24 peers each announce a 16 MiB frame and send one byte: the victim allocates 256 KiB for each
    (it allocated the whole 16 MiB before), closes each when no byte came for the idle deadline, and an
    honest peer's exchange goes on meanwhile."""
    network = MemoryStreamNetwork()
    async with trio.open_nursery() as nursery:
        victim = await start_node(nursery, network, VICTIM, answer_size=MiB)
        hostile = await hostile_channels(network, victim, 24)
        tracemalloc.start()
        try:
            for channel in hostile:
                await channel._stream.send_all(FRAME_HEADER.pack(DEFAULT_MAX_FRAME) + b"x")
            started = trio.current_time()
            await trio.sleep(1)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 16 * MiB  # 24 × 256 KiB; 24 × 16 MiB before
        answers = await honest_round_trip(network, victim, 5)
        assert [answer[:8] for answer in answers] == [i.to_bytes(8, "big") for i in range(5)]
        with caplog.at_level(logging.WARNING, logger="prime_node.dataplane"), trio.fail_after(60):
            for channel in hostile:
                await wait_closed(channel)
        assert trio.current_time() - started == pytest.approx(DEFAULT_FRAME_IDLE, abs=0.5)
        assert caplog.text.count("frame_stalled") == 24
        assert set(victim.plane.links) <= {HONEST.address}
        nursery.cancel_scope.cancel()


async def test_a_frame_trickled_a_byte_at_a_time_is_closed_at_its_deadline(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """A byte every 7 s never trips the 10 s idle deadline, but a 1 MiB frame must finish within
    10 s + 1 MiB / 64 KiB/s = 26 s of its first byte."""
    network = MemoryStreamNetwork()
    async with trio.open_nursery() as nursery:
        victim = await start_node(nursery, network, VICTIM)
        (channel,) = await hostile_channels(network, victim, 1)

        async def trickle() -> None:
            await channel._stream.send_all(FRAME_HEADER.pack(MiB))
            while True:
                await trio.sleep(7)
                await channel._stream.send_all(b"x")

        with caplog.at_level(logging.WARNING, logger="prime_node.dataplane"), trio.fail_after(120):
            nursery.start_soon(trickle)
            started = trio.current_time()
            await wait_closed(channel)
        allowed = DEFAULT_FRAME_GRACE + MiB / DEFAULT_FRAME_MIN_RATE
        assert allowed - 1 <= trio.current_time() - started <= allowed + 1
        assert "frame_too_slow" in caplog.text and "frame_stalled" not in caplog.text
        nursery.cancel_scope.cancel()


async def test_a_peer_that_never_reads_its_answers_is_closed_when_the_send_stalls(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Four requests, never a read: the answers fill the stream's window, the send stops moving, and the
    victim closes the channel after the idle deadline instead of holding the answers forever."""
    network = MemoryStreamNetwork(stream_pair=functools.partial(memory_pipe_pair, 64 << 10))
    async with trio.open_nursery() as nursery:
        victim = await start_node(nursery, network, VICTIM, answer_size=MiB)
        (channel,) = await hostile_channels(network, victim, 1)
        with caplog.at_level(logging.WARNING, logger="prime_node.dataplane"):
            for index in range(4):
                await channel.send_frame(index.to_bytes(8, "big"))
            await trio.sleep(1)
            assert victim.plane.links[HOSTILE[0].address].queued_bytes >= 3 * MiB
            await trio.sleep(DEFAULT_FRAME_IDLE)
        assert HOSTILE[0].address not in victim.plane.links
        assert "frame_stalled" in caplog.text
        assert victim.plane.budget.used == 0
        nursery.cancel_scope.cancel()


async def test_peers_that_never_read_share_one_budget_and_an_honest_peer_is_still_served(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Six peers each ask for twelve 1 MiB answers and read none: 72 MiB of answers against a 16 MiB
    budget. The node never reserves more than its budget, the greediest hoarders are evicted, the rest
    stall out, and an honest peer asking for twenty answers gets all of them."""
    network = MemoryStreamNetwork(stream_pair=functools.partial(memory_pipe_pair, 64 << 10))
    budget = MemoryBudget(16 * MiB)
    async with trio.open_nursery() as nursery:
        victim = await start_node(nursery, network, VICTIM, answer_size=MiB, budget=budget)
        hostile = await hostile_channels(network, victim, 6)
        tracemalloc.start()
        try:
            for channel in hostile:
                for index in range(12):
                    await channel.send_frame(index.to_bytes(8, "big"))
            answers = await honest_round_trip(network, victim, 20)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert len(answers) == 20
        assert budget.peak <= budget.limit and budget.evictions >= 1
        assert peak < 40 * MiB
        await trio.sleep(DEFAULT_FRAME_IDLE)  # still not reading: the survivors' sends stall out
        with trio.fail_after(1):
            for channel in hostile:
                await wait_closed(channel)
        assert not victim.plane.links and budget.used == 0
        nursery.cancel_scope.cancel()


async def test_over_tcp_stalled_frames_are_closed_by_a_short_deadline_while_honest_frames_flow(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Real sockets on 127.0.0.1: eight peers announce 16 MiB frames and send one byte; with a 0.5 s idle
    deadline each is closed within a second or two, and an honest exchange of 1 MiB answers completes."""
    deadlines = FrameDeadlines(idle=0.5, grace=1.0, min_rate=MiB)
    async with trio.open_nursery() as nursery:
        victim = await start_node(nursery, TCP, VICTIM, answer_size=MiB, deadlines=deadlines)
        hostile = await hostile_channels(TCP, victim, 8)
        tracemalloc.start()
        try:
            for channel in hostile:
                await channel._stream.send_all(FRAME_HEADER.pack(DEFAULT_MAX_FRAME) + b"x")
            started = trio.current_time()
            answers = await honest_round_trip(TCP, victim, 10)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert [answer[:8] for answer in answers] == [i.to_bytes(8, "big") for i in range(10)]
        assert peak < 32 * MiB  # the honest answers; 8 × 16 MiB for the stalled frames before
        with caplog.at_level(logging.WARNING, logger="prime_node.dataplane"), trio.fail_after(10):
            for channel in hostile:
                await wait_closed(channel)
        assert trio.current_time() - started < 5
        assert victim.plane.budget.used == 0
        nursery.cancel_scope.cancel()
