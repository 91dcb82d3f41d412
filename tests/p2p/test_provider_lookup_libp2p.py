"""The run's DHT lookup on real libp2p hosts (127.0.0.1): a node that provided the run still finds the
others. py-libp2p's own ``find_providers`` answered such a node from its local store, which held only its
own record (protocol/provider_lookup.py)."""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio

from crypto.keys import WalletKey
from prime_node.p2p.libp2p_host import open_libp2p_host

KEY = "/prime-node/run/lookup-test"


async def test_every_provider_finds_the_others_after_providing_itself() -> None:
    async with AsyncExitStack() as stack:
        hub, *members = [
            await stack.enter_async_context(
                open_libp2p_host(WalletKey.generate(), listen="/ip4/127.0.0.1/tcp/0")
            )
            for _ in range(4)
        ]
        for member in members:
            await member.connect(hub.listen_multiaddrs()[0])
        for member in members:  # one after another: the first provider's records reach nobody before it
            await member.provide(KEY)
        with trio.fail_after(30):
            for member in members:
                found = {p.peer_id for p in await member.find_providers(KEY)}
                assert found == {m.peer_id for m in members} - {member.peer_id}
                assert all(p.multiaddrs for p in await member.find_providers(KEY))
