"""The dial-back probe: "dial me back on these ports of the address you see me at".

Why our own and not py-libp2p's AutoNAT v1 (libp2p/host/autonat): its server dials back with
``host.connect``, which returns the connection the request came in on, so every requester already
connected to it is told it is reachable; and it has no rate limit. Here the server opens a *fresh* TCP
connection, completes a Noise handshake that must prove the requester's peer ID, and closes it; the
swarm never sees it. It dials only the requester's observed IP (never an address the requester names),
at most ``MAX_DIALBACK_PORTS`` ports, never over a relayed connection, within ``DialbackLimiter``.

Wire format (one request frame, one response frame, msgpack maps, at most ``MAX_MESSAGE`` bytes):
request ``{"ports": [int, ...]}``; response ``{"observed": "/ip4/IP/tcp/PORT" | "", "results":
[[port, ok], ...], "refused": reason | ""}``.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import msgpack
import trio

from prime_node.errors import NodeError
from prime_node.p2p.interface import FramedStream
from protocol.reachability import MAX_DIALBACK_PORTS, DialbackLimiter, dialback_ports

log = logging.getLogger(__name__)
MAX_MESSAGE = 1024
DIAL_TIMEOUT = 3.0

DialFn = Callable[[str, int], Awaitable[bool]]


@dataclass(frozen=True)
class DialbackAnswer:
    observed: str
    results: tuple[tuple[int, bool], ...]
    refused: str


def _unpack_map(frame: bytes | None) -> dict[str, object]:
    if frame is None:
        raise NodeError("dial-back peer closed the stream", reason="dialback_closed")
    try:
        value = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as exc:
        raise NodeError(f"bad dial-back message: {type(exc).__name__}", reason="bad_dialback") from exc
    if not isinstance(value, dict):
        raise NodeError("bad dial-back message: not a map", reason="bad_dialback")
    return value


def decode_answer(frame: bytes | None) -> DialbackAnswer:
    """A server's response; NodeError(bad_dialback) for anything malformed."""
    value = _unpack_map(frame)
    observed, results, refused = value.get("observed", ""), value.get("results", []), value.get("refused", "")
    if not isinstance(observed, str) or not isinstance(refused, str) or not isinstance(results, list):
        raise NodeError("bad dial-back response fields", reason="bad_dialback")
    parsed: list[tuple[int, bool]] = []
    for item in results[:MAX_DIALBACK_PORTS]:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], int)):
            raise NodeError("bad dial-back result", reason="bad_dialback")
        parsed.append((int(item[0]), item[1] is True))
    return DialbackAnswer(observed[:200], tuple(parsed), refused[:200])


async def request_dialback(stream: FramedStream, ports: list[int], timeout: float) -> DialbackAnswer:
    """Client side: send our listen ports, wait (at most ``timeout``) for the verdict."""
    with trio.move_on_after(timeout) as scope:
        await stream.send_frame(msgpack.packb({"ports": dialback_ports(ports)}))
        frame = await stream.receive_frame(MAX_MESSAGE)
    if scope.cancelled_caught:
        raise NodeError(f"no dial-back answer within {timeout:.0f} s", reason="dialback_timeout")
    return decode_answer(frame)


async def serve_dialback(
    stream: FramedStream,
    *,
    observed: tuple[str, int] | None,
    relayed: bool,
    limiter: DialbackLimiter,
    now: float,
    dial: DialFn,
) -> DialbackAnswer:
    """Server side: read one request and answer it (see the module doc for the rules). ``observed``: the
    requester's (IP, port) as our TCP socket sees it. Returns what was answered (for logs and tests)."""
    request: dict[str, object] = {}
    with trio.move_on_after(DIAL_TIMEOUT):
        request = _unpack_map(await stream.receive_frame(MAX_MESSAGE))
    ports_field = request.get("ports", [])
    ports = dialback_ports(ports_field if isinstance(ports_field, list) else [])
    observed_text = ""
    if observed is not None:
        family = "ip6" if ":" in observed[0] else "ip4"
        observed_text = f"/{family}/{observed[0]}/tcp/{observed[1]}"
    refused = ""
    results: list[tuple[int, bool]] = []
    if relayed:
        refused = "request came over a relayed connection"
    elif observed is None:
        refused = "no observed address"
    elif not ports:
        refused = "no valid port named"
    elif not limiter.allow(stream.remote_peer_id, now):
        refused = "rate limited"
    else:
        for port in ports:
            results.append((port, await dial(observed[0], port)))
    answer = DialbackAnswer(observed_text, tuple(results), refused)
    if refused:
        log.debug("dial-back for %s refused: %s", stream.remote_peer_id, refused)
    await stream.send_frame(
        msgpack.packb(
            {"observed": answer.observed, "results": [list(r) for r in answer.results], "refused": refused}
        )
    )
    return answer
