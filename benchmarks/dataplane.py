"""Throughput of one connection on 127.0.0.1: raw trio TCP vs our authenticated channel vs libp2p Noise+yamux.

Prints one JSON line. Each transport moves 512 MiB as 128 frames of 4 MiB from this process to a receiver
in a separate process (each end gets its own core, as two machines would), three times (raw and channel
runs interleaved); the best run counts (the machine is shared and noisy). Time runs from the first byte
sent to the receiver's acknowledgement of the last frame; connection setup and handshakes are timed
separately.

- raw: u32 length ‖ body, the receiver reads into one reused buffer (no copy, no check): the ceiling.
- channel: prime_node.dataplane (wallet-authenticated handshake, keyed-BLAKE3 MAC per frame), the
  receiver gets each frame as ``bytes``, checked.
- libp2p: prime_node.p2p's host (TCP + Noise + yamux) and its FramedStream, same frames.
- piece_path: the whole weight-swarm path, one checkpoint of the same bytes in pieces of the frame size:
  an origin (CheckpointTransfer over OriginDirectory, reading the shared file) and a fetcher (a fresh
  PieceStore on tmpfs each run) as two DataPlanes on one channel, with the swarm's requests, ``have``s,
  piece hashing and store writes. Time and CPU from the dial to the fetcher holding every piece.

``cpu_s_per_gb`` (both ends' CPU seconds per 10^9 bytes delivered, best run of each end) is the figure
benchmarks/broadcast.py reports across its peers as ``peers_cpu_s_per_gb_delivered``.

Usage: .venv/bin/python benchmarks/dataplane.py [--skip-libp2p] [--skip-pieces] [--frame-kib N]
"""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crypto.keys import Address, WalletKey  # noqa: E402
from prime_node.dataplane.connect import accept_channel, open_channel  # noqa: E402
from prime_node.swarm.checkpoint_pieces import build_checkpoint  # noqa: E402
from prime_node.swarm.piece_store import PieceStore  # noqa: E402
from prime_node.swarm.transfer import CheckpointTransfer, OriginDirectory, PieceSource  # noqa: E402
from prime_node.swarm.transport import DataPlane  # noqa: E402
from protocol.codec import decode, encode  # noqa: E402
from protocol.manifest import Manifest  # noqa: E402

TOTAL_BYTES = int(os.environ.get("BENCH_TOTAL_MIB", "512")) << 20
FRAME_SIZE = int(os.environ.get("BENCH_FRAME_KIB", "4096")) << 10
FRAME_COUNT = TOTAL_BYTES // FRAME_SIZE
REPEATS = 3
LIBP2P_PROTOCOL = "/prime-node/bench-dataplane/1"
LIBP2P_TIMEOUT = 60.0
_HEADER = 4


# --------------------------------------------------------------------------------------------------------
# Receivers (run in the child process): accept REPEATS connections, acknowledge each after FRAME_COUNT frames


async def _recv_exactly(stream: trio.SocketStream, view: memoryview) -> None:
    filled = 0
    while filled < len(view):
        count = await stream.socket.recv_into(view[filled:])
        if count == 0:
            raise EOFError("sender closed early")
        filled += count


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _raw_receiver(listener: trio.SocketListener, cpu: list[float]) -> None:
    buffer = bytearray(FRAME_SIZE)
    header = bytearray(_HEADER)
    for _ in range(REPEATS):
        stream = await listener.accept()
        started = _cpu_seconds()
        for _ in range(FRAME_COUNT):
            await _recv_exactly(stream, memoryview(header))
            length = int.from_bytes(header, "big")
            await _recv_exactly(stream, memoryview(buffer)[:length])
        cpu.append(_cpu_seconds() - started)
        await stream.send_all(b"k")
        await stream.aclose()


async def _channel_receiver(listener: trio.SocketListener, key: WalletKey, cpu: list[float]) -> None:
    for _ in range(REPEATS):
        stream = await listener.accept()
        channel = await accept_channel(stream, key)
        started = _cpu_seconds()
        for _ in range(FRAME_COUNT):
            frame = await channel.receive_frame()
            assert len(frame) == FRAME_SIZE
        cpu.append(_cpu_seconds() - started)
        await channel.send_frame(b"k")
        await channel.aclose()


async def _socket_child(mode: str) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listener = listeners[0]
    print(listener.socket.getsockname()[1], flush=True)
    cpu: list[float] = []
    if mode == "raw":
        await _raw_receiver(listener, cpu)
    else:
        await _channel_receiver(listener, WalletKey(bytes.fromhex(os.environ["BENCH_KEY"])), cpu)
    print(json.dumps(cpu), flush=True)


