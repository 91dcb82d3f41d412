"""``port_check``: a port some socket listens on, SO_REUSEPORT or not, is refused; a free or closed one is
not (the process-level test, with the holder's pid named, is in test_cli_processes.py)."""

from __future__ import annotations

import socket

import pytest

from prime_node.errors import NodeError
from prime_node.p2p.port_check import ensure_port_free, listener_pid


@pytest.mark.parametrize("reuse_port", [True, False])
def test_a_listening_port_is_refused_even_when_its_listener_lets_others_share_it(reuse_port: bool) -> None:
    with socket.socket() as held:
        if reuse_port:  # what py-libp2p's listener sets, and why a second node could bind beside it
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(NodeError, match=f"port {port} is in use") as refused:
            ensure_port_free("127.0.0.1", port)
        assert refused.value.reason == "port_in_use"
        assert listener_pid(port) is None  # our own process is not named as someone else


def test_a_free_port_and_port_zero_pass() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ensure_port_free("127.0.0.1", port)
    ensure_port_free("127.0.0.1", 0)
