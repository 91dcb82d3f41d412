"""The one seam between the data plane and the network: how to listen on ``host:port`` and how to dial it.

The channel and the ``DataPlane`` only need ``trio.abc.Stream`` (send_all, receive_some, aclose), so the
same code runs over TCP in production and over in-memory streams in tests
(prime_node/testing/memory_streams.py), where trio's ``autojump_clock`` turns handshake timeouts and
whole checkpoint transfers into instant tests. A transport reports failures as ``OSError`` (refused,
unreachable, port taken) as sockets do; the channel turns them into ``ChannelError`` in one place.
"""

from __future__ import annotations

from typing import Protocol

import trio

StreamListener = trio.abc.Listener[trio.abc.Stream]


class StreamTransport(Protocol):
    """Where data-plane streams come from."""

    async def open_listeners(self, host: str, port: int) -> tuple[list[StreamListener], int]:
        """Listen on ``host:port`` (port 0: any free one); the listeners and the port actually bound."""
        ...

    async def open_stream(self, host: str, port: int) -> trio.abc.Stream:
        """A connected stream to whoever listens on ``host:port``."""
        ...


class TcpTransport:
    """Plain TCP sockets (the default): what peers on the real network speak."""

    async def open_listeners(self, host: str, port: int) -> tuple[list[StreamListener], int]:
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound_port = int(listeners[0].socket.getsockname()[1])
        return list(listeners), bound_port

    async def open_stream(self, host: str, port: int) -> trio.abc.Stream:
        return await trio.open_tcp_stream(host, port)


TCP = TcpTransport()
