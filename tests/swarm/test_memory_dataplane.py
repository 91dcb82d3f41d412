"""DataPlanes on in-memory streams under trio's autojump clock: frames between two and three peers, the
simultaneous-dial rule, bounded send queues, inbound limits and bans (the TCP path is exercised by
test_network_swarm.py)."""

from __future__ import annotations

import functools
import hashlib
import logging
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing

from crypto.keys import Address, WalletKey
from prime_node.dataplane.channel import ChannelError
from prime_node.dataplane.connect import open_channel
from prime_node.swarm.transport import MAX_QUEUED_BYTES, MAX_QUEUED_FRAMES, DataPlane, DataPlaneSettings
from prime_node.testing.memory_streams import MemoryStreamNetwork, memory_pipe_pair

HOST = "10.0.0.1"
KEYS = [WalletKey(hashlib.sha256(bytes([i])).digest()) for i in range(4)]


@dataclass
class Peer:
    """A DataPlane listening on the memory network, recording what its callbacks saw."""

    key: WalletKey
    plane: DataPlane
    port: int
    scope: trio.CancelScope
    events: list[tuple[str, Address]] = field(default_factory=list)
    frames: list[tuple[Address, bytes]] = field(default_factory=list)

    @property
    def address(self) -> Address:
        return self.key.address

    def dial(self, other: Peer) -> None:
        self.plane.dial(other.address, HOST, other.port)


async def start_peer(
    nursery: trio.Nursery, network: MemoryStreamNetwork, key: WalletKey, **options: int
) -> Peer:
    events: list[tuple[str, Address]] = []
    frames: list[tuple[Address, bytes]] = []
    plane = DataPlane(
        key,
        on_up=lambda peer: events.append(("up", peer)),
        on_frame=lambda peer, frame: frames.append((peer, frame)),
        on_down=lambda peer: events.append(("down", peer)),
        transport=network,
        settings=DataPlaneSettings(**options),
    )
    scope = trio.CancelScope()

    async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await plane.run(HOST, 0, task_status=task_status)

    port = await nursery.start(run)
    return Peer(key, plane, port, scope, events, frames)


def unexpected(*args: object) -> None:
    raise AssertionError(f"unexpected callback {args}")


async def settle() -> None:
    """Let every exchange in flight finish (virtual time: instant)."""
    await trio.sleep(5)


