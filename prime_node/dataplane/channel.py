"""The trio side of the data plane: run the handshake of protocol/dataplane.py over a byte stream (a TCP
socket, or an in-memory stream in tests: prime_node/dataplane/streams.py), then move MAC'd frames.

An ``AuthenticatedChannel`` knows the wallet address of its peer and offers ``send_frame(bytes)`` /
``receive_frame() -> bytes``: exactly what a swarm transport needs (CheckpointTransfer's ``send`` and
``frame`` callbacks). Every failure (bad MAC, oversized or truncated frame, failed handshake, lost
connection) is a ``ChannelError`` with a ``reason``, logged once, and the stream is closed. Receiving
reads straight into a buffer of the announced size, allocated only after the size is checked (on TCP with
``recv_into``, no copy). Every timeout is trio's, so tests run under ``autojump_clock``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

from crypto.keys import Address, WalletKey
from crypto.randomness import random_bytes
from prime_node.dataplane.streams import TCP, StreamListener, StreamTransport
from prime_node.errors import NodeError
from protocol.dataplane import (
    DEFAULT_MAX_FRAME,
    FRAME_HEADER,
    NONCE_SIZE,
    SECRET_SIZE,
    TAG_SIZE,
    FrameCheck,
    FrameOpener,
    FrameSealer,
    Handshake,
    Role,
    SessionKeys,
    handshake_frame,
    handshake_length,
)
from protocol.errors import ProtocolError, RemoteProtocolError

log = logging.getLogger(__name__)

DEFAULT_CONTEXT = "swarm"
HANDSHAKE_TIMEOUT = 10.0


class ChannelError(NodeError):
    """The channel failed: handshake refused, integrity lost, or the connection dropped. It is closed."""


class AuthenticatedChannel:
    """A stream whose peer proved its wallet address. Frames in each direction are MAC'd and
    numbered; one sender and one receiver may run at once (each side has its own lock)."""

    def __init__(self, stream: trio.abc.Stream, keys: SessionKeys, *, max_frame: int) -> None:
        self._stream = stream
        self.remote: Address = keys.remote
        self._sealer = FrameSealer(keys.send_key, keys.send_direction, max_frame=max_frame)
        self._opener = FrameOpener(keys.receive_key, keys.receive_direction, max_frame=max_frame)
        self._send_lock = trio.Lock()
        self._receive_lock = trio.Lock()
        self._header = bytearray(FRAME_HEADER.size)
        self._tag = bytearray(TAG_SIZE)
        self.closed = False

    async def send_frame(self, data: bytes) -> None:
        """Send one frame (≤ the cap). ChannelError if the connection is gone."""
        async with self._send_lock:
            self._check_open()
            try:
                header, tag = self._sealer.seal(data)
            except ProtocolError as exc:
                raise ChannelError(str(exc), reason=exc.reason) from exc
            try:
                await self._stream.send_all(header)
                await self._stream.send_all(data)
                await self._stream.send_all(tag)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise await self._fail("connection_lost", f"sending to {self.remote} failed: {exc}") from exc

    async def receive_frame(self) -> bytes:
        """The next frame, checked. ChannelError reason ``closed`` when the peer closed between frames."""
        async with self._receive_lock:
            self._check_open()
            try:
                if not await self._read_into(memoryview(self._header), allow_eof=True):
                    await self.aclose()
                    raise ChannelError(f"{self.remote} closed the channel", reason="closed")
                length = self._opener.body_length(self._header)
                body = bytearray(length)
                check = self._opener.begin(length)
                await _read_exactly(self._stream, memoryview(body), allow_eof=False, check=check)
                await self._read_into(memoryview(self._tag), allow_eof=False)
                self._opener.finish(check, self._tag)
            except ProtocolError as exc:
                raise await self._fail(exc.reason, f"frame from {self.remote} refused: {exc}") from exc
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                if self.closed:  # closed on our side while a receive was waiting: not a failure
                    raise ChannelError(f"channel to {self.remote} is closed", reason="closed") from exc
                text = f"receiving from {self.remote} failed: {exc}"
                raise await self._fail("connection_lost", text) from exc
            return bytes(body)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._frames()

    async def _frames(self) -> AsyncIterator[bytes]:
        """Frames until the peer closes cleanly between frames; any other failure raises."""
        while True:
            try:
                yield await self.receive_frame()
            except ChannelError as exc:
                if exc.reason == "closed":
                    return
                raise

    async def aclose(self) -> None:
        self.closed = True
        await self._stream.aclose()

    async def _read_into(self, view: memoryview, *, allow_eof: bool) -> bool:
        return await _read_exactly(self._stream, view, allow_eof=allow_eof)

    def _check_open(self) -> None:
        if self.closed:
            raise ChannelError(f"channel to {self.remote} is closed", reason="closed")

    async def _fail(self, reason: str, text: str) -> ChannelError:
        log.warning("data plane: %s (%s); closing", text, reason)
        with trio.CancelScope(shield=True):
            await self.aclose()
        return ChannelError(text, reason=reason)


async def _receive_into(stream: trio.abc.Stream, view: memoryview) -> int:
    """Up to ``len(view)`` bytes into ``view``; 0 at end of stream. A TCP socket fills it in place."""
    if isinstance(stream, trio.SocketStream):
        return await stream.socket.recv_into(view)
    chunk = await stream.receive_some(len(view))
    view[: len(chunk)] = chunk
    return len(chunk)


async def _read_exactly(
    stream: trio.abc.Stream, view: memoryview, *, allow_eof: bool, check: FrameCheck | None = None
) -> bool:
    """Fill ``view`` from the stream, feeding ``check`` each chunk as it lands. False at EOF before the
    first byte when ``allow_eof``."""
    filled = 0
    while filled < len(view):
        count = await _receive_into(stream, view[filled:])
        if count == 0:
            if allow_eof and filled == 0:
                return False
            raise RemoteProtocolError("connection ended inside a frame", reason="truncated_frame")
        if check is not None:
            check.update(view[filled : filled + count])
        filled += count
    return True


async def _run_handshake(stream: trio.abc.Stream, handshake: Handshake, timeout: float) -> SessionKeys:
    peer = "the listener" if handshake.role is Role.DIALER else "a dialer"
    try:
        with trio.fail_after(timeout):
            for frame in handshake.initial_frames():
                await stream.send_all(handshake_frame(frame))
            while not handshake.done:
                header = bytearray(FRAME_HEADER.size)
                await _read_exactly(stream, memoryview(header), allow_eof=False)
                body = bytearray(handshake_length(header))
                await _read_exactly(stream, memoryview(body), allow_eof=False)
                for frame in handshake.receive(bytes(body)):
                    await stream.send_all(handshake_frame(frame))
    except ProtocolError as exc:
        raise await _refuse(stream, exc.reason, f"handshake with {peer} failed: {exc}") from exc
    except trio.TooSlowError as exc:
        raise await _refuse(stream, "handshake_timeout", f"handshake with {peer} timed out") from exc
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        raise await _refuse(stream, "connection_lost", f"handshake with {peer} broke off: {exc}") from exc
    assert handshake.result is not None
    return handshake.result


async def _refuse(stream: trio.abc.Stream, reason: str, text: str) -> ChannelError:
    log.warning("data plane: %s (%s)", text, reason)
    with trio.CancelScope(shield=True):
        await stream.aclose()
    return ChannelError(text, reason=reason)


def _new_handshake(role: Role, wallet: WalletKey, context: str, expected_peer: Address | None) -> Handshake:
    ephemeral = WalletKey.generate()  # a fresh in-range secp256k1 secret, used for this connection only
    assert len(ephemeral.secret) == SECRET_SIZE
    return Handshake(
        role,
        wallet,
        ephemeral_secret=ephemeral.secret,
        nonce=random_bytes(NONCE_SIZE),
        context=context,
        expected_peer=expected_peer,
    )


async def open_channel(
    host: str,
    port: int,
    wallet: WalletKey,
    *,
    expected_peer: Address,
    context: str = DEFAULT_CONTEXT,
    max_frame: int = DEFAULT_MAX_FRAME,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    transport: StreamTransport = TCP,
) -> AuthenticatedChannel:
    """Dial ``host:port`` and prove both identities; ChannelError unless the peer is ``expected_peer``."""
    try:
        stream = await transport.open_stream(host, port)
    except OSError as exc:
        raise ChannelError(f"cannot reach {host}:{port}: {exc}", reason="dial_failed") from exc
    keys = await _run_handshake(
        stream, _new_handshake(Role.DIALER, wallet, context, expected_peer), handshake_timeout
    )
    return AuthenticatedChannel(stream, keys, max_frame=max_frame)


async def accept_channel(
    stream: trio.abc.Stream,
    wallet: WalletKey,
    *,
    expected_peer: Address | None = None,
    context: str = DEFAULT_CONTEXT,
    max_frame: int = DEFAULT_MAX_FRAME,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
) -> AuthenticatedChannel:
    """Run the listener's side on an accepted connection; the channel's ``remote`` is the dialer's address."""
    keys = await _run_handshake(
        stream, _new_handshake(Role.LISTENER, wallet, context, expected_peer), handshake_timeout
    )
    return AuthenticatedChannel(stream, keys, max_frame=max_frame)


