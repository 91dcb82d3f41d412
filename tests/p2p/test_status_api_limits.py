"""The status API costs little however often it is asked (issue 35, item 6): real HTTP over 127.0.0.1
against a real node's server, under trio's virtual clock. The snapshot is built at most once per second
of trio time, a connection that floods is slowed while other clients are answered, a client that
reconnects for every request is held too, connections are capped, and requests from another site's
page are refused with 403 before any work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
from hypothesis import example, given
from hypothesis import strategies as st

from prime_node.node import status_api
from prime_node.node.service import Node
from prime_node.node.status_guard import cross_site_refusal, own_origins
from prime_node.testing.memory_network import MemoryNetwork
from tests.p2p.helpers import make_config, start_node


class _Builds:
    """Counts snapshot builds: the real ``snapshot`` the server calls, wrapped."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = status_api.snapshot

        def counting(node: Any) -> dict[str, Any]:
            self.count += 1
            return real(node)

        monkeypatch.setattr(status_api, "snapshot", counting)


class _Client:
    """An HTTP/1.1 client on one kept-alive connection (h11), reconnecting only when the server closes."""

    def __init__(self, port: int, headers: list[tuple[str, str]] | None = None) -> None:
        self.port = port
        self.headers = [("host", f"127.0.0.1:{port}"), *(headers or [])]
        self.stream: trio.SocketStream | None = None
        self.connection = h11.Connection(h11.CLIENT)
        self.connects = 0

    async def get(self, path: str = "/status") -> tuple[int, bytes]:
        for _ in range(3):  # a connection the server closed (it was idle too long) is opened again
            try:
                return await self._get(path)
            except (h11.RemoteProtocolError, trio.BrokenResourceError, ConnectionError):
                await self.close()
        raise AssertionError("the server kept closing the connection")

    async def _get(self, path: str) -> tuple[int, bytes]:
        if self.stream is None:
            self.stream = await trio.open_tcp_stream("127.0.0.1", self.port)
            self.connection = h11.Connection(h11.CLIENT)
            self.connects += 1
        out = self.connection.send(h11.Request(method="GET", target=path, headers=self.headers)) or b""
        out += self.connection.send(h11.EndOfMessage()) or b""
        await self.stream.send_all(out)
        status, body = 0, b""
        while True:
            event = self.connection.next_event()
            if event is h11.NEED_DATA:
                self.connection.receive_data(await self.stream.receive_some(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            elif isinstance(event, h11.ConnectionClosed):
                raise h11.RemoteProtocolError("closed before the response")
        if self.connection.our_state is h11.MUST_CLOSE or self.connection.their_state is h11.MUST_CLOSE:
            await self.close()
        else:
            self.connection.start_next_cycle()
        return status, body

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
            self.stream = None


async def _node(nursery: trio.Nursery, tmp_path: Path) -> tuple[Node, int]:
    node, _ = await start_node(nursery, MemoryNetwork().host, make_config(tmp_path, 0, role="seeder"))
    assert node.api_url is not None
    return node, int(node.api_url.rsplit(":", 1)[1])


async def test_many_requests_build_the_snapshot_at_most_once_per_second(
    tmp_path: Path, autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six kept-alive connections asking as fast as they are answered: every answer is the snapshot, but
    it was built once per request (874 a second, about one core) and is now built at most once per second
    of trio time."""
    builds = _Builds(monkeypatch)
    async with trio.open_nursery() as nursery:
        node, port = await _node(nursery, tmp_path)
        answers: list[tuple[int, bytes]] = []

        async def flood() -> None:
            client = _Client(port)
            for _ in range(25):
                answers.append(await client.get("/status" if len(answers) % 2 else "/metrics"))
            await client.close()

        builds.count = 0
        started = trio.current_time()
        async with trio.open_nursery() as clients:
            for _ in range(6):
                clients.start_soon(flood)
        seconds = trio.current_time() - started
        assert len(answers) == 150
        assert all(status == 200 for status, _ in answers)
        assert any(node.identity.peer_id.encode() in body for _, body in answers)
        assert 1 <= builds.count <= int(seconds / 1.0) + 1, (builds.count, seconds)
        nursery.cancel_scope.cancel()


async def test_a_flooding_connection_is_slowed_while_another_client_is_answered(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with trio.open_nursery() as nursery:
        _, port = await _node(nursery, tmp_path)
        flooder = _Client(port)
        answered = 0
        other: list[tuple[int, float]] = []

        async def flood() -> None:
            nonlocal answered
            for _ in range(60):
                status, _ = await flooder.get()
                assert status == 200
                answered += 1

        async def another_client() -> None:
            while answered < 20:  # the flooder has spent its burst and is being held back
                await trio.sleep(0.01)
            asked_at = trio.current_time()
            status, body = await _Client(port).get()
            other.append((status, trio.current_time() - asked_at))
            assert b'"peer_id"' in body

        started = trio.current_time()
        async with trio.open_nursery() as clients:
            clients.start_soon(flood)
            clients.start_soon(another_client)
        seconds = trio.current_time() - started
        # Today's server answered all 60 at once; now it reads the flooder's next request only when due.
        assert answered <= 20 + 20 * seconds, (answered, seconds)
        assert flooder.connects == 1  # slowed, not refused or cut off
        [(status, waited)] = other
        assert status == 200 and waited < 0.5  # answered at once while the flood goes on
        nursery.cancel_scope.cancel()


async def test_a_client_that_reconnects_for_every_request_is_held_too(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """Slowing a connection means nothing to a client that opens a new one each time: connections are
    accepted at a bounded rate."""
    async with trio.open_nursery() as nursery:
        _, port = await _node(nursery, tmp_path)
        client = _Client(port, headers=[("connection", "close")])
        started = trio.current_time()
        for _ in range(120):
            assert (await client.get("/health"))[0] == 200
        seconds = trio.current_time() - started
        assert client.connects == 120
        assert 50 + 50 * seconds >= 120, seconds
        nursery.cancel_scope.cancel()


async def test_connections_past_the_cap_wait_for_a_free_one(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with trio.open_nursery() as nursery:
        _, port = await _node(nursery, tmp_path)
        held = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(status_api.MAX_CONNECTIONS)]
        answer: list[int] = []

        async def late_client() -> None:
            answer.append((await _Client(port).get("/health"))[0])

        nursery.start_soon(late_client)
        await trio.sleep(status_api.REQUEST_TIMEOUT - 1)
        assert answer == []  # every slot is held: its connection waits in the kernel's queue
        await held[0].aclose()
        await trio.sleep(0.5)
        assert answer == [200]
        for stream in held[1:]:
            await stream.aclose()
        nursery.cancel_scope.cancel()


CROSS_SITE = [
    [("origin", "http://attacker.example")],
    [("origin", "null")],
    [("origin", "https://127.0.0.1:{port}")],
    [("origin", "http://127.0.0.1:{other}")],
    [("origin", "http://localhost:{other}")],
    [("sec-fetch-site", "cross-site")],
    [("sec-fetch-site", "same-site")],  # a page on another port of this machine
    [("sec-fetch-site", "same-origin"), ("origin", "http://attacker.example")],
    [("origin", "http://127.0.0.1:{port}"), ("sec-fetch-site", "cross-site")],
]
OWN = [
    [],
    [("sec-fetch-site", "none")],  # typed into the address bar
    [("origin", "http://127.0.0.1:{port}")],
    [("origin", "http://localhost:{port}"), ("sec-fetch-site", "same-origin")],
]


def _fill(headers: list[tuple[str, str]], port: int) -> list[tuple[str, str]]:
    return [(name, value.format(port=port, other=port + 1)) for name, value in headers]


async def test_requests_from_another_sites_page_are_refused_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = _Builds(monkeypatch)
    async with trio.open_nursery() as nursery:
        _, port = await _node(nursery, tmp_path)
        for headers in CROSS_SITE:
            for path in ("/status", "/metrics", "/health"):
                status, body = await _Client(port, _fill(headers, port)).get(path)
                assert status == 403, (headers, path, body[:80])
                assert b"peer_id" not in body
        assert builds.count == 0
        for headers in OWN:
            status, body = await _Client(port, _fill(headers, port)).get("/status")
            assert status == 200 and b'"peer_id"' in body, headers
        nursery.cancel_scope.cancel()


def _headers(pairs: list[tuple[str, str]]) -> Iterator[tuple[bytes, bytes]]:
    return ((name.encode(), value.encode()) for name, value in pairs)


@given(st.integers(1, 65535), st.text(min_size=1, max_size=40))
@example(
    port=80, origin="0"
)  # found in CI: at port 80 both http://127.0.0.1 and http://127.0.0.1:80 are ours
def test_only_the_apis_own_origin_passes(port: int, origin: str) -> None:
    value = origin.encode()
    refused = cross_site_refusal([(b"origin", value)], port) is not None
    assert refused == (value.strip().lower() not in own_origins(port))
    for host in ("127.0.0.1", "localhost", "[::1]"):
        assert cross_site_refusal(_headers([("origin", f"http://{host}:{port}")]), port) is None
        assert cross_site_refusal(_headers([("origin", f"http://{host}:{port % 65535 + 1}")]), port)


@given(st.sampled_from(["cross-site", "same-site", "same-origin", "none", "", "Cross-Site", "x"]))
def test_only_fetches_of_our_own_or_typed_by_the_user_pass(site: str) -> None:
    refused = cross_site_refusal([(b"sec-fetch-site", site.encode())], 8080) is not None
    assert refused == (site not in ("same-origin", "none"))
