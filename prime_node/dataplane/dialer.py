"""Opening a data-plane channel to a peer: its TCP port first, a libp2p stream when that fails.

A dial tries the peer's advertised ``host:port`` (``dial_host``: the host of its first direct multiaddr;
the port from its record), bounded by ``tcp_timeout``: a port behind NAT often drops packets rather than
refusing. If the TCP connect fails or times out, or the address answers as someone else (``wrong_peer``:
a private address that is another machine on our own network), the dial falls back to a libp2p stream of
``fallback_protocol(context)`` to the peer's libp2p ID, and runs the *same* handshake over it: the
channel, its MACs, deadlines and memory budget do not care what carries them. ``RouteMemo`` remembers
the failure, so the next dials go straight to the fallback until the pause ends. A handshake refused for
another reason (the peer is full, a bad signature) is not a reachability problem and does not fall back.
A libp2p stream that turns out to run over a relayed connection is not used unless ``relayed`` allows it
(libp2p_stream.py says why).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import trio

from crypto.keys import Address, WalletKey
from prime_node.dataplane.budget import MemoryBudget
from prime_node.dataplane.channel import (
    DEFAULT_CONTEXT,
    DEFAULT_DEADLINES,
    HANDSHAKE_TIMEOUT,
    AuthenticatedChannel,
    ChannelError,
)
from prime_node.dataplane.connect import dial_channel
from prime_node.dataplane.libp2p_stream import P2PStream, RouteStats, fallback_protocol
from prime_node.dataplane.route_memo import RouteMemo
from prime_node.dataplane.streams import TCP, StreamTransport
from prime_node.errors import NodeError
from prime_node.p2p.interface import P2PHost
from protocol.dataplane import DEFAULT_MAX_FRAME, FrameDeadlines

log = logging.getLogger(__name__)

TCP_DIAL_TIMEOUT = 5.0
"""How long a TCP connect may take before the dial falls back (a NAT that drops SYNs would take minutes)."""
UNREACHABLE_REASONS = frozenset({"dial_failed", "wrong_peer"})
"""Why a TCP attempt counts as "this port does not reach the peer" (see the module doc). A handshake that
times out after the connect succeeded is a busy peer, not an unreachable one: falling back (and going on
to the fallback for the pause) would only move the load onto the peer's libp2p connection."""


@dataclass(frozen=True)
class DialTarget:
    """Whom to dial: the wallet ``address`` the channel must prove, its TCP ``host:port`` (``host`` None
    or ``port`` 0: no direct address to try) and its libp2p ``peer_id`` for the fallback (None: none)."""

    address: Address
    host: str | None
    port: int
    peer_id: str | None = None

    @property
    def direct(self) -> bool:
        return self.host is not None and self.port > 0


@dataclass(frozen=True)
class ChannelSettings:
    """How a ``ChannelDialer`` opens channels: the handshake context, the largest frame, the frame
    deadlines, how long the handshake and a TCP dial may take, and whether a relayed libp2p connection
    may carry the fallback."""

    context: str = DEFAULT_CONTEXT
    max_frame: int = DEFAULT_MAX_FRAME
    deadlines: FrameDeadlines = DEFAULT_DEADLINES
    handshake_timeout: float = HANDSHAKE_TIMEOUT
    tcp_timeout: float = TCP_DIAL_TIMEOUT
    relayed: bool = False


