"""The node service on the in-memory network, under trio's autojump clock: discovery, heartbeats,
membership transitions, gap repair and scoring, deterministic and fast."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from crypto.identity import peer_id_from_public_key
from crypto.keys import WalletKey
from prime_node.node.neighbour_links import ANSWER_TIMEOUT, NEIGHBOUR_PROTOCOL
from prime_node.node.service import Node
from prime_node.p2p.interface import FramedStream
from prime_node.testing.memory_network import MemoryHost, MemoryNetwork
from protocol.membership import PeerState
from protocol.provider_duty import PROVIDERS, provides_run
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until


async def test_nodes_discover_each_other_and_mark_a_killed_one_dead(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    network = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        first, _ = await start_node(nursery, network.host, make_config(tmp_path, 0), serve_api=False)
        boot = first.host.listen_multiaddrs()[0]
        nodes = [first]
        scopes = []
        for i in range(1, 6):
            node, scope = await start_node(
                nursery, network.host, make_config(tmp_path, i, bootstrap=(boot,)), serve_api=False
            )
            nodes.append(node)
            scopes.append(scope)
        await wait_until(lambda: all(sees_all(n, nodes) for n in nodes), timeout=30)
        # Fewer nodes than the degree: every pair becomes neighbours, so deaths show as missed beats.
        await wait_until(lambda: all(len(n.links.neighbours()) == len(nodes) - 1 for n in nodes), timeout=30)
        victim = nodes[3]
        scopes[2].cancel()
        config = nodes[0].config
        took = await wait_until(
            lambda: all(
                victim.identity.peer_id in n.peers_in(PeerState.DEAD) for n in nodes if n is not victim
            ),
            timeout=60,
        )
        assert took <= config.dead_window + 2 * config.heartbeat_interval
        stopped = json.loads((config.data_dir.parent / "node3" / "node.json").read_text())
        assert stopped["state"] == "stopped"
        nursery.cancel_scope.cancel()


async def test_lost_gossip_is_repaired_by_a_direct_request(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    network = MemoryNetwork()
    dropped: list[bytes] = []
    finished = False

    probes_seen = 0

    def drop_every_third_probe(topic: str, origin: str, data: bytes, receiver: str) -> bool:
        # Never the first (a receiver owes nothing before first contact) nor after `finished`.
        nonlocal probes_seen
        if not topic.endswith("/probe") or finished:
            return False
        probes_seen += 1
        if probes_seen % 3 == 0:
            dropped.append(data)
            return True
        return False

    network.drop_gossip = drop_every_third_probe
    async with trio.open_nursery() as nursery:
        sender, _ = await start_node(nursery, network.host, make_config(tmp_path, 0), serve_api=False)
        receiver, _ = await start_node(
            nursery,
            network.host,
            make_config(tmp_path, 1, bootstrap=(sender.host.listen_multiaddrs()[0],)),
            serve_api=False,
        )
        got: list[bytes] = []

        async def collect(message: object) -> None:
            got.append(message.payload)  # type: ignore[attr-defined]

        await receiver.gossip.subscribe("probe", collect)
        await sender.gossip.subscribe("probe", collect)
        for i in range(30):
            await sender.gossip.publish("probe", b"m%d" % i)
            await trio.sleep(0.1)
        finished = True  # a gap at the very end is only noticed on the next message, which must arrive
        await sender.gossip.publish("probe", b"last")
        await wait_until(lambda: len(got) == 31, timeout=20)
        assert dropped, "the filter dropped nothing, so repair was not exercised"
        assert sorted(got) == sorted([b"m%d" % i for i in range(30)] + [b"last"])
        assert receiver.metrics.counters["gossip_repaired"] == len(dropped)
        nursery.cancel_scope.cancel()


async def test_a_swarm_larger_than_the_degree_keeps_bounded_links_and_still_sees_everyone(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """40 nodes, degree 4, at most 8 links: everyone learns everyone from records passed along the
    overlay, each node beats to at most 8 peers, and a killed node ages out of every table."""
    network = MemoryNetwork()
    small = {"neighbours": 4, "max_neighbours": 8}
    async with trio.open_nursery() as nursery:
        first, _ = await start_node(nursery, network.host, make_config(tmp_path, 0, **small), serve_api=False)
        boot = first.host.listen_multiaddrs()[0]
        nodes, scopes = [first], []
        for i in range(1, 40):
            node, scope = await start_node(
                nursery, network.host, make_config(tmp_path, i, bootstrap=(boot,), **small), serve_api=False
            )
            nodes.append(node)
            scopes.append(scope)
        took = await wait_until(lambda: all(sees_all(n, nodes) for n in nodes), timeout=60)
        assert took <= 3 * first.config.heartbeat_interval
        await wait_until(lambda: all(len(n.links.neighbours()) >= 4 for n in nodes), timeout=60)
        assert all(len(n.links.neighbours()) <= 8 for n in nodes)
        before = [n.metrics.counters["heartbeats_sent"] for n in nodes]
        await trio.sleep(10 * first.config.heartbeat_interval)
        for node, sent in zip(nodes, before, strict=True):
            beats = node.metrics.counters["heartbeats_sent"] - sent
            assert beats <= 8 * 10 + 8  # at most one frame per link per interval (+ one for timing)
        victim = nodes[7]
        scopes[6].cancel()
        await wait_until(
            lambda: all(
                victim.identity.peer_id not in n.peers_in(PeerState.HEALTHY) for n in nodes if n is not victim
            ),
            timeout=200,
        )
        nursery.cancel_scope.cancel()


async def test_a_link_lost_without_a_bye_is_asked_again_and_the_live_peer_stays_healthy(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """A link can end while both peers live (a replaced connection, a send that timed out under load).
    The peer that lost it sends one hello: the link comes back, and the peer never looks unhealthy
    (judged by its last beat it would be unhealthy 3 intervals later, until its next record). Both have
    refused each other recently, so choosing neighbours (``maintain``) would not relink them."""
    network = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        first, _ = await start_node(nursery, network.host, make_config(tmp_path, 0), serve_api=False)
        second, _ = await start_node(
            nursery,
            network.host,
            make_config(tmp_path, 1, bootstrap=(first.host.listen_multiaddrs()[0],)),
            serve_api=False,
        )
        pair = [first, second]
        await wait_until(lambda: all(len(n.links.neighbours()) == 1 for n in pair), timeout=30)
        for node, other in ((first, second), (second, first)):  # neither would choose the other again
            node.links.overlay.refused_by[other.identity.peer_id] = trio.current_time() + 3600
        lost = first.links._links[second.identity.peer_id]
        await lost.stream.reset()  # no bye: to both ends the link just breaks
        for _ in range(8):  # 8 intervals: past the 3 after which a silent neighbour is unhealthy
            await trio.sleep(first.config.heartbeat_interval)
            assert all(sees_all(n, pair) for n in pair)
        assert all(len(n.links.neighbours()) == 1 for n in pair)
        assert first.links._links[second.identity.peer_id] is not lost  # a new link
        assert (
            first.metrics.counters["neighbour_rechecks"] + second.metrics.counters["neighbour_rechecks"] >= 1
        )
        nursery.cancel_scope.cancel()


async def test_a_link_whose_opener_gave_up_waiting_is_not_left_open_at_the_peer(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """Seen at 64 processes: a loaded node's link open timed out while its peer had already welcomed it.
    The opener left its stream open and never used it; the peer kept a link on which no beat would ever
    come, judged the opener by its beats, and marked it unhealthy 3 intervals later and dead after 6 (back
    only with its next record). The opener now resets the stream it gave up on: the peer's link ends, its
    hello links the pair again, and the opener never looks unhealthy."""
    network = MemoryNetwork()
    stalled = [True]

    @asynccontextmanager
    async def stalled_host(key: WalletKey) -> AsyncIterator[MemoryHost]:
        """The first neighbour answer reaches this host only after it gave up waiting."""
        async with network.host(key) as host:
            open_stream = host.open_stream

            async def late_answer(peer_id: str, protocol_id: str) -> FramedStream:
                stream = await open_stream(peer_id, protocol_id)
                if protocol_id == NEIGHBOUR_PROTOCOL and stalled[0]:
                    stalled[0] = False
                    receive = stream.receive_frame

                    async def late(max_size: int) -> bytes | None:
                        await trio.sleep(ANSWER_TIMEOUT + 1)
                        return await receive(max_size)

                    stream.receive_frame = late  # type: ignore[method-assign]
                return stream

            host.open_stream = late_answer  # type: ignore[method-assign]
            yield host

    # The opener's retry must not replace the stale link by chance: of two links between a pair the one
    # the smaller peer ID opened stays, so the opener gets the larger ID, and the peer never opens one.
    first_key, second_key = sorted((WalletKey.generate() for _ in range(2)), key=_peer_id)
    async with trio.open_nursery() as nursery:
        first, _ = await start_node(
            nursery, network.host, make_config(tmp_path, 0), key=first_key, serve_api=False
        )
        first.links.overlay.refused_by[_peer_id(second_key)] = trio.current_time() + 3600
        second, _ = await start_node(
            nursery,
            stalled_host,
            make_config(tmp_path, 1, bootstrap=(first.host.listen_multiaddrs()[0],)),
            key=second_key,
            serve_api=False,
        )
        pair = [first, second]
        await wait_until(lambda: not stalled[0] and all(sees_all(n, pair) for n in pair), timeout=30)
        for _ in range(12):  # past the 6 intervals after which a neighbour without beats is dead
            await trio.sleep(first.config.heartbeat_interval)
            assert all(sees_all(n, pair) for n in pair)
        assert first.links.neighbours() == [second.identity.peer_id]
        assert second.links.neighbours() == [first.identity.peer_id]
        nursery.cancel_scope.cancel()


def _peer_id(key: WalletKey) -> str:
    return peer_id_from_public_key(key.public_key)


async def test_a_quiet_link_is_closed_and_asked_again_only_once_its_connection_is_gone(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """A neighbour stream can stop delivering without failing: seen in a 32-process swarm, where py-libp2p
    dropped the connection under it. Such a stranded link is closed after 3 quiet intervals and its peer
    asked again. A quiet link whose connection is alive stays, whether every link is quiet at once (our own
    process stalled) or only this one (its peer is slow): its beats judge the peer."""
    network = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        first, _ = await start_node(nursery, network.host, make_config(tmp_path, 0), serve_api=False)
        boot = first.host.listen_multiaddrs()[0]
        others = [
            (
                await start_node(
                    nursery, network.host, make_config(tmp_path, i, bootstrap=(boot,)), serve_api=False
                )
            )[0]
            for i in (1, 2)
        ]
        trio_nodes = [first, *others]
        interval = first.config.heartbeat_interval
        await wait_until(lambda: all(len(n.links.neighbours()) == 2 for n in trio_nodes), timeout=30)
        first_id = first.identity.peer_id

        async def swallow(data: bytes) -> None:
            """Sends that succeed and deliver nothing."""

        def mute(node: object) -> object:
            link = node.links._links[first_id]  # type: ignore[attr-defined]
            link.stream.send_frame = swallow
            return link

        # Every link of `first` quiet at once, connections alive: nothing is closed.
        muted = [mute(node) for node in others]
        await trio.sleep(6 * interval)
        assert first.metrics.counters["neighbour_links_silent"] == 0
        assert [n.links._links[first_id] for n in others] == muted
        # One quiet while the other delivers, its connection alive: its peer is only slow; the link stays.
        others[1].links._links[first_id].scope.cancel()  # a fresh, unmuted link replaces the second's
        await wait_until(lambda: len(first.links.neighbours()) == 2 and first_id in others[1].links._links,
                         timeout=60)  # fmt: skip
        await trio.sleep(6 * interval)
        assert first.metrics.counters["neighbour_links_silent"] == 0
        assert others[0].links._links[first_id] is muted[0]
        # Its connection replaced under it, the stream stranded: closed, and the peer linked again.
        slow = others[0].identity.peer_id
        await first.host.disconnect(slow)
        await first.host.connect(others[0].host.listen_multiaddrs()[0])
        await wait_until(lambda: first.metrics.counters["neighbour_links_silent"] >= 1, timeout=60)
        await wait_until(lambda: others[0].links._links.get(first_id) not in (None, muted[0]), timeout=60)
        for _ in range(4):
            await trio.sleep(interval)
            assert sees_all(first, trio_nodes)
        nursery.cancel_scope.cancel()


async def test_only_the_members_nearest_the_run_key_announce_it_and_a_joiner_finds_them(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """12 nodes: once they know each other, the 8 whose IDs are nearest the run key provide it in the
    DHT, not all 12 (protocol/provider_duty.py); a node whose links are full does not look providers up,
    and a joiner that knows nobody but an unhelpful peer still finds the swarm through them."""
    network = MemoryNetwork()
    key = "/prime-node/run/test"
    async with trio.open_nursery() as nursery:
        first, _ = await start_node(nursery, network.host, make_config(tmp_path, 0), serve_api=False)
        boot = first.host.listen_multiaddrs()[0]
        nodes = [first]
        for i in range(1, 12):
            config = make_config(tmp_path, i, bootstrap=(boot,))
            nodes.append((await start_node(nursery, network.host, config, serve_api=False))[0])
        await wait_until(lambda: all(sees_all(n, nodes) for n in nodes), timeout=30)
        # A node that is not among the nearest never provides, so the set only grows to the 8 nearest.
        await wait_until(lambda: len(network.providers.get(key, ())) == PROVIDERS, timeout=30)
        ids = [n.identity.peer_id for n in nodes]
        assert network.providers[key] == {p for p in ids if provides_run(p, ids, key)}
        assert all(
            n.metrics.counters["dht_provides"] == (n.identity.peer_id in network.providers[key])
            for n in nodes
        )
        rounds = [n.metrics.counters["discovery_rounds"] for n in nodes]
        # A joiner whose only bootstrap is a bare host (no neighbour links, so no records) finds the swarm
        # in the DHT.
        async with network.host(WalletKey.generate()) as bare:
            config = make_config(tmp_path, 12, bootstrap=(bare.listen_multiaddrs()[0],))
            joiner, _ = await start_node(nursery, network.host, config, serve_api=False)
            await wait_until(lambda: sees_all(joiner, nodes), timeout=20)
            assert joiner.metrics.counters["discovery_rounds"] >= 1
        await trio.sleep(30 * first.config.heartbeat_interval)
        assert [n.metrics.counters["discovery_rounds"] for n in nodes] == rounds  # links full: no lookups
        nursery.cancel_scope.cancel()


async def test_a_joiner_refused_by_a_full_bootstrap_asks_the_peers_it_sampled_before_its_next_heartbeat(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """The bootstrap has one slot, taken by an earlier member: it refuses the joiner with a sample of its
    records. The joiner asks that member within a quarter of an interval (``REFILL_PAUSE``), not at its
    next heartbeat a whole interval after it joined."""
    keys = sorted(
        (WalletKey.generate() for _ in range(2)), key=lambda k: peer_id_from_public_key(k.public_key)
    )
    joiner_key, member_key = keys  # the joiner's ID is the smaller: it dials at once (no DIAL_YIELD_DELAY)
    network = MemoryNetwork()
    interval = 4.0
    one_slot = {"neighbours": 1, "max_neighbours": 1, "heartbeat_interval": interval}
    async with trio.open_nursery() as nursery:
        boot, _ = await start_node(
            nursery, network.host, make_config(tmp_path, 0, **one_slot), serve_api=False
        )
        address = boot.host.listen_multiaddrs()[0]

        async def join(index: int, key: WalletKey) -> Node:
            config = make_config(
                tmp_path, index, bootstrap=(address,), neighbours=1, heartbeat_interval=interval
            )
            node, _ = await start_node(nursery, network.host, config, key=key, serve_api=False)
            return node

        member = await join(1, member_key)
        await wait_until(lambda: boot.links.neighbours() == [member.identity.peer_id], timeout=30)
        joiner = await join(2, joiner_key)
        took = await wait_until(lambda: joiner.links.neighbours() == [member.identity.peer_id], timeout=30)
        assert took <= interval / 2
        assert joiner.metrics.counters["neighbour_refused_us"] == 1  # the bootstrap said busy
        assert joiner.metrics.counters["neighbour_refills"] == 1
        nursery.cancel_scope.cancel()
