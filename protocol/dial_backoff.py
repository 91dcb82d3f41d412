"""Which of a peer record's addresses a node may dial now, and which it has proven.

A peer record is signed by its owner, so its multiaddrs say only where the owner *claims* to listen. A
stranger can name someone else's listener (issue 35, item 5): every node that holds the record then
dials that listener, and with no memory of failures a departed stranger's record made its victim and the
victim's neighbours open 204 TCP connections to it in 75 s. So addresses from records are tracked per
**endpoint** (the transport address a dial actually connects to, the part before the first ``/p2p/``)
together with the peer that endpoint is expected to prove (the first ``/p2p/`` peer ID: the owner for a
direct address, the relay for a relayed one):

- an endpoint is **proven** for a peer once a dial to it alone completed the secure handshake with that
  peer (the transport authenticates the peer ID; someone else's listener fails that check);
- every failed dial is a **strike** on each unproven endpoint it tried: that endpoint is not dialled
  again, for any record naming it, for ``base * 2**(strikes - 1)`` seconds, capped at ``cap``. Keyed by
  endpoint, not by record, so fresh keys naming the same victim share one backoff;
- a proven endpoint is dialled for its own peer regardless of strikes (a record of another key naming an
  honest node's listener cannot lock that node out, nor take its proof away); if a dial to it for its
  own peer fails, it loses its proof;
- a record whose every endpoint failed for its own peer, and none is proven, is **disproven**: the node
  does not pass it on.

Pure and bounded (``max_endpoints``, oldest forgotten first); time is passed in (seconds, any origin).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from protocol.errors import LocalProtocolError

BASE_PAUSE = 2.0
"""Seconds an endpoint rests after its first failed dial (then doubling)."""
MAX_PAUSE = 300.0
"""The longest rest: after ``log2(MAX_PAUSE / BASE_PAUSE) + 1`` failures (8), one dial per 5 minutes."""
MAX_ENDPOINTS = 4096


@dataclass(frozen=True)
class DialBackoffConfig:
    base: float = BASE_PAUSE
    cap: float = MAX_PAUSE
    max_endpoints: int = MAX_ENDPOINTS

    def __post_init__(self) -> None:
        if not (0 < self.base <= self.cap and self.max_endpoints > 0):
            raise LocalProtocolError(
                "dial backoff needs 0 < base <= cap and max_endpoints > 0", reason="bad_config"
            )


@dataclass(frozen=True)
class Endpoint:
    """Where a multiaddr connects (``/ip4/1.2.3.4/tcp/4001``) and whom the handshake there must prove."""

    transport: str
    expected_peer: str


def endpoint_of(multiaddr: str) -> Endpoint | None:
    """The endpoint of a full ``/p2p/`` multiaddr, or None if it has no transport part or no peer ID."""
    transport, sep, rest = multiaddr.partition("/p2p/")
    expected = rest.split("/", 1)[0]
    if not sep or not transport.startswith("/") or not expected:
        return None
    return Endpoint(transport, expected)


def pause_after(strikes: int, config: DialBackoffConfig) -> float:
    """How long an endpoint rests after ``strikes`` failures in a row (0 for none)."""
    if strikes <= 0:
        return 0.0
    if strikes > 64:  # 2**64 * base is past any cap: no float overflow on a long-lived endpoint
        return config.cap
    return min(config.base * 2.0 ** (strikes - 1), config.cap)


@dataclass
class _State:
    strikes: int = 0
    until: float = 0.0
    proven_for: str | None = None
    """The peer a dial to this endpoint alone authenticated (None: never, or its last dial failed)."""
    failed_for: str | None = None
    """The peer the last failed dial here expected (a record is disproven only by its own failures)."""


class DialBackoff:
    """The dial policy for addresses learnt from records (see the module doc)."""

    def __init__(self, config: DialBackoffConfig = DialBackoffConfig()) -> None:
        self.config = config
        self._endpoints: OrderedDict[str, _State] = OrderedDict()

    def __len__(self) -> int:
        return len(self._endpoints)

    def plan(self, multiaddrs: Iterable[str], now: float) -> tuple[str, ...]:
        """The multiaddrs that may be dialled now: proven ones first, then unproven ones at rest no more.
        Malformed ones are left out."""
        proven: list[str] = []
        unproven: list[str] = []
        for multiaddr in multiaddrs:
            endpoint = endpoint_of(multiaddr)
            if endpoint is None:
                continue
            state = self._endpoints.get(endpoint.transport)
            if state is None:
                unproven.append(multiaddr)
            elif state.proven_for == endpoint.expected_peer:
                proven.append(multiaddr)
            elif now >= state.until:
                unproven.append(multiaddr)
        return tuple(proven + unproven)

    def failed(self, multiaddrs: Iterable[str], now: float) -> None:
        """A dial to ``multiaddrs`` reached none of them: one strike on each endpoint."""
        for multiaddr in multiaddrs:
            endpoint = endpoint_of(multiaddr)
            if endpoint is None:
                continue
            state = self._touch(endpoint.transport)
            state.strikes += 1
            state.until = now + pause_after(state.strikes, self.config)
            if state.proven_for == endpoint.expected_peer:
                state.proven_for = None  # its own peer is gone from there (another's failure proves nothing)
            state.failed_for = endpoint.expected_peer

    def reached(self, multiaddr: str) -> None:
        """A dial to ``multiaddr`` alone completed the handshake with its expected peer: proven."""
        endpoint = endpoint_of(multiaddr)
        if endpoint is None:
            return
        state = self._touch(endpoint.transport)
        state.strikes, state.until = 0, 0.0
        state.proven_for, state.failed_for = endpoint.expected_peer, None

    def resting_until(self, multiaddr: str) -> float:
        """When ``multiaddr``'s endpoint may be dialled again if unproven (0: at once)."""
        endpoint = endpoint_of(multiaddr)
        state = None if endpoint is None else self._endpoints.get(endpoint.transport)
        return 0.0 if state is None else state.until

    def strikes(self, multiaddr: str) -> int:
        endpoint = endpoint_of(multiaddr)
        state = None if endpoint is None else self._endpoints.get(endpoint.transport)
        return 0 if state is None else state.strikes

    def proven(self, multiaddr: str) -> bool:
        endpoint = endpoint_of(multiaddr)
        state = None if endpoint is None else self._endpoints.get(endpoint.transport)
        return state is not None and endpoint is not None and state.proven_for == endpoint.expected_peer

    def disproven(self, multiaddrs: Iterable[str]) -> bool:
        """Each endpoint of a record failed its own expected peer's last dial there (so none is proven).
        A record with no usable multiaddr is not: it steers no dial."""
        endpoints = [e for e in map(endpoint_of, multiaddrs) if e is not None]
        for endpoint in endpoints:
            state = self._endpoints.get(endpoint.transport)
            if state is None or state.failed_for != endpoint.expected_peer:
                return False
        return bool(endpoints)

    def _touch(self, transport: str) -> _State:
        state = self._endpoints.pop(transport, None) or _State()
        self._endpoints[transport] = state
        while len(self._endpoints) > self.config.max_endpoints:
            self._endpoints.popitem(last=False)
        return state