class ChannelDialer:
    """See the module doc. ``p2p`` is set once the node's libp2p host is known (None: TCP only)."""

    def __init__(
        self,
        wallet: WalletKey,
        *,
        budget: MemoryBudget,
        settings: ChannelSettings | None = None,
        transport: StreamTransport = TCP,
        stats: RouteStats | None = None,
        memo: RouteMemo | None = None,
    ) -> None:
        self.wallet = wallet
        self.settings = settings = settings or ChannelSettings()
        self.context = settings.context
        self.protocol_id = fallback_protocol(settings.context)
        self.transport = transport
        self.budget = budget
        self.max_frame = settings.max_frame
        self.deadlines = settings.deadlines
        self.handshake_timeout = settings.handshake_timeout
        self.tcp_timeout = settings.tcp_timeout
        self.stats = stats or RouteStats()
        self.memo = memo or RouteMemo()
        self.relay_memo = RouteMemo()
        """Peers whose fallback stream ran over a relay (refused unless ``relayed``): not asked again
        before their pause ends, as hole punching may give them a direct connection meanwhile."""
        self.relayed = settings.relayed
        self.p2p: P2PHost | None = None

    def can_fall_back(self, target: DialTarget) -> bool:
        """A libp2p stream to ``target`` may carry a channel now: we know its libp2p ID, and it was not
        found behind a relay lately, unless a direct connection to it has come up since (a hole punch
        typically lands a few seconds after the relayed connection it upgrades)."""
        if self.p2p is None or target.peer_id is None:
            return False
        return self.relay_memo.may_try(target.address, trio.current_time()) or self.p2p.directly_connected(
            target.peer_id
        )

    def may_open(self, target: DialTarget) -> bool:
        """Whether ``open`` has a way to try now (its TCP port, not paused, or the fallback): callers
        skip a dial that could only fail with "no way to reach"."""
        tcp = target.direct and self.memo.may_try(target.address, trio.current_time())
        return tcp or self.can_fall_back(target)

    async def open(self, target: DialTarget) -> AuthenticatedChannel:
        """A channel to ``target.address`` (module doc); ChannelError if neither way reaches it."""
        failure: ChannelError | None = None
        if target.direct and self.memo.may_try(target.address, trio.current_time()):
            try:
                channel = await self._open_tcp(target)
            except ChannelError as exc:
                if exc.reason not in UNREACHABLE_REASONS:
                    raise
                failure = exc
                self.stats.tcp_failures += 1
                retry_at = self.memo.failed(target.address, trio.current_time())
                log.info(
                    "data plane: %s:%s does not reach %s (%s); libp2p fallback, TCP again in %.0f s",
                    target.host, target.port, target.address, exc.reason, retry_at - trio.current_time(),
                )  # fmt: skip
            else:
                self.memo.succeeded(target.address)
                self.stats.tcp_channels += 1
                return channel
        if not self.can_fall_back(target):
            if failure is not None:
                raise failure
            raise ChannelError(f"no way to reach {target.address}", reason="dial_failed")
        return await self._open_fallback(target)

    async def _open_tcp(self, target: DialTarget) -> AuthenticatedChannel:
        assert target.host is not None
        try:
            with trio.fail_after(self.tcp_timeout):
                stream = await self.transport.open_stream(target.host, target.port)
        except (OSError, trio.TooSlowError) as exc:
            text = f"cannot reach {target.host}:{target.port}: {str(exc) or 'timed out'}"
            raise ChannelError(text, reason="dial_failed") from exc
        return await dial_channel(
            stream,
            self.wallet,
            expected_peer=target.address,
            context=self.context,
            max_frame=self.max_frame,
            handshake_timeout=self.handshake_timeout,
            deadlines=self.deadlines,
            budget=self.budget,
        )

    async def _open_fallback(self, target: DialTarget) -> AuthenticatedChannel:
        assert self.p2p is not None and target.peer_id is not None
        try:
            framed = await self.p2p.open_stream(target.peer_id, self.protocol_id)
        except NodeError as exc:
            self.stats.fallback_failures += 1
            text = f"no libp2p stream to {target.address}: {exc}"
            raise ChannelError(text, reason="fallback_failed") from exc
        if framed.raw.relayed and not self.relayed:
            self.stats.relayed_refused += 1
            self.relay_memo.failed(target.address, trio.current_time())
            await framed.reset()
            text = f"{target.address} is reachable only through a relay: no bulk bytes there"
            raise ChannelError(text, reason="relayed_only")
        try:
            channel = await dial_channel(
                P2PStream(framed.raw, self.stats),
                self.wallet,
                expected_peer=target.address,
                context=self.context,
                max_frame=self.max_frame,
                handshake_timeout=self.handshake_timeout,
                deadlines=self.deadlines,
                budget=self.budget,
            )
        except ChannelError:
            self.stats.fallback_failures += 1
            raise
        self.stats.fallback_channels += 1
        self.relay_memo.succeeded(target.address)
        return channel


def dial_host(multiaddrs: tuple[str, ...]) -> str | None:
    """The first usable IPv4/IPv6/DNS host among a peer's direct multiaddrs (a relayed one names the
    relay's host, where the peer's data plane is not)."""
    for multiaddr in multiaddrs:
        if "/p2p-circuit" in multiaddr:
            continue
        parts = multiaddr.split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
            host = parts[2]
            if host not in ("0.0.0.0", "::"):
                return host
    return None
