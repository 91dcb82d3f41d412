"""py-libp2p's streams and connections as our code sees them: a byte stream for ``FramedStream``, and the
questions py-libp2p 0.8.1 answers only through its internals (is a connection closing, is a stream
relayed, did a read end the stream)."""

from __future__ import annotations

import logging
from typing import Any

from prime_node.errors import NodeError

log = logging.getLogger(__name__)


class Libp2pByteStream:
    """A py-libp2p stream as the byte stream ``FramedStream`` reads: its end and its failures become
    ``b""`` and ``NodeError(stream_closed)``."""

    def __init__(self, stream: Any, network: Any) -> None:
        self._stream = stream
        self._network = network
        self.remote_peer_id = str(stream.muxed_conn.peer_id)
        self.relayed = is_relayed_stream(stream)

    def stranded(self) -> bool:
        """Its yamux connection closed or is no longer one of the swarm's connections to the peer. Seen in
        py-libp2p 0.8.1: when two peers dial each other at once one connection is dropped, and a stream
        on it neither delivers nor fails."""
        try:
            connection = self._stream.muxed_conn
            if connection.is_closed:
                return True
            live = self._network.get_connections(connection.peer_id)
            return all(getattr(c, "muxed_conn", None) is not connection for c in live)
        except Exception:
            log.debug("could not tell whether a stream is stranded", exc_info=True)
            return False

    async def read(self, max_bytes: int) -> bytes:
        try:
            return bytes(await self._stream.read(max_bytes))
        except Exception as exc:
            if is_end_of_stream(exc):
                return b""
            raise NodeError(f"stream read failed: {type(exc).__name__}", reason="stream_closed") from exc

    async def write(self, data: bytes) -> None:
        try:
            await self._stream.write(data)
        except Exception as exc:
            raise NodeError(f"stream write failed: {type(exc).__name__}", reason="stream_closed") from exc

    async def close(self) -> None:
        try:
            await self._stream.close()
        except Exception:
            log.debug("closing a stream failed", exc_info=True)

    async def reset(self) -> None:
        try:
            await self._stream.reset()
        except Exception:
            log.debug("resetting a stream failed", exc_info=True)


def connection_closing(connection: Any) -> bool:
    """Whether a swarm connection is closed or closing (its own flag, or its muxer's)."""
    try:
        muxer = connection.muxed_conn
        shutting_down = getattr(muxer, "event_shutting_down", None)
        return bool(
            connection.is_closed or muxer.is_closed or (shutting_down is not None and shutting_down.is_set())
        )
    except Exception:
        return False


def is_relayed_stream(stream: Any) -> bool:
    """Whether a stream's connection goes through a circuit relay (py-libp2p marks the raw connection
    ``ConnectionType.RELAYED``; yamux and Noise pass the question down to it)."""
    try:
        from libp2p.connection_types import ConnectionType

        return bool(stream.muxed_conn.get_connection_type() == ConnectionType.RELAYED)
    except Exception:
        return False


def is_end_of_stream(exc: Exception) -> bool:
    return type(exc).__name__ in {
        "StreamEOF",
        "StreamClosed",
        "StreamReset",
        "MuxedStreamEOF",
        "MuxedStreamReset",
    }
