"""What an idle joined node costs: N full nodes (libp2p host, DHT, gossip, heartbeats, the weight swarm's
``SwarmService``), each its own process on its own loopback address (127.42.0.1, .2, ...), started with
benchmarks/broadcast_support/service_peer.py, the objects ``prime-node join``/``share``/``fetch`` run.
Node 0 shares a small checkpoint, the others fetch it and keep seeding it, then nothing happens: after
``--settle`` seconds each process's CPU time (user + system, /proc/PID/stat) is measured over ``--window``
seconds.

Prints one JSON line: ``idle_cpu_share_of_one_core_per_node`` (mean and max over the nodes: CPU seconds
÷ window), the machine's busy share over the same window (load from other work shows there), and with
``--profile`` where node 1's CPU went (cProfile on the process clock over the window: cumulative time of
each long-running task, and the functions with most own time; profiling itself slows node 1 several
times over, so read it as shares), and with ``--spy`` where the other receivers' CPU went (py-spy
sampling them, non-blocking, merged: on-CPU samples grouped by the task they run in and by the innermost
function; cheap enough that their CPU shares stay comparable). ``node1_traffic_per_s``: node 1's own
counters (heartbeat frames, gossip messages, discovery rounds) per second over the window. Goal (issue
16): mean ≤ 0.01 for 16 nodes over 60 s.

    .venv/bin/python benchmarks/idle.py                     # 16 nodes, 60 s window (~2 min)
    .venv/bin/python benchmarks/idle.py --nodes 4 --window 20 --profile
    .venv/bin/python benchmarks/idle.py --heartbeat-interval 300 --spy   # the floor without heartbeats
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crypto.keys import WalletKey  # noqa: E402

PEER = ROOT / "benchmarks" / "broadcast_support" / "service_peer.py"
SPY = Path(sys.executable).parent / "py-spy"
READY_TIMEOUT = 120.0
CHECKPOINT_BYTES = 256 * 1024


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    events: list[dict[str, Any]] = field(default_factory=list)
    arrived: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            with contextlib.suppress(ValueError):
                event = json.loads(raw)
                if isinstance(event, dict):
                    with self.arrived:
                        self.events.append(event)
                        self.arrived.notify_all()

    def wait_event(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while True:
                for event in self.events:
                    if event.get("event") == name:
                        return event
                left = deadline - time.monotonic()
                if left <= 0 or self.popen.poll() is not None:
                    raise RuntimeError(f"{self.name}: no {name!r} event (exit {self.popen.poll()})")
                self.arrived.wait(min(left, 0.5))

    def tell(self, line: str) -> None:
        with contextlib.suppress(BrokenPipeError, OSError):
            assert self.popen.stdin is not None
            self.popen.stdin.write(line.encode() + b"\n")
            self.popen.stdin.flush()

    def end(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)


def process_seconds(pid: int) -> float:
    after = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(after[11]) + int(after[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def write_checkpoint(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    text = json.dumps(
        {"w": {"dtype": "U8", "shape": [CHECKPOINT_BYTES], "data_offsets": [0, CHECKPOINT_BYTES]}}
    )
    header = text.encode().ljust((len(text) + 7) // 8 * 8)
    payload = len(header).to_bytes(8, "little") + header + os.urandom(CHECKPOINT_BYTES)
    (directory / "model.safetensors").write_bytes(payload)


def node_counters(data_dir: Path) -> dict[str, float]:
    """The node's own counters (heartbeats, gossip, discovery rounds...) from its status API."""
    api = json.loads((data_dir / "node.json").read_text())["api"]
    with urllib.request.urlopen(f"{api}/status", timeout=10) as response:
        counters = json.loads(response.read())["counters"]
    return {name: float(value) for name, value in counters.items()}


