"""Throughput and CPU of the data plane's channel over direct TCP vs over its libp2p fallback, same run.

Prints one JSON line. The receiver runs in a child process (each end gets its own core, as two machines
would): a TCP listener and a libp2p host (Noise + yamux, 127.0.0.1) serving the fallback protocol, both
accepting the same authenticated channel (prime_node/dataplane). The sender moves ``BENCH_TOTAL_MIB``
(default 256) as 4 MiB frames over each route, ``REPEATS`` times interleaved; the best run of each counts
(the machine is shared and noisy). Time runs from the first frame sent to the receiver's acknowledgement
of the last; ``cpu_s_per_gb`` is both ends' CPU seconds per 10^9 bytes moved.

Usage: flock /tmp/bench.lock .venv/bin/python benchmarks/dataplane_fallback.py
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from crypto.keys import WalletKey  # noqa: E402
from prime_node.dataplane.channel import AuthenticatedChannel  # noqa: E402
from prime_node.dataplane.connect import accept_channel, dial_channel, open_channel  # noqa: E402
from prime_node.dataplane.libp2p_stream import P2PStream, RouteStats, fallback_protocol  # noqa: E402
from prime_node.p2p.interface import FramedStream  # noqa: E402
from prime_node.p2p.libp2p_host import open_libp2p_host  # noqa: E402

TOTAL_BYTES = int(os.environ.get("BENCH_TOTAL_MIB", "256")) << 20
FRAME_SIZE = 4 << 20
FRAME_COUNT = TOTAL_BYTES // FRAME_SIZE
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))
PROTOCOL = fallback_protocol("swarm")


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _receive(channel: AuthenticatedChannel) -> None:
    """Take FRAME_COUNT frames, then answer with the CPU seconds this process spent on them."""
    start = _cpu()
    for _ in range(FRAME_COUNT):
        await channel.receive_frame()
    await channel.send_frame(json.dumps(_cpu() - start).encode())
    await channel.receive_frame()  # the sender's goodbye: keep the channel until it is done


async def _child(seed: str) -> None:
    key = WalletKey(bytes.fromhex(seed))

    async def on_tcp(stream: trio.SocketStream) -> None:
        await _receive(await accept_channel(stream, key))

    async def on_stream(framed: FramedStream) -> None:
        await _receive(await accept_channel(P2PStream(framed.raw, RouteStats()), key))

    async with open_libp2p_host(key) as host, trio.open_nursery() as nursery:
        host.set_stream_handler(PROTOCOL, on_stream)
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        port = listeners[0].socket.getsockname()[1]
        print(json.dumps({"port": port, "multiaddr": host.listen_multiaddrs()[0]}), flush=True)
        nursery.start_soon(trio.serve_listeners, on_tcp, listeners)
        await trio.to_thread.run_sync(sys.stdin.read)  # until the parent closes our stdin
        nursery.cancel_scope.cancel()


async def _send(channel: AuthenticatedChannel, payload: bytes) -> dict[str, float]:
    cpu, began = _cpu(), time.perf_counter()
    for _ in range(FRAME_COUNT):
        await channel.send_frame(payload)
    receiver_cpu = float(json.loads(await channel.receive_frame()))
    seconds, sender_cpu = time.perf_counter() - began, _cpu() - cpu
    await channel.send_frame(b"bye")
    await channel.aclose()
    return {"seconds": seconds, "sender_cpu": sender_cpu, "receiver_cpu": receiver_cpu}


async def _parent() -> dict[str, Any]:
    key, peer = WalletKey.generate(), WalletKey.generate()
    child = subprocess.Popen(
        [sys.executable, __file__, "--child", peer.secret.hex()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdin is not None
    where = json.loads(child.stdout.readline())
    payload = os.urandom(FRAME_SIZE)
    runs: dict[str, list[dict[str, float]]] = {"tcp": [], "fallback": []}
    try:
        async with open_libp2p_host(key) as host:
            peer_id = await host.connect(where["multiaddr"])
            for _ in range(REPEATS):
                tcp = await open_channel("127.0.0.1", where["port"], key, expected_peer=peer.address)
                runs["tcp"].append(await _send(tcp, payload))
                framed = await host.open_stream(peer_id, PROTOCOL)
                fallback = await dial_channel(
                    P2PStream(framed.raw, RouteStats()), key, expected_peer=peer.address
                )
                runs["fallback"].append(await _send(fallback, payload))
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    out: dict[str, Any] = {"total_mib": TOTAL_BYTES >> 20, "frame_kib": FRAME_SIZE >> 10, "repeats": REPEATS}
    for route, measured in runs.items():
        best = min(measured, key=lambda run: run["seconds"])
        cpu = min(run["sender_cpu"] for run in measured) + min(run["receiver_cpu"] for run in measured)
        out[route] = {
            "gb_per_s": round(TOTAL_BYTES / best["seconds"] / 1e9, 3),
            "seconds": [round(run["seconds"], 3) for run in measured],
            "cpu_s_per_gb": round(cpu / (TOTAL_BYTES / 1e9), 2),
        }
    out["fallback_vs_tcp_throughput"] = round(out["fallback"]["gb_per_s"] / out["tcp"]["gb_per_s"], 3)
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        trio.run(_child, sys.argv[2])
        return
    print(json.dumps(trio.run(_parent)))


if __name__ == "__main__":
    main()
