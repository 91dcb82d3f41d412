"""A hostile weight-swarm peer for tests (issue 13): it opens an authenticated data-plane channel to a
victim with its own wallet key and offers thousands of made-up checkpoint ids with high steps, then
offers the first of them again (what kept waits alive before), reading whatever the victim answers."""

from __future__ import annotations

import os

import trio

from crypto.keys import Address, WalletKey
from prime_node.dataplane.channel import ChannelError
from prime_node.dataplane.connect import open_channel
from protocol.codec import encode
from protocol.swarm.messages import Offer


async def flood_offers(
    host: str,
    port: int,
    victim: Address,
    *,
    count: int,
    repeats: int = 3,
    repeated: int = 64,
    seconds: float = 20.0,
    key: WalletKey | None = None,
) -> int:
    """Send ``count`` offers of random ids, then ``repeats`` rounds of the first ``repeated`` again, within
    ``seconds``. Returns how many frames the victim sent back."""
    channel = await open_channel(host, port, key or WalletKey.generate(), expected_peer=victim)
    ids = [os.urandom(32) for _ in range(count)]
    received = 0

    async def drain() -> None:
        nonlocal received
        try:
            async for _ in channel:
                received += 1
        except ChannelError:
            return

    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            try:
                for step, mid in enumerate(ids + ids[:repeated] * repeats):
                    await channel.send_frame(encode(Offer(mid, 1_000_000 + step)))
            except ChannelError:
                pass
            nursery.cancel_scope.cancel()
    with trio.CancelScope(shield=True):
        await channel.aclose()
    return received
