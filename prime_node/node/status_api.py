"""A tiny read-only HTTP/1.1 server (h11 over trio sockets) bound to 127.0.0.1 only.

GET /status → the JSON snapshot; GET /metrics → Prometheus text; GET /health → a short JSON summary
(running, members per state), 503 once the node stops running. One request per connection, bounded
request size and time: the API is local and read-only, so it needs nothing more.

Binding to loopback is not enough on its own: a web page the user visits can point its own DNS name at
127.0.0.1 (DNS rebinding) and read the API through the browser. Such a request still names the
attacker's host in its ``Host`` header, so only loopback host names are answered (421 otherwise).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import h11
import trio

from prime_node.errors import NodeError
from prime_node.node.snapshot import StatusSource, health, prometheus_text, snapshot

log = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 16 << 10
REQUEST_TIMEOUT = 5.0
LOOPBACK_HOSTS = frozenset({b"127.0.0.1", b"localhost", b"[::1]"})


def is_loopback_host(host: bytes) -> bool:
    """Whether a ``Host`` header names this machine's loopback (with or without a port)."""
    name = host.strip().lower()
    bracketed = name.startswith(b"[")  # an IPv6 literal carries colons of its own
    return (name[: name.find(b"]") + 1] if bracketed else name.split(b":", 1)[0]) in LOOPBACK_HOSTS


async def serve_status(node: StatusSource, port: int, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    try:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    except OSError as exc:
        raise NodeError(
            f"status API cannot listen on 127.0.0.1:{port}: {exc.strerror}", reason="port_in_use"
        ) from exc
    bound_port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        task_status.started(f"http://127.0.0.1:{bound_port}")
        for listener in listeners:
            nursery.start_soon(_accept_loop, node, listener, nursery)


async def _accept_loop(node: StatusSource, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
    async with listener:
        while True:
            stream = await listener.accept()
            nursery.start_soon(_serve_one, node, stream)


async def _serve_one(node: StatusSource, stream: trio.SocketStream) -> None:
    connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
    try:
        with trio.move_on_after(REQUEST_TIMEOUT):
            request = await _read_request(connection, stream)
            if request is None:
                return
            status, content_type, body = _respond(node, request)
            headers = [
                ("content-type", content_type),
                ("content-length", str(len(body))),
                ("connection", "close"),
            ]
            await stream.send_all(connection.send(h11.Response(status_code=status, headers=headers)) or b"")
            await stream.send_all(connection.send(h11.Data(data=body)) or b"")
            await stream.send_all(connection.send(h11.EndOfMessage()) or b"")
    except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
        log.debug("status request failed: %s", exc)
    finally:
        await stream.aclose()


async def _read_request(connection: h11.Connection, stream: trio.SocketStream) -> h11.Request | None:
    while True:
        event = connection.next_event()
        if isinstance(event, h11.Request):
            return event
        if event is h11.NEED_DATA:
            data = await stream.receive_some(4096)
            connection.receive_data(data)
            if not data:
                return None
        elif isinstance(event, h11.ConnectionClosed):
            return None


def _respond(node: StatusSource, request: h11.Request) -> tuple[int, str, bytes]:
    hosts = [value for name, value in request.headers if name == b"host"]
    if len(hosts) != 1 or not is_loopback_host(hosts[0]):
        log.warning("status API refused a request for host %r (only loopback names are served)", hosts[:1])
        return 421, "text/plain", b"this API answers only requests for 127.0.0.1 or localhost\n"
    if request.method not in (b"GET", b"HEAD"):
        return 405, "text/plain", b"read-only API: GET /status, /metrics or /health\n"
    path = request.target.split(b"?")[0]
    if path in (b"/", b"/status"):
        return 200, "application/json", json.dumps(snapshot(node)).encode()
    if path == b"/metrics":
        return 200, "text/plain; version=0.0.4", prometheus_text(snapshot(node)).encode()
    if path == b"/health":
        summary = health(node)
        return 200 if summary["running"] else 503, "application/json", json.dumps(summary).encode()
    return 404, "text/plain", b"not found: try /status, /metrics or /health\n"
