"""Checkpoint broadcast over real, capped links: 16 peer processes, each in its own network namespace with
its upload (and download) shaped by ``tc tbf``; one peer (the origin) holds a ≥ 256 MB Hugging
Face-format checkpoint and the others fetch it through the weight swarm. Then, in the same run, the same
checkpoint through a one-tier origin: receivers do not re-serve, every one downloads straight from the
origin.

Prints one JSON line. ``ratio_to_bound`` = broadcast time / T*, where T* = max(F/u_s, F/d_min,
N·F/(u_s + Σu_i)) from the configured caps (F bytes, u_s origin upload, u_i receivers' uploads, d_min the
slowest receiver download, N receivers). Broadcast time runs from the moment the receivers are told to
start (they are already running and listening, and have settled: see ``settle``, so interpreter start-up
is not counted) to the moment the last receiver has verified and stored every piece. Goal: ≤ 1.15.

Before the broadcast the shaping itself is checked with plain TCP between two namespaces (one sender:
its upload cap; several senders into one receiver: the download cap), and CPU use is sampled during each
phase (machine-wide from /proc/stat, and the peers' own CPU time), so a run limited by the 2 cores rather
than by the links says so. After the swarm phase the same bytes (F to every receiver) cross the same links
over plain TCP (``tcp_mesh``, ``--skip-tcp`` leaves it out): its CPU per GB delivered is what the kernel,
veth and tc cost here, and ``cpu_ratio_to_tcp_peers``/``_machine`` say how far above that floor we are.
Then once more with every receiver writing what it gets into a file beside the swarm's stores
(``tcp_mesh_store``, ``cpu_ratio_to_tcp_store_*``): the floor for a broadcast that keeps the checkpoint.

Peers (``--impl``): ``service`` (default) runs benchmarks/broadcast_support/service_peer.py: a full node
(libp2p host, DHT, gossip, heartbeats) with ``SwarmService``, the objects ``prime-node share``/``fetch``
run, finding its data-plane neighbours through the node's membership; it keeps seeding after it completes.
Its broadcast time ends when every piece is verified and stored (``written_s``: also the directory
written). ``direct`` runs direct_peer.py: the same swarm state machine, piece store and data plane on a
fixed full mesh, without libp2p. The one-tier baseline (``--one-tier-impl``, default ``direct``) is a
plain seeder origin (no super-seeding) with receivers that dial only it and serve nobody.

What a user would pick instead, in the same run (``--skip-libtorrent``, ``--skip-cold`` leave them out):
libtorrent (benchmarks/broadcast_support/torrent_peer.py, the ``bench`` extra: one plain seeder, the same
receivers, a .torrent of the same directory with the same piece size, no DHT/LSD/UPnP/trackers, every peer
given explicitly, TCP only) timed like the swarm phase (``libtorrent_s``, ``ratio_to_libtorrent`` = ours ÷
theirs); then ``prime-node share`` and 15 ``prime-node fetch`` processes started cold (imports, keystore
unlock, libp2p start, discovery, data; ``cold_s`` from the fetches' launch to the last directory written,
each fetch's ``phases``), and libtorrent receivers started cold the same way (``cold_ratio_to_libtorrent``).
``origin_upload_copies`` = bytes on the origin's link ÷ F; ``origin_super_seeding.first_pass_s`` = when the
origin had sent every piece once.

    .venv/bin/python benchmarks/broadcast.py                      # 16 peers, 256 MB, 20 MB/s up (~5 min)
    .venv/bin/python benchmarks/broadcast.py --size-mb 128 --upload-mbps 5 --skip-one-tier   # issue 15
    .venv/bin/python benchmarks/broadcast.py --upload-mbps 5 --skip-one-tier

Rates are in MB/s (10^6 bytes per second), as everywhere in docs/benchmarks.md. Needs root (network
namespaces); without it the line says ``"skipped"``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prime_node.testing.netns import Lab, NetPeer  # noqa: E402

SUPPORT = ROOT / "benchmarks" / "broadcast_support"
MB = 1_000_000
DATA_PORT = 7400
PROBE_PORT = 7500
TORRENT_PORT = 7600
P2P_PORT = 4001
PASSWORD_ENV = "BROADCAST_KEYSTORE_PASSWORD"
SHARDS = 4
READY_TIMEOUT = 120.0
STOP_TIMEOUT = 15.0
PROBE_SECONDS = 3.0
IDLE_WINDOW = 3.0
SETTLE_LIMIT = 40.0
SETTLE_SHARE = 0.3
"""Peers are settled once, over one second, all of them together use less than this share of the machine:
a swarm that has just formed still passes records and finishes start-up for several seconds after every
peer said ``ready``, and a checkpoint of a running swarm is not broadcast into that."""
SAMPLE_INTERVAL = 0.5
TCP_MESH_SENDERS = 4
"""The plain-TCP baseline: each receiver gets a 1/TCP_MESH_SENDERS share of F from each of that many peers."""


# --------------------------------------------------------------------------------------------------------
# The bound


def bound_seconds(
    size: int, origin_up: float, uploads: list[float], downloads: list[float | None]
) -> tuple[float, str]:
    """T* = max(F/u_s, F/d_min, N·F/(u_s + Σu_i)) and which term binds. A None download is uncapped."""
    n = len(uploads)
    terms = {
        "origin_upload": size / origin_up,
        "total_upload": n * size / (origin_up + sum(uploads)),
    }
    capped = [d for d in downloads if d]
    if capped:
        terms["slowest_download"] = size / min(capped)
    which = max(terms, key=lambda k: terms[k])
    return terms[which], which


# --------------------------------------------------------------------------------------------------------
# Processes: started in their own session, read line by line, always ended


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    events: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    arrived: threading.Condition = field(init=False)

    def __post_init__(self) -> None:
        self.arrived = threading.Condition(self.lock)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            now = time.monotonic()
            try:
                event = json.loads(raw)
            except ValueError:
                continue
            if isinstance(event, dict):
                with self.arrived:
                    self.events.append((now, event))
                    self.arrived.notify_all()

    def wait_event(self, name: str, deadline: float) -> tuple[float, dict[str, Any]] | None:
        return self.wait_for(lambda event: event.get("event") == name, deadline)

    def wait_for(
        self, match: Callable[[dict[str, Any]], bool], deadline: float
    ) -> tuple[float, dict[str, Any]] | None:
        """The first JSON line ``match`` accepts, with its arrival time; None at the deadline or exit."""
        with self.arrived:
            while True:
                for when, event in self.events:
                    if match(event):
                        return when, event
                left = deadline - time.monotonic()
                if left <= 0 or self.popen.poll() is not None:
                    return None
                self.arrived.wait(min(left, 0.5))

    def tell(self, line: str) -> None:
        try:
            assert self.popen.stdin is not None
            self.popen.stdin.write(line.encode() + b"\n")
            self.popen.stdin.flush()
        except (BrokenPipeError, OSError):
            pass

    def end(self) -> None:
        """SIGTERM the process group, then SIGKILL after a grace period."""
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout=5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=5)


def start(lab: Lab, peer: NetPeer, argv: list[str], env: dict[str, str], log: Path, name: str) -> Proc:
    popen = subprocess.Popen(
        lab.exec_args(peer, argv),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=log.open("ab"),
        env=env,
        start_new_session=True,
    )
    return Proc(name, popen)


def tail(path: Path, lines: int = 5) -> str:
    """The last lines of a log, bootstrap retries left out (they say only that a node started early)."""
    try:
        text = path.read_text(errors="replace").strip().splitlines()
        return " | ".join([line for line in text if "unreachable (retrying" not in line][-lines:])
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------------
# CPU: machine-wide busy share, and the peer processes' own CPU seconds


def _machine_ticks() -> tuple[int, int]:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _process_seconds(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    after = stat.rsplit(")", 1)[1].split()
    return (int(after[11]) + int(after[12])) / os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """Samples /proc every SAMPLE_INTERVAL seconds while running, for the phase it brackets."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.busy: list[float] = []
        self.peak_process: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> CpuSampler:
        self.started = time.monotonic()
        self.machine_start = _machine_ticks()
        self.process_start = {pid: _process_seconds(pid) for pid in self.pids}
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self) -> None:
        previous = _machine_ticks()
        while not self._stop.wait(SAMPLE_INTERVAL):
            current = _machine_ticks()
            total = current[1] - previous[1]
            if total > 0:
                self.busy.append((current[0] - previous[0]) / total)
            previous = current
            for pid in self.pids:
                self.peak_process[pid] = _process_seconds(pid)

    def stop(self) -> dict[str, Any]:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(5)
            self.wall = time.monotonic() - self.started
            busy_end, total_end = _machine_ticks()
            self.machine_busy = (busy_end - self.machine_start[0]) / max(1, total_end - self.machine_start[1])
            for pid in self.pids:
                now = _process_seconds(pid)
                self.peak_process[pid] = max(now, self.peak_process.get(pid, 0.0))
        cores = os.cpu_count() or 1
        peers_cpu = sum(self.peak_process[pid] - self.process_start[pid] for pid in self.pids)
        ordered = sorted(self.busy)
        return {
            "machine_busy": round(self.machine_busy, 3),
            "machine_busy_p90": round(ordered[int(0.9 * (len(ordered) - 1))], 3) if ordered else None,
            "peers_cpu_s": round(peers_cpu, 2),
            "peers_share_of_machine": round(peers_cpu / (self.wall * cores), 3),
            "machine_cpu_s": round(self.machine_busy * self.wall * cores, 2),
            "cores": cores,
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
        }


