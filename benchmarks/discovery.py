"""Discovery time and heartbeat traffic of real `prime-node join` processes on loopback.

For each swarm size N (default 8, 16, 32, 64): start one bootstrap node, then N-1 nodes that know only
its address, all as separate processes; measure the time until every node's status API lists every other
node as healthy, from launching the N-1 joiners (``all_see_all_s``) and from the moment the last of them
listens (``after_last_join_s``: what ``formation_vs_heartbeat`` divides by the interval; on one machine
start-up of N Python processes is most of the first figure). Then, with the swarm formed, measure over a
quiet window:
- heartbeat bytes per node per second (frames sent + received on the neighbour links, with the signed
  peer records they carry; from each node's own counters), gossip bytes, records received per second,
  and
- wire bytes per node per second (sent + received on the node processes' established TCP sockets,
  from ``ss -tinp``: includes libp2p's gossipsub forwarding and control traffic, Noise, yamux, DHT; the
  status API polls happen outside the window).

Next to the nodes-seeing-all curve, ``missing_peer_entries_after_last_join`` says why the others do not
(no record of the peer yet, a neighbour whose beats are late, a non-neighbour whose records are late,
dead), ``formation_cpu_s_per_node`` and ``machine_busy_during_formation`` say what the nodes spent from
the last join to formation (on 2 shared cores, formation cannot beat that work over the cores),
``bootstrap_busy_during_formation`` says how much of one core the bootstrap used then (every
joiner's first peer: the hot spot, if there is one), ``link_traffic_per_node_during_formation`` counts
the neighbour frames and peer records each node sent and received in that time,
``connections_per_node_at_formation`` counts each process's established TCP sockets, and
``neighbour_counters_at_formation`` sums the nodes' neighbour-link counters (opens that failed,
links lost without a ``bye``, links closed as silent), ``connections_per_node_by_kind`` splits the
connections by the listener they reach (libp2p, data plane, status API) and ``dht_provides_at_formation``
counts the DHT ``provide``s. Until formation the benchmark polls each node's ``/health`` summary (a few
hundred bytes; the full ``/status`` is ~40 KB at N = 64 and polling it took a tenth of every node's CPU):
``status_sweeps_during_formation`` and ``benchmark_cpu_s_during_formation`` (this process's own CPU,
which shares the cores) say what the polling cost. ``--keep DIR`` keeps every node's directory with an
info-level log; ``--stagger S`` launches the joiners S seconds apart, as a swarm grows, instead of all
at once.

Prints one JSON line per N. The baseline in the same run is the heartbeat interval: ``formation_vs_heartbeat``
is the formation time after the last join in heartbeat intervals (goal ≤ 3). Each node beats only to its
neighbours (8 by default), so heartbeat traffic per node should not grow with N; ``neighbours_mean`` and
``neighbours_max`` show the overlay's degree. On a 2-core machine N processes share the cores.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

DEFAULT_HEARTBEAT_INTERVAL = 2.0
WINDOW = 10.0
MAX_NODES = 256
LINK_TRAFFIC = ("heartbeats_sent", "heartbeat_frames_in", "records_sent", "records_in", "records_new")
"""Neighbour-link counters summed from the first sweep after the last join to formation (per node)."""


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
        # Every node dials from 127.0.0.1, so the others would count all of them as one host and admit
        # 16 (the Sybil bound per IP); on the internet each node has its own address.
        "--max-inbound-per-ip",
        str(MAX_NODES),
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
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / "stderr.log", "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)


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


def _snapshot(data_dir: Path, path: str = "/status") -> dict[str, Any]:
    """The node's status (or ``path``: ``/health`` while polling), from the API its node.json names now
    (reading it each time: a node that restarts its host, as a role switch does, writes a new one)."""
    for attempt in range(20):
        try:
            api = json.loads((data_dir / "node.json").read_text())["api"]
            with urllib.request.urlopen(api + path, timeout=10) as response:
                data: dict[str, Any] = json.loads(response.read())
                return data
        except (OSError, ValueError, KeyError, TypeError, http.client.HTTPException) as exc:
            if attempt == 19:
                tail = (data_dir / "stderr.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{data_dir.name} has no status API ({exc}):\n{tail}") from exc
            time.sleep(0.25)
    raise AssertionError("unreachable")


def _sockets(pids: list[int]) -> tuple[int, int]:
    """(established TCP sockets held by ``pids``, bytes sent + received on them), from ``ss -tinp``."""
    wanted = {str(p) for p in pids}
    out = subprocess.run(
        ["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True
    ).stdout
    held = total = 0
    owner_matches = False
    for line in out.splitlines():
        if "users:(" in line:
            owner_matches = bool(wanted & set(re.findall(r"pid=(\d+)", line)))
            held += owner_matches
        elif owner_matches:
            for field in ("bytes_sent", "bytes_received"):
                found = re.search(rf"\b{field}:(\d+)", line)
                total += int(found.group(1)) if found else 0
    return held, total


def _connection_kinds(pids: list[int], dirs: list[Path]) -> dict[str, float]:
    """The processes' established TCP connections per node, by the listener they reach (either end):
    ``libp2p`` (a node's multiaddr port), ``status_api``, ``dataplane`` (any other port a node listens
    on), ``other``."""
    kind_of_port: dict[int, str] = {}
    for line in _ss("-tlnpH"):
        owner = re.findall(r"pid=(\d+)", line)
        local = line.split()[3] if len(line.split()) > 3 else ""
        if owner and int(owner[0]) in pids and local.rsplit(":", 1)[-1].isdigit():
            kind_of_port[int(local.rsplit(":", 1)[-1])] = "dataplane"
    for d in dirs:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            document = json.loads((d / "node.json").read_text())
            for multiaddr in document["multiaddrs"]:
                kind_of_port[int(multiaddr.split("/tcp/")[1].split("/")[0])] = "libp2p"
            kind_of_port[int(str(document["api"]).rsplit(":", 1)[1].split("/")[0])] = "status_api"
    counts: dict[str, int] = {}
    for line in _ss("-tnpH", "state", "established"):
        owner = re.findall(r"pid=(\d+)", line)
        if not owner or int(owner[0]) not in pids:
            continue
        local, remote = (field.rsplit(":", 1)[-1] for field in line.split()[2:4])
        kind = kind_of_port.get(int(local)) or kind_of_port.get(int(remote)) or "other"
        counts[kind] = counts.get(kind, 0) + 1
    return {kind: round(count / len(pids), 1) for kind, count in sorted(counts.items())}


def _ss(*args: str) -> list[str]:
    return subprocess.run(["ss", *args], capture_output=True, text=True, check=True).stdout.splitlines()


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds the processes ``pids`` have used so far (/proc/PID/stat)."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot (/proc/stat)."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    return sum(values) - idle, sum(values)


def _per_node_growth(first: list[dict[str, int]], last: list[dict[str, int]], name: str) -> float:
    """How much counter ``name`` grew from ``first`` to ``last`` (one dict per node), per node."""
    return sum(b.get(name, 0) - a.get(name, 0) for a, b in zip(first, last, strict=True)) / len(last)


def _missing(summaries: list[dict[str, Any]], n: int) -> dict[str, int]:
    """Peer entries missing from the nodes that do not see all, by kind: ``unknown`` (no record of the
    peer yet), ``neighbour_unhealthy`` (a linked neighbour whose beats are late), ``unhealthy`` (a
    non-neighbour whose records are late), ``dead``; from the nodes' ``/health`` summaries."""
    kinds = {"unknown": 0, "neighbour_unhealthy": 0, "unhealthy": 0, "dead": 0}
    for summary in summaries:
        peers, neighbours = summary["peers"], summary["neighbours"]
        kinds["unknown"] += max(n - 1 - sum(peers.values()), 0)
        kinds["dead"] += peers["dead"]
        kinds["neighbour_unhealthy"] += neighbours["unhealthy"]
        kinds["unhealthy"] += peers["unhealthy"] - neighbours["unhealthy"]
    return kinds


