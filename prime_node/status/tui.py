"""The rich view of a node's status: identity, rates, the services' sections, peers, recent events."""

from __future__ import annotations

import select
import sys
import termios
import time
import tty
from typing import Any

from rich.console import Console, Group, RenderableType
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


def _header(data: dict[str, Any], previous: dict[str, Any] | None, seconds: float) -> Panel:
    """Who the node is and its rates, folded into few rows so the sections fit an 80×24 terminal."""
    header = Table.grid(padding=(0, 2))
    header.add_column(style="bold", no_wrap=True)
    header.add_column(overflow="fold")
    header.add_row("address", Text(as_text(data.get("address"))))
    header.add_row("peer id", Text(as_text(data.get("peer_id"))))
    uptime = as_num(data.get("uptime_s"))
    header.add_row(
        "role / run",
        Text(
            f"{as_text(data.get('role'), 16)} / {as_text(data.get('run'), 64)}"
            + ("" if uptime is None else f" · up {uptime:.0f} s")
        ),
    )
    listening = [m for m in (as_text(m, 200) for m in as_list(data.get("multiaddrs"))[:8]) if m]
    more = f" (+{len(listening) - 1} more)" if len(listening) > 1 else ""
    header.add_row("listening", Text((listening[0] + more) if listening else "-"))
    connected, table = as_int(data.get("connected_peers")) or 0, as_int(data.get("routing_table_size")) or 0
    neighbours = len(as_list(data.get("neighbours")))
    header.add_row("connections", f"{connected} · DHT table {table} · {neighbours} neighbours")
    rates = _rates(data, previous, seconds)
    sections = data.get("sections")
    section = section_rates(sections, previous.get("sections") if previous else None, seconds)
    rates.update({label: value for label, value in section.items() if not label.startswith("checkpoint")})
    pairs = list(rates.items())
    for i in range(0, len(pairs), 2):
        row = "  ·  ".join(f"{label} {value}" for label, value in pairs[i : i + 2])
        header.add_row("rates" if i == 0 else "", Text(row))
    refused = counts(data.get("rejections"))
    if refused:
        header.add_row("refused", Text(", ".join(f"{k}={v}" for k, v in refused.items())))
    return Panel(header, title="prime-node")


def _peers(data: dict[str, Any], rows: int = MAX_PEER_ROWS) -> Table:
    every = as_list(data.get("peers"))
    shown = [as_dict(peer) for peer in every[: max(0, min(rows, MAX_PEER_ROWS))]]
    hidden = f", {len(every) - len(shown)} not shown" if len(every) > len(shown) else ""
    peers = Table(title=f"peers ({len(every)}{hidden}; * = neighbour)", expand=True)
    for column in ("address", "peer id", "role", "state", "score", "latency", "last heard", "load"):
        peers.add_column(column)
    for peer in shown:
        peers.add_row(*_peer_row(peer))
    return peers


def _events(data: dict[str, Any], rows: int = 12) -> Panel:
    lines = []
    for event in (as_dict(e) for e in as_list(data.get("events"))[-max(1, rows) :]):
        at = as_num(event.get("at_s")) or 0.0
        lines.append(f"{at:>8.1f}s  {as_text(event.get('kind'), 9):<9} {as_text(event.get('text'))}")
    return Panel(Text("\n".join(lines) or "-"), title="recent events")


PAGE_KEYS = "n/space next page · p previous · q quit"


def pages(
    data: dict[str, Any],
    previous: dict[str, Any] | None = None,
    seconds: float = 0.0,
    *,
    width: int = 80,
    height: int = 24,
) -> list[Group]:
    """The live view cut into pages that each fit a ``width`` × ``height`` terminal: the identity and the
    services' panels packed in order as they fit, then the peers, then the recent events; each page ends
    with a footer naming the keys. A single panel taller than a page gets a page of its own (cropped)."""
    data = as_dict(data)
    previous = as_dict(previous) if previous is not None else None
    sections = data.get("sections")
    rates = section_rates(sections, previous.get("sections") if previous else None, seconds)
    room = max(4, height - 1)  # the footer's row
    blocks: list[RenderableType] = [_header(data, previous, seconds), *sections_view(sections, rates)]
    blocks += [_peers(data, rows=room - 6), _events(data, rows=room - 2)]  # their borders and titles
    measure = Console(width=width, color_system=None)
    packed: list[list[RenderableType]] = [[]]
    used = 0
    for block in blocks:
        rows = len(measure.render_lines(block, measure.options.update(width=width), pad=False))
        if packed[-1] and used + rows > room:
            packed.append([])
            used = 0
        packed[-1].append(block)
        used += rows
    total = len(packed)
    return [
        Group(*page_blocks, Text(f"page {i + 1}/{total} · {PAGE_KEYS}", style="dim"))
        for i, page_blocks in enumerate(packed)
    ]


def render(data: dict[str, Any], previous: dict[str, Any] | None = None, seconds: float = 0.0) -> Group:
    """The whole status page (``status --once``: every page in one). Missing or malformed fields render as
    "-" or are left out; never raises."""
    data = as_dict(data)
    previous = as_dict(previous) if previous is not None else None
    sections = data.get("sections")
    rates = section_rates(sections, previous.get("sections") if previous else None, seconds)
    views = sections_view(sections, rates)
    return Group(_header(data, previous, seconds), *views, _peers(data), _events(data))


def print_once(data: dict[str, Any]) -> None:
    Console().print(render(data))


def live(url: str, interval: float) -> None:
    """Refresh every ``interval`` s; keys turn pages and ``q`` quits (when standard input is a terminal)."""
    from rich.live import Live

    from prime_node.status.client import fetch_snapshot

    previous: dict[str, Any] | None = None
    data: dict[str, Any] | None = None
    previous_at = data_at = next_fetch = 0.0
    number = 0
    console = Console()
    with _Keys() as keys, Live(console=console, refresh_per_second=4, screen=False) as view:
        while True:
            now = time.monotonic()
            if now >= next_fetch:
                try:
                    fresh = fetch_snapshot(url)
                except NodeError as exc:
                    view.update(Panel(Text(str(exc), style="red"), title="prime-node"))
                else:
                    previous, previous_at, data, data_at = data, data_at, fresh, now
                next_fetch = now + interval
            if data is not None:
                width, height = console.size
                shown = pages(data, previous, data_at - previous_at, width=width, height=height)
                number %= len(shown)
                view.update(shown[number])
            try:
                key = keys.read(max(0.0, next_fetch - time.monotonic()))
            except KeyboardInterrupt:
                return
            if key in ("q", "Q", "\x03"):
                return
            if key in ("n", " ", "\t"):
                number += 1
            elif key in ("p", "b"):
                number = max(0, number - 1)


class _Keys:
    """Single key presses from a terminal's standard input (cbreak mode, restored on exit); where standard
    input is not a terminal it only waits."""

    def __init__(self) -> None:
        self._saved: Any = None

    def __enter__(self) -> _Keys:
        if sys.stdin.isatty():
            self._saved = termios.tcgetattr(sys.stdin)
            tty.setcbreak(sys.stdin)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            termios.tcsetattr(sys.stdin, termios.TCSADRAIN, self._saved)

    def read(self, timeout: float) -> str:
        """A key pressed within ``timeout`` s, or "" when none was."""
        if self._saved is None:
            time.sleep(timeout)
            return ""
        ready, _, _ = select.select([sys.stdin], [], [], timeout)
        return sys.stdin.read(1) if ready else ""
