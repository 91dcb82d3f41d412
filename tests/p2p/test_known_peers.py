"""A node vouches at its connection gate for the peers that earned it (healthy, past probation, not
banned), so a flood of strangers cannot take their slots, and withdraws it when they fall back
(issue 13, item 6: "slots kept for known peers"). In-memory network under trio's autojump clock; the
libp2p side of ``mark_known`` is tested in test_inbound_flood.py."""

from __future__ import annotations

from pathlib import Path

import trio

from prime_node.testing.memory_network import MemoryHost
from protocol.scoring import Offence
from tests.p2p.helpers import wait_until
from tests.p2p.test_gossip_fanout import Collector, _two_nodes


async def test_a_peer_is_known_once_past_probation_and_forgotten_when_banned(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with trio.open_nursery() as nursery:
        sender, receiver = await _two_nodes(nursery, tmp_path)
        gate = receiver.host
        assert isinstance(gate, MemoryHost)
        assert sender.host.peer_id not in gate.known  # a new key starts on probation
        await receiver.gossip.subscribe("probe", Collector())
        for number in range(12):  # verified frames: probation needs 10 of them and 30 s
            await sender.gossip.publish("probe", b"frame %d" % number)
            await trio.sleep(0.5)
        await wait_until(lambda: sender.host.peer_id in gate.known, timeout=60)
        assert not receiver.policy.on_probation(sender.host.peer_id)

        for _ in range(5):
            receiver.policy.offence(sender.host.peer_id, Offence.INVALID_SIGNATURE, "test: forged frame")
        assert receiver.policy.is_banned(sender.host.peer_id)
        await wait_until(lambda: sender.host.peer_id not in gate.known, timeout=5)
        nursery.cancel_scope.cancel()
