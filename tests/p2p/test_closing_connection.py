"""A peer whose only connection is closing is dialled again at once (real libp2p hosts on 127.0.0.1).

py-libp2p 0.8.1 keeps a closing connection in its swarm's records until the close has finished; until
then its ``connect`` dials nothing and ``new_stream`` fails with "No valid connections". In the discovery
benchmark at N = 64 that made a lost neighbour link's re-ask fail, and two live peers judged each other
dead by their last beats (docs/benchmarks.md, issue 16)."""

from __future__ import annotations

from contextlib import AsyncExitStack

import trio
import trio.lowlevel

from crypto.keys import WalletKey
from prime_node.p2p.interface import FramedStream
from prime_node.p2p.libp2p_host import Libp2pHost, open_libp2p_host

ECHO = "/test/echo/1"


async def _start_closing_the_connection(host: Libp2pHost, peer_id: str, nursery: trio.Nursery) -> None:
    """Begin closing ``host``'s connection to ``peer_id`` the way py-libp2p does when the link dies, and
    return while the close is still under way (the connection still in the swarm's records)."""
    from libp2p.peer.id import ID

    network = host._host.get_network()
    (connection,) = network.get_connections(ID.from_base58(peer_id))
    nursery.start_soon(connection.close)
    while not connection.is_closed:
        await trio.lowlevel.checkpoint()
    assert network.get_connections(ID.from_base58(peer_id)) == [connection]  # the stale record


async def test_a_peer_whose_connection_is_closing_is_not_listed_and_is_dialled_again() -> None:
    async with AsyncExitStack() as stack:
        a, b = [
            await stack.enter_async_context(open_libp2p_host(WalletKey.generate(), "/ip4/127.0.0.1/tcp/0"))
            for _ in range(2)
        ]

        async def echo(stream: FramedStream) -> None:
            while (frame := await stream.receive_frame(1024)) is not None:
                await stream.send_frame(frame[::-1])

        b.set_stream_handler(ECHO, echo)
        await a.connect(b.listen_multiaddrs()[0])
        async with trio.open_nursery() as nursery:
            await _start_closing_the_connection(a, b.peer_id, nursery)
            assert b.peer_id not in a.connected_peers()
            with trio.fail_after(10):
                stream = await a.open_stream(b.peer_id, ECHO)
                await stream.send_frame(b"again")
                assert await stream.receive_frame(1024) == b"niaga"
            assert a.connected_peers() == [b.peer_id]
            await stream.close()
