"""``prime-node status`` reads a node's status API; what comes back is untrusted: a cut-short body, a
non-JSON body or an unexpected document is one NodeError, never a traceback."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import pytest

from prime_node.errors import NodeError
from prime_node.status.client import fetch_snapshot


def _serve_once(response: bytes) -> Iterator[str]:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        connection, _ = server.accept()
        with connection:
            connection.recv(65536)
            connection.sendall(response)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        thread.join(timeout=5)
        server.close()


@pytest.mark.parametrize(
    ("response", "reason"),
    [
        # A node too busy to finish writing its status (seen with 32 nodes on 2 cores): a cut-short body.
        (b'HTTP/1.1 200 OK\r\nContent-Length: 39280\r\n\r\n{"peers": [', "api_bad_response"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", "api_bad_response"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n[]", "api_bad_response"),
        (b"garbage that is not HTTP\r\n\r\n", "api_unreachable"),  # http.client's BadStatusLine
    ],
)
def test_a_broken_status_answer_is_one_node_error(response: bytes, reason: str) -> None:
    for url in _serve_once(response):
        with pytest.raises(NodeError) as raised:
            fetch_snapshot(url, timeout=5)
        assert raised.value.reason == reason
