"""Throughput of one connection on 127.0.0.1: raw trio TCP vs our authenticated channel vs libp2p Noise+yamux.

Prints one JSON line. Each transport moves 256 MiB as 64 frames of 4 MiB from this process to a receiver
in a separate process (each end gets its own core, as two machines would), three times; the best run
counts (the machine is shared and noisy). Time runs from the first byte sent to the receiver's
acknowledgement of the last frame; connection setup and handshakes are timed separately.

- raw: u32 length ‖ body, the receiver reads into one reused buffer (no copy, no check): the ceiling.
- channel: prime_node.dataplane (wallet-authenticated handshake, keyed-BLAKE3 MAC per frame), the
  receiver gets each frame as ``bytes``, checked.
- libp2p: prime_node.p2p's host (TCP + Noise + yamux) and its FramedStream, same frames.

Usage: .venv/bin/python benchmarks/dataplane.py [--skip-libp2p]
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crypto.keys import WalletKey  # noqa: E402
from prime_node.dataplane.channel import accept_channel, open_channel  # noqa: E402

FRAME_SIZE = 4 << 20
FRAME_COUNT = 64
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


async def _raw_receiver(listener: trio.SocketListener) -> None:
    buffer = bytearray(FRAME_SIZE)
    header = bytearray(_HEADER)
    for _ in range(REPEATS):
        stream = await listener.accept()
        for _ in range(FRAME_COUNT):
            await _recv_exactly(stream, memoryview(header))
            length = int.from_bytes(header, "big")
            await _recv_exactly(stream, memoryview(buffer)[:length])
        await stream.send_all(b"k")
        await stream.aclose()


async def _channel_receiver(listener: trio.SocketListener, key: WalletKey) -> None:
    for _ in range(REPEATS):
        stream = await listener.accept()
        channel = await accept_channel(stream, key)
        for _ in range(FRAME_COUNT):
            frame = await channel.receive_frame()
            assert len(frame) == FRAME_SIZE
        await channel.send_frame(b"k")
        await channel.aclose()


async def _socket_child(mode: str) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listener = listeners[0]
    print(listener.socket.getsockname()[1], flush=True)
    if mode == "raw":
        await _raw_receiver(listener)
    else:
        await _channel_receiver(listener, WalletKey(bytes.fromhex(os.environ["BENCH_KEY"])))


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


# --------------------------------------------------------------------------------------------------------
# Senders (this process)


def _start_child(mode: str, key: WalletKey) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, BENCH_KEY=key.secret.hex(), PYTHONPATH=str(ROOT))
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


def _measure(mode: str, payload: bytes) -> list[tuple[float, float]]:
    receiver_key, sender_key = WalletKey.generate(), WalletKey.generate()
    child, endpoint = _start_child(mode, receiver_key)
    try:
        if mode == "libp2p":
            return trio.run(_send_libp2p, endpoint, payload, sender_key)
        runs = []
        for _ in range(REPEATS):
            if mode == "raw":
                runs.append(trio.run(_send_raw, int(endpoint), payload))
            else:
                runs.append(trio.run(_send_channel, int(endpoint), payload, sender_key, receiver_key))
        return runs
    finally:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def _summary(runs: list[tuple[float, float]]) -> dict[str, float]:
    total = FRAME_SIZE * FRAME_COUNT
    best = min(seconds for _, seconds in runs)
    return {
        "mb_per_s": round(total / best / 1e6, 1),
        "mb_per_s_runs": [round(total / seconds / 1e6, 1) for _, seconds in runs],  # type: ignore[dict-item]
        "setup_ms": round(min(setup for setup, _ in runs) * 1000, 2),
    }


def main() -> None:
    started = time.perf_counter()
    payload = os.urandom(FRAME_SIZE)
    raw = _summary(_measure("raw", payload))
    channel = _summary(_measure("channel", payload))
    result: dict[str, object] = {
        "benchmark": "dataplane",
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "bytes_per_run": FRAME_SIZE * FRAME_COUNT,
        "frame_bytes": FRAME_SIZE,
        "repeats": REPEATS,
        "raw_tcp": raw,
        "channel": channel,
        "ratio_to_raw": round(channel["mb_per_s"] / raw["mb_per_s"], 3),
        "goal_ratio_to_raw": 0.5,
    }
    if "--skip-libp2p" in sys.argv:
        result["libp2p_noise_yamux"] = "skipped (--skip-libp2p)"
    else:
        try:
            libp2p = _summary(_measure("libp2p", payload))
            result["libp2p_noise_yamux"] = libp2p
            result["libp2p_ratio_to_raw"] = round(libp2p["mb_per_s"] / raw["mb_per_s"], 3)
            result["channel_vs_libp2p"] = round(channel["mb_per_s"] / libp2p["mb_per_s"], 2)
        except Exception as exc:  # report, don't hide: the other numbers still stand
            result["libp2p_noise_yamux"] = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
    result["wall_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--receiver":
        if sys.argv[2] == "libp2p":
            trio.run(_libp2p_child)
        else:
            trio.run(_socket_child, sys.argv[2])
    else:
        main()
