"""Floods and Sybils against real libp2p hosts on 127.0.0.1 (issue 13, item 6 and the Sybil items).

Flooders are raw TCP clients bound to their own loopback addresses (127.0.9.x, 127.0.10.x ...), so the
victim sees them as other IP groups than the honest hosts (127.0.0.1), as it would on the internet.
Every flood is bounded: at most 300 sockets at once, a bounded number of reconnects each, and the test's
own deadline.
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.p2p.interface import FramedStream, PeerAddresses
from prime_node.p2p.libp2p_host import Libp2pHost, open_libp2p_host
from protocol.connection_admission import ConnectionLimits
from protocol.dht_key import provider_key
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until

OPEN = functools.partial(open_libp2p_host, listen="/ip4/127.0.0.1/tcp/0")
ECHO = "/prime-node-test/echo/1"
FLOOD_SIZE = 300
RECONNECTS = 15
MULTISTREAM = b"\x13/multistream/1.0.0\n"
NOISE = b"\x07/noise\n"


@dataclass
class FloodStats:
    opened: int = 0
    closed_by_victim: int = 0


def port_of(host: Libp2pHost) -> int:
    return int(host.listen_multiaddrs()[0].split("/tcp/")[1].split("/")[0])


async def _misbehave(sock: trio.socket.SocketType, mode: str) -> None:
    """Hold one connection the way a flooder does; returns when the victim closes it."""
    if mode == "slow":  # a handshake one byte every half second
        for byte in MULTISTREAM + NOISE:
            await sock.send(bytes([byte]))
            await trio.sleep(0.5)
    elif mode == "half":  # multistream + Noise message 1, then never message 3
        await sock.send(MULTISTREAM + NOISE)
        echoed = b""
        while len(echoed) < len(MULTISTREAM + NOISE):
            chunk = await sock.recv(256)
            if not chunk:
                return
            echoed += chunk
        await sock.send(len(b"e" * 32).to_bytes(2, "big") + os.urandom(32))
    while await sock.recv(4096):
        pass


async def flood(port: int, sources: list[str], mode: str, stats: FloodStats) -> None:
    """Keep FLOOD_SIZE connections open from ``sources`` (round-robin), reopening each one the victim closes
    after a short pause, at most RECONNECTS times per slot."""

    async def hold_slot(index: int) -> None:
        for _ in range(RECONNECTS):
            sock = trio.socket.socket()
            try:
                await sock.bind((sources[index % len(sources)], 0))
                await sock.connect(("127.0.0.1", port))
                stats.opened += 1
                await _misbehave(sock, mode)
                stats.closed_by_victim += 1
            except OSError:
                pass
            finally:
                sock.close()
            await trio.sleep(0.5)

    async with trio.open_nursery() as nursery:
        for index in range(FLOOD_SIZE):
            nursery.start_soon(hold_slot, index)


async def echo(stream: FramedStream) -> None:
    while (frame := await stream.receive_frame()) is not None:
        await stream.send_frame(frame)


async def honest_round_trip(victim: Libp2pHost) -> float:
    """A fresh host dials the victim and echoes one frame; returns the seconds it took."""
    async with OPEN(WalletKey.generate()) as honest:
        start = trio.current_time()
        with trio.fail_after(20):
            await honest.connect(victim.listen_multiaddrs()[0])
            stream = await honest.open_stream(victim.peer_id, ECHO)
            await stream.send_frame(b"still here")
            assert await stream.receive_frame() == b"still here"
            await stream.close()
        return trio.current_time() - start


@pytest.mark.parametrize("mode", ["idle", "slow", "half"])
async def test_an_honest_peer_gets_in_while_one_address_floods_300_connections(mode: str) -> None:
    async with OPEN(WalletKey.generate()) as victim:
        victim.set_stream_handler(ECHO, echo)
        stats = FloodStats()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood, port_of(victim), ["127.0.9.1"], mode, stats)
            await wait_until(lambda: stats.opened >= FLOOD_SIZE, timeout=20, step=0.05)
            took = await honest_round_trip(victim)
            print(f"{mode} flood from one address: honest round trip in {took:.2f} s, {stats}")
            nursery.cancel_scope.cancel()


async def test_an_honest_peer_gets_in_while_300_addresses_hold_idle_connections() -> None:
    sources = [f"127.0.{10 + i // 200}.{1 + i % 200}" for i in range(FLOOD_SIZE)]
    async with OPEN(WalletKey.generate()) as victim:
        victim.set_stream_handler(ECHO, echo)
        stats = FloodStats()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(flood, port_of(victim), sources, "idle", stats)
            await wait_until(lambda: stats.opened >= FLOOD_SIZE, timeout=20, step=0.05)
            took = await honest_round_trip(victim)
            print(f"idle flood from {len(sources)} addresses: honest round trip in {took:.2f} s, {stats}")
            nursery.cancel_scope.cancel()


async def test_a_new_node_bootstraps_and_finds_the_run_while_its_bootstrap_peer_is_flooded(
    tmp_path: Path,
) -> None:
    async with trio.open_nursery() as nursery:
        bootstrap, _ = await start_node(nursery, OPEN, make_config(tmp_path, 0))
        port = int(bootstrap.advertised_multiaddrs()[0].split("/tcp/")[1].split("/")[0])
        stats = FloodStats()
        nursery.start_soon(flood, port, ["127.0.9.1"], "half", stats)
        await wait_until(lambda: stats.opened >= FLOOD_SIZE, timeout=20, step=0.05)
        config = make_config(tmp_path, 1, bootstrap=bootstrap.advertised_multiaddrs(), bootstrap_timeout=15.0)
        joiner, _ = await start_node(nursery, OPEN, config)
        took = await wait_until(lambda: sees_all(joiner, [bootstrap]) and sees_all(bootstrap, [joiner]), 20)
        print(f"joined through a flooded bootstrap peer in {took:.2f} s, {stats}")
        nursery.cancel_scope.cancel()


async def test_a_peer_that_just_failed_a_dial_can_be_dialled_again_at_once() -> None:
    key = WalletKey.generate()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id_from_public_key(key.public_key)}"
    async with OPEN(WalletKey.generate()) as dialer:
        with pytest.raises(NodeError):
            await dialer.connect(address)  # nobody listens yet
        async with open_libp2p_host(key, f"/ip4/127.0.0.1/tcp/{port}") as late:
            with trio.fail_after(10):
                assert await dialer.connect(address) == late.peer_id
            assert late.peer_id in dialer.connected_peers()


async def _try_connect(host: Libp2pHost, victim: Libp2pHost) -> bool:
    try:
        await host.connect(victim.listen_multiaddrs()[0])
    except NodeError:
        return False
    await trio.sleep(0.3)  # a refused peer is closed right after its Noise handshake
    return victim.peer_id in host.connected_peers() and host.peer_id in victim.connected_peers()


async def test_one_address_holds_at_most_k_identities_at_once_and_known_peers_are_exempt() -> None:
    limits = ConnectionLimits(established_per_group=3)
    async with OPEN(WalletKey.generate(), limits=limits) as victim, trio.open_nursery() as nursery:
        sybils: list[Libp2pHost] = []

        async def run_sybil(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            async with OPEN(WalletKey.generate()) as sybil:
                sybils.append(sybil)
                task_status.started()
                await trio.sleep_forever()

        for _ in range(5):
            await nursery.start(run_sybil)
        admitted = [await _try_connect(s, victim) for s in sybils[:4]]
        assert admitted == [True, True, True, False]
        assert victim.inbound_gate.established_from("127.0.0.1") == 3
        assert victim.inbound_gate.outcomes["group_full"] >= 1

        victim.mark_known(sybils[4].peer_id)  # a peer the node vouches for keeps its place
        assert await _try_connect(sybils[4], victim)

        await sybils[0].disconnect(victim.peer_id)  # one identity leaves: another may take its place
        # (3 counted: the 2 strangers left and the known peer)
        await wait_until(lambda: victim.inbound_gate.established_from("127.0.0.1") == 3, timeout=10)
        assert await _try_connect(sybils[3], victim)
        nursery.cancel_scope.cancel()


async def test_a_crowd_of_sybil_provider_records_does_not_hide_the_honest_providers() -> None:
    from libp2p.peer.id import ID
    from libp2p.peer.peerinfo import PeerInfo
    from multiaddr import Multiaddr

    def record(group_prefix: str, n: int) -> PeerInfo:
        peer_id = peer_id_from_public_key(WalletKey.generate().public_key)
        return PeerInfo(ID.from_base58(peer_id), [Multiaddr(f"/ip4/{group_prefix}.{n}/tcp/4001")])

    run_key = "/prime-node/run/sybil-test"
    async with OPEN(WalletKey.generate()) as node:
        store = node._dht.provider_store
        sybils = [record("203.0.113", n) for n in range(26)]
        honest = [record("198.51.100", 7), record("192.0.2", 9)]
        for info in [*sybils, *honest]:  # the Sybils came first
            store.add_provider(provider_key(run_key), info)
        found = [p.peer_id for p in await node.find_providers(run_key)]
        honest_ids = {str(info.peer_id) for info in honest}
        sybil_ids = {str(info.peer_id) for info in sybils}
        print(f"lookup: {len(found)} providers, {len(sybil_ids & set(found))} Sybils")
        assert honest_ids <= set(found[:3])
        assert len(sybil_ids & set(found)) <= 8

        node.mark_known(str(honest[0].peer_id))
        found = [p.peer_id for p in await node.find_providers(run_key)]
        assert found[0] == str(honest[0].peer_id)
        assert PeerAddresses(found[0], ("/ip4/198.51.100.7/tcp/4001",)) in await node.find_providers(run_key)
