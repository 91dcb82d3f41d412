"""The rich view of a node's status: identity, rates, the services' sections, peers, recent events."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from prime_node.errors import NodeError
from prime_node.status.sections import section_rates, sections_view
from prime_node.status.values import as_dict, as_int, as_list, as_num, as_text, counts, short

_STATE_STYLE = {"healthy": "green", "unhealthy": "yellow", "dead": "red"}
_RATE_COUNTERS = (
    ("heartbeats in", "heartbeat_frames_in"),
    ("heartbeats out", "heartbeats_sent"),
    ("gossip in", "gossip_in"),
    ("gossip out", "gossip_out"),
)
MAX_PEER_ROWS = 200


def _rates(current: dict[str, Any], previous: dict[str, Any] | None, seconds: float) -> dict[str, str]:
    rates: dict[str, str] = {}
    counters = as_dict(current.get("counters"))
    before = as_dict(previous.get("counters")) if previous is not None else {}
    for label, name in _RATE_COUNTERS:
        total = as_num(counters.get(name)) or 0.0
        if previous is None or seconds <= 0:
            rates[label] = f"{total:.0f} total"
            continue
        messages = (total - (as_num(before.get(name)) or 0.0)) / seconds
        size = (
            (as_num(counters.get(name + "_bytes")) or 0.0) - (as_num(before.get(name + "_bytes")) or 0.0)
        ) / seconds
        rates[label] = f"{messages:.1f} msg/s  {size / 1024:.1f} KiB/s" if size else f"{messages:.1f} msg/s"
    return rates


def _peer_row(peer: dict[str, Any]) -> list[Text]:
    state = as_text(peer.get("state"), 16) or "?"
    latency = as_num(peer.get("latency_ms"))
    heard = as_num(peer.get("last_heard_s"))
    score = as_num(peer.get("score"))
    load = as_int(peer.get("load_percent"))
    return [
        Text(as_text(peer.get("address"), 42)),
        Text(short(as_text(peer.get("peer_id")), 6)),
        Text(as_text(peer.get("role"), 16)),
        Text(
            state
            + (" (banned)" if peer.get("banned") is True else "")
            + (" *" if peer.get("neighbour") is True else ""),
            style=_STATE_STYLE.get(state, ""),
        ),
        Text("-" if score is None else f"{score:.0f}"),
        Text("-" if latency is None else f"{latency:.0f} ms"),
        Text("-" if heard is None else f"{heard:.1f} s ago"),
        Text("-" if load is None else f"{load}%"),
    ]


def render(data: dict[str, Any], previous: dict[str, Any] | None = None, seconds: float = 0.0) -> Group:
    """The whole status page. Missing or malformed fields render as "-" or are left out; never raises."""
    data = as_dict(data)
    previous = as_dict(previous) if previous is not None else None
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold")
    header.add_column()
    header.add_row("address", Text(as_text(data.get("address"))))
    header.add_row("peer id", Text(as_text(data.get("peer_id"))))
    header.add_row("role / run", Text(f"{as_text(data.get('role'), 16)} / {as_text(data.get('run'), 64)}"))
    uptime = as_num(data.get("uptime_s"))
    header.add_row("uptime", "-" if uptime is None else f"{uptime:.0f} s")
    listening = [as_text(m, 200) for m in as_list(data.get("multiaddrs"))[:8]]
    header.add_row("listening", Text("\n".join(m for m in listening if m) or "-"))
    connected, table = as_int(data.get("connected_peers")) or 0, as_int(data.get("routing_table_size")) or 0
    header.add_row("connections", f"{connected} (DHT routing table {table})")
    neighbours = len(as_list(data.get("neighbours")))
    header.add_row("neighbours", f"{neighbours} (beats and peer records; the rest known from records)")
    for label, value in _rates(data, previous, seconds).items():
        header.add_row(label, value)
    sections = data.get("sections")
    rates = section_rates(sections, previous.get("sections") if previous else None, seconds)
    for label, value in rates.items():
        if not label.startswith("checkpoint"):
            header.add_row(label, value)
    refused = counts(data.get("rejections"))
    if refused:
        header.add_row("refused", Text(", ".join(f"{k}={v}" for k, v in refused.items())))

    peer_list = [as_dict(peer) for peer in as_list(data.get("peers"))[:MAX_PEER_ROWS]]
    peers = Table(title=f"peers ({len(as_list(data.get('peers')))}; * = neighbour)", expand=True)
    for column in ("address", "peer id", "role", "state", "score", "latency", "last heard", "load"):
        peers.add_column(column)
    for peer in peer_list:
        peers.add_row(*_peer_row(peer))
    lines = []
    for event in (as_dict(e) for e in as_list(data.get("events"))[-12:]):
        at = as_num(event.get("at_s")) or 0.0
        lines.append(f"{at:>8.1f}s  {as_text(event.get('kind'), 9):<9} {as_text(event.get('text'))}")
    events = Text("\n".join(lines) or "-")
    return Group(
        Panel(header, title="prime-node"),
        *sections_view(sections, rates),
        peers,
        Panel(events, title="recent events"),
    )


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
