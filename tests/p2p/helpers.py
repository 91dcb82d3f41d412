"""Shared helpers for the p2p tests: start nodes on the memory network or on real libp2p hosts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import trio

from crypto.keys import WalletKey
from prime_node.node.service import HostOpener, Node
from prime_node.node_config import NodeConfig
from protocol.membership import PeerState


def make_config(tmp_path: Path, index: int, **overrides: object) -> NodeConfig:
    fields: dict[str, object] = {
        "listen": "/ip4/127.0.0.1/tcp/0",
        "data_dir": tmp_path / f"node{index}",
        "heartbeat_interval": 1.0,
        "run_id": "test",
        "discovery_interval": 2.0,
    }
    fields.update(overrides)
    return NodeConfig.model_validate(fields)


async def start_node(
    nursery: trio.Nursery,
    opener: HostOpener,
    config: NodeConfig,
    *,
    key: WalletKey | None = None,
    **kwargs: object,
) -> tuple[Node, trio.CancelScope]:
    """Start a node in its own cancel scope so a test can kill it alone."""
    node = Node(config, key or WalletKey.generate(), opener, **kwargs)  # type: ignore[arg-type]
    scope = trio.CancelScope()

    async def run(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        with scope:
            await node.run(task_status=task_status)

    await nursery.start(run)
    return node, scope


async def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.1) -> float:
    """Poll ``predicate`` on trio's clock; returns the time it took (to the microsecond: under the virtual
    clock, 30 polls of 0.1 s differ by 1.3e-15 from 3.0, which failed a "within 3 intervals" check in
    CI), or fails the test on timeout."""
    start = trio.current_time()
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(step)
        return round(trio.current_time() - start, 6)
    raise AssertionError(f"condition not met within {timeout} s")


def sees_all(node: Node, others: list[Node]) -> bool:
    healthy = set(node.peers_in(PeerState.HEALTHY))
    return all(o.identity.peer_id in healthy for o in others if o is not node)