ChannelHandler = Callable[[AuthenticatedChannel], Awaitable[None]]


async def serve_channels(
    wallet: WalletKey,
    handler: ChannelHandler,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    context: str = DEFAULT_CONTEXT,
    max_frame: int = DEFAULT_MAX_FRAME,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    transport: StreamTransport = TCP,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept channels until cancelled; ``handler`` owns each authenticated channel. Reports the port.

    A failed handshake or a ChannelError out of ``handler`` ends that connection only (logged).
    """

    async def on_connection(stream: trio.abc.Stream) -> None:
        try:
            channel = await accept_channel(
                stream, wallet, context=context, max_frame=max_frame, handshake_timeout=handshake_timeout
            )
        except ChannelError:
            return  # already logged and closed
        try:
            await handler(channel)
        except ChannelError as exc:
            log.info("data plane: channel from %s ended: %s", channel.remote, exc)
        finally:
            with trio.CancelScope(shield=True):
                await channel.aclose()

    listeners, bound_port = await open_listeners(transport, host, port)
    async with trio.open_nursery() as nursery:
        task_status.started(bound_port)
        await trio.serve_listeners(on_connection, listeners, handler_nursery=nursery)


async def open_listeners(
    transport: StreamTransport, host: str, port: int
) -> tuple[list[StreamListener], int]:
    """``transport.open_listeners`` with its OSError as a ChannelError (reason ``port_in_use``)."""
    try:
        return await transport.open_listeners(host, port)
    except OSError as exc:
        raise ChannelError(f"cannot listen on {host}:{port}: {exc}", reason="port_in_use") from exc