def profiled_peer(out: str, argv: list[str]) -> None:
    """Run service_peer.py (``argv``) in this process; cProfile on CPU time between SIGUSR1 and SIGUSR2,
    the stats written to ``out`` at SIGUSR2."""
    import cProfile
    import runpy

    profiler = cProfile.Profile(time.process_time)

    def stop(*_: object) -> None:
        profiler.disable()
        profiler.dump_stats(out)

    signal.signal(signal.SIGUSR1, lambda *_: profiler.enable())
    signal.signal(signal.SIGUSR2, stop)
    sys.argv = [str(PEER), *argv]
    sys.path.insert(0, str(PEER.parent))
    runpy.run_path(str(PEER), run_name="__main__")


ROOTS = [  # (label, file, function): the long-running tasks an idle node has
    ("gossipsub: read RPCs", "libp2p/pubsub/pubsub.py", "continuously_read_stream"),
    ("gossipsub: send queue", "libp2p/pubsub/pubsub.py", "handle_sending_messages"),
    ("gossipsub: forward messages", "libp2p/pubsub/pubsub.py", "push_msg"),
    ("gossipsub: heartbeat", "libp2p/pubsub/gossipsub.py", "heartbeat"),
    ("gossipsub: GRAFT handling", "libp2p/pubsub/gossipsub.py", "handle_graft"),
    ("yamux: read frames", "libp2p/stream_muxer/yamux/yamux.py", "handle_incoming"),
    ("yamux: RTT pings", "libp2p/stream_muxer/yamux/yamux.py", "_measure_rtt_loop"),
    ("kademlia: find providers", "libp2p/kad_dht/kad_dht.py", "find_providers"),
    ("kademlia: refresh", "libp2p/kad_dht/kad_dht.py", "run"),
    ("node: heartbeat loop", "prime_node/node/service.py", "_heartbeat_loop"),
    ("node: membership loop", "prime_node/node/service.py", "_membership_loop"),
    ("node: discovery loop", "prime_node/node/service.py", "_discovery_loop"),
    ("node: direct heartbeats sent", "prime_node/node/heartbeats.py", "_send"),
    ("node: direct heartbeats served", "prime_node/node/heartbeats.py", "_serve"),
    ("swarm: transport streams (have/request)", "prime_node/swarm/transport.py", "_serve"),
    ("swarm: tick loop", "prime_node/swarm/service.py", "_tick_loop"),
    ("swarm: data plane links", "prime_node/dataplane/", "_serve"),
    ("trio: scheduler (epoll, run loop)", "trio/_core/_run.py", "unrolled_run"),
]


def profile_summary(path: Path, window: float, top: int) -> dict[str, Any]:
    """CPU seconds (process clock) by task root (cumulative) and the functions with most own time."""
    import pstats

    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    total = sum(entry[2] for entry in stats.values())
    roots: dict[str, float] = {}
    for (filename, _, name), entry in stats.items():
        for label, where, wanted in ROOTS:
            if name == wanted and where in filename:
                roots[label] = round(roots.get(label, 0.0) + entry[3] / window, 4)
    own = sorted(stats.items(), key=lambda item: -item[1][2])[:top]
    return {
        "profiled_cpu_share_of_one_core": round(total / window, 4),
        "by_task_cumulative_share": dict(sorted(roots.items(), key=lambda kv: -kv[1])),
        "top_own_time_share": [
            {
                "function": f"{name} ({_short_path(filename)}:{line})",
                "share": round(entry[2] / window, 4),
                "calls_per_s": round(entry[1] / window, 1),
            }
            for (filename, line, name), entry in own
        ],
    }