async def test_two_planes_exchange_frames_both_ways_in_order(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryStreamNetwork()
    async with trio.open_nursery() as nursery:
        a, b = [await start_peer(nursery, network, key) for key in KEYS[:2]]
        a.dial(b)
        await settle()
        assert a.events == [("up", b.address)] and b.events == [("up", a.address)]
        assert a.plane.links[b.address].dialer == a.address == b.plane.links[a.address].dialer
        big = bytes(range(256)) * 4096  # 1 MiB: four times the memory pipe's buffer
        sent = [b"first", big, b"", b"last"] + [i.to_bytes(4, "big") for i in range(500)]
        for frame in sent:
            a.plane.send(b.address, frame)
        b.plane.send(a.address, b"reply")
        await settle()
        assert b.frames == [(a.address, frame) for frame in sent]
        assert a.frames == [(b.address, b"reply")]
        assert a.plane.bytes_out == b.plane.bytes_in == sum(map(len, sent))
        a.plane.close(b.address)
        await settle()
        assert a.events[-1] == ("down", b.address) and b.events[-1] == ("down", a.address)
        assert not a.plane.links and not b.plane.links
        a.plane.send(b.address, b"after close")  # no link: dropped, no error
        nursery.cancel_scope.cancel()


async def test_three_planes_in_a_mesh_and_one_leaving(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryStreamNetwork()
    async with trio.open_nursery() as nursery:
        peers = [await start_peer(nursery, network, key) for key in KEYS[:3]]
        a, b, c = peers
        a.dial(b)
        a.dial(c)
        b.dial(c)
        await settle()
        for peer in peers:
            assert set(peer.plane.links) == {p.address for p in peers} - {peer.address}
        for peer in peers:
            for other in peers:
                if other is not peer:
                    peer.plane.send(other.address, b"from " + peer.address.raw)
        await settle()
        for peer in peers:
            assert sorted(peer.frames) == sorted(
                (other.address, b"from " + other.address.raw) for other in peers if other is not peer
            )
        c.scope.cancel()  # c leaves: its streams end, the others see it go and keep their own link
        await settle()
        assert a.events[-1] == ("down", c.address) and b.events[-1] == ("down", c.address)
        a.plane.send(b.address, b"still here")
        await settle()
        assert b.frames[-1] == (a.address, b"still here")
        nursery.cancel_scope.cancel()


async def test_a_simultaneous_dial_leaves_one_link_dialed_by_the_smaller_address(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    async with trio.open_nursery() as nursery:
        a, b = [await start_peer(nursery, network, key) for key in KEYS[:2]]
        a.dial(b)
        b.dial(a)
        await settle()
        assert network.dials == 2  # both channels were opened ...
        preferred = min(a.address, b.address, key=lambda address: address.raw)
        assert list(a.plane.links) == [b.address] and list(b.plane.links) == [a.address]
        assert a.plane.links[b.address].dialer == preferred == b.plane.links[a.address].dialer
        assert a.plane.links[b.address].alive and b.plane.links[a.address].alive
        a.plane.send(b.address, b"over the survivor")  # ... and the one both kept carries frames
        b.plane.send(a.address, b"and back")
        await settle()
        assert b.frames == [(a.address, b"over the survivor")] and a.frames == [(b.address, b"and back")]
        for peer in (a, b):
            ups = [event for event in peer.events if event[0] == "up"]
            downs = [event for event in peer.events if event[0] == "down"]
            assert len(ups) == len(downs) + 1  # every link dropped for the survivor was reported down
        # Both channels completed their handshake: one side adopted the other's and then replaced it.
        assert len(a.events) + len(b.events) >= 3
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize(
    "frame_size",
    [1 << 20, 1 << 10],
    ids=["bytes", "frames"],  # which of the two limits is hit first
)
async def test_a_peer_that_stops_reading_is_closed_when_its_queue_overflows(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture, frame_size: int
) -> None:
    network = MemoryStreamNetwork(stream_pair=functools.partial(memory_pipe_pair, 4096))  # a small window
    async with trio.open_nursery() as nursery:
        a = await start_peer(nursery, network, KEYS[0])
        # The slow peer authenticates and then never reads a frame.
        slow = await open_channel(HOST, a.port, KEYS[1], expected_peer=a.address, transport=network)
        await settle()
        assert a.events == [("up", KEYS[1].address)]
        frame = b"x" * frame_size
        slow_peer = KEYS[1].address
        with caplog.at_level(logging.WARNING, logger="prime_node.swarm.transport"):
            for _ in range(8):
                a.plane.send(slow_peer, frame)
            await settle()  # the sender fills the stream's buffer and blocks: the rest waits in the queue
            link = a.plane.links[slow_peer]
            assert link.queue
            room = min(
                (MAX_QUEUED_BYTES - link.queued_bytes) // frame_size, MAX_QUEUED_FRAMES - len(link.queue)
            )
            for _ in range(room):
                a.plane.send(slow_peer, frame)
            assert slow_peer in a.plane.links and "send queue is full" not in caplog.text
            a.plane.send(slow_peer, frame)  # one more than the queue holds
        assert a.events == [("up", KEYS[1].address), ("down", KEYS[1].address)]
        assert not a.plane.links
        assert "send queue is full" in caplog.text
        await settle()
        with pytest.raises(ChannelError):  # the slow peer finds its channel gone once it reads again
            while True:
                await slow.receive_frame()
        nursery.cancel_scope.cancel()


async def test_inbound_connections_beyond_the_limit_are_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    async with trio.open_nursery() as nursery:
        hub = await start_peer(nursery, network, KEYS[0], max_inbound=1)
        first, second = [await start_peer(nursery, network, key) for key in KEYS[1:3]]
        first.dial(hub)
        await settle()
        second.dial(hub)
        await settle()
        assert hub.plane.refused == 1
        assert list(hub.plane.links) == [first.address]
        assert not second.plane.links and not second.plane.dialing
        nursery.cancel_scope.cancel()


async def test_a_banned_peer_is_closed_and_its_new_channels_refused(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    async with trio.open_nursery() as nursery:
        a, b = [await start_peer(nursery, network, key) for key in KEYS[:2]]
        a.dial(b)
        await settle()
        b.plane.ban(a.address)
        await settle()
        assert a.events == [("up", b.address), ("down", b.address)]
        a.dial(b)  # the handshake completes, but b drops the channel at once
        b.dial(a)  # and b does not dial a banned peer at all
        await settle()
        assert not b.plane.links and not a.plane.links
        assert b.events == [("up", a.address), ("down", a.address)]
        assert network.dials == 2
        nursery.cancel_scope.cancel()


async def test_dialing_an_address_nobody_listens_on_gives_up_quietly(
    autojump_clock: trio.testing.MockClock,
) -> None:
    network = MemoryStreamNetwork()
    async with trio.open_nursery() as nursery:
        a = await start_peer(nursery, network, KEYS[0])
        a.plane.dial(KEYS[1].address, HOST, 1)
        assert a.plane.dialing == {KEYS[1].address}
        await settle()
        assert not a.plane.dialing and not a.plane.links and not a.events
        nursery.cancel_scope.cancel()


async def test_a_plane_cannot_listen_on_a_taken_address(autojump_clock: trio.testing.MockClock) -> None:
    network = MemoryStreamNetwork()
    async with trio.open_nursery() as nursery:
        a = await start_peer(nursery, network, KEYS[0])
        plane = DataPlane(
            KEYS[1], on_up=unexpected, on_frame=unexpected, on_down=unexpected, transport=network
        )
        with pytest.raises(ChannelError) as caught:
            await nursery.start(functools.partial(plane.run, HOST, a.port))
        assert caught.value.reason == "port_in_use"
        nursery.cancel_scope.cancel()
