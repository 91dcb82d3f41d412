"""The rich view of a node's status: identity, peers, gossip and byte rates, recent events."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from prime_node.errors import NodeError

_STATE_STYLE = {"healthy": "green", "unhealthy": "yellow", "dead": "red"}
_RATE_COUNTERS = (
    ("heartbeats in", "heartbeat_frames_in"),
    ("heartbeats out", "heartbeats_sent"),
    ("gossip in", "gossip_in"),
    ("gossip out", "gossip_out"),
)


def _short(text: str, keep: int = 10) -> str:
    return text if len(text) <= 2 * keep + 1 else f"{text[:keep]}…{text[-keep:]}"


def _rates(current: dict[str, Any], previous: dict[str, Any] | None, seconds: float) -> dict[str, str]:
    rates: dict[str, str] = {}
    for label, name in _RATE_COUNTERS:
        counters = current["counters"]
        if previous is None or seconds <= 0:
            rates[label] = f"{counters.get(name, 0)} total"
            continue
        before = previous["counters"]
        messages = (counters.get(name, 0) - before.get(name, 0)) / seconds
        size = (counters.get(name + "_bytes", 0) - before.get(name + "_bytes", 0)) / seconds
        rates[label] = f"{messages:.1f} msg/s  {size / 1024:.1f} KiB/s" if size else f"{messages:.1f} msg/s"
    return rates


def render(data: dict[str, Any], previous: dict[str, Any] | None = None, seconds: float = 0.0) -> Group:
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold")
    header.add_column()
    header.add_row("address", data["address"])
    header.add_row("peer id", data["peer_id"])
    header.add_row("role / run", f"{data['role']} / {data['run']}")
    header.add_row("uptime", f"{data['uptime_s']:.0f} s")
    header.add_row("listening", "\n".join(data["multiaddrs"]) or "-")
    header.add_row(
        "connections", f"{data['connected_peers']} (DHT routing table {data['routing_table_size']})"
    )
    for label, value in _rates(data, previous, seconds).items():
        header.add_row(label, value)
    if data["rejections"]:
        header.add_row("refused", ", ".join(f"{k}={v}" for k, v in data["rejections"].items()))

    peers = Table(title=f"peers ({len(data['peers'])})", expand=True)
    for column in ("address", "peer id", "role", "state", "score", "latency", "last heard", "load"):
        peers.add_column(column)
    for peer in data["peers"]:
        state = Text(
            peer["state"] + (" (banned)" if peer.get("banned") else ""),
            style=_STATE_STYLE.get(peer["state"], ""),
        )
        latency = "-" if peer.get("latency_ms") is None else f"{peer['latency_ms']} ms"
        peers.add_row(
            peer["address"],
            _short(peer["peer_id"], 6),
            peer["role"],
            state,
            f"{peer['score']:.0f}",
            latency,
            f"{peer['last_heard_s']:.1f} s ago",
            f"{peer['load_percent']}%",
        )
    events = Text(
        "\n".join(f"{e['at_s']:>8.1f}s  {e['kind']:<9} {e['text']}" for e in data["events"][-12:]) or "-"
    )
    return Group(Panel(header, title="prime-node"), peers, Panel(events, title="recent events"))


def print_once(data: dict[str, Any]) -> None:
    Console().print(render(data))


def live(url: str, interval: float) -> None:
    from rich.live import Live

    from prime_node.status.client import fetch_snapshot

    previous: dict[str, Any] | None = None
    previous_at = 0.0
    console = Console()
    with Live(console=console, refresh_per_second=4, screen=False) as view:
        while True:
            try:
                data = fetch_snapshot(url)
            except NodeError as exc:
                view.update(Panel(Text(str(exc), style="red"), title="prime-node"))
                time.sleep(interval)
                continue
            now = time.monotonic()
            view.update(render(data, previous, now - previous_at))
            previous, previous_at = data, now
            try:
                time.sleep(interval)
            except KeyboardInterrupt:
                return
