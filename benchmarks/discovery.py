"""Discovery time and heartbeat traffic of real `prime-node join` processes on loopback.

For each swarm size N (default 8, 16, 32): start one bootstrap node, then N-1 nodes that know only its
address, all as separate processes; measure the time from launching the N-1 joiners until every node's
status API lists every other node as healthy. Then, with the swarm formed, measure over a quiet window:
- heartbeat bytes per node per second (signed records sent + received on the direct heartbeat streams,
  from each node's own counters), gossip bytes (the lower-rate gossiped records, and anything else on
  gossip), and
- wire bytes per node per second (sent + received on the node processes' established TCP sockets,
  from ``ss -tinp``: includes libp2p's gossipsub forwarding and control traffic, Noise, yamux, DHT; the
  status API polls happen outside the window).

Prints one JSON line per N. The baseline in the same run is the heartbeat interval: ``formation_vs_heartbeat``
is the discovery time in heartbeat intervals (1 would be a node seen at its very first beat). On a
2-core machine N processes share the cores, so start-up (≈1.5 s of imports each) weighs on large N.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_HEARTBEAT_INTERVAL = 2.0
WINDOW = 10.0


def _join(data_dir: Path, bootstrap: str | None, interval: float) -> subprocess.Popen[bytes]:
    args = [
        sys.executable,
        "-m",
        "prime_node",
        "join",
        "--data-dir",
        str(data_dir),
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--run",
        "bench",
        "--heartbeat-interval",
        str(interval),
        "--new-wallet",
        "--no-password",
        "--light-kdf",
        "--bootstrap-timeout",
        "120",
    ]
    if bootstrap:
        args += ["--bootstrap", bootstrap]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _node_file(data_dir: Path, deadline: float) -> dict[str, Any]:
    path = data_dir / "node.json"
    while time.monotonic() < deadline:
        try:
            document: dict[str, Any] = json.loads(path.read_text())
            if document.get("state") == "running":
                return document
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{path} never showed a running node")


def _snapshot(api: str) -> dict[str, Any]:
    with urllib.request.urlopen(api + "/status", timeout=10) as response:
        data: dict[str, Any] = json.loads(response.read())
        return data


def _socket_bytes(pids: list[int]) -> int:
    """Bytes sent + received on the established TCP sockets of ``pids`` (from ``ss -tinp``)."""
    wanted = {str(p) for p in pids}
    out = subprocess.run(
        ["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    total, owner_matches = 0, False
    for line in out.splitlines():
        if "users:(" in line:
            owner_matches = bool(wanted & set(re.findall(r"pid=(\d+)", line)))
        elif owner_matches:
            for field in ("bytes_sent", "bytes_received"):
                found = re.search(rf"\b{field}:(\d+)", line)
                total += int(found.group(1)) if found else 0
    return total


def measure(n: int, timeout: float, interval: float = DEFAULT_HEARTBEAT_INTERVAL) -> dict[str, Any]:
    processes: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="prime-node-discovery-") as root:
        try:
            dirs = [Path(root) / f"node{i}" for i in range(n)]
            processes.append(_join(dirs[0], None, interval))
            boot = _node_file(dirs[0], time.monotonic() + 60)
            started = time.monotonic()
            processes += [_join(d, boot["multiaddrs"][0], interval) for d in dirs[1:]]
            apis = [boot["api"]] + [_node_file(d, started + timeout)["api"] for d in dirs[1:]]
            all_up = time.monotonic() - started
            formed_at = None
            while time.monotonic() - started < timeout:
                healthy = [sum(p["state"] == "healthy" for p in _snapshot(api)["peers"]) for api in apis]
                if all(h == n - 1 for h in healthy):
                    formed_at = time.monotonic() - started
                    break
                time.sleep(0.5)
            result: dict[str, Any] = {
                "benchmark": "discovery",
                "mode": "processes",
                "n": n,
                "heartbeat_interval_s": interval,
                "all_processes_listening_s": round(all_up, 2),
                "all_see_all_s": None if formed_at is None else round(formed_at, 2),
                "formation_vs_heartbeat": None if formed_at is None else round(formed_at / interval, 2),
            }
            if formed_at is None:
                result["healthy_peers_seen"] = healthy
                return result
            before = [_snapshot(api)["counters"] for api in apis]
            io_before = _socket_bytes([p.pid for p in processes])
            time.sleep(WINDOW)
            after = [_snapshot(api)["counters"] for api in apis]
            io_after = _socket_bytes([p.pid for p in processes])

            def rate(name: str) -> float:
                total: int = sum(a.get(name, 0) - b.get(name, 0) for a, b in zip(after, before, strict=True))
                return total / n / WINDOW

            result["heartbeat_bytes_per_s_per_node"] = round(
                rate("heartbeats_sent_bytes") + rate("heartbeat_frames_in_bytes"), 1
            )
            result["gossip_bytes_per_s_per_node"] = round(
                rate("gossip_out_bytes") + rate("gossip_in_bytes"), 1
            )
            result["heartbeats_received_per_s_per_node"] = round(rate("heartbeats_received"), 2)
            result["wire_bytes_per_s_per_node"] = round((io_after - io_before) / n / WINDOW, 1)
            return result
        finally:
            for process in processes:
                process.send_signal(signal.SIGTERM)
            for process in processes:
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--heartbeat-interval", type=float, default=DEFAULT_HEARTBEAT_INTERVAL)
    args = parser.parse_args()
    os.environ.setdefault("PRIME_NODE_LOG_LEVEL", "error")
    for n in args.sizes:
        print(json.dumps(measure(n, args.timeout, args.heartbeat_interval)), flush=True)


if __name__ == "__main__":
    main()
