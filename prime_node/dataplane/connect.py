"""Opening data-plane channels: the handshake of protocol/dataplane_handshake.py run over a byte stream,
then an ``AuthenticatedChannel`` (channel.py) on it. Dial (``open_channel``, ``dial_channel``), accept
(``accept_channel``, ``handle_connection``) or serve a port (``serve_channels``); a failed handshake is a
logged ``ChannelError`` and a closed stream.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from crypto.keys import Address, WalletKey
from crypto.randomness import random_bytes
from prime_node.dataplane.budget import MemoryBudget
from prime_node.dataplane.channel import (
    DEFAULT_CONTEXT,
    DEFAULT_DEADLINES,
    HANDSHAKE_TIMEOUT,
    AuthenticatedChannel,
    ChannelError,
)
from prime_node.dataplane.streams import TCP, StreamListener, StreamTransport
from protocol.dataplane import DEFAULT_MAX_FRAME, FRAME_HEADER, FrameDeadlines
from protocol.dataplane_handshake import (
    NONCE_SIZE,
    SECRET_SIZE,
    Handshake,
    Role,
    SessionKeys,
    handshake_frame,
    handshake_length,
)
from protocol.errors import ProtocolError, RemoteProtocolError

log = logging.getLogger(__name__)


async def _read_exactly(stream: trio.abc.Stream, view: memoryview) -> None:
    """Fill ``view`` from the stream (the handshake's small frames, under the handshake's deadline)."""
    filled = 0
    while filled < len(view):
        chunk = await stream.receive_some(len(view) - filled)  # never past the handshake's own bytes
        count = len(chunk)
        view[filled : filled + count] = chunk
        if count == 0:
            raise RemoteProtocolError("connection ended inside a frame", reason="truncated_frame")
        filled += count


async def _run_handshake(stream: trio.abc.Stream, handshake: Handshake, timeout: float) -> SessionKeys:
    peer = "the listener" if handshake.role is Role.DIALER else "a dialer"
    try:
        with trio.fail_after(timeout):
            for frame in handshake.initial_frames():
                await stream.send_all(handshake_frame(frame))
            while not handshake.done:
                header = bytearray(FRAME_HEADER.size)
                await _read_exactly(stream, memoryview(header))
                body = bytearray(handshake_length(header))
                await _read_exactly(stream, memoryview(body))
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
    deadlines: FrameDeadlines = DEFAULT_DEADLINES,
    budget: MemoryBudget | None = None,
    transport: StreamTransport = TCP,
) -> AuthenticatedChannel:
    """Dial ``host:port`` and prove both identities; ChannelError unless the peer is ``expected_peer``.
    ``budget``: the node's shared MemoryBudget (None: the channel gets a default-sized one of its own)."""
    try:
        stream = await transport.open_stream(host, port)
    except OSError as exc:
        raise ChannelError(f"cannot reach {host}:{port}: {exc}", reason="dial_failed") from exc
    return await dial_channel(
        stream,
        wallet,
        expected_peer=expected_peer,
        context=context,
        max_frame=max_frame,
        handshake_timeout=handshake_timeout,
        deadlines=deadlines,
        budget=budget,
    )


async def dial_channel(
    stream: trio.abc.Stream,
    wallet: WalletKey,
    *,
    expected_peer: Address,
    context: str = DEFAULT_CONTEXT,
    max_frame: int = DEFAULT_MAX_FRAME,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    deadlines: FrameDeadlines = DEFAULT_DEADLINES,
    budget: MemoryBudget | None = None,
) -> AuthenticatedChannel:
    """Run the dialer's side on a stream we opened (TCP, or a libp2p stream when TCP cannot reach the
    peer: prime_node/dataplane/libp2p_stream.py); the stream is closed if the handshake fails."""
    keys = await _run_handshake(
        stream, _new_handshake(Role.DIALER, wallet, context, expected_peer), handshake_timeout
    )
    return AuthenticatedChannel(stream, keys, max_frame=max_frame, deadlines=deadlines, budget=budget)


async def accept_channel(
    stream: trio.abc.Stream,
    wallet: WalletKey,
    *,
    expected_peer: Address | None = None,
    context: str = DEFAULT_CONTEXT,
    max_frame: int = DEFAULT_MAX_FRAME,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    deadlines: FrameDeadlines = DEFAULT_DEADLINES,
    budget: MemoryBudget | None = None,
) -> AuthenticatedChannel:
    """Run the listener's side on an accepted connection; the channel's ``remote`` is the dialer's address."""
    keys = await _run_handshake(
        stream, _new_handshake(Role.LISTENER, wallet, context, expected_peer), handshake_timeout
    )
    return AuthenticatedChannel(stream, keys, max_frame=max_frame, deadlines=deadlines, budget=budget)


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
    deadlines: FrameDeadlines = DEFAULT_DEADLINES,
    budget: MemoryBudget | None = None,
    transport: StreamTransport = TCP,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept channels until cancelled; ``handler`` owns each authenticated channel. Reports the port.

    A failed handshake or a ChannelError out of ``handler`` ends that connection only (logged). All the
    channels share ``budget`` (None: a new default-sized one).
    """
    shared = budget or MemoryBudget()

    async def on_connection(stream: trio.abc.Stream) -> None:
        await handle_connection(
            stream,
            wallet,
            handler,
            context=context,
            max_frame=max_frame,
            handshake_timeout=handshake_timeout,
            deadlines=deadlines,
            budget=shared,
        )

    listeners, bound_port = await open_listeners(transport, host, port)
    async with trio.open_nursery() as nursery:
        task_status.started(bound_port)
        await trio.serve_listeners(on_connection, listeners, handler_nursery=nursery)


async def handle_connection(
    stream: trio.abc.Stream,
    wallet: WalletKey,
    handler: ChannelHandler,
    *,
    expected_peer: Address | None = None,
    context: str = DEFAULT_CONTEXT,
    max_frame: int = DEFAULT_MAX_FRAME,
    handshake_timeout: float = HANDSHAKE_TIMEOUT,
    deadlines: FrameDeadlines = DEFAULT_DEADLINES,
    budget: MemoryBudget,
) -> None:
    """One accepted connection of ``serve_channels`` (or a libp2p fallback stream, whose transport already
    names the peer: ``expected_peer``): handshake, then ``handler`` owns the channel until it returns."""
    try:
        channel = await accept_channel(
            stream,
            wallet,
            expected_peer=expected_peer,
            context=context,
            max_frame=max_frame,
            handshake_timeout=handshake_timeout,
            deadlines=deadlines,
            budget=budget,
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


async def open_listeners(
    transport: StreamTransport, host: str, port: int
) -> tuple[list[StreamListener], int]:
    """``transport.open_listeners`` with its OSError as a ChannelError (reason ``port_in_use``)."""
    try:
        return await transport.open_listeners(host, port)
    except OSError as exc:
        raise ChannelError(f"cannot listen on {host}:{port}: {exc}", reason="port_in_use") from exc