def measure(
    n: int,
    timeout: float,
    interval: float = DEFAULT_HEARTBEAT_INTERVAL,
    keep: Path | None = None,
    stagger: float = 0.0,
) -> dict[str, Any]:
    """One swarm of ``n`` processes (module doc); ``keep``: leave the nodes' directories (logs) there;
    ``stagger``: launch the joiners this many seconds apart instead of all at once."""
    processes: list[subprocess.Popen[bytes]] = []
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    kept = contextlib.nullcontext(tempfile.mkdtemp(prefix=f"n{n}-", dir=keep)) if keep else None
    with kept or tempfile.TemporaryDirectory(prefix="prime-node-discovery-") as root:
        try:
            dirs = [Path(root) / f"node{i}" for i in range(n)]
            processes.append(_join(dirs[0], None, interval))
            boot = _node_file(dirs[0], time.monotonic() + 60)
            started = time.monotonic()
            for i, d in enumerate(dirs[1:]):
                if stagger and i:
                    time.sleep(max(0.0, started + i * stagger - time.monotonic()))
                processes.append(_join(d, boot["multiaddrs"][0], interval))
            for d in dirs[1:]:
                _node_file(d, started + timeout)
            all_up = time.monotonic() - started
            pids = [p.pid for p in processes]
            cpu_at_last_join, ticks_at_last_join = _cpu_seconds(pids), _machine_ticks()
            bootstrap_at_last_join = _cpu_seconds(pids[:1])
            own_cpu_at_last_join = time.process_time()
            sweeps = 0
            cpu_at_formation, ticks_at_formation = cpu_at_last_join, ticks_at_last_join
            bootstrap_at_formation = bootstrap_at_last_join
            healthy: list[int] = []
            formed_at = None
            progress: list[tuple[float, int]] = []  # (seconds after the last join, nodes that see all)
            missing: list[tuple[float, dict[str, int]]] = []  # why the others do not, at the same times
            first_counters: list[dict[str, int]] | None = None  # at the first sweep after the last join
            with ThreadPoolExecutor(max_workers=16) as pool:  # one sweep must not take longer than a beat
                while time.monotonic() - started < timeout:
                    dead = [i for i, p in enumerate(processes) if p.poll() is not None]
                    if dead:
                        tail = (dirs[dead[0]] / "stderr.log").read_text(errors="replace")[-2000:]
                        raise RuntimeError(
                            f"node {dead[0]} exited ({processes[dead[0]].returncode}):\n{tail}"
                        )
                    swept_at = time.monotonic() - started
                    summaries = list(pool.map(lambda d: _snapshot(d, "/health"), dirs))
                    sweeps += 1
                    if first_counters is None:
                        first_counters = [snap["counters"] for snap in pool.map(_snapshot, dirs)]
                    healthy = [summary["peers"]["healthy"] for summary in summaries]
                    complete = sum(h == n - 1 for h in healthy)
                    if not progress or progress[-1][1] != complete:
                        progress.append((round(swept_at - all_up, 1), complete))
                        missing.append((round(swept_at - all_up, 1), _missing(summaries, n)))
                    if complete == n:
                        formed_at = swept_at
                        cpu_at_formation, ticks_at_formation = _cpu_seconds(pids), _machine_ticks()
                        bootstrap_at_formation = _cpu_seconds(pids[:1])
                        break
                    time.sleep(0.25)
            result: dict[str, Any] = {
                "benchmark": "discovery",
                "mode": "processes",
                "n": n,
                "heartbeat_interval_s": interval,
                "stagger_s": stagger,
                "all_processes_listening_s": round(all_up, 2),
                "all_see_all_s": None if formed_at is None else round(formed_at, 2),
                "nodes_seeing_all_after_last_join": progress[-12:],
                "missing_peer_entries_after_last_join": missing[-12:],
                "after_last_join_s": None if formed_at is None else round(formed_at - all_up, 2),
                "formation_vs_heartbeat": (
                    None if formed_at is None else round((formed_at - all_up) / interval, 2)
                ),
            }
            if formed_at is None:
                result["healthy_peers_seen"] = healthy
                worst = min(range(n), key=healthy.__getitem__)
                log_tail = (dirs[worst] / "stderr.log").read_text(errors="replace")[-1500:]
                result["worst_node_log_tail"] = log_tail
                return result
            # What the nodes spent between the last join and formation (the benchmark's status polls
            # included): on a saturated machine formation cannot be faster than this work over the cores.
            busy = ticks_at_formation[0] - ticks_at_last_join[0]
            result["formation_cpu_s_per_node"] = round((cpu_at_formation - cpu_at_last_join) / n, 3)
            # The bootstrap is every joiner's first peer; one process can use one core at most.
            result["bootstrap_busy_during_formation"] = round(
                (bootstrap_at_formation - bootstrap_at_last_join) / max(formed_at - all_up, 1e-9), 3
            )
            result["status_sweeps_during_formation"] = sweeps
            result["benchmark_cpu_s_during_formation"] = round(time.process_time() - own_cpu_at_last_join, 2)
            result["machine_busy_during_formation"] = round(
                busy / max(ticks_at_formation[1] - ticks_at_last_join[1], 1), 3
            )
            before = [_snapshot(d)["counters"] for d in dirs]
            result["neighbour_counters_at_formation"] = {
                name: sum(c.get(name, 0) for c in before)
                for name in sorted({k for c in before for k in c if k.startswith("neighbour")})
            }
            result["dht_provides_at_formation"] = sum(c.get("dht_provides", 0) for c in before)
            assert first_counters is not None  # formation is seen in a sweep, the first one at the latest
            result["link_traffic_per_node_during_formation"] = {
                name: round(_per_node_growth(first_counters, before, name), 1) for name in LINK_TRAFFIC
            }
            connections, io_before = _sockets(pids)
            result["connections_per_node_at_formation"] = round(connections / n, 1)
            result["connections_per_node_by_kind"] = _connection_kinds(pids, dirs)
            time.sleep(WINDOW)
            after = [_snapshot(d)["counters"] for d in dirs]
            io_after = _sockets(pids)[1]

            def rate(name: str) -> float:
                return _per_node_growth(before, after, name) / WINDOW

            result["heartbeat_bytes_per_s_per_node"] = round(
                rate("heartbeats_sent_bytes") + rate("heartbeat_frames_in_bytes"), 1
            )
            result["gossip_bytes_per_s_per_node"] = round(
                rate("gossip_out_bytes") + rate("gossip_in_bytes"), 1
            )
            result["heartbeats_received_per_s_per_node"] = round(rate("heartbeats_received"), 2)
            result["wire_bytes_per_s_per_node"] = round((io_after - io_before) / n / WINDOW, 1)
            result["records_received_per_s_per_node"] = round(rate("records_in"), 2)
            degrees = [len(_snapshot(d).get("neighbours", [])) for d in dirs]
            result["neighbours_mean"] = round(sum(degrees) / n, 1)
            result["neighbours_max"] = max(degrees)
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
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.add_argument("--timeout", type=float, default=180.0)
    parser.add_argument("--heartbeat-interval", type=float, default=DEFAULT_HEARTBEAT_INTERVAL)
    parser.add_argument("--keep", type=Path, default=None, help="keep the nodes' directories, info logs")
    parser.add_argument("--stagger", type=float, default=0.0, help="launch the joiners this many s apart "
                        "(default: all at once; on one machine their start-ups then pile up)")  # fmt: skip
    args = parser.parse_args()
    os.environ.setdefault("PRIME_NODE_LOG_LEVEL", "info" if args.keep else "error")
    for n in args.sizes:
        result = measure(n, args.timeout, args.heartbeat_interval, args.keep, args.stagger)
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
