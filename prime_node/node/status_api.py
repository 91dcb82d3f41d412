"""A tiny read-only HTTP/1.1 server (h11 over trio sockets) bound to 127.0.0.1 only.

GET /status → the JSON snapshot; GET /metrics → Prometheus text; GET /health → a short JSON summary
(running, members per state), 503 once the node stops running. Bounded request size and time.

Binding to loopback is not enough on its own: a web page the user has open can send requests here for
as long as it stays open. Requests from another site's page are refused before any work (421 for a
foreign ``Host``, 403 for a foreign ``Origin`` or ``Sec-Fetch-Site``: status_guard.py), and what anyone
may ask costs little: the snapshot is rebuilt at most once per ``SNAPSHOT_MAX_AGE``, a kept-alive
connection is held to ``REQUESTS_PER_S`` (its next request is read only when due, so it is slowed, not
refused), at most ``MAX_CONNECTIONS`` are open and ``CONNECTIONS_PER_S`` accepted, so a client that
reconnects for every request is held too. Six flooding clients once drove 874 snapshots a second, about
one core.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import h11
import trio

from prime_node.errors import NodeError
from prime_node.node.snapshot import StatusSource, health, prometheus_text, snapshot
from prime_node.node.status_guard import TokenBucket, cross_site_refusal, is_loopback_host

log = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 16 << 10
REQUEST_TIMEOUT = 5.0  # to read a request (a kept-alive connection idle this long is closed) and answer it
SNAPSHOT_MAX_AGE = 1.0  # /status and /metrics answer from a snapshot at most this old
REQUESTS_PER_S = 5.0  # per connection, after a burst of REQUEST_BURST
REQUEST_BURST = 10
MAX_REQUESTS_PER_CONNECTION = 100  # then it is closed, so held connections take turns with new ones
MAX_CONNECTIONS = 32
CONNECTIONS_PER_S = 20.0  # accepted, after a burst of CONNECTION_BURST
CONNECTION_BURST = 40
REFUSAL_LOG_INTERVAL = 60.0

__all__ = ["SnapshotCache", "is_loopback_host", "serve_status"]


class SnapshotCache:
    """The node's snapshot and its two encodings, rebuilt at most once per ``SNAPSHOT_MAX_AGE`` of trio
    time however often it is asked for: building it walks every member (~1.6 ms at 64 peers)."""

    def __init__(self, node: StatusSource) -> None:
        self._node = node
        self._built_at = -math.inf
        self._json: bytes | None = None
        self._metrics: bytes | None = None
        self._data: dict[str, Any] = {}

    def _fresh(self) -> dict[str, Any]:
        now = trio.current_time()
        if now - self._built_at >= SNAPSHOT_MAX_AGE:
            self._data = snapshot(self._node)
            self._built_at = now
            self._json = self._metrics = None
        return self._data

    def json_body(self) -> bytes:
        data = self._fresh()
        if self._json is None:
            self._json = json.dumps(data).encode()
        return self._json

    def metrics_body(self) -> bytes:
        data = self._fresh()
        if self._metrics is None:
            self._metrics = prometheus_text(data).encode()
        return self._metrics


class _Refusals:
    """Logs refused requests at most once a minute (with how many there were), so a page that keeps
    sending them cannot flood the log either."""

    def __init__(self) -> None:
        self._count = 0
        self._logged_at = -math.inf

    def note(self, status: int, why: str) -> None:
        self._count += 1
        now = trio.current_time()
        if now - self._logged_at >= REFUSAL_LOG_INTERVAL:
            log.warning(
                "status API refused %d request(s) a web page may have sent, latest %d: %s",
                self._count,
                status,
                why,
            )
            self._count = 0
            self._logged_at = now


class _Server:
    def __init__(self, node: StatusSource, port: int) -> None:
        self.node = node
        self.port = port
        self.cache = SnapshotCache(node)
        self.refusals = _Refusals()
        self.slots = trio.Semaphore(MAX_CONNECTIONS)
        self.accepts = TokenBucket.full(CONNECTIONS_PER_S, CONNECTION_BURST, trio.current_time())

    async def accept_loop(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        async with listener:
            while True:
                await self.slots.acquire()  # past MAX_CONNECTIONS, new ones wait in the kernel's queue
                try:
                    await trio.sleep(self.accepts.take(trio.current_time()))
                    stream = await listener.accept()
                except BaseException:
                    self.slots.release()
                    raise
                nursery.start_soon(self.serve_connection, stream)

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        connection = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_REQUEST_BYTES)
        bucket = TokenBucket.full(REQUESTS_PER_S, REQUEST_BURST, trio.current_time())
        try:
            for served in range(1, MAX_REQUESTS_PER_CONNECTION + 1):
                await trio.sleep(bucket.take(trio.current_time()))  # the next request is read when due
                with trio.move_on_after(REQUEST_TIMEOUT) as timeout:
                    request = await _read_request(connection, stream)
                    if request is None:
                        return
                    status, content_type, body = self.respond(request)
                    close = status in (403, 421) or served == MAX_REQUESTS_PER_CONNECTION
                    headers = [("content-type", content_type), ("content-length", str(len(body)))]
                    if close:
                        headers.append(("connection", "close"))
                    out = connection.send(h11.Response(status_code=status, headers=headers)) or b""
                    if request.method != b"HEAD":
                        out += connection.send(h11.Data(data=body)) or b""
                    out += connection.send(h11.EndOfMessage()) or b""
                    await stream.send_all(out)
                if timeout.cancelled_caught or connection.our_state is not h11.DONE:
                    return
                connection.start_next_cycle()
        except (h11.ProtocolError, trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            log.debug("status request failed: %s", exc)
        finally:
            self.slots.release()
            await stream.aclose()

    def respond(self, request: h11.Request) -> tuple[int, str, bytes]:
        hosts = [value for name, value in request.headers if name == b"host"]
        if len(hosts) != 1 or not is_loopback_host(hosts[0]):
            self.refusals.note(421, f"host {hosts[:1]!r} (only loopback names are served)")
            return 421, "text/plain", b"this API answers only requests for 127.0.0.1 or localhost\n"
        cross_site = cross_site_refusal(request.headers, self.port)
        if cross_site is not None:
            self.refusals.note(403, f"another site's page ({cross_site})")
            return 403, "text/plain", b"this API answers only this machine's own clients, not web pages\n"
        if request.method not in (b"GET", b"HEAD"):
            return 405, "text/plain", b"read-only API: GET /status, /metrics or /health\n"
        path = request.target.split(b"?")[0]
        if path in (b"/", b"/status"):
            return 200, "application/json", self.cache.json_body()
        if path == b"/metrics":
            return 200, "text/plain; version=0.0.4", self.cache.metrics_body()
        if path == b"/health":
            summary = health(self.node)
            return 200 if summary["running"] else 503, "application/json", json.dumps(summary).encode()
        return 404, "text/plain", b"not found: try /status, /metrics or /health\n"


async def serve_status(node: StatusSource, port: int, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    try:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
    except OSError as exc:
        raise NodeError(
            f"status API cannot listen on 127.0.0.1:{port}: {exc.strerror}", reason="port_in_use"
        ) from exc
    bound_port = listeners[0].socket.getsockname()[1]
    server = _Server(node, bound_port)
    async with trio.open_nursery() as nursery:
        task_status.started(f"http://127.0.0.1:{bound_port}")
        for listener in listeners:
            nursery.start_soon(server.accept_loop, listener, nursery)


async def _read_request(connection: h11.Connection, stream: trio.SocketStream) -> h11.Request | None:
    """The next whole request (its body, which a read-only API has no use for, read and dropped up to
    ``MAX_REQUEST_BYTES``), or None when the client closed or sent too much."""
    request: h11.Request | None = None
    body_bytes = 0
    while True:
        event = connection.next_event()
        if isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body_bytes += len(event.data)
            if body_bytes > MAX_REQUEST_BYTES:
                return None
        elif isinstance(event, h11.EndOfMessage):
            return request
        elif event is h11.NEED_DATA:
            data = await stream.receive_some(4096)
            connection.receive_data(data)
            if not data:
                return None
        elif isinstance(event, h11.ConnectionClosed):
            return None