SPY_TASKS = [  # (label, frame substring): the outermost matching frame of a sample names its task
    ("gossipsub: heartbeat", "heartbeat (libp2p/pubsub/gossipsub.py"),
    ("gossipsub: read RPCs", "continuously_read_stream (libp2p/pubsub/pubsub.py"),
    ("gossipsub: send queue", "handle_sending_messages (libp2p/pubsub/pubsub.py"),
    ("yamux: read frames", "handle_incoming (libp2p/stream_muxer/yamux/yamux.py"),
    ("yamux: RTT pings", "_measure_rtt_loop (libp2p/stream_muxer/yamux/yamux.py"),
    ("yamux: stale-stream sweeper", "_stale_stream_sweeper (libp2p/stream_muxer/yamux/yamux.py"),
    ("kademlia", "libp2p/kad_dht/"),
    ("node: heartbeat loop", "_heartbeat_loop (prime_node/node/service.py"),
    ("node: membership loop", "_membership_loop (prime_node/node/service.py"),
    ("node: discovery loop", "_discovery_loop (prime_node/node/service.py"),
    ("node: direct heartbeats", "prime_node/node/heartbeats.py"),
    ("node: status API", "prime_node/node/api"),
    ("swarm: neighbours", "keep_neighbours (prime_node/swarm/neighbours.py"),
    ("swarm: tick loop", "_tick_loop (prime_node/swarm/service.py"),
    ("swarm: data plane channels", "prime_node/swarm/transport.py"),
    ("swarm: data plane channels", "prime_node/dataplane/"),
    ("trio: scheduler (epoll, timers)", "unrolled_run (trio/_core/_run.py"),
]


def spy_command(pid: int, seconds: float, out: Path) -> list[str]:
    """py-spy sampling ``pid`` at 50 Hz without pausing it, stacks written raw (collapsed) to ``out``."""
    return [str(SPY), "record", "--nonblocking", "--format", "raw", "--rate", "50",
            "--duration", str(int(seconds)), "--pid", str(pid), "--output", str(out)]  # fmt: skip


def spy_summary(paths: list[Path], top: int) -> dict[str, Any]:
    """py-spy raw stacks (``frame;frame;... count``, outermost first) of several nodes merged: the share of
    on-CPU samples by task (the first SPY_TASKS label any frame matches, innermost task wins) and by
    innermost function."""
    tasks: dict[str, int] = {}
    leaves: dict[str, int] = {}
    total = 0
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            stack, _, count_text = line.rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            count = int(count_text)
            frames = stack.split(";")
            total += count
            label = "other"
            for frame in reversed(frames):
                label = next((name for name, where in SPY_TASKS if where in frame), "")
                if label:
                    break
            label = label or "other"
            tasks[label] = tasks.get(label, 0) + count
            leaf = frames[-1]
            leaves[leaf] = leaves.get(leaf, 0) + count
    if not total:
        return {"samples": 0}
    return {
        "samples": total,
        "by_task_share_of_samples": {
            name: round(n / total, 3) for name, n in sorted(tasks.items(), key=lambda kv: -kv[1])
        },
        "top_innermost_share_of_samples": {
            name: round(n / total, 3) for name, n in sorted(leaves.items(), key=lambda kv: -kv[1])[:top]
        },
    }


