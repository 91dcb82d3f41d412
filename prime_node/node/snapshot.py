"""The status snapshot: one JSON-ready dict describing a running node, its Prometheus form, and the short
health summary.

It reads the node through ``StatusSource``, the part of the Node it shows, so this module sits below
node/service.py (which starts the status API) instead of in a cycle with it. prime_node/status/ holds
what reads a snapshot (client, terminal views) and imports nothing from node/.
"""

from __future__ import annotations

from typing import Any, Protocol

from prime_node.node.context import NodeIdentity, StatusSection
from prime_node.node.metrics import NodeMetrics
from prime_node.node.peers import PeerPolicy
from prime_node.node_config import NodeConfig
from prime_node.p2p.interface import P2PHost
from prime_node.status.section_metrics import section_lines
from protocol.membership import Membership, PeerState
from protocol.peer_record import PeerRecord

SNAPSHOT_VERSION = 1


class StatusSource(Protocol):
    """What a status snapshot reads from a node (``prime_node.node.service.Node`` is one)."""

    @property
    def config(self) -> NodeConfig: ...
    @property
    def identity(self) -> NodeIdentity: ...
    @property
    def metrics(self) -> NodeMetrics: ...
    @property
    def membership(self) -> Membership[PeerRecord]: ...
    @property
    def host(self) -> P2PHost: ...
    @property
    def policy(self) -> PeerPolicy: ...
    @property
    def role(self) -> str: ...
    @property
    def is_running(self) -> bool: ...
    @property
    def api_url(self) -> str | None: ...
    @property
    def status_sections(self) -> dict[str, StatusSection]: ...
    def now(self) -> float: ...
    def uptime(self) -> float: ...
    def latency_ms(self, peer_id: str) -> int | None: ...
    def advertised_multiaddrs(self) -> list[str]: ...
    def neighbours(self) -> list[str]: ...


def snapshot(node: StatusSource) -> dict[str, Any]:
    running = node.is_running
    connected = set(node.host.connected_peers()) if running else set()
    neighbours = set(node.neighbours()) if running else set()
    peers = []
    for member in node.membership.members():
        record = member.record
        peers.append(
            {
                "address": str(record.address),
                "peer_id": member.peer_id,
                "state": member.state.value,
                "role": record.role,
                "connected": member.peer_id in connected,
                "neighbour": member.peer_id in neighbours,
                "score": round(node.policy.score(member.peer_id), 1) if running else 0.0,
                "banned": node.policy.is_banned(member.peer_id) if running else False,
                "latency_ms": node.latency_ms(member.peer_id),
                "last_heard_s": round(max(0.0, node.now() - member.last_heard), 2),
                "heartbeats": member.heartbeats,
                "multiaddrs": list(record.multiaddrs),
                "versions_held": list(record.versions_held),
                "load_percent": record.load_percent,
                "hardware": {
                    "cpu_cores": record.hardware.cpu_cores,
                    "ram_mib": record.hardware.ram_mib,
                    "gpu_count": record.hardware.gpu_count,
                    "gpu_vram_mib": record.hardware.gpu_vram_mib,
                    "device": record.hardware.device,
                },
                "software_version": record.software_version,
            }
        )
    banned = node.policy.scores.banned(node.now()) if running else []
    return {
        "version": SNAPSHOT_VERSION,
        "address": node.identity.address,
        "peer_id": node.identity.peer_id,
        "role": node.role,
        "run": node.config.run_id,
        "uptime_s": round(node.uptime(), 2),
        "multiaddrs": node.advertised_multiaddrs() if running else [],
        "api": node.api_url,
        "connected_peers": len(connected),
        "neighbours": sorted(neighbours),
        "routing_table_size": node.host.routing_table_size() if running else 0,
        "peers": peers,
        "banned": banned,
        "counters": dict(sorted(node.metrics.counters.items())),
        "rejections": dict(sorted(node.metrics.rejections.items())),
        "sections": _sections(node),
        "events": [
            {"at_s": round(e.at, 2), "kind": e.kind, "text": e.text} for e in list(node.metrics.events)[-30:]
        ],
    }


def health(node: StatusSource) -> dict[str, Any]:
    """A few hundred bytes for liveness checks and swarm-wide polling: whether the node runs and how many
    members (and neighbours) it holds in each state. ``snapshot`` builds ~40 KB for 63 peers, and the
    64-node discovery benchmark polling it ~3 times a second spent a tenth of every node's CPU on it."""
    running = node.is_running
    neighbours = set(node.neighbours()) if running else set()
    peers = {state.value: 0 for state in PeerState}
    linked = dict(peers)
    for member in node.membership.members():
        peers[member.state.value] += 1
        if member.peer_id in neighbours:
            linked[member.state.value] += 1
    return {
        "version": SNAPSHOT_VERSION,
        "running": running,
        "peer_id": node.identity.peer_id,
        "uptime_s": round(node.uptime(), 2),
        "peers": peers,
        "neighbours": linked,
    }


def _sections(node: StatusSource) -> dict[str, Any]:
    """What the node's services report (role, checkpoints, rollouts, ...); one failing section is shown as
    its error rather than breaking the whole snapshot."""
    sections: dict[str, Any] = {}
    for name, section in node.status_sections.items():
        try:
            sections[name] = section()
        except Exception as exc:  # a status page must not take the node down
            sections[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return sections


def prometheus_text(data: dict[str, Any]) -> str:
    """Prometheus text exposition (version 0.0.4) of a snapshot."""
    lines = [
        "# HELP prime_node_up 1 while the node runs.",
        "# TYPE prime_node_up gauge",
        f'prime_node_up{{address="{data["address"]}",role="{data["role"]}",run="{data["run"]}"}} 1',
        "# TYPE prime_node_uptime_seconds gauge",
        f"prime_node_uptime_seconds {data['uptime_s']}",
        "# TYPE prime_node_connected_peers gauge",
        f"prime_node_connected_peers {data['connected_peers']}",
        "# TYPE prime_node_peers gauge",
    ]
    states: dict[str, int] = {"healthy": 0, "unhealthy": 0, "dead": 0}
    for peer in data["peers"]:
        states[peer["state"]] = states.get(peer["state"], 0) + 1
    lines += [f'prime_node_peers{{state="{state}"}} {count}' for state, count in sorted(states.items())]
    lines.append("# TYPE prime_node_events_total counter")
    for name, value in data["counters"].items():
        lines.append(f'prime_node_events_total{{name="{name}"}} {value}')
    lines.append("# TYPE prime_node_rejections_total counter")
    for reason, value in data["rejections"].items():
        lines.append(f'prime_node_rejections_total{{reason="{reason}"}} {value}')
    lines += section_lines(data.get("sections"))
    return "\n".join(lines) + "\n"
