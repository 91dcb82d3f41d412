"""Gossip fans out: every handler of a topic gets each verified message, once; one that fails or leaves
does not take the topic from the others. On the in-memory network under trio's autojump clock."""

from __future__ import annotations

from pathlib import Path

import trio

from prime_node.node.gossip import Delivered
from prime_node.node.service import Node
from prime_node.testing.memory_network import MemoryNetwork
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until


async def _two_nodes(nursery: trio.Nursery, tmp_path: Path) -> tuple[Node, Node]:
    network = MemoryNetwork()
    sender, _ = await start_node(nursery, network.host, make_config(tmp_path, 0), serve_api=False)
    receiver, _ = await start_node(
        nursery,
        network.host,
        make_config(tmp_path, 1, bootstrap=(sender.host.listen_multiaddrs()[0],)),
        serve_api=False,
    )
    await wait_until(lambda: sees_all(sender, [receiver]) and sees_all(receiver, [sender]), timeout=30)
    return sender, receiver


class Collector:
    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    async def __call__(self, message: Delivered) -> None:
        self.payloads.append(message.payload)


async def test_every_subscriber_of_a_topic_gets_each_message_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with trio.open_nursery() as nursery:
        sender, receiver = await _two_nodes(nursery, tmp_path)
        first, second = Collector(), Collector()
        await receiver.gossip.subscribe("probe", first)
        await receiver.gossip.subscribe("probe", second)
        await receiver.gossip.subscribe("probe", second)  # again: still one delivery per message
        assert receiver.gossip.handler_count("probe") == 2
        await sender.gossip.subscribe("probe", Collector())
        sent = [b"m%d" % i for i in range(5)]
        for payload in sent:
            await sender.gossip.publish("probe", payload)
        await wait_until(lambda: len(first.payloads) == len(second.payloads) == len(sent), timeout=10)
        await trio.sleep(1)
        assert first.payloads == second.payloads == sent
        nursery.cancel_scope.cancel()


async def test_a_failing_handler_does_not_starve_the_others(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with trio.open_nursery() as nursery:
        sender, receiver = await _two_nodes(nursery, tmp_path)
        calls = 0

        async def broken(message: Delivered) -> None:
            nonlocal calls
            calls += 1
            raise RuntimeError("a service bug")

        healthy = Collector()
        await receiver.gossip.subscribe("probe", broken)
        await receiver.gossip.subscribe("probe", healthy)
        await sender.gossip.subscribe("probe", Collector())
        for i in range(3):
            await sender.gossip.publish("probe", b"m%d" % i)
        await wait_until(lambda: len(healthy.payloads) == 3, timeout=10)
        assert healthy.payloads == [b"m0", b"m1", b"m2"]
        assert calls == 3
        assert receiver.metrics.counters["gossip_handler_errors"] == 3
        assert receiver.is_running
        nursery.cancel_scope.cancel()


async def test_an_unsubscribed_or_scoped_handler_stops_hearing_the_topic(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with trio.open_nursery() as nursery:
        sender, receiver = await _two_nodes(nursery, tmp_path)
        stays, leaves, scoped = Collector(), Collector(), Collector()
        await receiver.gossip.subscribe("probe", stays)
        await receiver.gossip.subscribe("probe", leaves)
        await sender.gossip.subscribe("probe", Collector())
        with receiver.context.scoped() as role_context:
            await role_context.gossip.subscribe("probe", scoped)
            await sender.gossip.publish("probe", b"before")
            await wait_until(lambda: len(scoped.payloads) == 1, timeout=10)
        receiver.gossip.unsubscribe("probe", leaves)
        assert receiver.gossip.handler_count("probe") == 1
        await sender.gossip.publish("probe", b"after")
        await wait_until(lambda: len(stays.payloads) == 2, timeout=10)
        await trio.sleep(1)
        assert stays.payloads == [b"before", b"after"]
        assert leaves.payloads == scoped.payloads == [b"before"]
        nursery.cancel_scope.cancel()
