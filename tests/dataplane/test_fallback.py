"""The data plane's libp2p fallback on in-memory hosts and streams, under trio's autojump clock: a dial
whose TCP port is refused or never answers falls back to a libp2p stream carrying the same channel, the
failure is remembered and TCP tried again later, a direct channel wins over a fallback one, and inbound
fallback streams meet the same admission rules as TCP connections (the real libp2p path is in
tests/swarm/test_dataplane_fallback.py)."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import trio
import trio.testing

from crypto.digests import blake3
from crypto.keys import Address, WalletKey
from prime_node.dataplane.channel import ChannelError
from prime_node.dataplane.connect import dial_channel
from prime_node.dataplane.dialer import TCP_DIAL_TIMEOUT
from prime_node.dataplane.libp2p_stream import P2PStream, RouteStats, fallback_protocol
from prime_node.dataplane.route_memo import RETRY_BASE, RouteMemo
from prime_node.p2p.interface import P2PHost
from prime_node.swarm.transport import DataPlane, DataPlaneSettings
from prime_node.testing.memory_network import MemoryHost, MemoryNetwork
from prime_node.testing.memory_streams import MemoryStreamNetwork
from prime_node.verification.batch_transfer import BatchTransfer
from protocol.rollout_transfer import announcement_for

HOST = "10.0.0.1"
NOBODY = 39_999  # below the memory network's first port: nobody listens there
SWARM = fallback_protocol("swarm")
TEST_LIMIT = 3600.0
KEYS = [WalletKey(hashlib.sha256(b"fallback" + bytes([i])).digest()) for i in range(5)]


@dataclass
class Peer:
    key: WalletKey
    host: MemoryHost
    plane: DataPlane
    port: int
    events: list[tuple[str, Address]] = field(default_factory=list)
    frames: list[tuple[Address, bytes]] = field(default_factory=list)

    @property
    def address(self) -> Address:
        return self.key.address


class Blackhole:
    """A transport whose dials to ``port`` never answer (a NAT that drops SYNs); others go to ``inner``."""

    def __init__(self, inner: MemoryStreamNetwork, port: int) -> None:
        self.inner = inner
        self.port = port
        self.hung = 0

    async def open_listeners(self, host: str, port: int) -> Any:
        return await self.inner.open_listeners(host, port)

    async def open_stream(self, host: str, port: int) -> trio.abc.Stream:
        if port == self.port:
            self.hung += 1
            await trio.sleep_forever()
        return await self.inner.open_stream(host, port)


@asynccontextmanager
async def planes(
    count: int, transport: Any = None, **options: Any
) -> AsyncIterator[tuple[MemoryNetwork, MemoryStreamNetwork, list[Peer]]]:
    """``count`` DataPlanes, each with a memory libp2p host attached, all hosts connected."""
    hosts, streams = MemoryNetwork(), MemoryStreamNetwork()
    async with AsyncExitStack() as stack:
        p2p = [await stack.enter_async_context(hosts.host(key)) for key in KEYS[:count]]
        with trio.fail_after(TEST_LIMIT):  # virtual seconds: a test that waits forever fails instead
            async with trio.open_nursery() as nursery:
                yield hosts, streams, await _start_planes(nursery, p2p, transport or streams, options)
                nursery.cancel_scope.cancel()


async def _start_planes(
    nursery: trio.Nursery, p2p: list[MemoryHost], transport: Any, options: dict[str, Any]
) -> list[Peer]:
    peers = [
        await _start_plane(nursery, key, host, transport, options)
        for key, host in zip(KEYS[: len(p2p)], p2p, strict=True)
    ]
    for peer in peers:
        for other in peers:
            if other is not peer:
                await peer.host.connect(other.host.listen_multiaddrs()[0])
    return peers


async def _start_plane(
    nursery: trio.Nursery, key: WalletKey, host: MemoryHost, transport: Any, options: dict[str, Any]
) -> Peer:
    events: list[tuple[str, Address]] = []
    frames: list[tuple[Address, bytes]] = []
    plane = DataPlane(
        key,
        on_up=lambda peer: events.append(("up", peer)),
        on_frame=lambda peer, frame: frames.append((peer, frame)),
        on_down=lambda peer: events.append(("down", peer)),
        transport=transport,
        settings=DataPlaneSettings(**options),
    )
    plane.attach(host)
    port = await nursery.start(plane.run, HOST, 0)
    return Peer(key, host, plane, port, events, frames)


async def settle() -> None:
    await trio.sleep(5)


def dial(a: Peer, b: Peer, port: int) -> None:
    a.plane.dial(b.address, HOST, port, peer_id=b.host.peer_id)


async def test_a_refused_port_falls_back_to_libp2p_and_frames_flow_both_ways(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(2) as (_, streams, (a, b)):
        dial(a, b, NOBODY)
        await settle()
        assert a.plane.links[b.address].fallback and b.plane.links[a.address].fallback
        a.plane.send(b.address, b"x" * (1 << 20))
        b.plane.send(a.address, b"pong")
        await settle()
        assert b.frames == [(a.address, b"x" * (1 << 20))] and a.frames == [(b.address, b"pong")]
        stats = a.plane.stats
        assert (stats.tcp_failures, stats.fallback_channels, stats.tcp_channels) == (1, 1, 0)
        assert stats.fallback_bytes_out > 1 << 20 and stats.relayed_bytes_out == 0
        assert b.plane.stats.fallback_bytes_in > 1 << 20
        assert a.plane.stats.status()["dataplane_fallback_bytes"] > 1 << 20
        assert streams.dials == 1


async def test_the_failure_is_remembered_and_tcp_tried_again_after_the_pause(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(2) as (_, streams, (a, b)):
        dial(a, b, NOBODY)
        await settle()
        a.plane.close(b.address)
        await settle()
        dial(a, b, NOBODY)  # within the pause: straight to the fallback, no TCP dial
        await settle()
        assert a.plane.links[b.address].fallback
        assert streams.dials == 1 and a.plane.stats.fallback_channels == 2
        a.plane.close(b.address)
        await trio.sleep(RETRY_BASE)
        dial(a, b, b.port)  # the pause is over and the port answers now: back on TCP
        await settle()
        assert not a.plane.links[b.address].fallback and not b.plane.links[a.address].fallback
        assert streams.dials == 2 and a.plane.stats.tcp_channels == 1
        assert len(a.plane.dialer.memo) == 0


async def test_a_fallback_link_is_upgraded_to_tcp_once_the_pause_is_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(2) as (_, streams, (a, b)):
        dial(a, b, NOBODY)
        await settle()
        assert not a.plane.upgrade(b.address, HOST, b.port)  # within the pause: no TCP dial
        await trio.sleep(RETRY_BASE)
        assert a.plane.upgrade(b.address, HOST, NOBODY)  # still unreachable: the link stays
        await settle()
        assert a.plane.links[b.address].fallback and a.plane.stats.tcp_failures == 2
        await trio.sleep(2 * RETRY_BASE)  # the pause doubled
        assert a.plane.upgrade(b.address, HOST, b.port)
        await settle()
        assert not a.plane.links[b.address].fallback and not b.plane.links[a.address].fallback
        assert [kind for kind, _ in a.events] == ["up", "down", "up"]
        a.plane.send(b.address, b"over tcp")
        await settle()
        assert b.frames == [(a.address, b"over tcp")] and streams.dials == 3


async def test_a_port_that_never_answers_falls_back_after_the_tcp_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    blackhole = Blackhole(MemoryStreamNetwork(), NOBODY)
    async with planes(2, transport=blackhole) as (_, _streams, (a, b)):
        start = trio.current_time()
        dial(a, b, NOBODY)
        with trio.fail_after(60):
            while b.address not in a.plane.links:
                await trio.sleep(0.1)
        assert trio.current_time() - start >= TCP_DIAL_TIMEOUT
        assert blackhole.hung == 1 and a.plane.links[b.address].fallback


async def test_a_peer_with_no_direct_host_is_dialed_over_libp2p_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(2) as (_, streams, (a, b)):
        a.plane.dial(b.address, None, b.port, peer_id=b.host.peer_id)
        await settle()
        assert a.plane.links[b.address].fallback and streams.dials == 0
        assert a.plane.stats.tcp_failures == 0


async def test_without_a_libp2p_host_a_refused_port_stays_a_failed_dial(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(2) as (_, _streams, (a, b)):
        a.plane.dialer.p2p = None
        dial(a, b, NOBODY)
        a.plane.dial(b.address, None, b.port, peer_id=b.host.peer_id)  # nothing to try: no-op
        await settle()
        assert not a.plane.links and a.plane.stats.fallback_channels == 0


async def test_relayed_connections_carry_no_bulk_bytes_by_default(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(2) as (hosts, _, (a, b)):
        hosts.relayed.add(frozenset((a.host.peer_id, b.host.peer_id)))
        dial(a, b, NOBODY)
        await settle()
        assert not a.plane.links and a.plane.stats.relayed_refused == 1
        a.plane.dial(b.address, None, 0, peer_id=b.host.peer_id)  # within the pause: no new stream
        dial(a, b, NOBODY)
        await settle()
        assert a.plane.stats.relayed_refused == 1 and b.plane.stats.fallback_streams_in == 1
        stream = await _raw_fallback(a.host, b)  # a peer that tries anyway is refused at the door
        assert await stream.receive_some(1024) == b""
        # b refused both: a's own stream (which a dropped too) and this one
        assert b.plane.stats.relayed_refused == 2 and b.plane.inbound == 0 and not b.events


async def test_a_peer_found_behind_a_relay_is_dialled_again_as_soon_as_a_direct_connection_comes_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Hole punching upgrades a relayed connection seconds after it opened: the relay pause (a minute)
    must not keep the data plane off the direct connection that replaced it."""
    async with planes(2) as (hosts, _, (a, b)):
        hosts.relayed.add(frozenset((a.host.peer_id, b.host.peer_id)))
        dial(a, b, NOBODY)
        await settle()
        assert not a.plane.links and a.plane.stats.relayed_refused == 1
        hosts.relayed.clear()  # the hole punch succeeded
        dial(a, b, NOBODY)
        await settle()
        assert a.plane.links[b.address].route == "libp2p" and a.plane.stats.fallback_channels == 1
        assert trio.current_time() < RETRY_BASE  # well within the relay pause


