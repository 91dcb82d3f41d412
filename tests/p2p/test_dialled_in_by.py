"""``NatCounters.dialled_in_by`` on real libp2p hosts (127.0.0.1): the peers that reached us by dialling,
which the reachability rules weigh against a failed dial-back (protocol/reachability.py ``combine``)."""

from __future__ import annotations

from contextlib import AsyncExitStack

from crypto.keys import WalletKey
from prime_node.p2p.libp2p_host import open_libp2p_host
from tests.p2p.helpers import wait_until


async def test_counts_the_peers_that_dialled_us_and_not_those_we_dialled() -> None:
    async with AsyncExitStack() as stack:
        a, b, c = [
            await stack.enter_async_context(open_libp2p_host(WalletKey.generate(), "/ip4/127.0.0.1/tcp/0"))
            for _ in range(3)
        ]
        await a.connect(b.listen_multiaddrs()[0])
        await c.connect(b.listen_multiaddrs()[0])
        await wait_until(lambda: b.nat_counters().dialled_in_by == 2, timeout=10)
        assert a.nat_counters().dialled_in_by == 0 and c.nat_counters().dialled_in_by == 0
        assert b.nat_counters().direct_connections == 2

        await a.disconnect(b.peer_id)
        await wait_until(lambda: b.nat_counters().dialled_in_by == 1, timeout=10)
