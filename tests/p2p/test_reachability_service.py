"""The reachability service: probes, reserves a relay when private (bootstrap peers first), re-reserves
when the relay goes, and shows it all in the "reachability" status section."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import trio

from prime_node.errors import NodeError
from prime_node.node.context import NodeContext
from prime_node.node.reachability_service import SECTION, ReachabilityService, peer_id_of
from prime_node.p2p.nat import NatCounters, Reachability
from prime_node.testing.memory_network import MemoryNetwork
from tests.p2p.helpers import make_config, start_node, wait_until


class PrivateHost:
    """A host behind NAT: every probe says private; ``refusing`` relays refuse reservations."""

    peer_id = "me"

    def __init__(self, peers: list[str], refusing: set[str], dialled_in_by: int = 0) -> None:
        self.peers = peers
        self.refusing = refusing
        self.dialled_in_by = dialled_in_by
        self.held: set[str] = set()
        self.reserve_calls: list[str] = []

    def connected_peers(self) -> list[str]:
        return list(self.peers)

    async def probe_reachability(self, peer_id: str, timeout: float) -> Reachability:
        return Reachability("private", ("/ip4/198.51.100.7/tcp/50000",), None, f"{peer_id}: unreachable")

    async def reserve_relay(self, relay_peer_id: str) -> str:
        self.reserve_calls.append(relay_peer_id)
        if relay_peer_id in self.refusing:
            raise NodeError("full", reason="relay_refused")
        self.held.add(relay_peer_id)
        return f"/p2p/{relay_peer_id}/p2p-circuit/p2p/me"

    def nat_counters(self) -> NatCounters:
        return NatCounters(
            relay_reservations=tuple(sorted(self.held)),
            direct_connections=len(self.peers),
            dialled_in_by=self.dialled_in_by,
        )


def _context(host: PrivateHost, clock: list[float]) -> NodeContext:
    fake = SimpleNamespace(host=host, clock=SimpleNamespace(now=lambda: clock[0]))
    return cast(NodeContext, fake)


async def test_private_node_reserves_on_a_bootstrap_peer_and_again_when_the_relay_goes() -> None:
    host = PrivateHost(["zz-other", "boot2", "boot1"], refusing={"boot1"})
    clock = [0.0]
    service = ReachabilityService(["/ip4/1.2.3.4/tcp/1/p2p/boot1", "/ip4/1.2.3.5/tcp/1/p2p/boot2"])
    context = _context(host, clock)
    service._context = context

    assert await service.round(context)  # private; boot1 refused, boot2 gave a slot: settled
    assert host.reserve_calls == ["boot1", "boot2"]
    section = service.section()
    assert section["status"] == "private"
    assert section["relay_reserved"] and section["relay"] == "/p2p/boot2/p2p-circuit/p2p/me"
    assert section["observed_addrs"] == ["/ip4/198.51.100.7/tcp/50000"]
    assert "zz-other" not in host.reserve_calls  # bootstrap peers are the relays we try

    host.held.clear()  # the relay went away
    clock[0] = 10.0
    assert await service.round(context)
    assert host.reserve_calls[-1] == "boot2" and service.section()["relay_reserved"]
    assert host.reserve_calls.count("boot1") == 1  # a refusing relay rests before it is asked again


async def test_reserving_can_be_turned_off() -> None:
    host = PrivateHost(["boot1"], refusing=set())
    service = ReachabilityService(["/p2p/boot1"], reserve_relay=False)
    context = _context(host, [0.0])
    service._context = context
    assert await service.round(context)
    assert service.status == "private" and host.reserve_calls == []


async def test_a_node_others_dialled_asks_again_before_calling_itself_private() -> None:
    """One timed-out dial-back made the saturated bootstrap of a 64-process swarm reserve a relay."""
    host = PrivateHost(["p1", "p2", "p3"], refusing=set(), dialled_in_by=3)
    service = ReachabilityService()
    context = _context(host, [0.0])
    service._context = context
    assert not await service.round(context)  # one failure: ask again (another peer) before acting on it
    assert service.status == "unknown" and host.reserve_calls == []
    assert service.section()["dialled_in_by"] == 3
    assert await service.round(context)
    assert service.status == "private" and len(host.reserve_calls) == 1


def test_peer_id_of() -> None:
    assert peer_id_of("/ip4/1.2.3.4/tcp/1/p2p/Qm1") == "Qm1"
    assert peer_id_of("/ip4/1.2.3.4/tcp/1/p2p/R/p2p-circuit/p2p/B") == "B"
    assert peer_id_of("/ip4/1.2.3.4/tcp/1") is None


async def test_memory_nodes_show_the_section(tmp_path: Path) -> None:
    network = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        first, _ = await start_node(nursery, network.host, make_config(tmp_path, 0), serve_api=False)
        boot = first.advertised_multiaddrs()[0]
        service = ReachabilityService([boot])
        second, _ = await start_node(
            nursery,
            network.host,
            make_config(tmp_path, 1, bootstrap=(boot,)),
            serve_api=False,
            services=[service],
        )
        sections: dict[str, Any] = second.reports.status_sections

        def public() -> bool:
            return bool(sections[SECTION]()["status"] == "public")

        await wait_until(public, timeout=20)
        section = sections[SECTION]()
        assert section["relay_reserved"] is False and section["probes"] >= 1
        assert section["direct_connections"] >= 1
        nursery.cancel_scope.cancel()
