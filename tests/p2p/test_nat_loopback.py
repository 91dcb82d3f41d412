"""Dial-back probe, relay reservation, relayed dial and the upgrade to direct with real libp2p hosts on
127.0.0.1 (no NAT here: tests/p2p/test_nat_netns.py puts the same path behind real NAT routers)."""

from __future__ import annotations

import msgpack
import trio

from crypto.keys import WalletKey
from prime_node.p2p.interface import FramedStream
from prime_node.p2p.libp2p_host import open_libp2p_host
from prime_node.p2p.nat import DIALBACK_PROTOCOL, probe_reachability
from prime_node.p2p.nat_dialback import decode_answer
from tests.p2p.helpers import wait_until

ECHO = "/prime-node/test-echo/1"


async def _echo(stream: FramedStream) -> None:
    frame = await stream.receive_frame()
    if frame is not None:
        await stream.send_frame(frame)


async def test_probe_on_loopback_is_public_and_a_second_probe_is_rate_limited() -> None:
    async with (
        open_libp2p_host(WalletKey.generate()) as server,
        open_libp2p_host(WalletKey.generate()) as client,
    ):
        await client.connect(server.listen_multiaddrs()[0])
        first = await probe_reachability(client, server.peer_id, timeout=10)
        assert first.status == "public", first
        assert any(a.startswith("/ip4/127.0.0.1/tcp/") for a in first.observed_addrs)
        assert first.relay is None
        second = await probe_reachability(client, server.peer_id, timeout=10)
        assert second.status == "unknown"
        assert "rate limited" in second.detail


async def test_dial_back_to_a_port_nobody_listens_on_is_private_and_never_another_ip() -> None:
    async with (
        open_libp2p_host(WalletKey.generate()) as server,
        open_libp2p_host(WalletKey.generate()) as client,
    ):
        await client.connect(server.listen_multiaddrs()[0])
        with trio.socket.socket() as spare:  # a port that was free a moment ago and is closed now
            await spare.bind(("127.0.0.1", 0))
            closed_port = spare.getsockname()[1]
        stream = await client.open_stream(server.peer_id, DIALBACK_PROTOCOL)
        # The request names only ports; there is no way to name another IP.
        await stream.send_frame(msgpack.packb({"ports": [closed_port, 0, 70000], "ip": "10.9.9.9"}))
        answer = decode_answer(await stream.receive_frame())
        assert answer.refused == ""
        assert answer.results == ((closed_port, False),)
        assert answer.observed.startswith("/ip4/127.0.0.1/tcp/")


async def test_unconnected_probe_is_unknown() -> None:
    async with (
        open_libp2p_host(WalletKey.generate()) as lonely,
        open_libp2p_host(WalletKey.generate()) as other,
    ):
        result = await probe_reachability(lonely, other.peer_id, timeout=2)
        assert result.status == "unknown"
        assert result.detail


async def test_reserve_relay_dial_through_it_and_upgrade_to_direct() -> None:
    async with (
        open_libp2p_host(WalletKey.generate(), relay_service=True) as relay,
        open_libp2p_host(WalletKey.generate()) as home_a,
        open_libp2p_host(WalletKey.generate()) as home_b,
    ):
        home_a.set_stream_handler(ECHO, _echo)
        relay_addr = relay.listen_multiaddrs()[0]
        await home_a.connect(relay_addr)
        await home_b.connect(relay_addr)
        relayed = await home_a.reserve_relay(relay.peer_id)
        assert relayed == f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{home_a.peer_id}"
        advertised = home_a.listen_multiaddrs()
        assert advertised[-1].endswith(relayed) and advertised[-1].startswith("/ip4/127.0.0.1/tcp/")
        assert home_a.nat_counters().relay_reservations == (relay.peer_id,)
        assert relay.nat_counters().relay_serving

        assert await home_b.connect(advertised[-1]) == home_a.peer_id
        assert home_b.nat_counters().relayed_connections == 1
        stream = await home_b.open_stream(home_a.peer_id, ECHO)
        await stream.send_frame(b"over the relay")
        assert await stream.receive_frame() == b"over the relay"
        # DCUtR upgrades within a few seconds (on loopback its first step, a plain direct dial, works).
        await wait_until(lambda: home_b.nat_counters().direct_connections == 2, timeout=20)
        stream = await home_b.open_stream(home_a.peer_id, ECHO)
        await stream.send_frame(b"direct")
        assert await stream.receive_frame() == b"direct"


async def test_a_host_without_the_relay_service_refuses_reservations() -> None:
    async with (
        open_libp2p_host(WalletKey.generate()) as plain,
        open_libp2p_host(WalletKey.generate()) as home,
    ):
        await home.connect(plain.listen_multiaddrs()[0])
        try:
            await home.reserve_relay(plain.peer_id)
        except Exception as exc:
            assert getattr(exc, "reason", None) == "relay_refused"
        else:
            raise AssertionError("reservation on a non-relay host succeeded")
