"""A record's addresses are only its owner's claim (issue 35, item 5): a stranger whose record names
someone else's listener, and who says ``bye`` and leaves, must not keep its victim dialling that listener,
must not be passed on to newcomers, and must not stay healthy on its record alone."""

from __future__ import annotations

import functools
from pathlib import Path

import trio

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from prime_node.node.neighbour_links import NEIGHBOUR_PROTOCOL
from prime_node.node.runner import local_hardware
from prime_node.node.service import Node
from prime_node.p2p.interface import FramedStream, P2PHost
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.testing.memory_network import MemoryNetwork
from protocol.codec import decode, encode
from protocol.dial_backoff import BASE_PAUSE, MAX_PAUSE, pause_after
from protocol.envelope import Domain, seal
from protocol.membership import PeerState
from protocol.overlay import MAX_NEIGHBOUR_FRAME, FrameKind, NeighbourFrame
from protocol.peer_record import PeerRecord
from tests.p2p.helpers import make_config, start_node, wait_until

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")


def _frame(kind: FrameKind, records: tuple[bytes, ...], now_ms: int) -> bytes:
    return encode(NeighbourFrame(kind.value, now_ms, records))


async def _hello_bye_and_leave(
    stranger: P2PHost, key: WalletKey, node: Node, multiaddrs: tuple[str, ...]
) -> None:
    """Link to ``node`` with our own signed record naming ``multiaddrs``, say bye at once, hang up."""
    await stranger.connect(node.host.listen_multiaddrs()[0])
    stream = await stranger.open_stream(node.identity.peer_id, NEIGHBOUR_PROTOCOL)
    now_ms = node.links.clock.wall_ms()
    envelope = _envelope(key, multiaddrs, node)
    await stream.send_frame(_frame(FrameKind.HELLO, (envelope,), now_ms))
    answer = await stream.receive_frame(MAX_NEIGHBOUR_FRAME)
    assert answer is not None and decode(answer, NeighbourFrame).kind == FrameKind.WELCOME
    await stream.send_frame(_frame(FrameKind.BYE, (), now_ms))
    await stream.close()
    await stranger.disconnect(node.identity.peer_id)


async def test_a_stranger_that_said_bye_and_left_is_not_kept_healthy_on_its_record(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """Before: a ``bye`` moved the stranger to record judging at once, healthy for 2.5 refresh periods
    (75 s) after it was gone. Now a bye is checked with a hello: nobody answers, so it is judged by its
    last beat and is dead after the dead window."""
    network = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, network.host, make_config(tmp_path, 0), serve_api=False)
        key = WalletKey.generate()
        peer_id = peer_id_from_public_key(key.public_key)
        async with network.host(key) as stranger:
            await _hello_bye_and_leave(stranger, key, node, tuple(stranger.listen_multiaddrs()))
            assert node.membership.get(peer_id) is not None
        await trio.sleep(node.config.dead_window + 2 * node.config.heartbeat_interval)
        member = node.membership.get(peer_id)
        assert member is None or member.state is PeerState.DEAD
        assert node.links.dials.strikes(stranger.listen_multiaddrs()[0]) >= 1
        nursery.cancel_scope.cancel()


async def test_a_record_naming_a_third_partys_listener_rests_and_is_not_passed_on(tmp_path: Path) -> None:
    """Real libp2p hosts on 127.0.0.1. A stranger's own signed record, passed on by a neighbour, names a
    third party's listener under the stranger's peer ID. The victim's dial there fails the Noise
    peer-ID check: the endpoint rests, doubling, for every key that names it; the honest third party's
    own address is not locked out; and the record is withheld from a newcomer."""
    async with trio.open_nursery() as nursery, OPEN(WalletKey.generate()) as third:
        node, _ = await start_node(nursery, OPEN, make_config(tmp_path, 0))
        key = WalletKey.generate()
        peer_id = peer_id_from_public_key(key.public_key)
        listener = third.listen_multiaddrs()[0].rsplit("/p2p/", 1)[0]
        claimed = f"{listener}/p2p/{peer_id}"
        neighbour_key = WalletKey.generate()
        async with OPEN(neighbour_key) as neighbour:
            stream = await _link(neighbour, neighbour_key, node)
            now_ms = node.links.clock.wall_ms()
            await stream.send_frame(_frame(FrameKind.BEAT, (_envelope(key, (claimed,), node),), now_ms))
            await wait_until(lambda: node.membership.get(peer_id) is not None, timeout=60)

            # Its heartbeat loop dials the healthy stranger at the address its record names: the dial
            # fails the Noise peer-ID check, a strike on that endpoint, and the endpoint rests.
            await wait_until(lambda: node.links.dials.strikes(claimed) >= 1, timeout=60)
            dials = node.links.dials
            assert not dials.proven(claimed) and dials.disproven((claimed,))
            first_rest = dials.resting_until(claimed)
            assert first_rest > 0
            fresh = peer_id_from_public_key(WalletKey.generate().public_key)
            if first_rest > trio.current_time():  # neither this key nor a fresh one naming it dials it
                assert dials.plan((claimed, f"{listener}/p2p/{fresh}"), trio.current_time()) == ()
            # The third party's own address, for its own peer ID, is not disproven by the stranger.
            assert not dials.disproven(tuple(third.listen_multiaddrs()))

            # A newcomer linking to the victim is not handed the record.
            newcomer, _ = await start_node(
                nursery, OPEN, make_config(tmp_path, 1, bootstrap=(node.advertised_multiaddrs()[0],))
            )
            await wait_until(lambda: node.identity.peer_id in newcomer.neighbours(), timeout=60)
            await trio.sleep(3 * newcomer.config.heartbeat_interval)  # beats and the records they carry
            assert newcomer.membership.get(peer_id) is None
            assert node.metrics.counters["records_withheld"] >= 1
            # Every later strike rested the endpoint at least twice as long as the one before (capped).
            strikes = dials.strikes(claimed)
            assert pause_after(strikes, dials.config) >= min(2 ** (strikes - 1) * BASE_PAUSE, MAX_PAUSE)
            await stream.close()
        nursery.cancel_scope.cancel()


def _envelope(key: WalletKey, multiaddrs: tuple[str, ...], node: Node) -> bytes:
    peer_id = peer_id_from_public_key(key.public_key)
    record = PeerRecord(key.address, peer_id, "validator", multiaddrs, local_hardware(), (), 0, "0.1.0")
    now_ms = node.links.clock.wall_ms()
    return encode(seal(key, Domain("peer_record", node.config.run_id), encode(record), now_ms=now_ms))


async def _link(host: P2PHost, key: WalletKey, node: Node) -> FramedStream:
    """Become ``node``'s neighbour with a hello carrying our own record (retrying a busy answer, which
    a node gives when it is opening a link to us at the same moment)."""
    await host.connect(node.host.listen_multiaddrs()[0])
    with trio.fail_after(60):  # a guard against a hang
        while True:
            stream = await host.open_stream(node.identity.peer_id, NEIGHBOUR_PROTOCOL)
            own = _envelope(key, tuple(host.listen_multiaddrs()), node)
            await stream.send_frame(_frame(FrameKind.HELLO, (own,), node.links.clock.wall_ms()))
            answer = await stream.receive_frame(MAX_NEIGHBOUR_FRAME)
            assert answer is not None
            if decode(answer, NeighbourFrame).kind == FrameKind.WELCOME:
                return stream
            await stream.close()
            await trio.sleep(0.5)