async def _libp2p_child() -> None:
    from prime_node.p2p.interface import FramedStream
    from prime_node.p2p.libp2p_host import open_libp2p_host

    done = trio.Event()
    served = 0

    async def handler(stream: FramedStream) -> None:
        nonlocal served
        for _ in range(FRAME_COUNT):
            frame = await stream.receive_frame(max_bytes=FRAME_SIZE)
            assert frame is not None and len(frame) == FRAME_SIZE
        await stream.send_frame(b"k")
        served += 1
        if served == REPEATS:
            done.set()

    async with open_libp2p_host(WalletKey(bytes.fromhex(os.environ["BENCH_KEY"]))) as host:
        host.set_stream_handler(LIBP2P_PROTOCOL, handler)
        print(host.listen_multiaddrs()[0], flush=True)
        with trio.move_on_after(LIBP2P_TIMEOUT * REPEATS):
            await done.wait()
        await trio.sleep(0.2)  # let the last acknowledgement leave


class _PiecePeer:
    """One end of the piece path: a DataPlane carrying one CheckpointTransfer; ``done`` is set when the
    transfer completes (fetcher) or its peer leaves (origin)."""

    def __init__(self, key: WalletKey, manifest: Manifest, pieces: PieceSource) -> None:
        self.done = trio.Event()
        self.transfer = CheckpointTransfer(
            manifest,
            pieces,
            send=self._send,
            close=self._close,
            rng=random.Random(0),
            on_complete=self.done.set,
        )
        self.plane = DataPlane(key, on_up=self._up, on_frame=self._frame, on_down=self._down)

    def _send(self, peer: object, frame: bytes) -> None:
        assert isinstance(peer, Address)
        self.plane.send(peer, frame)

    def _close(self, peer: object, reason: str) -> None:
        assert isinstance(peer, Address)
        self.plane.close(peer)

    def _up(self, peer: Address) -> None:
        self.transfer.connected(peer, trio.current_time())

    def _frame(self, peer: Address, frame: bytes) -> None:
        self.transfer.frame(peer, frame, trio.current_time())

    def _down(self, peer: Address) -> None:
        self.transfer.disconnected(peer, trio.current_time())
        self.done.set()


async def _piece_child() -> None:
    """The fetcher: a fresh PieceStore per run; CPU from its channel being up to holding every piece."""
    key = WalletKey(bytes.fromhex(os.environ["BENCH_KEY"]))
    manifest = decode(Path(os.environ["BENCH_MANIFEST"]).read_bytes(), Manifest)
    root = Path(os.environ["BENCH_STORE"])
    cpu: list[float] = []
    async with trio.open_nursery() as nursery:
        for run in range(REPEATS):
            store = PieceStore.open(root / str(run), manifest)
            peer = _PiecePeer(key, manifest, store)
            port = await nursery.start(peer.plane.run, "127.0.0.1", 0)
            print(port, flush=True)
            while not peer.plane.links:
                await trio.sleep(0.001)
            started = _cpu_seconds()
            await peer.done.wait()
            cpu.append(_cpu_seconds() - started)
            for link in list(peer.plane.links):
                peer.plane.close(link)
            store.close()
            store.remove()
        print(json.dumps(cpu), flush=True)
        nursery.cancel_scope.cancel()


# --------------------------------------------------------------------------------------------------------
# Senders (this process)


