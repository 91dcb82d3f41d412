"""A Sybil's fresh keys cannot buy a gossip budget: ten new keys flooding together get through no more
than the shared newcomer budget (one flood limit), while a peer that earned its place keeps all of its
own. On the in-memory network under trio's autojump clock (real nodes, real keys and signatures)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import trio

from crypto.keys import WalletKey
from prime_node.node.clock import NodeClock
from prime_node.node.gossip import Delivered
from prime_node.p2p.interface import GossipMessage
from prime_node.testing.memory_network import MemoryHost, MemoryNetwork
from protocol.codec import encode
from protocol.envelope import Domain, seal
from protocol.gossip_sequence import GossipFrame
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until

TOPIC = "prime-node/test/spam"
SYBILS = 10
SYBIL_RATE = 8.0  # each under a new key's own budget: the shared one is what binds
HONEST_RATE = 15.0  # under the flood limit of 20/s
SECONDS = 10.0


class Origins:
    def __init__(self) -> None:
        self.delivered: Counter[str] = Counter()

    async def __call__(self, message: Delivered) -> None:
        self.delivered[message.origin_peer_id] += 1


async def _ignore(_: GossipMessage) -> None:
    return None


async def _sybil(host: MemoryHost, key: WalletKey, count: int) -> None:
    """Publish ``count`` validly signed, well-sequenced frames at ``SYBIL_RATE``."""
    clock, domain = NodeClock(), Domain("gossip", "test")
    epoch = clock.wall_ms()
    for sequence in range(count):
        frame = encode(GossipFrame(TOPIC, epoch, sequence, b"sybil"))
        await host.publish(TOPIC, encode(seal(key, domain, frame, now_ms=clock.wall_ms())))
        await trio.sleep(1 / SYBIL_RATE)


async def test_ten_fresh_keys_together_get_no_more_than_one_established_peer(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    network = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        victim, _ = await start_node(nursery, network.host, make_config(tmp_path, 0), serve_api=False)
        boot = (victim.host.listen_multiaddrs()[0],)
        honest, _ = await start_node(
            nursery, network.host, make_config(tmp_path, 1, bootstrap=boot), serve_api=False
        )
        seen = Origins()
        await victim.gossip.subscribe("spam", seen)
        await honest.gossip.subscribe("spam", Origins())
        await wait_until(lambda: sees_all(victim, [honest]), timeout=30)
        honest_id = honest.identity.peer_id
        # The honest peer earns its place: a message a second until the victim no longer holds it back.
        assert victim.policy.on_probation(honest_id)
        earned_in = trio.current_time()
        while victim.policy.on_probation(honest_id):
            await honest.gossip.publish("spam", b"hello")
            await trio.sleep(1.0)
        earned_in = trio.current_time() - earned_in
        assert earned_in >= victim.scoring.probation_seconds

        sybils: list[tuple[MemoryHost, WalletKey]] = []
        async with trio.open_nursery() as attack:
            for _ in range(SYBILS):
                key = WalletKey.generate()
                host = await attack.start(_serve_host, network, key)
                await host.subscribe(TOPIC, _ignore)
                await host.connect(boot[0])
                sybils.append((host, key))
            sybil_ids = [host.peer_id for host, _ in sybils]
            before = dict(seen.delivered)
            honest_sent = 0
            started = trio.current_time()
            for host, key in sybils:
                attack.start_soon(_sybil, host, key, int(SYBIL_RATE * SECONDS))
            while trio.current_time() - started < SECONDS:
                await honest.gossip.publish("spam", b"honest")
                honest_sent += 1
                await trio.sleep(1 / HONEST_RATE)
            await trio.sleep(2.0)  # let the last frames land
            attack.cancel_scope.cancel()

        sybil_total = sum(seen.delivered[s] for s in sybil_ids)
        honest_got = seen.delivered[honest_id] - before.get(honest_id, 0)
        offered = SYBILS * int(SYBIL_RATE * SECONDS)
        config = victim.scoring
        newcomer_budget = config.newcomer_burst + config.newcomer_rate * (SECONDS + 2.0)
        honest_budget = config.flood_limit / config.flood_window * SECONDS
        print(
            f"sybil: {SYBILS} fresh keys offered {offered}, delivered {sybil_total} "
            f"(newcomer budget {newcomer_budget:.0f}); established peer sent {honest_sent}, "
            f"delivered {honest_got}; probation earned in {earned_in:.0f} s; "
            f"sybil/established-budget share {sybil_total / honest_budget:.2f}"
        )
        assert honest_got == honest_sent  # the established peer is not slowed at all
        assert sybil_total <= newcomer_budget
        assert sybil_total <= honest_budget + config.newcomer_burst  # one flood limit, plus a burst
        assert all(not victim.policy.is_banned(s) for s in sybil_ids)  # held back, not punished
        nursery.cancel_scope.cancel()


async def _serve_host(
    network: MemoryNetwork, key: WalletKey, task_status: Any = trio.TASK_STATUS_IGNORED
) -> None:
    async with network.host(key) as host:
        task_status.started(host)
        await trio.sleep_forever()
