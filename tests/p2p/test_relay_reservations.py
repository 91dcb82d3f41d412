"""Relay reservations under attack, with a real relay host on 127.0.0.1 and real hosts reserving (issue 35,
item 3): 32 fresh keys that connect, reserve and leave filled every slot of py-libp2p's relay for an hour
and an honest NAT'd key was refused. Reservations now end with their holder's connection, are budgeted per
IP group with slots kept for known members, and a NAT'd node whose relay refuses tries the next one."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import trio

from crypto.identity import peer_id_bytes
from crypto.keys import WalletKey
from prime_node.errors import NodeError
from prime_node.node.context import NodeContext
from prime_node.node.reachability_service import ReachabilityService
from prime_node.p2p.libp2p_host import Libp2pHost, open_libp2p_host
from prime_node.p2p.nat import Reachability
from prime_node.p2p.nat_relay import RELAY_MAX_RESERVATIONS
from protocol.relay_reservations import ReservationLimits
from tests.p2p.helpers import wait_until

HANG_GUARD = 120


async def _reserve(relay: Libp2pHost, home: Libp2pHost) -> bool:
    """Connect ``home`` to ``relay`` and ask for a slot: whether it got one."""
    await home.connect(relay.listen_multiaddrs()[0])
    try:
        await home.reserve_relay(relay.peer_id)
    except NodeError as exc:
        assert exc.reason == "relay_refused"
        return False
    return True


async def _stranger_reserves_and_leaves(relay: Libp2pHost) -> bool:
    """One fresh key connects, reserves and leaves (the next comes once the relay saw it go: on loopback
    all strangers are one IP group, whose budget of established connections would refuse them first). It
    hangs up itself: a host closed inside this process leaves its sockets open until they are collected."""
    async with open_libp2p_host(WalletKey.generate()) as stranger:
        granted = await _reserve(relay, stranger)
        await stranger.disconnect(relay.peer_id)
    await _gone(relay, {stranger.peer_id})
    return granted


async def _gone(relay: Libp2pHost, peer_ids: set[str]) -> None:
    await wait_until(lambda: not peer_ids & set(relay.connected_peers()), timeout=30)


async def test_strangers_that_reserved_and_left_do_not_keep_an_honest_home_out() -> None:
    """The attack as it was made: as many fresh keys as the relay has slots connect, reserve and leave."""
    with trio.fail_after(HANG_GUARD * 3):
        async with open_libp2p_host(WalletKey.generate(), relay_service=True) as relay:
            granted = []
            for _ in range(RELAY_MAX_RESERVATIONS):
                granted.append(await _stranger_reserves_and_leaves(relay))
            assert any(granted)
            async with open_libp2p_host(WalletKey.generate()) as home:
                assert await _reserve(relay, home)
            assert relay._relay.reservation_outcomes["departed"] >= RELAY_MAX_RESERVATIONS


async def test_a_stranger_cannot_reserve_slots_for_other_peer_ids() -> None:
    """py-libp2p takes the RESERVE message's optional peer field over the connection's peer: one
    connection could fill every slot with made-up IDs."""
    from libp2p.peer.id import ID
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
    from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
    from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID
    from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg

    with trio.fail_after(HANG_GUARD):
        async with (
            open_libp2p_host(WalletKey.generate(), relay_service=True) as relay,
            open_libp2p_host(WalletKey.generate()) as stranger,
        ):
            await stranger.connect(relay.listen_multiaddrs()[0])
            raw = stranger._host
            refused = 0
            for _ in range(RELAY_MAX_RESERVATIONS + 1):
                claimed = ID(peer_id_bytes(WalletKey.generate().public_key))
                stream = await raw.new_stream(ID.from_base58(relay.peer_id), [PROTOCOL_ID])
                message = HopMessage(type=HopMessage.RESERVE, peer=CircuitPeerId(id=claimed.to_bytes()))
                await write_delimited_msg(stream, message)
                answer = await read_delimited_msg(stream, HopMessage)
                refused += answer.status != 100  # StatusCode.OK
                await stream.close()
            assert refused == RELAY_MAX_RESERVATIONS + 1
            assert relay._relay.reservation_outcomes["claims_another_peer"] == RELAY_MAX_RESERVATIONS + 1
            async with open_libp2p_host(WalletKey.generate()) as home:
                assert await _reserve(relay, home)


async def test_strangers_of_one_ip_group_hold_at_most_their_cap_and_known_members_still_get_slots() -> None:
    """On loopback every host is one IP group (127.0.0.1), so the group cap is set small here; the default
    (4 per /24 or /48) is in protocol.relay_reservations."""
    limits = ReservationLimits(total=32, per_group=2, reserved_known=4)
    with trio.fail_after(HANG_GUARD):
        async with (
            open_libp2p_host(WalletKey.generate(), relay_service=True, relay_reservations=limits) as relay,
            open_libp2p_host(WalletKey.generate()) as first,
            open_libp2p_host(WalletKey.generate()) as second,
            open_libp2p_host(WalletKey.generate()) as third,
            open_libp2p_host(WalletKey.generate()) as member,
        ):
            assert await _reserve(relay, first)
            assert await _reserve(relay, second)
            assert not await _reserve(relay, third)  # its group holds its cap
            assert relay._relay.reservation_outcomes["group_full"] == 1
            await member.connect(relay.listen_multiaddrs()[0])
            relay.mark_known(member.peer_id)  # the relay's node vouches for members (healthy, past probation)
            assert await _reserve(relay, member)  # same IP, but a known member skips the group cap
            counters = relay.nat_counters()
            assert (counters.relay_clients, counters.relay_refusals) == (3, 1)
            assert await _reserve(relay, first)  # a holder refreshes its own slot
            await first.disconnect(relay.peer_id)
            await _gone(relay, {first.peer_id})
            assert await _reserve(relay, third)  # a slot ends with its holder's connection


async def test_slots_kept_for_known_members_when_strangers_hold_the_rest() -> None:
    limits = ReservationLimits(total=3, per_group=8, reserved_known=1)
    with trio.fail_after(HANG_GUARD):
        async with (
            open_libp2p_host(WalletKey.generate(), relay_service=True, relay_reservations=limits) as relay,
            open_libp2p_host(WalletKey.generate()) as first,
            open_libp2p_host(WalletKey.generate()) as second,
            open_libp2p_host(WalletKey.generate()) as third,
            open_libp2p_host(WalletKey.generate()) as member,
            open_libp2p_host(WalletKey.generate()) as late_member,
        ):
            assert await _reserve(relay, first)
            assert await _reserve(relay, second)
            assert not await _reserve(relay, third)  # the last slot is kept for members
            assert relay._relay.reservation_outcomes["full"] == 1
            for home in (member, late_member):
                await home.connect(relay.listen_multiaddrs()[0])
                relay.mark_known(home.peer_id)
            assert await _reserve(relay, member)
            # Every slot is held; a member still gets one: the newest stranger's reservation goes.
            assert await _reserve(relay, late_member)
            held = relay._relay.protocol.resource_manager._reservations
            assert {str(p) for p in held} == {first.peer_id, member.peer_id, late_member.peer_id}


class _PrivateLibp2pHost:
    """A real host whose dial-back probes all say "private" (on loopback they would say public)."""

    def __init__(self, host: Libp2pHost) -> None:
        self._host = host

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)

    async def probe_reachability(self, peer_id: str, timeout: float) -> Reachability:
        return Reachability("private", (), None, f"{peer_id}: unreachable (test)")


async def test_a_home_whose_bootstrap_relay_refuses_reserves_on_another_connected_relay() -> None:
    with trio.fail_after(HANG_GUARD):
        async with (
            open_libp2p_host(WalletKey.generate()) as bootstrap,  # no relay service: refuses
            open_libp2p_host(WalletKey.generate(), relay_service=True) as relay,
            open_libp2p_host(WalletKey.generate()) as real_home,
        ):
            boot_addr = bootstrap.listen_multiaddrs()[0]
            await real_home.connect(boot_addr)
            await real_home.connect(relay.listen_multiaddrs()[0])
            home = _PrivateLibp2pHost(real_home)
            service = ReachabilityService([boot_addr])
            context = cast(
                NodeContext, SimpleNamespace(host=home, clock=SimpleNamespace(now=trio.current_time))
            )
            service._context = context
            assert await service.round(context)
            assert service.status == "private"
            assert service.relay_peer == relay.peer_id
            assert real_home.nat_counters().relay_reservations == (relay.peer_id,)


async def test_a_home_displaced_by_a_member_finds_out_at_its_next_round_and_moves_to_another_relay() -> None:
    one_slot = ReservationLimits(total=1, per_group=1, reserved_known=0)
    with trio.fail_after(HANG_GUARD):
        async with (
            open_libp2p_host(
                WalletKey.generate(), relay_service=True, relay_reservations=one_slot
            ) as bootstrap,
            open_libp2p_host(WalletKey.generate(), relay_service=True) as relay,
            open_libp2p_host(WalletKey.generate()) as real_home,
            open_libp2p_host(WalletKey.generate()) as member,
        ):
            boot_addr = bootstrap.listen_multiaddrs()[0]
            await real_home.connect(boot_addr)
            await real_home.connect(relay.listen_multiaddrs()[0])
            service = ReachabilityService([boot_addr])
            context = cast(
                NodeContext,
                SimpleNamespace(
                    host=_PrivateLibp2pHost(real_home), clock=SimpleNamespace(now=trio.current_time)
                ),
            )
            service._context = context
            assert await service.round(context)
            assert service.relay_peer == bootstrap.peer_id

            await member.connect(boot_addr)
            bootstrap.mark_known(member.peer_id)
            assert await _reserve(bootstrap, member)  # the one slot goes to the member
            assert bootstrap._relay.reservation_outcomes["displaced"] == 1

            assert await service.round(context)  # the refresh is refused: reserve elsewhere
            assert service.relay_peer == relay.peer_id
            assert real_home.nat_counters().relay_reservations == (relay.peer_id,)
