"""The status API answers only requests addressed to a loopback name (DNS-rebinding defence)."""

from __future__ import annotations

from pathlib import Path

import trio
from hypothesis import given
from hypothesis import strategies as st

from prime_node.node.status_api import is_loopback_host
from prime_node.testing.memory_network import MemoryNetwork
from tests.p2p.helpers import make_config, start_node


async def _raw_get(url: str, host: bytes) -> bytes:
    port = int(url.rsplit(":", 1)[1])
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"GET /status HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n")
        received = b""
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):
                received += chunk
    return received


async def test_requests_for_other_host_names_are_refused_loopback_names_served(
    tmp_path: Path,
) -> None:
    network = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        node, _ = await start_node(nursery, network.host, make_config(tmp_path, 0, role="seeder"))
        assert node.api_url is not None
        port = node.api_url.rsplit(":", 1)[1].encode()
        for hostile in (b"attacker.example", b"attacker.example:" + port, b"127.0.0.1.attacker.example"):
            answer = await _raw_get(node.api_url, hostile)
            assert answer.startswith(b"HTTP/1.1 421"), answer[:80]
            assert b'"peer_id"' not in answer
        for own in (b"127.0.0.1:" + port, b"localhost:" + port, b"LOCALHOST", b"[::1]:" + port):
            answer = await _raw_get(node.api_url, own)
            assert answer.startswith(b"HTTP/1.1 200"), (own, answer[:80])
        nursery.cancel_scope.cancel()


@given(st.from_regex(rb"\A[a-z0-9.-]{1,30}(:[0-9]{1,5})?\Z"))
def test_only_the_three_loopback_names_pass(host: bytes) -> None:
    name = host.split(b":", 1)[0]
    assert is_loopback_host(host) == (name in (b"127.0.0.1", b"localhost"))
