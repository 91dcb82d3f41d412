"""The status API over real HTTP on 127.0.0.1: JSON snapshot, Prometheus text, health summary, errors; and the
TUI render."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import trio
from rich.console import Console

from prime_node.errors import NodeError
from prime_node.node.context import NodeContext
from prime_node.status.client import fetch_snapshot, resolve_api_url
from prime_node.status.tui import render
from prime_node.testing.memory_network import MemoryNetwork
from tests.p2p.helpers import make_config, sees_all, start_node, wait_until


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


async def test_status_api_serves_snapshot_metrics_and_refuses_the_rest(tmp_path: Path) -> None:
    network = MemoryNetwork()
    async with trio.open_nursery() as nursery:
        a, _ = await start_node(nursery, network.host, make_config(tmp_path, 0, role="seeder"))
        b, _ = await start_node(
            nursery, network.host, make_config(tmp_path, 1, bootstrap=(a.host.listen_multiaddrs()[0],))
        )
        await wait_until(lambda: sees_all(a, [a, b]) and sees_all(b, [a, b]), timeout=20)
        assert a.api_url is not None and a.api_url.startswith("http://127.0.0.1:")
        assert resolve_api_url(None, a.config.data_dir) == a.api_url
        data = await trio.to_thread.run_sync(fetch_snapshot, a.api_url)
        assert data["address"] == a.identity.address and data["role"] == "seeder"
        [peer] = data["peers"]
        assert (peer["address"], peer["peer_id"], peer["state"]) == (
            b.identity.address,
            b.identity.peer_id,
            "healthy",
        )
        status, metrics = await trio.to_thread.run_sync(_get, a.api_url + "/metrics")
        assert status == 200
        assert 'prime_node_peers{state="healthy"} 1' in metrics
        assert "prime_node_up{" in metrics
        status, body = await trio.to_thread.run_sync(_get, a.api_url + "/health")
        summary = json.loads(body)
        assert status == 200 and summary["running"] and summary["peer_id"] == a.identity.peer_id
        assert summary["peers"] == {"healthy": 1, "unhealthy": 0, "dead": 0}
        assert summary["neighbours"]["healthy"] == (b.identity.peer_id in data["neighbours"])
        assert len(body) < 400  # what makes it cheap to poll: no per-peer detail
        assert (await trio.to_thread.run_sync(_get, a.api_url + "/nope"))[0] == 404
        console = Console(record=True, width=140)
        console.print(render(data))
        text = console.export_text()
        assert b.identity.address[:8] in text and "healthy" in text
        nursery.cancel_scope.cancel()
    stopped = json.loads((a.config.data_dir / "node.json").read_text())
    assert stopped["state"] == "stopped"
    with pytest.raises(NodeError, match="not running"):
        resolve_api_url(None, a.config.data_dir)


class _CountingService:
    """A node service that counts its own ticks and reports them as a status section."""

    def __init__(self) -> None:
        self.ticks = 0
        self.context_seen: NodeContext | None = None

    async def run(self, context: NodeContext, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        self.context_seen = context
        context.add_status_section("counting", lambda: {"ticks": self.ticks})
        context.add_status_section("broken", lambda: 1 // 0)
        task_status.started()
        while True:
            self.ticks += 1
            await trio.sleep(0.05)


async def test_services_run_inside_the_node_and_report_status_sections(tmp_path: Path) -> None:
    network = MemoryNetwork()
    service = _CountingService()
    async with trio.open_nursery() as nursery:
        node, scope = await start_node(nursery, network.host, make_config(tmp_path, 0), services=[service])
        assert service.context_seen is node.context
        await wait_until(lambda: service.ticks >= 3, timeout=10)
        assert node.api_url is not None
        data = await trio.to_thread.run_sync(fetch_snapshot, node.api_url)
        assert data["sections"]["counting"]["ticks"] >= 3
        assert data["sections"]["broken"] == {
            "error": "ZeroDivisionError: integer division or modulo by zero"
        }
        scope.cancel()
    ticks_at_stop = service.ticks
    await trio.sleep(0.2)
    assert service.ticks == ticks_at_stop