async def test_relayed_streams_are_counted_apart(autojump_clock: trio.testing.MockClock) -> None:
    async with planes(2, relayed_fallback=True) as (hosts, _, (a, b)):
        hosts.relayed.add(frozenset((a.host.peer_id, b.host.peer_id)))
        dial(a, b, NOBODY)
        await settle()
        a.plane.send(b.address, b"y" * 4096)
        await settle()
        assert a.plane.stats.relayed_bytes_out == a.plane.stats.fallback_bytes_out > 4096
        assert b.plane.stats.relayed_bytes_in == b.plane.stats.fallback_bytes_in > 4096


async def test_a_direct_channel_wins_over_a_fallback_one_at_both_ends(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(2) as (_, _streams, (a, b)):
        # a cannot reach b's port, b reaches a's: both channels complete at once, TCP survives.
        low, high = sorted((a, b), key=lambda peer: peer.address.raw)
        dial(low, high, NOBODY)  # the smaller address's channel would win a tie: make it the fallback one
        dial(high, low, low.port)
        await settle()
        assert len(a.plane.links) == 1 and len(b.plane.links) == 1
        assert not a.plane.links[b.address].fallback and not b.plane.links[a.address].fallback
        a.plane.send(b.address, b"after")
        await settle()
        assert b.frames == [(a.address, b"after")]


# --- hostile peers through the fallback ------------------------------------------------------------------


async def _raw_fallback(host: P2PHost, peer: Peer) -> P2PStream:
    framed = await host.open_stream(peer.host.peer_id, SWARM)
    return P2PStream(framed.raw, RouteStats())


async def test_garbage_on_a_fallback_stream_is_refused_like_on_tcp(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(2) as (_, _streams, (a, b)):
        stream = await _raw_fallback(a.host, b)
        await stream.send_all(b"\xff" * 64)
        await settle()
        assert await stream.receive_some(1024) == b""  # closed after the refused handshake
        assert b.plane.inbound == 0 and not b.plane.links and not b.events


async def test_a_channel_must_prove_the_wallet_of_the_libp2p_peer_that_opened_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(2) as (_, _streams, (a, b)):
        impostor = KEYS[4]  # a's libp2p connection, another wallet's handshake
        stream = await _raw_fallback(a.host, b)
        channel = await dial_channel(stream, impostor, expected_peer=b.address, context="swarm")
        with pytest.raises(ChannelError):
            await channel.receive_frame()
        await settle()
        assert not b.plane.links and not b.events and b.plane.inbound == 0


async def test_fallback_and_tcp_connections_share_one_inbound_limit(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(3, max_inbound=1) as (_, streams, (a, b, c)):
        idle_tcp = await streams.open_stream(HOST, c.port)  # holds c's only inbound slot (no handshake)
        await trio.sleep(1)
        dial(a, c, NOBODY)
        await trio.sleep(1)
        assert c.plane.refused == 1 and not c.plane.links
        await idle_tcp.aclose()
        await trio.sleep(1)
        dial(b, c, NOBODY)
        await settle()
        assert c.address in b.plane.links and c.plane.links[b.address].fallback


async def test_a_banned_peer_is_refused_through_the_fallback(autojump_clock: trio.testing.MockClock) -> None:
    async with planes(2) as (_, _streams, (a, b)):
        b.plane.ban(a.address)
        dial(a, b, NOBODY)
        await settle()
        assert not a.plane.links and not b.plane.links and b.plane.refused == 1


async def test_fallback_channels_draw_on_the_planes_memory_budget(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with planes(2) as (_, _streams, (a, b)):
        dial(a, b, NOBODY)
        await settle()
        assert b.plane.links[a.address].channel.account.budget is b.plane.budget
        assert b.plane.budget.accounts == 1


# --- rollout batches -------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct_host", [HOST, None])
async def test_a_rollout_batch_is_fetched_through_the_fallback(
    autojump_clock: trio.testing.MockClock, direct_host: str | None
) -> None:
    hosts, streams = MemoryNetwork(), MemoryStreamNetwork()
    frame = bytes(range(256)) * (12 << 10)  # 3 MiB
    async with hosts.host(KEYS[0]) as worker_host, hosts.host(KEYS[1]) as fetcher_host:
        await fetcher_host.connect(worker_host.listen_multiaddrs()[0])
        worker = BatchTransfer(KEYS[0], host_of=lambda _: None, host=HOST, transport=streams, p2p=worker_host)
        fetcher = BatchTransfer(
            KEYS[1], host_of=lambda _: direct_host, host=HOST, transport=streams, p2p=fetcher_host
        )
        with trio.fail_after(TEST_LIMIT):
            async with trio.open_nursery() as nursery:
                await nursery.start(worker.run)
                await nursery.start(fetcher.run)
                worker.hold(blake3(frame), frame)
                announcement = announcement_for(
                    frame, run_id="run", worker=KEYS[0].address, policy_step=0, batch_counter=1, port=NOBODY
                )
                fetcher.heard(announcement, KEYS[0].address, worker_host.peer_id)
                assert await fetcher.fetch(announcement.batch_id, len(frame)) == frame
                assert fetcher.stats.fallback_channels == 1
                assert fetcher.stats.fallback_bytes_in > len(frame)
                assert worker.status()["dataplane_fallback_bytes"] > len(frame)
                assert worker.counts["served"] == 1
                nursery.cancel_scope.cancel()


def test_route_memo_pauses_double_up_to_the_cap_and_a_success_forgets() -> None:
    memo = RouteMemo(base=10, cap=35, max_peers=2)
    peer, other, third = (key.address for key in KEYS[:3])
    assert memo.may_try(peer, 0)
    assert memo.failed(peer, 0) == 10
    assert not memo.may_try(peer, 9.9) and memo.may_try(peer, 10)
    assert memo.failed(peer, 10) == 30
    assert memo.failed(peer, 30) == 65  # 40 capped at 35
    memo.succeeded(peer)
    assert memo.may_try(peer, 30) and memo.failed(peer, 100) == 110
    memo.failed(other, 0)
    memo.failed(third, 0)  # over max_peers: the oldest (peer) is forgotten
    assert len(memo) == 2 and memo.may_try(peer, 100)