def cpu_per_gb(cpu: dict[str, Any], delivered: int) -> dict[str, float]:
    """Peers' and the whole machine's CPU-seconds per GB delivered in one phase."""
    return {
        "peers_cpu_s_per_gb_delivered": round(cpu["peers_cpu_s"] / (delivered / 1e9), 2),
        "machine_cpu_s_per_gb_delivered": round(cpu["machine_cpu_s"] / (delivered / 1e9), 2),
    }


def settle(pids: list[int]) -> float:
    """Wait (at most SETTLE_LIMIT) until the peers together use under SETTLE_SHARE of the machine for one
    second; the seconds waited."""
    began = time.monotonic()
    limit = SETTLE_SHARE * (os.cpu_count() or 1)
    before = sum(_process_seconds(pid) for pid in pids)
    while time.monotonic() - began < SETTLE_LIMIT:
        time.sleep(1.0)
        now = sum(_process_seconds(pid) for pid in pids)
        if now - before < limit:
            break
        before = now
    return time.monotonic() - began


# --------------------------------------------------------------------------------------------------------
# The checkpoint


def write_checkpoint(directory: Path, size: int) -> None:
    """A Hugging Face-format directory: config.json, tokenizer.json and SHARDS valid safetensors files of
    random bytes (one U8 tensor each), ``size`` bytes in all. Random so nothing compresses or dedups."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64}))
    (directory / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    overhead = sum(p.stat().st_size for p in directory.iterdir())
    left = size - overhead
    for shard in range(SHARDS):
        header = b""
        body = left // (SHARDS - shard)
        for _ in range(2):  # the header's length depends on the body's, which depends on the header's
            tensor = body - 8 - len(header)
            text = json.dumps({"w": {"dtype": "U8", "shape": [tensor], "data_offsets": [0, tensor]}})
            header = text.encode().ljust((len(text) + 7) // 8 * 8)
        tensor = body - 8 - len(header)
        with open(directory / f"model-{shard + 1:05d}-of-{SHARDS:05d}.safetensors", "wb") as out:
            out.write(len(header).to_bytes(8, "little") + header)
            for offset in range(0, tensor, 16 * MB):
                out.write(os.urandom(min(16 * MB, tensor - offset)))
        left -= body


def choose_workdir(needed: int, preferred: str | None) -> Path:
    """tmpfs if memory allows (the peers' disks must not be the bottleneck), else the system temp dir."""
    candidates = [preferred] if preferred else ["/dev/shm", tempfile.gettempdir()]
    for candidate in candidates:
        if not candidate or not os.path.isdir(candidate):
            continue
        free = shutil.disk_usage(candidate).free
        if candidate == "/dev/shm":
            available = _mem_available()
            free = min(free, available - 2 * (1 << 30))  # leave others 2 GiB of memory
        if free > needed:
            return Path(tempfile.mkdtemp(prefix="prime-node-broadcast-", dir=candidate))
    raise SystemExit(f"error: no directory with {needed / 1e9:.1f} GB free (tried {candidates})")


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


# --------------------------------------------------------------------------------------------------------
# Shaping check


def probe(lab: Lab, receiver: NetPeer, senders: list[NetPeer], per_sender: int, log: Path) -> float:
    """Payload bytes/s into ``receiver`` from ``senders`` at once, measured by the receiver."""
    python = sys.executable
    script = str(SUPPORT / "tcp_probe.py")
    recv = start(lab, receiver, [python, script, "recv", receiver.address, str(PROBE_PORT),
                                 str(len(senders))], dict(os.environ), log, "probe-recv")  # fmt: skip
    procs = [recv]
    try:
        if recv.wait_event("ready", time.monotonic() + 30) is None:
            raise RuntimeError(f"probe receiver did not start: {tail(log)}")
        for sender in senders:
            argv = [python, script, "send", receiver.address, str(PROBE_PORT), str(per_sender)]
            procs.append(start(lab, sender, argv, dict(os.environ), log, "probe-send"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and recv.popen.poll() is None:
            time.sleep(0.1)
        for _, event in recv.events:
            if "bytes_per_s" in event:
                return float(event["bytes_per_s"])
        raise RuntimeError(f"probe gave no result: {tail(log)}")
    finally:
        for proc in procs:
            proc.end()


def check_shaping(lab: Lab, upload: float, download: float | None, log: Path) -> dict[str, Any]:
    a, b = lab.peers[1], lab.peers[2 if len(lab.peers) > 2 else 0]
    measured_up = probe(lab, b, [a], int(upload * PROBE_SECONDS), log)
    result: dict[str, Any] = {
        "upload_configured_mb_s": round(upload / MB, 2),
        "upload_measured_mb_s": round(measured_up / MB, 2),
        "upload_measured_over_configured": round(measured_up / upload, 3),
    }
    if download:
        senders = max(2, int(download / upload) + 2)
        senders = min(senders, len(lab.peers) - 1)
        group = [p for p in lab.peers if p is not b and p.index != 0][:senders]
        if len(group) * upload > download * 1.2:
            measured_down = probe(lab, b, group, int(download * PROBE_SECONDS / len(group)), log)
            result |= {
                "download_configured_mb_s": round(download / MB, 2),
                "download_measured_mb_s": round(measured_down / MB, 2),
                "download_measured_over_configured": round(measured_down / download, 3),
                "download_probe_senders": len(group),
            }
    return result


# --------------------------------------------------------------------------------------------------------
# One broadcast phase


@dataclass(frozen=True)
class Setup:
    lab: Lab
    work: Path
    checkpoint: Path
    manifest_file: Path
    keys: list[str]
    addresses: list[str]
    timeout: float
    impl: str
    size: int
    heartbeat_interval: float
    min_links: int
    no_super_seed: bool
    piece_size: int | None
    piece_bytes: int = 0
    torrent_file: Path | None = None
    keystores: list[Path] = field(default_factory=list)
    fetch_seed_until: str = "swarm"
    compare_seed_until: tuple[str, ...] = ()
    password: str = ""


def _direct_argv(setup: Setup, peer: NetPeer, stores: Path, peers_file: Path, one_tier: bool) -> list[str]:
    argv = [sys.executable, str(SUPPORT / "direct_peer.py"), "--manifest", str(setup.manifest_file),
            "--key-env", "BROADCAST_KEY", "--listen", f"{peer.address}:{DATA_PORT}",
            "--peers", str(peers_file)]  # fmt: skip
    if peer.index == 0:
        plain = one_tier or setup.no_super_seed
        return [*argv, "--origin", str(setup.checkpoint)] + (["--no-super-seed"] if plain else [])
    # Swarm: full mesh (each peer dials every lower index). One tier: only the origin, and no re-serving.
    argv += ["--store", str(stores / f"p{peer.index}"), "--dial-below", "1" if one_tier else str(peer.index)]
    return argv + (["--no-upload"] if one_tier else [])


def _service_argv(
    setup: Setup, peer: NetPeer, stores: Path, origin: dict[str, Any] | None, one_tier: bool
) -> list[str]:
    argv = [sys.executable, str(SUPPORT / "service_peer.py"), "--key-env", "BROADCAST_KEY",
            "--host", peer.address, "--data-dir", str(stores / f"p{peer.index}"),
            "--heartbeat-interval", str(setup.heartbeat_interval)]  # fmt: skip
    if origin is None:
        piece = ["--piece-kib", str(setup.piece_size // 1024)] if setup.piece_size else []
        return [*argv, "--origin", str(setup.checkpoint), *piece]
    origin_ip = setup.lab.peers[0].address
    bootstrap = next(m for m in origin["multiaddrs"] if f"/ip4/{origin_ip}/" in m)
    argv += ["--trainer", setup.addresses[0], "--bootstrap", bootstrap,
             "--min-links", str(min(len(setup.keys) - 1, setup.min_links))]  # fmt: skip
    if one_tier:
        argv += ["--no-upload", "--dial-origin", f"{origin_ip}:{DATA_PORT}"]
    return argv


def run_phase(setup: Setup, *, one_tier: bool) -> dict[str, Any]:
    lab, work = setup.lab, setup.work
    phase = "one_tier" if one_tier else "swarm"
    stores = work / f"stores-{phase}"
    stores.mkdir()
    peers_file = work / "peers.json"
    peers_file.write_text(
        json.dumps(
            [
                {"index": p.index, "address": setup.addresses[p.index], "host": p.address, "port": DATA_PORT}
                for p in lab.peers
            ]
        )
    )
    log = work / f"{phase}.log"
    procs: list[Proc] = []
    go = "go"
    # Direct peers report "complete" once every piece is verified and stored; service peers report
    # "verified" then, and "complete" after writing the checkpoint directory as well.
    done_event = "verified" if setup.impl == "service" else "complete"
    setup_started = time.monotonic()
    try:

        def launch(peer: NetPeer, argv: list[str]) -> Proc:
            env = dict(os.environ, BROADCAST_KEY=setup.keys[peer.index], PYTHONPATH=str(ROOT))
            return start(lab, peer, argv, env, log, f"p{peer.index}")

        if setup.impl == "service":
            origin_proc = launch(lab.peers[0], _service_argv(setup, lab.peers[0], stores, None, one_tier))
            procs.append(origin_proc)
            got = origin_proc.wait_event("ready", time.monotonic() + READY_TIMEOUT)
            if got is None:
                raise RuntimeError(f"{phase}: the origin never became ready: {tail(log)}")
            go = f"go {got[1]['manifest_id']}"
            for peer in lab.peers[1:]:
                procs.append(launch(peer, _service_argv(setup, peer, stores, got[1], one_tier)))
        else:
            for peer in lab.peers:
                procs.append(launch(peer, _direct_argv(setup, peer, stores, peers_file, one_tier)))
        deadline = time.monotonic() + READY_TIMEOUT
        links = []
        for proc in procs:
            ready = proc.wait_event("ready", deadline)
            if ready is None:
                raise RuntimeError(f"{phase}: {proc.name} never became ready: {tail(log)}")
            links.append(ready[1].get("links"))
        ready_s = time.monotonic() - setup_started
        pids = [p.popen.pid for p in procs]
        settle_s = settle(pids)
        # What the running peers cost before any piece moves (service peers: libp2p, heartbeats, gossip).
        idle_before = sum(_process_seconds(pid) for pid in pids)
        time.sleep(IDLE_WINDOW)
        idle_cpu_s_per_s = (sum(_process_seconds(pid) for pid in pids) - idle_before) / IDLE_WINDOW
        sent_before = [lab.sent_bytes(p) for p in lab.peers]
        with CpuSampler([p.popen.pid for p in procs]) as sampler:
            started = time.monotonic()
            for proc in procs:
                proc.tell(go)
            deadline = started + setup.timeout
            finished: dict[int, float] = {}
            written: dict[int, float] = {}
            for index, proc in enumerate(procs[1:], start=1):
                got = proc.wait_event(done_event, deadline)
                if got is not None:
                    finished[index] = got[0] - started
            cpu = sampler.stop()
            if setup.impl == "service":
                for index, proc in enumerate(procs[1:], start=1):
                    got = proc.wait_event("complete", time.monotonic() + STOP_TIMEOUT)
                    if got is not None:
                        written[index] = got[0] - started
        sent = [lab.sent_bytes(p) - before for p, before in zip(lab.peers, sent_before, strict=True)]
        for proc in procs:
            proc.tell("stop")
        stats_deadline = time.monotonic() + STOP_TIMEOUT
        stats = [proc.wait_event("stats", stats_deadline) for proc in procs]
    finally:
        for proc in procs:
            proc.end()
    times = sorted(finished.values())
    receivers = len(procs) - 1
    result: dict[str, Any] = {
        "complete": len(finished),
        "receivers": receivers,
        "broadcast_s": round(times[-1], 2) if len(finished) == receivers else None,
        "first_finish_s": round(times[0], 2) if times else None,
        "median_finish_s": round(times[len(times) // 2], 2) if times else None,
        "origin_sent_mb": round(sent[0] / MB, 1),
        "origin_upload_copies": round(sent[0] / setup.size, 3),
        "receivers_sent_mb": round(sum(sent[1:]) / MB, 1),
        "duplicate_share": round(max(0.0, sum(sent) / (receivers * setup.size) - 1), 3),
        "start_up_s": round(ready_s, 1),
        "settle_s": round(settle_s, 1),
        "cpu": cpu
        | {"idle_peers_share_of_machine": round(idle_cpu_s_per_s / (os.cpu_count() or 1), 3)}
        | cpu_per_gb(cpu, receivers * setup.size),
        "peer_cpu_s_max": max((s[1].get("cpu_s", 0.0) for s in stats if s is not None), default=None),
    }
    if setup.impl == "service":
        result["links_at_start"] = links[1:]
        origin_stats = stats[0][1] if stats[0] is not None else {}
        keys = ("served", "pieces_served_twice_or_more", "opened", "opened_unrequested", "opened_unspread",
                "hop_time_s", "spread_deadline_s", "first_pass_s")  # fmt: skip
        result["origin_super_seeding"] = {k: origin_stats[k] for k in keys if k in origin_stats}
        if len(written) == receivers:
            result["written_s"] = round(max(written.values()), 2)
    if len(finished) < receivers:
        result["timed_out_after_s"] = setup.timeout
        result["unfinished"] = [
            {"peer": i} | {k: v for k, v in (stats[i] or (0, {}))[1].items() if k != "event"}
            for i in range(1, receivers + 1)
            if i not in finished
        ]
        result["log_tail"] = tail(log)
    else:
        result["stores_identical"] = verify_stores(stores, setup)
    shutil.rmtree(stores, ignore_errors=True)
    return result


def verify_stores(stores: Path, setup: Setup) -> bool:
    """Every receiver holds the origin's bytes (outside the timing): direct peers' piece stores, or the
    checkpoint directories service peers wrote, hashed as one stream in path order."""
    want = _stream_digest(sorted(p for p in setup.checkpoint.rglob("*") if p.is_file()))
    for index in range(1, len(setup.keys)):
        root = stores / f"p{index}"
        found = [
            sorted(p for p in d.rglob("*") if p.is_file())
            for d in [*root.glob("*/files"), *root.glob("swarm/checkpoints/*")]
        ]
        if len(found) != 1 or _stream_digest(found[0]) != want:
            return False
    return True


def _stream_digest(files: list[Path]) -> bytes:
    from blake3 import blake3

    digest = blake3()
    for path in files:
        with path.open("rb") as handle:
            while chunk := handle.read(16 * MB):
                digest.update(chunk)
    return digest.digest()


# --------------------------------------------------------------------------------------------------------
# What a user would pick instead: libtorrent over the same links, and both tools started cold


def _trees_identical(setup: Setup, trees: list[Path]) -> bool:
    """Every directory in ``trees`` holds the origin's files, byte for byte (outside the timing)."""
    want = _stream_digest(sorted(p for p in setup.checkpoint.rglob("*") if p.is_file()))
    return all(_stream_digest(sorted(p for p in tree.rglob("*") if p.is_file())) == want for tree in trees)


def _summary(setup: Setup, finished: dict[int, float], sent: list[int]) -> dict[str, Any]:
    times = sorted(finished.values())
    receivers = len(setup.keys) - 1
    return {
        "complete": len(finished),
        "receivers": receivers,
        "broadcast_s": round(times[-1], 2) if len(finished) == receivers else None,
        "first_finish_s": round(times[0], 2) if times else None,
        "median_finish_s": round(times[len(times) // 2], 2) if times else None,
        "origin_sent_mb": round(sent[0] / MB, 1),
        "origin_upload_copies": round(sent[0] / setup.size, 3),
        "receivers_sent_mb": round(sum(sent[1:]) / MB, 1),
        "duplicate_share": round(max(0.0, sum(sent) / (receivers * setup.size) - 1), 3),
    }


def _children_cpu_s() -> float:
    """CPU seconds of this process's reaped children (cold phases: processes that exit count too)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_torrent_phase(setup: Setup, *, cold: bool) -> dict[str, Any]:
    """libtorrent: one plain seeder and the same receivers. Warm: every process is running with the torrent
    added before "go" (like the swarm phase); cold: the seeder hashes the directory into a .torrent (as
    ``share`` hashes its manifest), then the receivers are started as fresh processes and timed from their
    launch. Receivers keep seeding until the last one has finished (a BitTorrent client's habit)."""
    lab, work = setup.lab, setup.work
    phase = "torrent_cold" if cold else "torrent"
    stores = work / f"stores-{phase}"
    stores.mkdir()
    log = work / f"{phase}.log"
    torrent = stores / "checkpoint.torrent" if cold else setup.torrent_file
    assert torrent is not None
    script = [sys.executable, str(SUPPORT / "torrent_peer.py")]
    wait = [] if cold else ["--wait-go"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs: list[Proc] = []
    cpu_before = _children_cpu_s()
    try:
        seeder = [
            *script,
            "--listen",
            f"{lab.peers[0].address}:{TORRENT_PORT}",
            "--seed",
            str(setup.checkpoint),
        ]
        if cold:
            seeder += ["--make-torrent", str(torrent), "--piece-kib", str(setup.piece_bytes // 1024)]
        else:
            seeder += ["--torrent", str(torrent), "--wait-go"]
        launched = time.monotonic()
        procs.append(start(lab, lab.peers[0], seeder, env, log, "seeder"))
        ready = procs[0].wait_event("ready", launched + READY_TIMEOUT)
        if ready is None:
            raise RuntimeError(f"{phase}: the seeder never became ready: {tail(log)}")
        seeder_ready_s = ready[0] - launched
        sent_before = [lab.sent_bytes(p) for p in lab.peers]

        def receiver(peer: NetPeer) -> list[str]:
            # Warm: each dials the lower indices (a full mesh, as the direct swarm peers); cold: every other
            # peer, again every second until done, since they start at different moments.
            others = [p for p in lab.peers if p.index < peer.index or (cold and p.index != peer.index)]
            return [*script, "--listen", f"{peer.address}:{TORRENT_PORT}", "--torrent", str(torrent),
                    "--save", str(stores / f"p{peer.index}"), *wait, "--redial", "1" if cold else "0",
                    "--dial", *[f"{p.address}:{TORRENT_PORT}" for p in others]]  # fmt: skip

        cpu_warm: dict[int, float] = {}
        if not cold:  # every receiver running, torrent added, before the clock starts
            for peer in lab.peers[1:]:
                procs.append(start(lab, peer, receiver(peer), env, log, f"p{peer.index}"))
            for proc in procs:
                if proc.wait_event("ready", time.monotonic() + READY_TIMEOUT) is None:
                    raise RuntimeError(f"{phase}: {proc.name} never became ready: {tail(log)}")
            cpu_warm = {proc.popen.pid: _process_seconds(proc.popen.pid) for proc in procs}
            sent_before = [lab.sent_bytes(p) for p in lab.peers]
        sampler = CpuSampler([]).__enter__()
        started = time.monotonic()
        if cold:
            for peer in lab.peers[1:]:
                procs.append(start(lab, peer, receiver(peer), env, log, f"p{peer.index}"))
        else:
            for proc in procs:
                proc.tell("go")
        deadline = started + setup.timeout
        finished: dict[int, float] = {}
        for index, proc in enumerate(procs[1:], start=1):
            got = proc.wait_event("complete", deadline)
            if got is not None:
                finished[index] = got[0] - started
        machine = sampler.stop()
        sent = [lab.sent_bytes(p) - before for p, before in zip(lab.peers, sent_before, strict=True)]
        peers_cpu = sum(_process_seconds(pid) - was for pid, was in cpu_warm.items()) if not cold else None
        for proc in procs:
            proc.tell("stop")
        stats_deadline = time.monotonic() + STOP_TIMEOUT
        for proc in procs:
            proc.wait_event("stats", stats_deadline)
    finally:
        for proc in procs:
            proc.end()
    result = _summary(setup, finished, sent)
    gb = (len(setup.keys) - 1) * setup.size / 1e9
    cpu: dict[str, Any] = {"machine_busy": machine["machine_busy"]}
    if peers_cpu is not None:
        cpu |= {"peers_cpu_s": round(peers_cpu, 2), "peers_cpu_s_per_gb_delivered": round(peers_cpu / gb, 2)}
    else:  # every process from launch to exit, the seeder's hashing included
        total = _children_cpu_s() - cpu_before
        cpu |= {"processes_cpu_s": round(total, 2), "processes_cpu_s_per_gb_delivered": round(total / gb, 2)}
    result["cpu"] = cpu
    if cold:
        result["seeder_ready_s"] = round(seeder_ready_s, 2)
    if len(finished) == len(setup.keys) - 1:
        result["stores_identical"] = _trees_identical(
            setup, [stores / f"p{i}" / setup.checkpoint.name for i in range(1, len(setup.keys))]
        )
    else:
        result["log_tail"] = tail(log)
    shutil.rmtree(stores, ignore_errors=True)
    return result


def _cli_argv(setup: Setup, peer: NetPeer, data: Path, *, wallet: bool = True) -> list[str]:
    """The flags every ``prime-node`` process of the cold phase takes (what a user passes); ``wallet``:
    with its keystore (a fetch without keystore flags runs under a throwaway identity)."""
    keystore = ["--keystore", str(setup.keystores[peer.index]), "--password-env", PASSWORD_ENV]
    return ["--listen", f"/ip4/{peer.address}/tcp/{P2P_PORT}", "--dataplane-host", peer.address,
            "--dataplane-port", str(DATA_PORT), *(keystore if wallet else []), "--data-dir", str(data),
            "--run", "bench", "--json"]  # fmt: skip


def run_cold_phase(setup: Setup, *, ephemeral: bool = False) -> dict[str, Any]:
    """``prime-node share`` then 15 ``prime-node fetch`` processes started cold (imports, keystore unlock,
    libp2p start, discovery, data), timed from the fetches' launch to the last directory written; each
    fetch prints the seconds from its start to each phase (``phases``)."""
    lab, work = setup.lab, setup.work
    name = f"cold-{setup.fetch_seed_until}" + ("-ephemeral" if ephemeral else "")
    stores = work / f"stores-{name}"
    stores.mkdir()
    log = work / f"{name}.log"
    cli = [sys.executable, "-m", "prime_node.cli.main"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{PASSWORD_ENV: setup.password})
    origin = lab.peers[0]
    procs: list[Proc] = []
    cpu_before = _children_cpu_s()
    exits: dict[int, float] = {}
    try:
        piece = ["--piece-size", str(setup.piece_size)] if setup.piece_size else []
        share = [*cli, "share", str(setup.checkpoint), "--step", "1", *piece,
                 *_cli_argv(setup, origin, stores / "p0")]  # fmt: skip
        launched = time.monotonic()
        procs.append(start(lab, origin, share, env, log, "share"))
        shared = procs[0].wait_for(lambda event: "manifest_id" in event, launched + READY_TIMEOUT)
        if shared is None:
            raise RuntimeError(f"cold: share never printed its manifest: {tail(log)}")
        share_ready_s = shared[0] - launched
        mid = shared[1]["manifest_id"]
        bootstrap = next(m for m in shared[1]["multiaddrs"] if f"/ip4/{origin.address}/" in m)
        sent_before = [lab.sent_bytes(p) for p in lab.peers]
        with CpuSampler([]) as sampler:
            started = time.monotonic()
            for peer in lab.peers[1:]:
                argv = [*cli, "fetch", mid, "--out", str(stores / f"p{peer.index}" / "out"),
                        "--trainer", setup.addresses[0], "--bootstrap", bootstrap,
                        "--seed-until", setup.fetch_seed_until,
                        *_cli_argv(setup, peer, stores / f"p{peer.index}" / "data",
                                   wallet=not ephemeral)]  # fmt: skip
                procs.append(start(lab, peer, argv, env, log, f"p{peer.index}"))
            deadline = started + setup.timeout
            finished: dict[int, float] = {}
            phases: list[dict[str, float]] = []
            for index, proc in enumerate(procs[1:], start=1):
                got = proc.wait_for(lambda event: "out" in event, deadline)
                if got is not None:
                    finished[index] = got[0] - started
                    phases.append(got[1].get("phases", {}))
            machine = sampler.stop()
            sent = [lab.sent_bytes(p) - before for p, before in zip(lab.peers, sent_before, strict=True)]
            for index, proc in enumerate(procs[1:], start=1):  # --seed-until swarm: they leave by themselves
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.popen.wait(timeout=max(1.0, deadline + STOP_TIMEOUT - time.monotonic()))
                    exits[index] = time.monotonic() - started
    finally:
        for proc in procs:
            proc.end()
    result = _summary(setup, finished, sent)
    result |= {
        "share_ready_s": round(share_ready_s, 2),
        "last_exit_s": round(max(exits.values()), 2) if len(exits) == len(procs) - 1 else None,
        "exit_codes": sorted({proc.popen.returncode for proc in procs[1:]}),
    }
    if phases:  # median over the fetches of the seconds from process start to each phase
        names = ["cli", "imports", "key", "node_up", "manifest", "first_piece", "written"]
        result["fetch_phases_median_s"] = {
            name: sorted(p[name] for p in phases if name in p)[len(phases) // 2]
            for name in names
            if all(name in p for p in phases)
        }
    total = _children_cpu_s() - cpu_before
    gb = (len(setup.keys) - 1) * setup.size / 1e9
    result["cpu"] = {
        "machine_busy": machine["machine_busy"],
        "processes_cpu_s": round(total, 2),
        "processes_cpu_s_per_gb_delivered": round(total / gb, 2),
    }
    if len(finished) == len(setup.keys) - 1:
        result["stores_identical"] = _trees_identical(
            setup, [stores / f"p{i}" / "out" for i in range(1, len(setup.keys))]
        )
    else:
        result["log_tail"] = tail(log)
    shutil.rmtree(stores, ignore_errors=True)
    return result


def make_keystores(directory: Path, secrets: list[str], password: str) -> list[Path]:
    """One keystore per peer, with the default (slow, as users have it) scrypt; made outside the timing."""
    from crypto.keys import WalletKey
    from prime_node.wallet_store import create_keystore

    directory.mkdir()
    paths = [directory / f"p{i}.json" for i in range(len(secrets))]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda i: create_keystore(paths[i], WalletKey(bytes.fromhex(secrets[i])), password),
                      range(len(secrets))))  # fmt: skip
    return paths


def make_torrent(checkpoint: Path, out: Path, piece_size: int) -> Path:
    """The .torrent every libtorrent phase but the cold one uses (made outside the timing)."""
    import importlib

    sys.path.insert(0, str(SUPPORT))
    importlib.import_module("torrent_peer").make_torrent(checkpoint, out, piece_size)
    return out


def run_tcp_phase(setup: Setup, *, store: bool = False) -> dict[str, Any]:
    """The CPU floor of the same traffic over plain TCP, on the same shaped links: every receiver gets F
    bytes, a quarter from each of the next four peers (the origin included), each peer one process of
    tcp_probe.py ``mesh``. CPU per GB delivered is what the kernel and a minimal Python loop cost to move
    these bytes through veth and tc here, the baseline the swarm's own CPU per GB is compared with.
    ``store``: every receiver also writes its F bytes into a file in the workdir, where the swarm's stores
    are (``tcp_mesh_store``): the floor for a broadcast that keeps what it receives, which also counts what
    this machine's file system costs per byte written (on a VM whose memory the host backs lazily, writing
    into fresh page-cache pages costs several times a write into pages the guest touched recently)."""
    lab = setup.lab
    count = len(lab.peers)
    share = setup.size // TCP_MESH_SENDERS
    senders_of = {r: [(r + d) % count for d in range(1, TCP_MESH_SENDERS + 1)] for r in range(1, count)}
    targets: dict[int, list[str]] = {j: [] for j in range(count)}
    for receiver, senders in senders_of.items():
        for sender in senders:
            targets[sender].append(f"{lab.peers[receiver].address}:{PROBE_PORT}")
    log = setup.work / "tcp_mesh.log"
    script = str(SUPPORT / "tcp_probe.py")
    files = setup.work / "tcp-mesh-store"
    procs: list[Proc] = []
    try:
        if store:
            files.mkdir(parents=True, exist_ok=True)
        for peer in lab.peers:
            inbound = len(senders_of.get(peer.index, []))
            keep = ["--store", str(files / f"p{peer.index}")] if store and inbound else []
            argv = [sys.executable, script, "mesh", peer.address, str(PROBE_PORT), str(inbound), str(share),
                    *keep, *targets[peer.index]]  # fmt: skip
            procs.append(start(lab, peer, argv, dict(os.environ), log, f"tcp{peer.index}"))
        deadline = time.monotonic() + 60
        if any(proc.wait_event("ready", deadline) is None for proc in procs):
            raise RuntimeError(f"tcp mesh: a peer never became ready: {tail(log)}")
        with CpuSampler([p.popen.pid for p in procs]) as sampler:
            started = time.monotonic()
            for proc in procs:
                proc.tell("go")
            done = [proc.wait_event("complete", started + setup.timeout) for proc in procs]
            cpu = sampler.stop()
    finally:
        for proc in procs:
            proc.end()
        shutil.rmtree(files, ignore_errors=True)
    if any(got is None for got in done):
        raise RuntimeError(f"tcp mesh did not complete: {tail(log)}")
    delivered = sum(int(got[1]["received"]) for got in done if got is not None)
    return {
        "seconds": round(max(got[0] for got in done if got is not None) - started, 2),
        "delivered_bytes": delivered,
        "cpu": cpu | cpu_per_gb(cpu, delivered),
    }


def run_alternatives(
    setup: Setup, result: dict[str, Any], bound: float, *, libtorrent: bool, cold: bool, ephemeral: bool
) -> None:
    """libtorrent over the same links (warm), then ``share`` + ``fetch`` and libtorrent started cold; the
    ratios go into ``result`` (ours ÷ theirs: below 1 is faster than libtorrent)."""
    swarm_s = result["swarm"]["broadcast_s"]
    if libtorrent:
        torrent = run_torrent_phase(setup, cold=False)
        result["libtorrent"] = torrent
        result["libtorrent_s"] = torrent["broadcast_s"]
        if torrent["broadcast_s"] and swarm_s:
            result["ratio_to_libtorrent"] = round(swarm_s / torrent["broadcast_s"], 3)
        result["libtorrent_ratio_to_bound"] = _ratio(torrent["broadcast_s"], bound)
        result["libtorrent_cpu_s_per_gb_delivered"] = torrent["cpu"].get("peers_cpu_s_per_gb_delivered")
    if cold:
        ours = run_cold_phase(setup)
        result["cold"] = ours
        result["cold_s"] = ours["broadcast_s"]
        result["cold_ratio_to_bound"] = _ratio(ours["broadcast_s"], bound)
        result["cold_origin_upload_copies"] = ours["origin_upload_copies"]
        if libtorrent:
            theirs = run_torrent_phase(setup, cold=True)
            result["libtorrent_cold"] = theirs
            result["libtorrent_cold_s"] = theirs["broadcast_s"]
            result["libtorrent_cold_ratio_to_bound"] = _ratio(theirs["broadcast_s"], bound)
            if ours["broadcast_s"] and theirs["broadcast_s"]:
                result["cold_ratio_to_libtorrent"] = round(ours["broadcast_s"] / theirs["broadcast_s"], 3)
        if ephemeral:  # fetch without keystore flags (a throwaway identity): no keystore unlock
            light = run_cold_phase(setup, ephemeral=True)
            result["cold_ephemeral"] = light
            result["cold_ephemeral_s"] = light["broadcast_s"]
            result["cold_ephemeral_ratio_to_bound"] = _ratio(light["broadcast_s"], bound)
            theirs_s = result.get("libtorrent_cold_s")
            if light["broadcast_s"] and theirs_s:
                result["cold_ephemeral_ratio_to_libtorrent"] = round(light["broadcast_s"] / theirs_s, 3)
        for until in setup.compare_seed_until:  # the same cold phase with another --seed-until (A/B)
            other = run_cold_phase(replace(setup, fetch_seed_until=until))
            result[f"cold_seed_until_{until}"] = other
            result[f"cold_seed_until_{until}_ratio_to_bound"] = _ratio(other["broadcast_s"], bound)


def _ratio(seconds: float | None, bound: float) -> float | None:
    return round(seconds / bound, 3) if seconds else None


# --------------------------------------------------------------------------------------------------------


def skipped(reason: str) -> NoReturn:
    print(f"broadcast benchmark skipped: {reason}", file=sys.stderr)
    print(json.dumps({"benchmark": "broadcast", "skipped": reason}))
    raise SystemExit(0)


def _terminate(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=16, help="processes in all, origin included")
    parser.add_argument("--size-mb", type=float, default=256, help="checkpoint size, MB")
    parser.add_argument("--upload-mbps", type=float, default=20, help="each receiver's upload cap, MB/s")
    parser.add_argument("--origin-upload-mbps", type=float, default=None, help="origin upload cap, MB/s "
                        "(default: same as --upload-mbps)")  # fmt: skip
    parser.add_argument("--download-mbps", type=float, default=None, help="each peer's download cap, MB/s "
                        "(default: 4 x upload; 0: uncapped)")  # fmt: skip
    parser.add_argument("--piece-kib", type=int, default=None, help="piece size, KiB (default: "
                        "choose_piece_size, 1 MiB for 256 MB)")  # fmt: skip
    parser.add_argument("--skip-one-tier", action="store_true")
    parser.add_argument("--skip-libtorrent", action="store_true", help="no libtorrent baseline (warm, cold)")
    parser.add_argument("--skip-cold", action="store_true", help="no cold share/fetch (and libtorrent) phase")
    parser.add_argument("--skip-tcp", action="store_true", help="no plain-TCP CPU baseline")
    parser.add_argument("--cold-ephemeral", action="store_true", help="also time the cold fetches as a user "
                        "types them, without keystore flags (a throwaway identity, no unlock)")  # fmt: skip
    parser.add_argument("--cold-compare-seed-until", nargs="*", default=[], help="run the cold phase again "
                        "with each of these --seed-until values (e.g. done)")  # fmt: skip
    parser.add_argument("--fetch-seed-until", default="swarm", help="cold phase: fetch's --seed-until "
                        "(done: exit once written, as before issue 15)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=None, help="per phase, s (default: 4 x its bound)")
    impl_help = "service: full nodes with SwarmService (libp2p discovery); direct: swarm core, fixed mesh"
    parser.add_argument("--impl", choices=("service", "direct"), default="service", help=impl_help)
    parser.add_argument("--one-tier-impl", choices=("service", "direct"), default="direct", help="one-tier "
                        "baseline peers (direct: a plain seeder origin, leechers dial only it)")  # fmt: skip
    parser.add_argument("--heartbeat-interval", type=float, default=2.0, help="service peers' heartbeat, s")
    parser.add_argument("--min-links", type=int, default=12, help="service receivers wait for this many "
                        "data-plane neighbours (at most 60 s) before the broadcast starts")  # fmt: skip
    plain_help = "direct: the swarm's origin is a plain seeder (to compare with super-seeding)"
    parser.add_argument("--no-super-seed", action="store_true", help=plain_help)
    parser.add_argument("--workdir", default=None, help="where the checkpoint and stores go")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _terminate)

    reason = Lab.available()
    if reason:
        skipped(reason)
    size = int(args.size_mb * MB)
    upload = args.upload_mbps * MB
    origin_up = (args.origin_upload_mbps or args.upload_mbps) * MB
    download = (4 * upload if args.download_mbps is None else args.download_mbps * MB) or None
    receivers = args.peers - 1
    bound, binding = bound_seconds(size, origin_up, [upload] * receivers, [download] * receivers)
    one_tier_bound = receivers * size / origin_up
    began = time.monotonic()

    from crypto.keys import WalletKey
    from prime_node.swarm.checkpoint_pieces import build_checkpoint
    from protocol.codec import encode

    work = choose_workdir(
        int(size * (args.peers + 1) * (2.2 if args.impl == "service" else 1.1)), args.workdir
    )
    lab = Lab(args.peers)
    result: dict[str, Any] = {
        "benchmark": "broadcast",
        "impl": args.impl + ("+plain_origin" if args.no_super_seed and args.impl == "direct" else ""),
        "python": platform.python_version(),
        "peers": args.peers,
        "receivers": receivers,
        "workdir": str(work.parent),
    }
    try:
        checkpoint = work / "checkpoint"
        write_checkpoint(checkpoint, size)
        trainer = WalletKey.generate()
        shared = build_checkpoint(
            checkpoint,
            trainer,
            run="bench",
            step=1,
            now_ms=int(time.time() * 1000),
            piece_size=args.piece_kib * 1024 if args.piece_kib else None,
        )
        manifest_file = work / "manifest.bin"
        manifest_file.write_bytes(encode(shared.manifest))
        keys = [WalletKey.generate() for _ in range(args.peers)]
        result |= {
            "checkpoint_bytes": shared.manifest.total_size,
            "piece_bytes": shared.manifest.piece_size,
            "pieces": shared.manifest.piece_count,
            "upload_mb_s": args.upload_mbps,
            "origin_upload_mb_s": origin_up / MB,
            "download_mb_s": download / MB if download else None,
            "bound_s": round(bound, 2),
            "bound_term": binding,
        }
        try:
            lab.create()
        except Exception as exc:
            lab.close()
            shutil.rmtree(work, ignore_errors=True)
            skipped(f"cannot create network namespaces: {exc}")
        for peer in lab.peers:
            lab.shape(
                peer, upload_bytes_s=origin_up if peer.index == 0 else upload, download_bytes_s=download
            )
        result["shaping"] = check_shaping(lab, upload, download, work / "probe.log")
        setup = Setup(
            lab,
            work,
            checkpoint,
            manifest_file,
            [k.secret.hex() for k in keys],
            [k.address.checksummed() for k in keys],
            args.timeout or max(60.0, 4 * bound),
            args.impl,
            shared.manifest.total_size,
            args.heartbeat_interval,
            args.min_links,
            args.no_super_seed,
            args.piece_kib * 1024 if args.piece_kib else None,
            shared.manifest.piece_size,
        )
        if not args.skip_libtorrent:
            torrent_file = make_torrent(checkpoint, work / "checkpoint.torrent", shared.manifest.piece_size)
            setup = replace(setup, torrent_file=torrent_file)
        if not args.skip_cold:
            password = os.urandom(12).hex()
            keystores = make_keystores(work / "keystores", setup.keys, password)
            setup = replace(
                setup,
                keystores=keystores,
                password=password,
                fetch_seed_until=args.fetch_seed_until,
                compare_seed_until=tuple(args.cold_compare_seed_until),
            )
            result["fetch_seed_until"] = args.fetch_seed_until
        swarm = run_phase(setup, one_tier=False)
        result["swarm"] = swarm
        if swarm["broadcast_s"] is not None:
            result["broadcast_s"] = swarm["broadcast_s"]
            result["ratio_to_bound"] = round(swarm["broadcast_s"] / bound, 3)
        else:
            result["ratio_to_bound"] = None
        result["goal_ratio_to_bound"] = 1.15
        result["origin_upload_copies"] = swarm["origin_upload_copies"]
        result["goal_cpu_s_per_gb_delivered"] = 2.0
        if not args.skip_tcp:
            tcp = run_tcp_phase(setup)
            result["tcp_mesh"] = tcp
            stored = run_tcp_phase(setup, store=True)
            result["tcp_mesh_store"] = stored
            for who in ("peers", "machine"):
                key = f"{who}_cpu_s_per_gb_delivered"
                result[f"cpu_ratio_to_tcp_{who}"] = round(swarm["cpu"][key] / tcp["cpu"][key], 2)
                result[f"cpu_ratio_to_tcp_store_{who}"] = round(swarm["cpu"][key] / stored["cpu"][key], 2)
        run_alternatives(
            setup,
            result,
            bound,
            libtorrent=not args.skip_libtorrent,
            cold=not args.skip_cold,
            ephemeral=args.cold_ephemeral and not args.skip_cold,
        )
        if not args.skip_one_tier:
            tier_setup = replace(
                setup, impl=args.one_tier_impl, timeout=args.timeout or 1.3 * one_tier_bound + 30
            )
            tier = run_phase(tier_setup, one_tier=True)
            tier["bound_s"] = round(one_tier_bound, 2)
            result["one_tier"] = {"impl": args.one_tier_impl} | tier
            if tier["broadcast_s"] is not None:
                result["one_tier_ratio_to_bound"] = round(tier["broadcast_s"] / bound, 3)
                result["one_tier_over_own_bound"] = round(tier["broadcast_s"] / one_tier_bound, 3)
                if swarm["broadcast_s"]:
                    result["speedup_over_one_tier"] = round(tier["broadcast_s"] / swarm["broadcast_s"], 2)
    except KeyboardInterrupt:
        result["interrupted"] = True
        raise
    except SystemExit:
        result = {}
        raise
    except Exception as exc:  # reported in the line, and still raised: never a number from a broken run
        result["error"] = f"{type(exc).__name__}: {exc}"[:1000]
        raise
    finally:
        lab.close()
        shutil.rmtree(work, ignore_errors=True)
        if result:
            result["wall_s"] = round(time.monotonic() - began, 1)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