def _start_child(mode: str, key: WalletKey, **extra: str) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, BENCH_KEY=key.secret.hex(), PYTHONPATH=str(ROOT), **extra)
    child = subprocess.Popen(
        [sys.executable, __file__, "--receiver", mode], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None
    line = child.stdout.readline().strip()
    if not line:
        child.kill()
        raise RuntimeError(f"{mode} receiver did not start")
    return child, line


async def _send_raw(port: int, payload: bytes) -> tuple[float, float]:
    started = time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    connected = time.perf_counter()
    header = len(payload).to_bytes(_HEADER, "big")
    for _ in range(FRAME_COUNT):
        await stream.send_all(header)
        await stream.send_all(payload)
    ack = await stream.receive_some(1)
    finished = time.perf_counter()
    assert ack == b"k"
    await stream.aclose()
    return connected - started, finished - connected


async def _send_channel(port: int, payload: bytes, key: WalletKey, peer: WalletKey) -> tuple[float, float]:
    started = time.perf_counter()
    channel = await open_channel("127.0.0.1", port, key, expected_peer=peer.address)
    connected = time.perf_counter()
    for _ in range(FRAME_COUNT):
        await channel.send_frame(payload)
    ack = await channel.receive_frame()
    finished = time.perf_counter()
    assert ack == b"k"
    await channel.aclose()
    return connected - started, finished - connected


async def _send_libp2p(multiaddr: str, payload: bytes, key: WalletKey) -> list[tuple[float, float]]:
    from prime_node.p2p.libp2p_host import open_libp2p_host

    runs = []
    async with open_libp2p_host(key) as host:
        with trio.fail_after(LIBP2P_TIMEOUT * REPEATS):
            peer_id = await host.connect(multiaddr)
            for _ in range(REPEATS):
                started = time.perf_counter()
                stream = await host.open_stream(peer_id, LIBP2P_PROTOCOL)
                connected = time.perf_counter()
                for _ in range(FRAME_COUNT):
                    await stream.send_frame(payload)
                ack = await stream.receive_frame()
                finished = time.perf_counter()
                assert ack == b"k"
                await stream.close()
                runs.append((connected - started, finished - connected))
    return runs


async def _send_pieces(
    port: int, key: WalletKey, peer: WalletKey, origin: OriginDirectory
) -> tuple[float, float]:
    started = time.perf_counter()
    sender = _PiecePeer(key, origin.manifest, origin)
    async with trio.open_nursery() as nursery:
        await nursery.start(sender.plane.run, "127.0.0.1", 0)
        sender.plane.dial(peer.address, "127.0.0.1", port)
        while not sender.plane.links:
            await trio.sleep(0.001)
        connected = time.perf_counter()
        await sender.done.wait()  # the fetcher hangs up once it holds every piece
        finished = time.perf_counter()
        nursery.cancel_scope.cancel()
    return connected - started, finished - connected


def _measure_piece_path(payload: bytes) -> dict[str, object]:
    """The origin serves a checkpoint holding ``payload`` repeated; the fetcher is a child process."""
    receiver_key, sender_key = WalletKey.generate(), WalletKey.generate()
    work = Path(tempfile.mkdtemp(prefix="dp-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        model = work / "model"
        model.mkdir()
        (model / "config.json").write_text("{}")
        with open(model / "model.safetensors", "wb") as out:
            for _ in range(FRAME_COUNT):
                out.write(payload)
        shared = build_checkpoint(model, sender_key, run="bench", step=0, now_ms=0, piece_size=FRAME_SIZE)
        (work / "manifest").write_bytes(encode(shared.manifest))
        origin = OriginDirectory(model, shared.manifest)
        env = {"BENCH_MANIFEST": str(work / "manifest"), "BENCH_STORE": str(work / "stores")}
        child, port = _start_child("piece", receiver_key, **env)
        assert child.stdout is not None
        runs: list[Run] = []
        try:
            for run in range(REPEATS):
                if run:
                    port = child.stdout.readline().strip()
                args = (_send_pieces, int(port), sender_key, receiver_key, origin)
                runs.append(_timed(lambda args=args: trio.run(*args)))  # type: ignore[misc]
        finally:
            cpu = _stop(child)
        summary = _summary(runs, cpu)
        summary["bytes"] = shared.manifest.total_size
        return summary
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stop(child: subprocess.Popen[str]) -> list[float]:
    """Wait for a receiver; the CPU seconds it reported per run (empty if it reported nothing)."""
    try:
        out, _ = child.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return []
    lines = out.strip().splitlines()
    return [float(x) for x in json.loads(lines[-1])] if lines else []


Run = tuple[float, float, float | None]
"""(setup seconds, transfer seconds, sender CPU seconds during the transfer)"""


def _timed(run: Callable[[], tuple[float, float]]) -> Run:
    started = _cpu_seconds()
    setup, seconds = run()
    return setup, seconds, _cpu_seconds() - started


def _measure_sockets(payload: bytes) -> tuple[dict[str, object], dict[str, object]]:
    """Raw and channel runs interleaved (raw, channel, raw, ...), so load changes hit both alike."""
    receiver_key, sender_key = WalletKey.generate(), WalletKey.generate()
    raw_child, raw_port = _start_child("raw", receiver_key)
    channel_child, channel_port = _start_child("channel", receiver_key)
    raw_runs: list[Run] = []
    channel_runs: list[Run] = []
    try:
        for _ in range(REPEATS):
            raw_runs.append(_timed(lambda: trio.run(_send_raw, int(raw_port), payload)))
            channel_runs.append(
                _timed(lambda: trio.run(_send_channel, int(channel_port), payload, sender_key, receiver_key))
            )
    finally:
        raw_cpu = _stop(raw_child)
        channel_cpu = _stop(channel_child)
    return _summary(raw_runs, raw_cpu), _summary(channel_runs, channel_cpu)


def _measure_libp2p(payload: bytes) -> dict[str, object]:
    receiver_key, sender_key = WalletKey.generate(), WalletKey.generate()
    child, multiaddr = _start_child("libp2p", receiver_key)
    try:
        runs = trio.run(_send_libp2p, multiaddr, payload, sender_key)
    finally:
        _stop(child)
    return _summary([(setup, seconds, None) for setup, seconds in runs], [])


def _summary(runs: list[Run], receiver_cpu: list[float]) -> dict[str, object]:
    """Best-of throughput, every run's throughput, and CPU seconds per GiB moved at each end (the cost
    that does not depend on how busy the shared machine is; best run of each)."""
    total = FRAME_SIZE * FRAME_COUNT
    gib = total / (1 << 30)
    best = min(seconds for _, seconds, _ in runs)
    summary: dict[str, object] = {
        "mb_per_s": round(total / best / 1e6, 1),
        "mb_per_s_runs": [round(total / seconds / 1e6, 1) for _, seconds, _ in runs],
        "setup_ms": round(min(setup for setup, _, _ in runs) * 1000, 2),
    }
    sender_cpu = [cpu for _, _, cpu in runs if cpu is not None]
    if sender_cpu:
        summary["sender_cpu_s_per_gib"] = round(min(sender_cpu) / gib, 3)
    if receiver_cpu:
        summary["receiver_cpu_s_per_gib"] = round(min(receiver_cpu) / gib, 3)
    if sender_cpu and receiver_cpu:
        summary["cpu_s_per_gb"] = round((min(sender_cpu) + min(receiver_cpu)) / (total / 1e9), 3)
    return summary


def _ratio(a: dict[str, object], b: dict[str, object]) -> float:
    return round(float(a["mb_per_s"]) / float(b["mb_per_s"]), 3)  # type: ignore[arg-type]


def _cpu_ratio(channel: dict[str, object], raw: dict[str, object]) -> float | None:
    """The throughput ratio if each end had a core to itself: the busier end's CPU cost per GiB, raw over
    channel. Unlike the wall-clock ratio it does not move with the load other users put on the machine."""
    keys = ("sender_cpu_s_per_gib", "receiver_cpu_s_per_gib")
    if not all(key in channel and key in raw for key in keys):
        return None
    busiest_raw = max(float(raw[key]) for key in keys)  # type: ignore[arg-type]
    busiest_channel = max(float(channel[key]) for key in keys)  # type: ignore[arg-type]
    return round(busiest_raw / busiest_channel, 3)


def _per_gb_ratio(a: dict[str, object], b: dict[str, object]) -> float | None:
    """Both ends' CPU per GB of ``a`` over that of ``b``."""
    if "cpu_s_per_gb" not in a or "cpu_s_per_gb" not in b:
        return None
    return round(float(a["cpu_s_per_gb"]) / float(b["cpu_s_per_gb"]), 2)  # type: ignore[arg-type]


def main() -> None:
    started = time.perf_counter()
    payload = os.urandom(FRAME_SIZE)
    raw, channel = _measure_sockets(payload)
    result: dict[str, object] = {
        "benchmark": "dataplane",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "bytes_per_run": FRAME_SIZE * FRAME_COUNT,
        "frame_bytes": FRAME_SIZE,
        "repeats": REPEATS,
        "raw_tcp": raw,
        "channel": channel,
        "ratio_to_raw": _ratio(channel, raw),
        "goal_ratio_to_raw": 0.5,
        "cpu_ratio_to_raw": _cpu_ratio(channel, raw),
    }
    if "--skip-pieces" not in sys.argv:
        pieces = _measure_piece_path(payload)
        result["piece_path"] = pieces
        result["piece_path_cpu_over_raw"] = _per_gb_ratio(pieces, raw)
    result["channel_cpu_over_raw"] = _per_gb_ratio(channel, raw)
    if "--skip-libp2p" in sys.argv:
        result["libp2p_noise_yamux"] = "skipped (--skip-libp2p)"
    else:
        try:
            libp2p = _measure_libp2p(payload)
            result["libp2p_noise_yamux"] = libp2p
            result["libp2p_ratio_to_raw"] = _ratio(libp2p, raw)
            result["channel_vs_libp2p"] = _ratio(channel, libp2p)
        except Exception as exc:  # report, don't hide: the other numbers still stand
            result["libp2p_noise_yamux"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    if "--frame-kib" in sys.argv:
        os.environ["BENCH_FRAME_KIB"] = sys.argv[sys.argv.index("--frame-kib") + 1]
        FRAME_SIZE = int(os.environ["BENCH_FRAME_KIB"]) << 10
        FRAME_COUNT = TOTAL_BYTES // FRAME_SIZE
    if len(sys.argv) == 3 and sys.argv[1] == "--receiver":
        if sys.argv[2] == "libp2p":
            trio.run(_libp2p_child)
        elif sys.argv[2] == "piece":
            trio.run(_piece_child)
        else:
            trio.run(_socket_child, sys.argv[2])
    else:
        main()
