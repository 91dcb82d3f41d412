"""A libp2p service that fails under a running node stops the node with a clear error, not silently.

py-libp2p runs its services (pubsub, gossipsub, DHT, relay) under ``background_trio_service``: when one
fails, its nursery cancels the code running inside it, i.e. the whole node. Before, that cancellation
was taken for the node's own teardown: ``Node.run`` returned normally with its node file "stopped", while
the process lived on waiting for a signal, holding its sockets without reading them (its peers' writes
to it then blocked). Seen in the flood demo test with the go-yamux window-credit patch.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from crypto.keys import WalletKey
from prime_node.errors import NodeError, first_node_error
from prime_node.node.service import Node
from prime_node.p2p.libp2p_host import Libp2pHost, open_libp2p_host
from tests.p2p.helpers import make_config

KEY = WalletKey(bytes(31) + b"\x21")


async def _fail_inside(host: Libp2pHost) -> None:
    async def boom() -> None:
        raise RuntimeError("a pubsub task failed")

    host._pubsub.manager.run_task(boom)  # what a failing py-libp2p task does to its service


async def test_a_failing_libp2p_service_raises_out_of_the_host_context() -> None:
    with trio.fail_after(20), pytest.raises(NodeError) as failed:
        async with open_libp2p_host(KEY, "/ip4/127.0.0.1/tcp/0") as host:
            await _fail_inside(host)
            await trio.sleep_forever()
    assert failed.value.reason == "host_failed"
    assert "a pubsub task failed" in str(failed.value)


async def test_a_node_whose_host_fails_stops_with_that_error(tmp_path: Path) -> None:
    node = Node(make_config(tmp_path, 0), KEY, lambda key: open_libp2p_host(key, "/ip4/127.0.0.1/tcp/0"))
    with trio.fail_after(20), pytest.raises(BaseExceptionGroup) as failed:
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            assert isinstance(node.host, Libp2pHost)
            await _fail_inside(node.host)
            await trio.sleep_forever()  # the node's failure must end this, as an error
    error = first_node_error(failed.value)
    assert error is not None and error.reason == "host_failed"
    assert json.loads(node.node_file().read_text())["state"] == "stopped"


async def test_cancelling_the_node_from_outside_is_still_a_clean_stop(tmp_path: Path) -> None:
    node = Node(make_config(tmp_path, 1), KEY, lambda key: open_libp2p_host(key, "/ip4/127.0.0.1/tcp/0"))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(node.run)
            nursery.cancel_scope.cancel()
    assert not node.is_running


async def _victim(
    done: trio.Event,
    install: Callable[[Libp2pHost], None] = lambda host: None,
    task_status: Any = trio.TASK_STATUS_IGNORED,
) -> None:
    """A host (with ``install``'s handlers) that runs until cancelled, or until it fails: ``done`` is set
    when it ends either way."""
    try:
        async with open_libp2p_host(KEY, "/ip4/127.0.0.1/tcp/0") as host:
            install(host)
            task_status.started(host)
            await trio.sleep_forever()
    finally:
        done.set()


async def test_a_peer_sending_an_rpc_that_does_not_parse_loses_its_stream_not_our_host() -> None:
    """py-libp2p 0.8.1's pubsub stream handler lets a protobuf ``DecodeError`` escape, and that failed the
    whole host: any peer could stop any node with one malformed RPC. ``LeanPubsub`` contains it to the
    stream."""
    from libp2p.custom_types import TProtocol
    from libp2p.peer.id import ID

    from prime_node.p2p.libp2p_build import GOSSIPSUB_PROTOCOL

    victim_done = trio.Event()
    async with trio.open_nursery() as nursery:
        target: Libp2pHost = await nursery.start(_victim, victim_done)
        with trio.fail_after(20):
            async with open_libp2p_host(WalletKey(bytes(31) + b"\x22"), "/ip4/127.0.0.1/tcp/0") as attacker:
                await attacker.connect(target.listen_multiaddrs()[0] + f"/p2p/{target.peer_id}")
                raw = await attacker._host.new_stream(
                    ID.from_base58(target.peer_id), [TProtocol(GOSSIPSUB_PROTOCOL)]
                )
                garbage = b"\xff" * 8  # field 31, wire type 7: no protobuf message parses
                await raw.write(bytes([len(garbage)]) + garbage)
                await trio.sleep(2)
                assert not victim_done.is_set()
                # The victim still serves: a fresh stream of the same protocol opens.
                again = await attacker._host.new_stream(
                    ID.from_base58(target.peer_id), [TProtocol(GOSSIPSUB_PROTOCOL)]
                )
                await again.close()
        assert not victim_done.is_set()
        nursery.cancel_scope.cancel()


async def test_an_error_in_any_stream_handler_ends_that_stream_only() -> None:
    """The same for every protocol's handler, py-libp2p's and ours: contained in ``build_host``."""
    from libp2p.custom_types import TProtocol
    from libp2p.host.exceptions import StreamFailure
    from libp2p.peer.id import ID

    calls: list[str] = []

    async def failing(stream: object) -> None:
        calls.append("called")
        raise RuntimeError("a handler that fails on what the peer sent")

    victim_done = trio.Event()

    def install(host: Libp2pHost) -> None:
        host._host.set_stream_handler(TProtocol("/prime-node/test-failing/1"), failing)

    async with trio.open_nursery() as nursery:
        target: Libp2pHost = await nursery.start(_victim, victim_done, install)
        with trio.fail_after(20):
            async with open_libp2p_host(WalletKey(bytes(31) + b"\x23"), "/ip4/127.0.0.1/tcp/0") as peer:
                await peer.connect(target.listen_multiaddrs()[0] + f"/p2p/{target.peer_id}")
                for attempt in (1, 2):  # the victim handles the second stream as it did the first
                    # The victim resets the stream as its handler fails, possibly before our side has
                    # finished negotiating it: then opening it fails here, which is that reset.
                    with contextlib.suppress(StreamFailure):
                        await peer._host.new_stream(
                            ID.from_base58(target.peer_id), [TProtocol("/prime-node/test-failing/1")]
                        )
                    while len(calls) < attempt:
                        await trio.sleep(0.05)
                    await trio.sleep(0.5)
                    assert not victim_done.is_set()
        assert calls == ["called", "called"] and not victim_done.is_set()
        nursery.cancel_scope.cancel()