def _short_path(filename: str) -> str:
    for marker in ("site-packages/", str(ROOT) + "/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    return filename


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--profiled-peer":
        profiled_peer(sys.argv[2], sys.argv[3:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--window", type=float, default=60.0)
    parser.add_argument("--settle", type=float, default=70.0, help="s after joining; past the DHT warm-up")
    parser.add_argument("--heartbeat-interval", type=float, default=2.0)
    parser.add_argument("--profile", action="store_true", help="cProfile (CPU clock) node 1 over the window")
    parser.add_argument("--spy", action="store_true", help="py-spy every receiver but node 1 over the window")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="idle-bench-"))
    procs: list[Proc] = []
    keys = [WalletKey.generate() for _ in range(args.nodes)]
    log = open(work / "nodes.log", "wb")  # noqa: SIM115  (closed in finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))

    stats_file = work / "node1.pstats"

    def launch(index: int, extra: list[str]) -> Proc:
        host = f"127.42.0.{index + 1}"
        wrap = [__file__, "--profiled-peer", str(stats_file)] if args.profile and index == 1 else [str(PEER)]
        argv = [sys.executable, *wrap, "--key-env", "IDLE_KEY", "--host", host,
                "--data-dir", str(work / f"n{index}"), "--heartbeat-interval", str(args.heartbeat_interval),
                *extra]  # fmt: skip
        env = dict(os.environ, IDLE_KEY=keys[index].secret.hex(), PYTHONPATH=str(ROOT))
        popen = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True
        )
        proc = Proc(f"n{index}", popen)
        procs.append(proc)
        return proc

    try:
        write_checkpoint(work / "checkpoint")
        origin = launch(0, ["--origin", str(work / "checkpoint")])
        shared = origin.wait_event("ready", READY_TIMEOUT)
        bootstrap = next(m for m in shared["multiaddrs"] if "/ip4/127.42.0.1/" in m)
        started = time.monotonic()
        for index in range(1, args.nodes):
            launch(index, ["--trainer", str(keys[0].address), "--bootstrap", bootstrap,
                           "--min-links", str(min(args.nodes - 1, 3)), "--link-wait", "60"])  # fmt: skip
        for proc in procs[1:]:
            proc.wait_event("ready", READY_TIMEOUT)
        for proc in procs[1:]:
            proc.tell(f"go {shared['manifest_id']}")
        for proc in procs[1:]:
            proc.wait_event("complete", READY_TIMEOUT)
        joined_s = time.monotonic() - started
        time.sleep(args.settle)

        profiled = procs[1].popen.pid if args.profile and args.nodes > 1 else None
        if profiled is not None:
            os.kill(profiled, signal.SIGUSR1)
        pids = [p.popen.pid for p in procs]
        counters_start = node_counters(work / "n1")
        cpu_start = {pid: process_seconds(pid) for pid in pids}
        spies = [
            subprocess.Popen(
                spy_command(proc.popen.pid, args.window, work / f"{proc.name}.spy"),
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
            for proc in (procs[2:] if args.spy else [])
        ]
        machine_start = machine_ticks()
        window_start = time.monotonic()
        time.sleep(args.window)
        wall = time.monotonic() - window_start
        if profiled is not None:
            os.kill(profiled, signal.SIGUSR2)
        counters_end = node_counters(work / "n1")
        shares = [(process_seconds(pid) - cpu_start[pid]) / wall for pid in pids]
        for spy in spies:
            spy.wait(timeout=60)
        machine_end = machine_ticks()
        alive = sum(1 for p in procs if p.popen.poll() is None)
        result: dict[str, Any] = {
            "benchmark": "idle",
            "nodes": args.nodes,
            "alive": alive,
            "window_s": round(wall, 1),
            "heartbeat_interval_s": args.heartbeat_interval,
            "joined_s": round(joined_s, 1),
            "idle_cpu_share_of_one_core_per_node": {
                "mean": round(sum(shares) / len(shares), 4),
                "max": round(max(shares), 4),
                "origin": round(shares[0], 4),
                "median": round(sorted(shares)[len(shares) // 2], 4),
                "mean_without_node1": round(sum(shares[:1] + shares[2:]) / max(1, len(shares) - 1), 4),
            },
            "all_nodes_share_of_one_core": round(sum(shares), 3),
            "machine_busy": round(
                (machine_end[0] - machine_start[0]) / max(1, machine_end[1] - machine_start[1]), 3
            ),
            "cores": os.cpu_count(),
            "node1_traffic_per_s": {
                name: round((counters_end[name] - counters_start.get(name, 0)) / wall, 2)
                for name in sorted(counters_end)
                if counters_end[name] != counters_start.get(name, 0)
            },
        }
        if profiled is not None:
            for _ in range(50):
                if stats_file.exists():
                    break
                time.sleep(0.1)
            time.sleep(0.5)
            result["profile_node1"] = profile_summary(stats_file, wall, 15)
        if spies:
            result["spy_nodes_2_on"] = spy_summary([work / f"{p.name}.spy" for p in procs[2:]], 25)
        print(json.dumps(result), flush=True)
    finally:
        for proc in procs:
            proc.tell("stop")
        for proc in procs:
            proc.end()
        log.close()
        if args.keep:
            print(f"work directory: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
